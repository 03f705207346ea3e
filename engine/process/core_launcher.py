"""The parent's side of an engine core process: spawning it, watching it, and making sure it ends.

Each core gets a private temporary directory for its `ipc://` sockets, so any number of engines
coexist on one host with no port to choose or collide on. The process is spawned (never forked: the
parent may hold threads and CUDA state) and stopped with SIGTERM, then SIGKILL if it lingers, by
`shutdown`, by garbage collection, or at interpreter exit, whichever comes first.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
from multiprocessing.process import BaseProcess

import psutil

from engine.config import EngineConfig
from engine.process.core_proc import run_engine_core
from engine.process.process_utils import (
    StopOnReleaseOrExit,
    describe_exit,
    kill_descendants,
    stop_resource_tracker_if_unused,
)

logger = logging.getLogger(__name__)

# Time the core gets to stop its workers after SIGTERM before it is killed.
_TERMINATE_GRACE_S = 5.0


def _stop_process(process: BaseProcess, socket_dir: str) -> None:
    """SIGTERM, then SIGKILL after a grace period; reap the process (and multiprocessing's resource
    tracker, when it was the last child) and remove its socket directory.

    A KeyboardInterrupt while the core stops (a second Ctrl-C, or SIGTERM where the server maps it
    so) kills it at once rather than leaving it running: it still ends before this process goes on.
    """
    try:
        if process.is_alive():
            process.terminate()
            try:
                process.join(_TERMINATE_GRACE_S)
            except KeyboardInterrupt:
                _kill(process)
                raise
        if process.is_alive():
            logger.warning("EngineCore process %d ignored SIGTERM; killing it", process.pid)
            _kill(process)
    except ValueError:
        pass  # never started (or already closed): nothing to stop
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    stop_resource_tracker_if_unused()


def _kill(process: BaseProcess) -> None:
    """SIGKILL the core and its workers (which would otherwise outlive it until they notice), and
    wait for all of them."""
    workers = kill_descendants(psutil.Process(process.pid))
    process.kill()
    process.join()
    psutil.wait_procs(workers, timeout=_TERMINATE_GRACE_S)


class CoreProcess:
    """One spawned EngineCoreProc: its socket addresses, liveness, and stopping it."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.executor_backend == "ray":
            # Imports Ray: only for a core whose workers are Ray actors.
            from engine.executor.ray_utils import inherit_ray_context

            config = inherit_ray_context(config)
        self.socket_dir = tempfile.mkdtemp(prefix="raypage-core-")
        self.input_address = f"ipc://{self.socket_dir}/input"
        self.output_address = f"ipc://{self.socket_dir}/output"
        log_level = logging.getLogger("engine").getEffectiveLevel()
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config.model_dump_json(), self.input_address, self.output_address, log_level),
            name="EngineCore",
        )
        # Holds no reference to self, so that an unreachable client is collected and its core stopped.
        self._stop = StopOnReleaseOrExit(self, _stop_process, self.process, self.socket_dir)

    def start(self) -> None:
        self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def death_message(self) -> str | None:
        """Why the process is gone, or None while it runs."""
        code = self.process.exitcode if self.process.pid is not None else None
        if code is None:
            return None
        return f"EngineCore process {self.process.pid} died ({describe_exit(code)})"

    def shutdown(self) -> None:
        """Stop the process and remove the socket directory; safe to call twice."""
        self._stop()
