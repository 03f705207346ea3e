"""Workers in subprocesses of this host, one per rank.

Each call is pickled once and written to every worker's request pipe (the broadcast); a step's
SchedulerOutput travels inside it as msgpack bytes, which encode and decode faster than pickle. Each
worker answers on its own response pipe, read in rank order. A monitor thread watches the processes'
sentinels: when a worker dies the executor is marked failed, the other workers are stopped, and
every pending or later call raises EngineDeadError instead of waiting forever.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.exceptions import EngineDeadError
from engine.executor.base import Executor
from engine.outputs import ModelRunnerOutput, PendingBitmask, SchedulerOutput
from engine.process.process_utils import StopOnReleaseOrExit, available_cores, describe_exit

logger = logging.getLogger(__name__)

_EXIT_GRACE_S = 5.0  # how long shutdown lets workers leave on their own before terminating them
_KILL_GRACE_S = 2.0  # how long a terminated worker gets before SIGKILL


def _run_worker(*args: Any) -> None:
    """A worker process's entry point: `engine.worker.worker_proc.run_worker`, imported there. The
    executor's own process (the engine core) runs no model: importing the worker's stack (torch and
    the model code) only to name its entry point cost it about a second of each start-up."""
    from engine.worker.worker_proc import run_worker

    run_worker(*args)


class MultiprocExecutor(Executor):
    """Runs tensor_parallel_size x pipeline_parallel_size Workers in spawned subprocesses.

    Spawning re-imports the caller's main module in each worker, so a script that builds an engine
    must do so under `if __name__ == "__main__":`.
    """

    def _init_executor(self) -> None:
        self._call_ids = itertools.count()
        # One sender or reader at a time: a reader takes answers off the pipes for other calls too.
        self._call_lock = threading.Lock()
        self._early_answers: dict[tuple[int, int], tuple[bool, Any]] = {}
        self._abandoned: set[int] = set()
        self._workers = _WorkerGroup()
        # Before multiprocessing's own exit hook, which would terminate the workers first and have
        # the monitor report them as dead.
        self._stop_workers = StopOnReleaseOrExit(self, self._workers.stop)
        try:
            self._workers.start(self.config)
            # init_device joins the process group, which needs every rank at once: a broadcast does that.
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, in rank order."""
        return [process.pid for process in self._workers.processes]

    def _call_workers(
        self, method: str, args: tuple, kwargs: dict[str, Any], deadline: float | None
    ) -> list[Any]:
        return self._gather(self._broadcast(method, args, kwargs), method, deadline)

    def _start_step(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None
    ) -> Callable[[], list[ModelRunnerOutput | None]]:
        """Send the step to every worker now, so that pipeline stages work on consecutive steps at once."""
        message = msgspec.msgpack.encode(self.with_grammar_bitmask(scheduler_output, grammar_bitmask))
        call_id = self._broadcast("execute_model", (message,), {})
        return lambda: self._gather(call_id, "execute_model", None)

    def _broadcast(self, method: str, args: tuple, kwargs: dict[str, Any]) -> int:
        with self._call_lock:
            failure = self._workers.check()
            if failure is not None:
                raise EngineDeadError(f"{failure}; cannot run {method}")
            call_id = next(self._call_ids)
            message = pickle.dumps((call_id, method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                for pipe in self._workers.requests:
                    pipe.send_bytes(message)
            except OSError:
                raise self._dead_error(method) from None
            return call_id

    def _gather(self, call_id: int, method: str, deadline: float | None) -> list[Any]:
        """Every rank's answer to `call_id`, in rank order."""
        with self._call_lock:
            try:
                return [
                    self._receive(rank, call_id, method, deadline)
                    for rank in range(len(self._workers.processes))
                ]
            except BaseException:
                self._abandoned.add(call_id)  # its remaining answers are dropped when they arrive
                raise

    def _receive(self, rank: int, call_id: int, method: str, deadline: float | None) -> Any:
        """Rank `rank`'s answer to call `call_id`; raises when it failed, died or ran out of time.

        Answers to other calls read on the way are kept for their own gather (steps in flight), or
        dropped if their call was abandoned (it timed out, or a lower rank failed).
        """
        pipe = self._workers.responses[rank]
        # Any worker's death wakes this up: the answer would otherwise never come (the monitor stops
        # the others, and a rank blocked in a collective waits on the dead one).
        watched = [pipe, *self._workers.sentinels]
        while (rank, call_id) not in self._early_answers:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(watched, remaining)
            if pipe in ready:
                try:
                    answer_id, ok, value = pickle.loads(pipe.recv_bytes())
                except (EOFError, OSError):
                    # The worker is exiting (or shutdown closed the pipe): its exit status says why.
                    multiprocessing.connection.wait([self._workers.processes[rank].sentinel], _KILL_GRACE_S)
                    raise self._dead_error(method) from None
                if answer_id not in self._abandoned:
                    self._early_answers[(rank, answer_id)] = (ok, value)
            elif ready:
                raise self._dead_error(method)
            else:
                raise TimeoutError(f"worker rank {rank} did not answer {method} in time")
        ok, value = self._early_answers.pop((rank, call_id))
        if ok:
            return value
        raise RuntimeError(f"worker rank {rank} failed in {method}:\n{value}")

    def _dead_error(self, method: str) -> EngineDeadError:
        return EngineDeadError(f"{self._workers.record_failure()}; {method} did not complete")

    def shutdown(self) -> None:
        """Stop the workers (politely, then SIGTERM, then SIGKILL), join them, close the pipes."""
        self._stop_workers()


class _WorkerGroup:
    """The worker processes, this side's ends of their pipes, and the thread that watches them.

    Kept apart from the executor so that the finalizer and the monitor thread can hold it without
    keeping the executor alive.
    """

    def __init__(self) -> None:
        self.processes: list[BaseProcess] = []
        self.requests: list[Connection] = []
        self.responses: list[Connection] = []
        self.failure: str | None = None
        self._failure_lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self.rendezvous_dir: str | None = None

    @property
    def sentinels(self) -> list[int]:
        return [process.sentinel for process in self.processes]

    def start(self, config: EngineConfig) -> None:
        world_size = config.parallel.world_size
        # Spawn, not fork: forking a process whose torch thread pools are running can deadlock the child.
        context = multiprocessing.get_context("spawn")
        # A file in a private (0700) directory rather than tcp://: torch's TCPStore listens on every
        # interface, not only the one named, and every rank is on this host.
        self.rendezvous_dir = tempfile.mkdtemp(prefix="raypage-rendezvous-")
        init_method = f"file://{self.rendezvous_dir}/store"
        num_threads = max(1, available_cores() // world_size)
        for rank in range(world_size):
            request_reader, request_writer = context.Pipe(duplex=False)
            response_reader, response_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_run_worker,
                args=(config, rank, rank, init_method, num_threads, request_reader, response_writer),
                name=f"raypage-worker-{rank}",
                daemon=True,
            )
            process.start()
            # Keep only this side's ends, so that each side reads EOF once the other closes or dies.
            request_reader.close()
            response_writer.close()
            self.processes.append(process)
            self.requests.append(request_writer)
            self.responses.append(response_reader)
        logger.info(
            "Started %d worker processes (%d torch threads each), rendezvous at %s",
            world_size,
            num_threads,
            init_method,
        )
        self._monitor = threading.Thread(target=self._watch, name="raypage-worker-monitor", daemon=True)
        self._monitor.start()

    def check(self) -> str | None:
        """Why the group cannot take calls, or None; notices a death the monitor has not handled yet."""
        if self.failure is None and multiprocessing.connection.wait(self.sentinels, 0):
            return self.record_failure()
        return self.failure

    def record_failure(self) -> str:
        """Name the worker(s) that died, once: the first description sticks, so that the workers the
        monitor stops afterwards are not blamed."""
        with self._failure_lock:
            if self.failure is None:
                exited = set(multiprocessing.connection.wait(self.sentinels, 0))
                deaths = [
                    _describe_death(rank, process)
                    for rank, process in enumerate(self.processes)
                    if process.sentinel in exited
                ]
                self.failure = "; ".join(deaths) or "a worker stopped answering"
            return self.failure

    def _watch(self) -> None:
        multiprocessing.connection.wait(self.sentinels)
        if self._stopping.is_set():
            return
        logger.error("%s; stopping the other workers", self.record_failure())
        self._reap(0.0)

    def _reap(self, wait_s: float) -> None:
        """Give the workers `wait_s` to exit on their own, then terminate, then kill the rest."""
        with self._reap_lock:
            _join_all(self.processes, wait_s)
            for process in self.processes:
                if process.is_alive():
                    process.terminate()
            _join_all(self.processes, _KILL_GRACE_S)
            for process in self.processes:
                if process.is_alive():
                    process.kill()
            _join_all(self.processes, _KILL_GRACE_S)

    def stop(self) -> None:
        self._stopping.set()
        with self._failure_lock:
            self.failure = self.failure or "the executor was shut down"
        for pipe in self.requests:
            pipe.close()  # each worker reads EOF and leaves its loop
        self._reap(_EXIT_GRACE_S)
        for pipe in self.responses:
            pipe.close()
        if self._monitor is not None:
            self._monitor.join()
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)


def _describe_death(rank: int, process: BaseProcess) -> str:
    # The sentinel fires when the process closes its files, a moment before its exit status exists.
    process.join(_KILL_GRACE_S)
    return f"worker rank {rank} (pid {process.pid}) died ({describe_exit(process.exitcode)})"


def _join_all(processes: list[BaseProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
