"""Long generation on an EngineCore stepped in a background thread, for fault tests to interrupt."""

from __future__ import annotations

import threading
import time

from engine import SamplingParams
from engine.outputs import EngineCoreRequest
from engine.process.core import EngineCore

LONG_RUN = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)


class BackgroundSteps:
    """Adds four long requests to `core` and steps it in a daemon thread until they finish or a step
    raises; `stepping` is set after the first step, `errors` holds what a step raised."""

    def __init__(self, core: EngineCore) -> None:
        for index in range(4):
            request = EngineCoreRequest(f"r{index}", [1, 2, 3, 4 + index], LONG_RUN, None, time.time())
            core.add_request(request)
        self.core = core
        self.stepping = threading.Event()
        self.errors: list[Exception] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while self.core.has_unfinished_requests():
                self.core.step()
                self.stepping.set()
        except Exception as error:
            self.errors.append(error)
