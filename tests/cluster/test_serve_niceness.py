"""Raising a live process's niceness thread by thread (`cluster.serve.niceness.raise_niceness`),
on a real child process with threads of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from cluster.serve.niceness import process_threads, raise_niceness

# Three threads besides the main one, then a line on stdout, then it waits for stdin to close.
CHILD = """
import sys, threading
for _ in range(3):
    threading.Thread(target=sys.stdin.read, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        yield process
    finally:
        process.stdin.close()
        process.wait(timeout=10)


def niceness_by_thread(pid: int) -> dict[int, int]:
    return {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in process_threads(pid)}


def test_every_thread_is_raised_and_a_higher_one_keeps_its_own(child: subprocess.Popen) -> None:
    before = niceness_by_thread(child.pid)
    assert len(before) == 4
    assert set(before.values()) == {os.getpriority(os.PRIO_PROCESS, 0)} != {17}
    # One thread already above the target keeps its niceness.
    higher = next(tid for tid in before if tid != child.pid)
    os.setpriority(os.PRIO_PROCESS, higher, 18)

    raise_niceness(child.pid, 17)

    after = niceness_by_thread(child.pid)
    assert after == {tid: 18 if tid == higher else 17 for tid in before}
    # psutil's process-wide view is the main thread's.
    assert psutil.Process(child.pid).nice() == 17


def test_a_process_that_is_gone_is_skipped(child: subprocess.Popen) -> None:
    child.stdin.close()
    child.wait(timeout=10)
    assert process_threads(child.pid) == []
    raise_niceness(child.pid, 19)  # nothing to do, and no error
