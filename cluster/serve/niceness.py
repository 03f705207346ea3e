"""Process niceness for the Serve app's processes, set thread by thread.

On Linux niceness belongs to each thread (`setpriority(PRIO_PROCESS, tid)`), and a new thread or
process takes its creator's: renicing a running process means renicing every one of its threads,
after which whatever they start inherits the new value. Raising a niceness is always allowed on
one's own processes; lowering it needs CAP_SYS_NICE (or root).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def process_threads(pid: int) -> list[int]:
    """The thread ids of process `pid` ([pid] where /proc is missing: not Linux); [] once it is gone."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return [] if os.path.isdir("/proc") else [pid]
    except OSError:
        return [pid]


def renice_process(pid: int, niceness: int) -> bool:
    """Set every thread of process `pid` to `niceness`; False without the permission to (lowering it
    without CAP_SYS_NICE). A process or thread that ends meanwhile is skipped."""
    for tid in process_threads(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except PermissionError:
            return False
        except ProcessLookupError:  # a thread that has just ended
            pass
    return True


def raise_niceness(pid: int, niceness: int) -> None:
    """Raise each thread of process `pid` to at least `niceness` (one already above keeps its own)."""
    for tid in process_threads(pid):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # a thread or process that has just ended
            pass


def set_niceness(niceness: int) -> None:
    """Run this process's threads (and what they start from now on) at `niceness`; without the
    permission to, keep the current one and say so."""
    if not renice_process(os.getpid(), niceness):
        current = os.getpriority(os.PRIO_PROCESS, 0)
        logger.warning("cannot set niceness %d (no CAP_SYS_NICE); keeping %d", niceness, current)
