"""The processes of the Ray cluster that `raypage serve` starts for itself, kept out of the engine's way.

On a small machine every process of that cluster competes with the engine core for the same cores,
and the engine loses more than the CPU they take: its torch threads meet at a barrier in every
operator, so a core taken from one of them for a moment stalls the others. Ray starts its own
processes (GCS, raylet, dashboard head and agents, the autoscaler and log monitors) at the driver's
niceness, 0, the engine's; its workers (Serve's controller, proxies and HAProxy manager) run 15
above that. Once the app is up, `lower_cluster_priority` raises every process of the cluster to at
least `cluster_niceness`, all but the data path: the LLMServer replicas and what they start (their
engine cores, at `replica_niceness`), the engines' Ray worker actors (the ray executor's, at Ray's 15)
and the proxy that carries HTTP to the replicas, which keep their own.
The cluster's processes then mostly run when the engine leaves a core idle (between its steps).

Raising a niceness needs no privilege. Threads and processes started later inherit their creator's:
a replica Serve starts later comes from the raylet at 19 and sets its own `replica_niceness`.
"""

from __future__ import annotations

import logging
import os

import psutil

from cluster.serve.niceness import process_threads
from cluster.serve.proxy_mode import HAPROXY
from engine.executor.ray_distributed import RayWorker

logger = logging.getLogger(__name__)

REPLICA_TITLE = "ray::ServeReplica:"
ENGINE_WORKER_TITLE = f"ray::{RayWorker.__name__}"
PYTHON_PROXY_TITLE = "ray::ProxyActor"
HAPROXY_BINARY = "haproxy"
# Niceness at least this for the cluster's own processes by default: the lowest priority there is.
DEFAULT_CLUSTER_NICENESS = 19


def _title(process: psutil.Process) -> str:
    return " ".join(process.cmdline())


def _is_data_path(process: psutil.Process, proxy_mode: str) -> bool:
    """The processes a request goes through: the replicas, their engines' workers, and the proxy of
    `proxy_mode` (in HAProxy mode the Python proxy actor Serve also starts is only its idle fallback)."""
    title = _title(process)
    if title.startswith((REPLICA_TITLE, ENGINE_WORKER_TITLE)):
        return True
    if proxy_mode == HAPROXY:
        return process.name() == HAPROXY_BINARY
    return title.startswith(PYTHON_PROXY_TITLE)


def cluster_processes(proxy_mode: str) -> list[psutil.Process]:
    """This process (the driver) and the local cluster's processes it started, but the data path and
    whatever a data-path process started."""
    descendants = psutil.Process().children(recursive=True)
    skipped: set[int] = set()
    for process in descendants:
        try:
            if _is_data_path(process, proxy_mode):
                skipped.add(process.pid)
                skipped.update(child.pid for child in process.children(recursive=True))
        except psutil.NoSuchProcess:
            skipped.add(process.pid)
    return [psutil.Process()] + [process for process in descendants if process.pid not in skipped]


def raise_niceness(pid: int, niceness: int) -> None:
    """Raise each thread of process `pid` to at least `niceness` (one already above keeps its own)."""
    for tid in process_threads(pid):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # a thread or process that has just ended
            pass


def lower_cluster_priority(cluster_niceness: int, proxy_mode: str) -> None:
    """Raise the driver and the local cluster's own processes to at least `cluster_niceness` (0 keeps
    Ray's niceness); call it once the app runs, so that Serve's actors are there."""
    if cluster_niceness <= 0:
        return
    processes = cluster_processes(proxy_mode)
    for process in processes:
        raise_niceness(process.pid, cluster_niceness)
    logger.info(
        "the cluster's own %d processes run at niceness %d or above", len(processes), cluster_niceness
    )
