"""Workers as Ray actors, one per placement-group bundle, across the nodes of a Ray cluster.

The engine core (this process) is a Ray driver. Each step is encoded once (msgpack, which msgspec
encodes and decodes faster than pickle) and the same bytes go to every worker as one remote call;
stages pass activations to each other over torch.distributed, never through the object store. Calls are awaited with `ray.wait`, one answer at a time, so that the first
dead actor (a killed process, a removed node) fails the call at once with EngineDeadError, rather than
after the live ranks, which may be blocked in a collective with it, time out.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.exceptions import EngineDeadError
from engine.executor import ray_utils
from engine.executor.base import Executor
from engine.outputs import ModelRunnerOutput, PendingBitmask, SchedulerOutput
from engine.process.process_utils import available_cores, free_port, interface_with_address
from engine.worker.worker import Worker

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 300.0  # actor start plus model load on every worker
_DEAD_PEER_GRACE_S = 2.0  # how long a failed step waits for the other ranks to reveal a dead actor


class RayWorker:
    """The actor around one Worker: runs its methods by name (its process title is `ray::RayWorker`)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self._steps = msgspec.msgpack.Decoder(SchedulerOutput)

    def node_info(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, cores this process may run on)."""
        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address(), available_cores()

    def free_port(self) -> int:
        """A port free on this worker's node (all its addresses), for the torch.distributed rendezvous
        it will host."""
        return free_port("")

    def start(self, config: EngineConfig, rank: int, init_method: str, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        _bind_collectives_to_node_address()
        # Ray narrows CUDA_VISIBLE_DEVICES to this actor's own GPU, so its device index is always 0;
        # an actor given no GPU (a placement_bundle without one) would share GPU 0 of its node.
        if config.model.device == "cuda" and not ray.get_gpu_ids():
            raise RuntimeError(
                f"worker rank {rank} was given no GPU: with device cuda every worker's placement "
                "bundle needs {'GPU': 1} (placement_bundle null gives that)"
            )
        self.worker = Worker(config, rank, 0, init_method)

    def execute_method(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_model(self, message: bytes) -> ModelRunnerOutput | None:
        return self.worker.execute_model(self._steps.decode(message))


class RayDistributedExecutor(Executor):
    """Runs tensor_parallel_size x pipeline_parallel_size Workers as Ray actors in a placement group."""

    def _init_executor(self) -> None:
        parallel = self.config.parallel
        self._failure: str | None = None
        self._workers: list[Any] = []
        self.worker_nodes: list[str] = []
        self.worker_ips: list[str] = []  # each rank's node address, to name a lost node by
        self._placement_group = None
        self._owns_placement_group = parallel.placement_group_id is None
        ray_utils.connect(parallel.ray_address)
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        parallel = self.config.parallel
        world_size = parallel.world_size
        bundle = ray_utils.worker_bundle(self.config)
        if self._owns_placement_group:
            self._placement_group = ray_utils.reserve_placement_group(parallel, bundle)
        else:
            self._placement_group = ray_utils.placement_group_by_id(parallel.placement_group_id)
            if self._placement_group.bundle_count < world_size:
                raise ValueError(
                    f"placement group {parallel.placement_group_id} has "
                    f"{self._placement_group.bundle_count} bundles; {world_size} workers need one each"
                )
        actor_class = ray.remote(RayWorker)
        actors = [
            actor_class.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources={name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=index
                ),
            ).remote()
            for index in range(world_size)
        ]
        self._workers = actors  # so that shutdown kills them if anything below fails
        infos = self._wait([actor.node_info.remote() for actor in actors], "node_info", _deadline())
        nodes = [node for node, _, _ in infos]
        driver_node = ray.get_runtime_context().get_node_id()
        order = ray_utils.rank_order(nodes, driver_node, parallel.tensor_parallel_size)
        self._workers = [actors[index] for index in order]
        self.worker_nodes = [nodes[index] for index in order]
        self.worker_ips = [infos[index][1] for index in order]
        rank0_ip = infos[order[0]][1]
        port = self._wait([self._workers[0].free_port.remote()], "free_port", _deadline())[0]
        init_method = f"tcp://{rank0_ip}:{port}"
        per_node = {node: self.worker_nodes.count(node) for node in self.worker_nodes}
        starts = []
        for rank, index in enumerate(order):
            node, _, cores = infos[index]
            # Co-located workers share the node's cores; none may ask for more than its bundle.
            threads = max(1, min(int(bundle.get("CPU", 1)) or 1, cores // per_node[node]))
            starts.append(self._workers[rank].start.remote(self.config, rank, init_method, threads))
        self._wait(starts, "start", _deadline())
        logger.info(
            "Started %d Ray workers on %d node(s), rendezvous at %s", world_size, len(per_node), init_method
        )
        # init_device joins the process group, which needs every rank at once: one call to each does that.
        self.collective_rpc("init_device", timeout=_STARTUP_TIMEOUT_S)
        self.collective_rpc("load_model", timeout=_STARTUP_TIMEOUT_S)

    def _call_workers(
        self, method: str, args: tuple, kwargs: dict[str, Any], deadline: float | None
    ) -> list[Any]:
        self._check_alive(method)
        refs = [worker.execute_method.remote(method, args, kwargs) for worker in self._workers]
        return self._wait(refs, method, deadline)

    def _start_step(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None
    ) -> Callable[[], list[ModelRunnerOutput | None]]:
        """Send the step to every worker now (one encoded message, the same bytes for all). An actor
        runs its calls in order, so pipeline stages work on consecutive steps at once."""
        self._check_alive("execute_model")
        message = msgspec.msgpack.encode(self.with_grammar_bitmask(scheduler_output, grammar_bitmask))
        refs = [worker.execute_model.remote(message) for worker in self._workers]
        return lambda: self._wait(refs, "execute_model", None)

    def _check_alive(self, method: str) -> None:
        if self._failure is not None:
            raise EngineDeadError(f"{self._failure}; cannot run {method}")

    def _wait(self, refs: list[ray.ObjectRef], method: str, deadline: float | None) -> list[Any]:
        """The results of `refs` (one per rank, in rank order), failing on the first error.

        A worker's exception in a step is fatal, as a dead worker is: its peers are left mid-collective.
        It is often the symptom (a collective whose peer vanished), so the other ranks get a moment to
        show a dead actor, which is then named as the cause."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                ranks = sorted(rank_of[ref] for ref in pending)
                raise TimeoutError(f"worker rank(s) {ranks} did not answer {method} in time")
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0], timeout=0)
            except RayActorError as error:
                raise self._fail(
                    f"Ray worker rank {rank}{self._node_of(rank)} died: {_first_line(error)}", method
                ) from None
            except RayTaskError as error:
                if method != "execute_model":
                    raise RuntimeError(f"worker rank {rank} failed in {method}:\n{error}") from None
                dead = self._find_dead(pending, rank_of)
                if dead is not None:
                    raise self._fail(dead, method) from None
                raise self._fail(
                    f"Ray worker rank {rank}{self._node_of(rank)} failed in a step: {_first_line(error.cause)}",
                    method,
                ) from None
        return [results[rank] for rank in range(len(refs))]

    def _find_dead(self, pending: list[ray.ObjectRef], rank_of: dict[ray.ObjectRef, int]) -> str | None:
        """Which of the ranks still answering `pending` calls died, if one shows it within a grace period."""
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=_DEAD_PEER_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except RayActorError as error:
                rank = rank_of[ref]
                return f"Ray worker rank {rank}{self._node_of(rank)} died: {_first_line(error)}"
            except Exception:  # another symptom: the first error is reported instead
                continue
        return None

    def _node_of(self, rank: int) -> str:
        if rank >= len(self.worker_nodes):
            return ""
        return f" (node {self.worker_nodes[rank][:8]} at {self.worker_ips[rank]})"

    def _fail(self, failure: str, method: str) -> EngineDeadError:
        """Mark the executor dead and stop the workers (the live ones wait in collectives for the dead)."""
        if self._failure is None:
            self._failure = failure
            logger.error("%s; stopping the other workers", failure)
            self._kill_workers()
        return EngineDeadError(f"{self._failure}; {method} did not complete")

    def _kill_workers(self) -> None:
        for worker in self._workers:
            ray.kill(worker, no_restart=True)

    def shutdown(self) -> None:
        """Kill every actor and remove the placement group this executor created; safe to call twice."""
        if getattr(self, "_failure", None) is None:
            self._failure = "the executor was shut down"
        if not ray.is_initialized():
            return
        self._kill_workers()
        self._workers = []
        if self._placement_group is not None and self._owns_placement_group:
            remove_placement_group(self._placement_group)
        self._placement_group = None


def _bind_collectives_to_node_address() -> None:
    """Make gloo (and NCCL's bootstrap) use the interface of the address Ray knows this node by.

    Left alone, gloo binds the address its host name resolves to, which on many hosts (and here in
    a container) is loopback or no local address at all, and then falls back to loopback: peers on
    other nodes cannot reach it and the rendezvous times out. An interface the user chose wins."""
    ip = ray.util.get_node_ip_address()
    interface = interface_with_address(ip)
    if interface is None:  # the node's address is not local (NAT): keep the libraries' own choice
        logger.warning("no local interface holds the Ray node address %s; gloo picks its own", ip)
        return
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, interface)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _deadline() -> float:
    return time.monotonic() + _STARTUP_TIMEOUT_S
