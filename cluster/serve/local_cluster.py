"""The processes of the Ray cluster that `raypage serve` starts for itself, kept out of the engine's way.

On a small machine every process of that cluster competes with the engine core for the same cores,
and the engine loses more than the CPU they take: its torch threads meet at a barrier in every
operator, so a core taken from one of them for a moment stalls the others. Ray starts its own
processes (GCS, raylet, dashboard head and agents, the autoscaler and log monitors) at the driver's
niceness, 0, the engine's; its workers (Serve's controller, proxies and HAProxy manager) run 15
above that. Once the app is up, `set_cluster_priorities` raises every process of the cluster to at
least `cluster_niceness`, all but the data path: the LLMServer replicas and what they start (their
engine cores, at `replica_niceness`) and the engines' Ray worker actors (the ray executor's, at Ray's
15) keep their own, and the proxy that carries HTTP to the replicas runs at `replica_niceness` too.
The cluster's processes then mostly run when the engine leaves a core idle (between its steps).

Raising a niceness needs no privilege. Threads and processes started later inherit their creator's:
a replica Serve starts later comes from the raylet at 19 and sets its own `replica_niceness`.
"""

from __future__ import annotations

import logging

import psutil

from cluster.serve.niceness import raise_niceness, renice_process
from cluster.serve.proxy_mode import HAPROXY
from engine.executor.ray_distributed import RayWorker

logger = logging.getLogger(__name__)

REPLICA_TITLE = "ray::ServeReplica:"
ENGINE_WORKER_TITLE = f"ray::{RayWorker.__name__}"
PYTHON_PROXY_TITLE = "ray::ProxyActor"
HAPROXY_BINARY = "haproxy"
HAPROXY_MANAGER_TITLE = "ray::HAProxyManager"
# Niceness at least this for the cluster's own processes by default: the lowest priority there is.
DEFAULT_CLUSTER_NICENESS = 19


def _title(process: psutil.Process) -> str:
    return " ".join(process.cmdline())


def _is_replica(process: psutil.Process) -> bool:
    """A Serve replica or an engine's Ray worker: each keeps the niceness it set for itself or got."""
    return _title(process).startswith((REPLICA_TITLE, ENGINE_WORKER_TITLE))


def _is_proxy(process: psutil.Process, proxy_mode: str) -> bool:
    """The proxy of `proxy_mode`, which carries every request to the replicas. In HAProxy mode that is
    HAProxy and the actor that manages it, which starts a new HAProxy at each reload (with its own
    niceness); the Python proxy actor Serve also starts there is only an idle fallback."""
    if proxy_mode == HAPROXY:
        return process.name() == HAPROXY_BINARY or _title(process).startswith(HAPROXY_MANAGER_TITLE)
    return _title(process).startswith(PYTHON_PROXY_TITLE)


def cluster_processes(proxy_mode: str) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(the HTTP proxies, the cluster's own processes): the latter are this process (the driver) and
    the local cluster's processes it started, but the replicas, the engines' workers and whatever
    those started."""
    proxies: list[psutil.Process] = []
    own = [psutil.Process()]
    skipped: set[int] = set()
    for process in psutil.Process().children(recursive=True):  # each parent before its children
        try:
            if process.pid in skipped:
                continue
            if _is_replica(process):
                skipped.update(child.pid for child in process.children(recursive=True))
            elif _is_proxy(process, proxy_mode):
                proxies.append(process)
            else:
                own.append(process)
        except psutil.NoSuchProcess:
            pass
    return proxies, own


def set_cluster_priorities(cluster_niceness: int, proxy_niceness: int | None, proxy_mode: str) -> None:
    """Raise the driver and the local cluster's own processes to at least `cluster_niceness` (0 keeps
    Ray's niceness), and set the HTTP proxy to `proxy_niceness` (the replicas': a request's path runs
    at one priority; None keeps Ray's 15). Call it once the app runs, so that Serve's actors are there."""
    proxies, own = cluster_processes(proxy_mode)
    if proxy_niceness is not None:
        # Twice: HAProxy's manager starts a new HAProxy at each reload, at the manager's niceness. A
        # reload the app's start set off may start one while the first pass runs, before the manager
        # is reniced; the second pass, after it, finds that one (later ones inherit the new niceness).
        for _ in range(2):
            for proxy in proxies:
                if not renice_process(proxy.pid, proxy_niceness):
                    logger.warning(
                        "cannot set the HTTP proxy's niceness to %d (no CAP_SYS_NICE)", proxy_niceness
                    )
                    break
            proxies, _ = cluster_processes(proxy_mode)
    if cluster_niceness > 0:
        for process in own:
            raise_niceness(process.pid, cluster_niceness)
        logger.info("the cluster's own %d processes run at niceness %d or above", len(own), cluster_niceness)
