"""A front end that exits without shutting its engine down, or is killed, leaves no core behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import SETTINGS, process_is_running, wait_until

SCRIPT = textwrap.dedent(
    f"""
    import os, signal, sys
    from engine import LLM

    if __name__ == "__main__":
        llm = LLM(multiprocess_mode=True, **{SETTINGS!r})
        client = llm.llm_engine.engine_core
        print(client.core_pid, client.socket_dir, flush=True)
        if sys.argv[1] == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_no_core_outlives_its_front_end(how, tmp_path):
    script = tmp_path / "front_end.py"
    script.write_text(SCRIPT)
    # Exiting must not wait on the live core (interpreter exit stops it), nor hang.
    result = subprocess.run(
        [sys.executable, str(script), how],
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
