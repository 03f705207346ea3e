"""Shared helpers: tiny engine settings, bounded waiting, process checks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# Small and exact: float32 for token-identical greedy outputs, a small fixed KV cache (the model is
# conftest.py's `engine_settings`).
SETTINGS = {"dtype": "float32", "num_kv_blocks": 64}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def process_is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it to reap it)."""
    if not process_exists(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
