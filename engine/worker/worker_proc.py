"""The body of a worker subprocess: build a Worker, then answer the executor's calls until it leaves.

Each call arrives as a pickled `(call_id, method, args, kwargs)` on the request pipe; each answer goes
back as a pickled `(call_id, ok, result or traceback text)` on the response pipe. Pickle is safe here
because both ends are processes of this host started by the executor (never a network peer), and it
carries every call's arguments and results alike. A step's SchedulerOutput, the one message sent every
step, comes as msgpack bytes inside the call: msgspec encodes and decodes it faster than pickle.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection

import msgspec
import torch

from engine.config import EngineConfig
from engine.outputs import SchedulerOutput
from engine.process.process_utils import loopback_interface
from engine.worker.worker import Worker
from parallel.state import destroy_model_parallel


def run_worker(
    config: EngineConfig,
    rank: int,
    local_rank: int,
    distributed_init_method: str,
    num_threads: int,
    requests: Connection,
    responses: Connection,
) -> None:
    """Entry point of a worker process (spawned by MultiprocExecutor)."""
    # Ctrl-C in a terminal reaches the whole process group; the executor decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Workers share the host's cores: without a limit each would start one thread per core.
    torch.set_num_threads(num_threads)
    # Every rank is on this host: gloo's connections between them listen on loopback only.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    worker = Worker(config, rank, local_rank, distributed_init_method)
    steps = msgspec.msgpack.Decoder(SchedulerOutput)
    while True:
        try:
            message = requests.recv_bytes()
        except EOFError:
            # The executor closed its end (shutdown) or its process died: either way, leave.
            break
        call_id, method, args, kwargs = pickle.loads(message)
        try:
            if method == "execute_model":
                args = (steps.decode(args[0]),)
            result = getattr(worker, method)(*args, **kwargs)
            # Pickled inside the try, so that an answer that cannot be pickled is reported as an error.
            answer = pickle.dumps((call_id, True, result), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            answer = pickle.dumps((call_id, False, traceback.format_exc()), protocol=pickle.HIGHEST_PROTOCOL)
        responses.send_bytes(answer)
    destroy_model_parallel()
