"""engine.process.process_utils: which network interface holds an address (what a Ray worker binds
gloo to), and ending the processes an engine started without leaving any behind."""

from __future__ import annotations

import multiprocessing
import multiprocessing.resource_tracker
import subprocess
import time

import psutil

from engine.process.process_utils import (
    interface_with_address,
    kill_descendants,
    loopback_interface,
    stop_resource_tracker_if_unused,
)


def test_the_loopback_address_is_on_the_loopback_interface():
    assert interface_with_address("127.0.0.1") == loopback_interface()


def test_an_address_no_interface_holds_has_none():
    assert interface_with_address("198.51.100.7") is None  # TEST-NET-2: never assigned here


def test_kill_descendants_kills_children_and_theirs():
    # A child that starts a child of its own, which starts another: three levels below this process.
    root = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60 & wait' & wait"])
    try:
        tree = psutil.Process(root.pid)
        deadline = time.monotonic() + 10
        while len(tree.children(recursive=True)) < 2:
            assert time.monotonic() < deadline, "the tree never grew"
            time.sleep(0.01)
        victims = kill_descendants(tree)
        assert len(victims) == 2
        _, alive = psutil.wait_procs(victims, timeout=10)
        assert not alive
    finally:
        root.kill()
        root.wait()


def test_the_resource_tracker_is_stopped_and_reaped_once_no_child_is_left():
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    process.start()
    tracker = multiprocessing.resource_tracker._resource_tracker
    tracker_pid = tracker._pid
    assert tracker_pid is not None and psutil.pid_exists(tracker_pid)
    stop_resource_tracker_if_unused()  # the child still runs: kept
    assert tracker._pid == tracker_pid
    process.terminate()
    process.join()
    stop_resource_tracker_if_unused()
    assert tracker._pid is None and not psutil.pid_exists(tracker_pid)  # reaped, not a zombie


def test_a_spawned_process_leaves_its_parents_tracker_alone():
    # The child shares the tracker's descriptor but not its pid: stopping it there is the parent's job.
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=stop_resource_tracker_if_unused)
    child.start()
    child.join(timeout=60)
    tracker = multiprocessing.resource_tracker._resource_tracker
    assert child.exitcode == 0 and tracker._pid is not None and psutil.pid_exists(tracker._pid)
    stop_resource_tracker_if_unused()
