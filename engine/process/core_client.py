"""How a front end talks to an EngineCore: in its own process, or in a core process over ZeroMQ.

- `InprocClient`: the core runs in the caller's thread; each `get_output` is one step. No extra
  process: the cheapest to start, and tests can reach into the scheduler.
- `SyncMPClient` (LLMEngine) and `AsyncMPClient` (AsyncLLMEngine): the core runs in its own process
  (engine/process/core_proc.py), so the model's steps overlap the front end's tokenization and
  detokenization. Messages go out on a PUSH socket and come back on a PULL socket, two frames each
  (type, msgpack body); a result of a utility call (`get_stats`) is matched to its caller by id.

Liveness: whenever a client waits for the core it polls with a short timeout and, on each timeout,
checks the process; a dead process, or a FAILURE message from the core's step loop, turns into
`EngineDeadError` for the waiter and for every later call. Nothing ever waits on a dead core.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import itertools
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from engine.config import ResolvedEngineConfig
from engine.exceptions import EngineDeadError, EngineStartupError
from engine.lora.request import LoRARequest
from engine.outputs import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    SchedulerStats,
    StopSequence,
    UtilityOutput,
    UtilityRequest,
)
from engine.process.core import EngineCore
from engine.process.core_launcher import CoreProcess
from engine.process.core_wire import MessageDecoder, encode_message

T = TypeVar("T")

# Seconds a new core may take to load its model and size its KV cache before we give up on it.
DEFAULT_READY_TIMEOUT_S = 600.0
# How often a waiting client checks that the core process is alive: the bound on noticing a death.
_LIVENESS_POLL_MS = 200

_FROM_CORE = MessageDecoder(EngineCoreOutputType)


class EngineCoreClient(abc.ABC):
    """One interface to an EngineCore, wherever it runs (vLLM v1's shape).

    Requests go in the same way for every client (`add_request`, `abort_requests`, `stop_sequence`:
    they never block). Outputs and utility calls come back through blocking methods (`get_output`,
    `call_utility`: InprocClient, SyncMPClient) or their `*_async` twins (AsyncMPClient); a client
    raises NotImplementedError for the half it was not made for. The named utilities (`get_stats`,
    `collective_rpc`, `reset_prefix_cache`) are defined once, here, over those two calls (an async
    twin where an asyncio caller needs one).
    """

    # The core's counters when it became ready (before any request).
    initial_stats: SchedulerStats

    @staticmethod
    def make_client(
        config: ResolvedEngineConfig,
        multiprocess: bool,
        asyncio_mode: bool = False,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        wait_until_ready: bool = True,
    ) -> EngineCoreClient:
        """The in-process client, or a client of a core process (blocking or asyncio). The asyncio
        one returns at once with `wait_until_ready=False`: see `MPClient.wait_until_ready`."""
        if asyncio_mode:
            return AsyncMPClient(config, ready_timeout_s, wait_until_ready)
        return SyncMPClient(config, ready_timeout_s) if multiprocess else InprocClient(config)

    @property
    @abc.abstractmethod
    def idle_report_is_current(self) -> bool:
        """Whether an idle report from `get_output` covers every message sent before the call. True
        in process, where the call runs the step; a core process may report before a request that
        is still on its way to it arrives."""

    @property
    @abc.abstractmethod
    def errored(self) -> bool:
        """Whether the core has failed or is gone."""

    @abc.abstractmethod
    def check_alive(self) -> None:
        """Raise EngineDeadError if the core failed or its process is gone."""

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """The front end matched a stop string: the core finishes that sequence and frees its blocks."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocking until there are some)."""
        raise NotImplementedError(f"{type(self).__name__} has no blocking get_output")

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs; raises EngineDeadError once the core is gone."""
        raise NotImplementedError(f"{type(self).__name__} has no get_output_async")

    def call_utility(self, method: str, *args: Any, result_type: type[T] = Any) -> T:
        """An EngineCore method's result, after every message sent before this call."""
        raise NotImplementedError(f"{type(self).__name__} has no blocking call_utility")

    async def call_utility_async(self, method: str, *args: Any, result_type: type[T] = Any) -> T:
        raise NotImplementedError(f"{type(self).__name__} has no call_utility_async")

    def get_stats(self) -> SchedulerStats:
        """The scheduler's counters now, after every message sent before this call."""
        return self.call_utility("get_stats", result_type=SchedulerStats)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """A Worker method's results on every rank, in rank order."""
        return self.call_utility("collective_rpc", method, list(args))

    def add_lora(self, lora: LoRARequest) -> bool:
        """Read a LoRA adapter into the workers' host caches; False if they held it already."""
        return self.call_utility("add_lora", lora, result_type=bool)

    async def add_lora_async(self, lora: LoRARequest) -> bool:
        return await self.call_utility_async("add_lora", lora, result_type=bool)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter from the workers' host caches; False if none held it."""
        return self.call_utility("remove_lora", lora_int_id, result_type=bool)

    async def remove_lora_async(self, lora_int_id: int) -> bool:
        return await self.call_utility_async("remove_lora", lora_int_id, result_type=bool)

    def list_loras(self) -> list[int]:
        """The ids of the LoRA adapters in the workers' host caches."""
        return self.call_utility("list_loras", result_type=list[int])

    async def list_loras_async(self) -> list[int]:
        return await self.call_utility_async("list_loras", result_type=list[int])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while a request holds KV blocks."""
        return self.call_utility("reset_prefix_cache", result_type=bool)

    async def reset_prefix_cache_async(self) -> bool:
        return await self.call_utility_async("reset_prefix_cache", result_type=bool)


class InprocClient(EngineCoreClient):
    """Runs the EngineCore in the caller's process and thread: each `get_output` is one step."""

    def __init__(self, config: ResolvedEngineConfig) -> None:
        self.engine_core = EngineCore(config)
        self.initial_stats = self.engine_core.get_stats()

    @property
    def idle_report_is_current(self) -> bool:
        return True

    # An in-process core cannot die apart from its caller: its errors raise in the caller's thread.
    @property
    def errored(self) -> bool:
        return False

    def check_alive(self) -> None:
        return None

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        self.engine_core.stop_sequence(request_id, index, stop_reason)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any, result_type: type[T] = Any) -> T:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class MPClient(EngineCoreClient):
    """Starts a core process and holds the two sockets to it; what the sync and async clients share.

    The client binds the output socket before the process starts, and connects the input socket
    once the core answered READY (the core binds it first). A connecting PUSH socket queues
    messages even while its peer is away, and has no high-water mark here, so sending never blocks.
    """

    def __init__(
        self,
        config: ResolvedEngineConfig,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        wait_until_ready: bool = True,
    ) -> None:
        self._zmq = zmq.Context()
        # Unsent messages to a dead core must never hold up closing (or collecting) the sockets.
        self._zmq.linger = 0
        self._process = CoreProcess(config)
        self._ready_timeout_s = ready_timeout_s
        self._dead_error: EngineDeadError | None = None
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._input: zmq.Socket | None = None
        try:
            self._output = self._zmq.socket(zmq.PULL)
            self._output.bind(self._process.output_address)
            self._process.start()
        except BaseException:
            self.shutdown()
            raise
        if wait_until_ready:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Block until the core has loaded its model and sized its KV cache (READY), then connect to
        it; the client is shut down if it never gets there. A client made with
        `wait_until_ready=False` lets its caller do other work while the core starts, then calls this
        before anything else."""
        if self._input is not None:
            return
        try:
            self.initial_stats = self._wait_for_ready(self._ready_timeout_s).scheduler_stats
            self._input = self._zmq.socket(zmq.PUSH)
            self._input.sndhwm = 0
            self._input.connect(self._process.input_address)
        except BaseException:
            self.shutdown()
            raise

    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    @property
    def socket_dir(self) -> str:
        """The private directory of this engine's ipc:// sockets."""
        return self._process.socket_dir

    @property
    def idle_report_is_current(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return self._dead_error is not None or self._process.death_message() is not None

    def check_alive(self) -> None:
        """Raise EngineDeadError if the core failed or its process is gone."""
        if self._dead_error is None:
            message = self._process.death_message()
            if message is not None:
                self._dead_error = EngineDeadError(f"{message}; every pending request failed")
        if self._dead_error is not None:
            raise self._dead_error

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.errored:  # a dead core holds nothing to abort
            self._send(EngineCoreRequestType.ABORT, AbortRequests(request_ids))

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        self._send(EngineCoreRequestType.STOP_SEQUENCE, StopSequence(request_id, index, stop_reason))

    def shutdown(self) -> None:
        """Stop the core process and close the sockets; safe to call twice."""
        self._dead_error = self._dead_error or EngineDeadError("the engine was shut down")
        self._process.shutdown()
        self._zmq.destroy(linger=0)

    def _send(self, kind: EngineCoreRequestType, message: msgspec.Struct) -> None:
        self.check_alive()
        if self._input is None:
            raise RuntimeError("the EngineCore client was used before wait_until_ready()")
        self._input.send_multipart(encode_message(self._encoder, kind, message), copy=False)

    def _send_utility(self, method: str, args: tuple) -> int:
        call_id = next(self._call_ids)
        self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        return call_id

    def _decode(self, frames: list[zmq.Frame]) -> tuple[EngineCoreOutputType, Any]:
        """A message from the core; a FAILURE marks the engine dead and raises."""
        kind, message = _FROM_CORE.decode(frames)
        if kind is EngineCoreOutputType.FAILURE:
            self._dead_error = EngineDeadError(f"EngineCore encountered an error: {message.message}")
            raise self._dead_error
        return kind, message

    def _wait_for_ready(self, timeout_s: float) -> EngineCoreReady:
        for _ in range(max(1, int(timeout_s * 1000 / _LIVENESS_POLL_MS))):
            if self._output.poll(_LIVENESS_POLL_MS):
                try:
                    kind, message = self._decode(self._output.recv_multipart(copy=False))
                except EngineDeadError as exc:
                    raise EngineStartupError(f"EngineCore failed to start: {exc.args[0]}") from None
                if kind is not EngineCoreOutputType.READY:
                    raise EngineStartupError(f"EngineCore sent {kind.name} before READY")
                return message
            death = self._process.death_message()
            if death is not None:
                raise EngineStartupError(f"{death} before it was ready; its error is in the log above")
        raise EngineStartupError(
            f"EngineCore did not become ready within {timeout_s:.0f} s (loading the model and "
            "sizing the KV cache take longer?)"
        )

    @staticmethod
    def _utility_result(method: str, output: UtilityOutput, result_type: type[T]) -> T:
        if output.error is not None:
            raise RuntimeError(f"EngineCore.{method}() failed: {output.error}")
        return msgspec.msgpack.decode(output.result, type=result_type)


class SyncMPClient(MPClient):
    """The blocking client LLMEngine uses for a core in its own process."""

    def __init__(
        self, config: ResolvedEngineConfig, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    ) -> None:
        super().__init__(config, ready_timeout_s)
        # Step outputs that arrived while a utility call waited for its answer.
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()

    def get_output(self) -> EngineCoreOutputs:
        if self._pending:
            return self._pending.popleft()
        while True:
            kind, message = self._recv()
            if kind is EngineCoreOutputType.OUTPUTS:
                return message
            # (A utility answer whose caller gave up, e.g. interrupted: nobody waits for it.)

    def call_utility(self, method: str, *args: Any, result_type: type[T] = Any) -> T:
        call_id = self._send_utility(method, args)
        while True:
            kind, message = self._recv()
            if kind is EngineCoreOutputType.OUTPUTS:
                self._pending.append(message)
            elif kind is EngineCoreOutputType.UTILITY and message.call_id == call_id:
                return self._utility_result(method, message, result_type)

    def _recv(self) -> tuple[EngineCoreOutputType, Any]:
        self.check_alive()
        while not self._output.poll(_LIVENESS_POLL_MS):
            self.check_alive()
        return self._decode(self._output.recv_multipart(copy=False))


class AsyncMPClient(MPClient):
    """The asyncio client AsyncLLMEngine uses: one reader task per event loop receives everything,
    queueing step outputs for `get_output_async` and resolving utility calls' futures.

    Sending is synchronous (it never blocks, see MPClient), so aborts can be sent from `finally`
    blocks of cancelled tasks. The reader starts with the first awaited call; if the client is then
    used from another event loop (a second `asyncio.run`), it starts again there.
    """

    def __init__(
        self,
        config: ResolvedEngineConfig,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        wait_until_ready: bool = True,
    ) -> None:
        super().__init__(config, ready_timeout_s, wait_until_ready)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_output: zmq.asyncio.Socket | None = None
        self._queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._reader: asyncio.Task | None = None  # (the loop keeps only a weak reference to a task)
        self._futures: dict[int, asyncio.Future] = {}

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs; raises EngineDeadError once the core is gone."""
        queue = self._start_reader()
        item = await queue.get()
        if isinstance(item, EngineDeadError):
            queue.put_nowait(item)  # for every later caller too
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any, result_type: type[T] = Any) -> T:
        self._start_reader()
        future = asyncio.get_running_loop().create_future()
        call_id = self._send_utility(method, args)
        self._futures[call_id] = future
        return self._utility_result(method, await future, result_type)

    def shutdown(self) -> None:
        loop, socket = self._loop, self._async_output
        if socket is not None and loop is not None and not loop.is_closed():
            # Unregisters the socket from the loop and cancels the reader's pending poll first.
            socket.close(linger=0)
        super().shutdown()

    def _start_reader(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._queue = asyncio.Queue()
            self._futures = {}
            self._async_output = zmq.asyncio.Socket.shadow(self._output.underlying)
            self._reader = loop.create_task(
                self._read_outputs(self._async_output, self._queue), name="EngineCoreReader"
            )
        assert self._queue is not None
        return self._queue

    async def _read_outputs(self, socket: zmq.asyncio.Socket, queue: asyncio.Queue) -> None:
        try:
            while True:
                if not await socket.poll(_LIVENESS_POLL_MS):
                    self.check_alive()
                    continue
                kind, message = self._decode(await socket.recv_multipart(copy=False))
                if kind is EngineCoreOutputType.OUTPUTS:
                    queue.put_nowait(message)
                elif kind is EngineCoreOutputType.UTILITY:
                    future = self._futures.pop(message.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(message)
        except Exception as exc:
            if socket.closed:
                return  # the client shut down
            # Whatever stops this task would leave every waiter hanging: fail them all instead.
            if not isinstance(exc, EngineDeadError):
                exc = EngineDeadError(f"cannot read the EngineCore's outputs: {type(exc).__name__}: {exc}")
            self._dead_error = self._dead_error or exc
            queue.put_nowait(exc)
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(exc)
            self._futures.clear()
