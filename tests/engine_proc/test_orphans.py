"""A front end that exits without shutting its engine down, or is killed, leaves no core behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import process_is_running, wait_until

# The engine's settings come as JSON in the first argument, how the front end ends in the second.
# LLM is imported under the main guard: the spawned core runs this file's top level again.
SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys

    if __name__ == "__main__":
        from engine import LLM

        llm = LLM(multiprocess_mode=True, **json.loads(sys.argv[1]))
        client = llm.llm_engine.engine_core
        print(client.core_pid, client.socket_dir, flush=True)
        if sys.argv[2] == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_no_core_outlives_its_front_end(how, tmp_path, engine_settings):
    script = tmp_path / "front_end.py"
    script.write_text(SCRIPT)
    # Exiting must not wait on the live core (interpreter exit stops it), nor hang.
    result = subprocess.run(
        [sys.executable, str(script), json.dumps(engine_settings), how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == (-9 if how == "killed" else 0), result.stderr
    pid, socket_dir = result.stdout.split()
    # A killed front end's core notices its parent is gone within a second or so, and cleans up.
    assert wait_until(lambda: not process_is_running(int(pid)), timeout_s=10)
    assert wait_until(lambda: not Path(socket_dir).exists(), timeout_s=5)
