"""Helpers for the processes an engine starts: cores, ports, exit statuses, and stopping them at exit.

Shared by the engine-core launcher and the executors, which start processes of their own.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import socket
import weakref
from collections.abc import Callable
from typing import Any

import psutil


def available_cores() -> int:
    """Cores this process may run on (its affinity, which containers and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now; the OS picks it, so engines on one host never collide on a
    fixed one (it could be taken before it is bound, as with any such probe, but rarely is)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def loopback_interface() -> str:
    """The name of this host's loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    return interface_with_address("127.0.0.1") or "lo"


def interface_with_address(ip: str) -> str | None:
    """The name of the network interface that holds address `ip` on this host, or None."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == ip for address in addresses):
            return name
    return None


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, from its exit code: "killed by SIGKILL", "exit code 1"."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:  # a real-time signal, which has no name
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def kill_descendants(process: psutil.Process) -> list[psutil.Process]:
    """SIGKILL every process that `process` started, children and theirs; the ones signalled, for
    the caller to wait on (they were found before any was killed, so none escapes by reparenting)."""
    try:
        descendants = process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for descendant in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            descendant.kill()
    return descendants


def stop_resource_tracker_if_unused() -> None:
    """Stop multiprocessing's resource tracker, and reap it, once this process has no child left.

    Spawning a process starts the tracker, a child that outlives its parent by design: it waits for
    the parent's end to clean up after it. So a server that exits leaves it running (and then a
    zombie until init reaps it) for a moment after its own exit, the one process of its group
    still there. Stopped here instead, it exits before its parent; the next spawn starts a new one.
    """
    if multiprocessing.active_children():
        return
    tracker = multiprocessing.resource_tracker._resource_tracker
    # A spawned process shares its parent's tracker (its descriptor, not its pid): that one is the
    # parent's to stop, and stopping it here would fail on the pid it does not know.
    if getattr(tracker, "_pid", None) is None:
        return
    # Private API (CPython 3.8+), which the standard library's tests use for the same purpose.
    stop = getattr(tracker, "_stop", None)
    if stop is not None:
        stop()


class StopOnReleaseOrExit:
    """Calls `stop(*args)` once: when called, when `owner` is garbage-collected, or at interpreter exit,
    whichever comes first, so that no child process outlives the object that started it.

    `stop` and `args` must not refer to `owner`, or it is never collected. At exit it runs from an
    atexit hook of its own rather than weakref's: registered after multiprocessing's, it runs before
    that one, which would otherwise wait for (or terminate) the live children first.
    """

    def __init__(self, owner: object, stop: Callable[..., Any], *args: Any) -> None:
        self._finalizer = weakref.finalize(owner, stop, *args)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    def __call__(self) -> None:
        self._finalizer()  # a finalizer runs once, however often it is called
        atexit.unregister(self._finalizer)
