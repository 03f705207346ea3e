"""A Ray cluster whose nodes are separate hosts: Linux network namespaces on one machine.

Each host is a network namespace with its own loopback and one veth interface (`eth0`) whose peer
is a port of a bridge in the root namespace; the hosts' addresses are in 198.18.0.0/24, the range
set aside for network tests, and the bridge has no address, so traffic only ever flows between the
hosts. `ray start --head` runs in the first host and `ray start --address HEAD:PORT` in the others,
each with its own num_cpus, custom resources and temp dir. Every process a host runs lives in its
namespace, so `ip netns pids` names exactly the processes to stop: nothing here ever stops a process
by name.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); `unavailable_reason()` says why not, for a skip.
Everything is named with PREFIX, so that a crashed run's leftovers are found and removed by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

PREFIX = "rpmh"  # raypage multi-host: namespaces, links and the bridge all start with it
BRIDGE = f"{PREFIX}-br"
SUBNET_PREFIX = "198.18.0"
RAY_PORT = 6379
TEMP_ROOT = Path(f"/tmp/{PREFIX}")  # short: Ray's unix socket paths under it must stay < 108 bytes
OBJECT_STORE_BYTES = 80 * 1024 * 1024
VENV_BIN = Path(sys.executable).parent
# Every process on a host: no hub to wait for, and no Ray token auth (a head started where a token
# file exists would turn it on, and nodes and drivers would then need the token too).
PROCESS_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
_CLONE_NEWNET = 0x40000000
_STOP_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine of the cluster: a namespace, its address, and the Ray node it runs."""

    name: str  # short: the namespace is PREFIX-name, the root-side veth too (15 bytes at most)
    index: int  # its address is SUBNET_PREFIX.index
    num_cpus: int
    resources: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def namespace(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def link(self) -> str:
        """The root-side end of the host's veth, a port of the bridge."""
        return f"{PREFIX}-{self.name}"

    @property
    def ip(self) -> str:
        return f"{SUBNET_PREFIX}.{self.index}"

    @property
    def temp_dir(self) -> Path:
        return TEMP_ROOT / self.name


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def namespace_pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)
    return [int(pid) for pid in done.stdout.split()]


def kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process in `namespace` (they are all this cluster's) and wait until they are gone."""
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    while pids := namespace_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in {namespace} outlived SIGKILL")
        time.sleep(0.1)


def leftovers() -> tuple[list[str], list[str]]:
    """The namespaces and the links (in the root namespace) whose names start with PREFIX."""
    namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    links = [
        line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").stdout.splitlines()
    ]
    mine = f"{PREFIX}-"
    return [name for name in namespaces if name.startswith(mine)], [
        name for name in links if name.startswith(mine)
    ]


def remove_leftovers() -> None:
    """Remove what a crashed run left: its namespaces (after their processes), links and bridge."""
    namespaces, links = leftovers()
    for namespace in namespaces:
        kill_namespace_processes(namespace)
        _ip("netns", "delete", namespace, check=False)
    for link in links:
        _ip("link", "delete", link, check=False)
    shutil.rmtree(TEMP_ROOT, ignore_errors=True)


@contextlib.contextmanager
def entered(namespace: str) -> Iterator[None]:
    """Run this thread inside `namespace` (sockets it opens stay there); back to its own on exit.

    setns(2) moves only the calling thread, so other threads of the test process are unaffected."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        try:
            yield
        finally:
            if libc.setns(own, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)


class NetnsCluster:
    """Hosts on a bridge, each running a Ray node; the first host is the head. Use as a context
    manager: on exit every process, namespace, link and temp dir is removed, whatever happened."""

    def __init__(self, hosts: list[Host], ray_env: dict[str, str] | None = None) -> None:
        self.hosts = {host.name: host for host in hosts}
        self.head = hosts[0]
        self.ray_env = ray_env or {}

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{RAY_PORT}"

    def __enter__(self) -> NetnsCluster:
        remove_leftovers()
        try:
            self._build_network()
            self.start_node(self.head.name)
            # The other hosts join together: each `ray start` mostly waits for its own node's
            # processes to come up, seconds that one after the other would add up.
            self.start_node(*[name for name in self.hosts if name != self.head.name])
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()

    def _build_network(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("link", "set", BRIDGE, "up")
        for host in self.hosts.values():
            namespace = host.namespace
            _ip("netns", "add", namespace)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", host.link, "master", BRIDGE)
            _ip("link", "set", host.link, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            # A default route, so that "which of my addresses reaches the world" (how Ray finds a
            # node's IP) answers the host's own address rather than loopback.
            _ip("-n", namespace, "route", "add", "default", "dev", "eth0")

    def popen(self, host: str, argv: list[str], **kwargs: object) -> subprocess.Popen:
        """`argv` run on `host` (inside its namespace)."""
        env = {**os.environ, **PROCESS_ENV, **kwargs.pop("env", {})}
        namespace = self.hosts[host].namespace
        return subprocess.Popen(["ip", "netns", "exec", namespace, *argv], env=env, **kwargs)

    def run(
        self, host: str, argv: list[str], timeout: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """`argv` run on `host` to its end; its output (stdout and stderr) in `stdout`."""
        return self._finish(host, self._start(host, argv, env), argv, timeout)

    def _start(self, host: str, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        return self.popen(
            host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or {}
        )

    @staticmethod
    def _finish(
        host: str, process: subprocess.Popen, argv: list[str], timeout: float
    ) -> subprocess.CompletedProcess:
        """`process` (`argv` on `host`) waited for; its output in `stdout`."""
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            raise AssertionError(f"{argv} on {host} ran over {timeout} s:\n{output[-4000:]}") from None
        return subprocess.CompletedProcess(argv, process.returncode, output)

    def start_node(self, *names: str) -> None:
        """`ray start` on each host named, all at once: the head, or nodes joining it."""
        commands = {name: self._ray_start_argv(name) for name in names}
        running = {name: self._start(name, argv, self.ray_env) for name, argv in commands.items()}
        for name, process in running.items():
            started = self._finish(name, process, commands[name], timeout=120)
            if started.returncode != 0:
                raise RuntimeError(f"`ray start` on {name} failed:\n{started.stdout[-4000:]}")

    def _ray_start_argv(self, name: str) -> list[str]:
        host = self.hosts[name]
        shutil.rmtree(host.temp_dir, ignore_errors=True)
        host.temp_dir.mkdir(parents=True)
        flags = [
            *("--node-ip-address", host.ip, "--num-cpus", str(host.num_cpus)),
            *("--resources", json.dumps(host.resources), "--object-store-memory", str(OBJECT_STORE_BYTES)),
            *("--temp-dir", str(host.temp_dir), "--disable-usage-stats"),
        ]
        if host is self.head:
            flags += ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"]
        else:
            flags += ["--address", self.address]
        return [str(VENV_BIN / "ray"), "start", *flags]

    def partition(self, name: str) -> None:
        """Cut host `name` off the network (its processes keep running). The host's own end of its
        veth is taken down, which `ip -n` reaches from any namespace the caller is in."""
        _ip("-n", self.hosts[name].namespace, "link", "set", "eth0", "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.hosts[name].namespace, "link", "set", "eth0", "up")

    def hosts_running(self, title: str) -> list[str]:
        """The hosts with a process whose command line contains `title` (e.g. "RayWorker")."""
        found = []
        for name, host in self.hosts.items():
            for pid in namespace_pids(host.namespace):
                with contextlib.suppress(psutil.Error):
                    if title in " ".join(psutil.Process(pid).cmdline()):
                        found.append(name)
                        break
        return found

    def kill_node(self, name: str) -> None:
        """Host `name` dies: every process on it is killed at once."""
        kill_namespace_processes(self.hosts[name].namespace)

    def teardown(self) -> None:
        for host in self.hosts.values():
            kill_namespace_processes(host.namespace)
        for host in self.hosts.values():
            _ip("netns", "delete", host.namespace, check=False)
            _ip("link", "delete", host.link, check=False)
        _ip("link", "delete", BRIDGE, check=False)
        shutil.rmtree(TEMP_ROOT, ignore_errors=True)
        namespaces, links = leftovers()
        if namespaces or links:
            raise RuntimeError(f"teardown left namespaces {namespaces} and links {links}")
