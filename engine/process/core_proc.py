"""EngineCoreProc: an EngineCore in its own process, driven over two ZeroMQ sockets.

The main thread runs the step loop. One thread reads and decodes messages from the input socket, one
encodes and writes outputs to the output socket: (de)serialization overlaps the forward pass (torch
releases the GIL), and a slow front end never stalls a step. Messages are msgspec Structs
(engine/outputs.py), two frames each (engine/process/core_wire.py): type, body.

Lifecycle: the parent spawns `run_engine_core`, which builds the EngineCore (executor, workers,
model, KV cache) and answers READY, or FAILURE with the error's message. An exception in the step
loop is sent as FAILURE too, then the process exits; SIGTERM (the parent's shutdown) exits cleanly,
and so does the loop when it finds its parent gone, so that a killed front end leaves no orphan.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import sys
import threading
from typing import Any

import msgspec
import zmq

from engine.config import ResolvedEngineConfig
from engine.outputs import (
    EngineCoreFailure,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)
from engine.process.core import EngineCore
from engine.process.core_wire import MessageDecoder, encode_message

logger = logging.getLogger(__name__)

# The EngineCore methods a client may call by name (UtilityRequest), nothing else. collective_rpc
# reaches Worker methods; the client is this engine's own front end, over a private ipc:// socket.
UTILITY_METHODS = frozenset(
    {
        "get_stats",
        "check_health",
        "collective_rpc",
        "reset_prefix_cache",
        "prefix_cache_summary",
        "add_lora",
        "remove_lora",
        "list_loras",
    }
)
# How often an idle core checks that its parent is still alive (a busy one checks every step).
_PARENT_CHECK_S = 1.0
# How long the last outputs (a FAILURE message above all) may take to reach the client at exit.
_FLUSH_LINGER_MS = 2000

_TO_CORE = MessageDecoder(EngineCoreRequestType)


class EngineCoreProc:
    """Runs one EngineCore's step loop for one client, connected by ZeroMQ `ipc://` addresses.

    The output writer starts first, so that a failure to build the EngineCore still reaches the
    client; `start` builds the core and answers READY; `run_busy_loop` serves until SIGTERM.
    """

    def __init__(self, output_address: str) -> None:
        self._parent_pid = os.getppid()
        self.orphaned = False
        self._zmq = zmq.Context()
        # Items are (kind, message), or (None, exception) for an error of the reader or the writer.
        self._inputs: queue.Queue[tuple[EngineCoreRequestType | None, Any]] = queue.Queue()
        self._outputs: queue.Queue[tuple[EngineCoreOutputType, msgspec.Struct] | None] = queue.Queue()
        self._writer = threading.Thread(
            target=self._write_outputs, args=(output_address,), name="EngineCoreOutputs", daemon=True
        )
        self._writer.start()
        self.engine_core: EngineCore | None = None

    def start(self, config: ResolvedEngineConfig, input_address: str) -> None:
        """Build the EngineCore, open the input socket, and tell the client it is ready."""
        self.engine_core = EngineCore(config)
        # Bound here, before READY, so that the client's first message finds it; the reader
        # thread owns it from now on.
        socket = self._zmq.socket(zmq.PULL)
        socket.bind(input_address)
        threading.Thread(
            target=self._read_inputs, args=(socket,), name="EngineCoreInputs", daemon=True
        ).start()
        self._outputs.put((EngineCoreOutputType.READY, EngineCoreReady(self.engine_core.get_stats())))

    def run_busy_loop(self) -> None:
        """Apply what arrived, step while there is work; an idle core blocks on its input."""
        core = self.engine_core
        assert core is not None
        while True:
            self._check_parent()
            changed = self._process_inputs(block=not core.has_unfinished_requests())
            # After adds, aborts or stops even an idle core reports, so the client's stats are current.
            if changed or core.has_unfinished_requests():
                self._outputs.put((EngineCoreOutputType.OUTPUTS, core.step()))

    def report_failure(self, exc: BaseException) -> None:
        self._outputs.put((EngineCoreOutputType.FAILURE, EngineCoreFailure(f"{type(exc).__name__}: {exc}")))

    def shutdown(self) -> None:
        """Stop the workers, send what is left, close the sockets."""
        try:
            if self.engine_core is not None:
                self.engine_core.shutdown()
        finally:
            self._outputs.put(None)
            self._writer.join(timeout=_FLUSH_LINGER_MS / 1000 + 1)
            # Blocks until the writer's socket delivered its last messages (bounded by its linger);
            # the reader's blocked receive raises ContextTerminated and closes its socket.
            self._zmq.term()

    # ---- inputs ----------------------------------------------------------------------------------

    def _process_inputs(self, block: bool) -> bool:
        """Apply every queued message (waiting for one first if `block`); True if any changed the
        scheduler's state."""
        changed = False
        if block:
            changed |= self._handle(*self._wait_for_input())
        while True:
            try:
                item = self._inputs.get_nowait()
            except queue.Empty:
                return changed
            changed |= self._handle(*item)

    def _wait_for_input(self) -> tuple[EngineCoreRequestType | None, Any]:
        while True:
            try:
                return self._inputs.get(timeout=_PARENT_CHECK_S)
            except queue.Empty:
                self._check_parent()

    def _check_parent(self) -> None:
        """Exit if the front end is gone (killed: it could not stop us); a syscall, cheap per step."""
        if os.getppid() != self._parent_pid:
            logger.warning("EngineCore: the front-end process is gone; exiting")
            self.orphaned = True
            raise SystemExit(0)

    def _handle(self, kind: EngineCoreRequestType | None, message: Any) -> bool:
        core = self.engine_core
        assert core is not None
        if kind is None:
            raise message
        if kind is EngineCoreRequestType.ADD:
            core.add_request(message)
        elif kind is EngineCoreRequestType.ABORT:
            core.abort_requests(message.request_ids)
        elif kind is EngineCoreRequestType.STOP_SEQUENCE:
            core.stop_sequence(message.request_id, message.index, message.stop_reason)
        else:
            self._outputs.put((EngineCoreOutputType.UTILITY, self._call_utility(message)))
            return False
        return True

    def _call_utility(self, request: UtilityRequest) -> UtilityOutput:
        if request.method not in UTILITY_METHODS:
            return UtilityOutput(request.call_id, error=f"{request.method!r} is not a utility method")
        try:
            result = getattr(self.engine_core, request.method)(*request.args)
        except Exception as exc:
            return UtilityOutput(request.call_id, error=f"{type(exc).__name__}: {exc}")
        return UtilityOutput(request.call_id, msgspec.Raw(msgspec.msgpack.encode(result)))

    # ---- the socket threads ----------------------------------------------------------------------

    def _read_inputs(self, socket: zmq.Socket) -> None:
        try:
            while True:
                self._inputs.put(_TO_CORE.decode(socket.recv_multipart(copy=False)))
        except zmq.ContextTerminated:
            pass
        except Exception as exc:
            # A message the core cannot read is a bug in the client: fail loudly, in the step loop.
            self._inputs.put((None, exc))
        finally:
            socket.close(linger=0)

    def _write_outputs(self, address: str) -> None:
        socket = self._zmq.socket(zmq.PUSH)
        socket.connect(address)
        encoder = msgspec.msgpack.Encoder()
        try:
            while (item := self._outputs.get()) is not None:
                kind, message = item
                socket.send_multipart(encode_message(encoder, kind, message), copy=False)
        except Exception as exc:
            logger.exception("EngineCore: cannot send outputs")
            self._inputs.put((None, exc))  # the step loop raises it and the process exits
        finally:
            socket.close(linger=_FLUSH_LINGER_MS)


def _setup_process(log_level: int) -> None:
    # The parent owns this process's lifetime: Ctrl-C reaches it, and it shuts the core down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s [EngineCore pid=%(process)d] %(name)s: %(message)s"
    )


def run_engine_core(config_json: str, input_address: str, output_address: str, log_level: int) -> None:
    """Entry point of the core process (a multiprocessing spawn target): serve until told to stop."""
    _setup_process(log_level)
    proc = EngineCoreProc(output_address)
    exit_code = 0
    try:
        proc.start(ResolvedEngineConfig.model_validate_json(config_json), input_address)
        proc.run_busy_loop()
    except SystemExit:
        pass
    except BaseException as exc:
        logger.exception("EngineCore failed")
        proc.report_failure(exc)
        exit_code = 1
    finally:
        proc.shutdown()
        if proc.orphaned:
            # The front end owned the socket directory and can no longer remove it.
            shutil.rmtree(os.path.dirname(input_address.removeprefix("ipc://")), ignore_errors=True)
    sys.exit(exit_code)
