"""One worker: a device, a shard of the model, its KV cache and the model runner driving both.

Executors call these methods by name (`collective_rpc`), in this order: `init_device`,
`load_model`, `determine_num_kv_blocks`, `initialize_cache`, then `execute_model` every step.
"""

from __future__ import annotations

import logging
import os

import torch

from engine.config import ResolvedEngineConfig
from engine.lora.request import LoRARequest
from engine.lora.worker_slots import LoRAWorkerSlots
from engine.outputs import ModelRunnerOutput, PendingBitmask, SchedulerOutput
from engine.sched.kv_cache_manager import cdiv
from engine.worker.cache_engine import CacheEngine
from engine.worker.cuda_graphs import cuda_graphs_disabled_reason, graph_memory_estimate
from engine.worker.memory import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    GiB,
    host_available_bytes,
    profile_cuda_memory,
    profile_host_memory,
)
from engine.worker.model_runner import ModelRunner
from kernels.host_malloc import keep_freed_host_memory
from kernels.huge_pages import engine_step
from parallel.comm import take_comm_times
from parallel.state import get_parallel_state, init_model_parallel

logger = logging.getLogger(__name__)

# A CPU KV cache of at most this share of the host's available memory leaves at least as much again
# for the activations of one step, which take a fraction of the cache's size at the batch limits.
_UNPROFILED_SHARE = 0.5


class Worker:
    """A single rank of the engine."""

    def __init__(
        self,
        config: ResolvedEngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None
        self.cache_engine: CacheEngine | None = None

    def init_device(self) -> None:
        if self.config.model.device == "cuda":
            # Before any other CUDA work, so that the context, NCCL and every allocation land on this
            # rank's GPU. Under Ray local_rank is 0: Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU.
            visible = torch.cuda.device_count()
            if self.local_rank >= visible:
                raise RuntimeError(
                    f"worker rank {self.rank} needs GPU {self.local_rank} but this process sees {visible} "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
                    "each worker needs its own GPU"
                )
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            keep_freed_host_memory()  # each step's logits and sampling buffers, reused without faults
        parallel = self.config.parallel
        init_model_parallel(
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            self.rank,
            self.distributed_init_method,
            self.device,
            parallel.enable_expert_parallel,
        )
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> tuple[int, int]:
        """(device blocks, host swap blocks) this worker can hold, after a profiling pass at the batch
        limits (on the CPU only for a cache of more than _UNPROFILED_SHARE of the available memory)."""
        cache = self.config.cache
        runner = self.model_runner
        block_bytes = CacheEngine.bytes_per_block(
            cache.block_size, runner.kv_cache_spec(), runner.kv_cache_dtype
        )
        if runner.draft is not None:  # a speculative draft model's cache has a block for each
            block_bytes += CacheEngine.bytes_per_block(
                cache.block_size, runner.draft.kv_cache_spec(), runner.kv_cache_dtype
            )
        num_cpu_blocks = min(int(cache.swap_space * GiB) // block_bytes, self._most_blocks_swapped_at_once())
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks, num_cpu_blocks
        if self.device.type == "cuda":
            budget = profile_cuda_memory(
                runner.profile_run, self.device, cache.gpu_memory_utilization
            ).available_after
            if self._cuda_graphs_disabled_reason() is None:
                # The graphs are captured after the cache is allocated, so their memory (and the
                # spare block their padding rows write to) is set aside now.
                tp_size = self.config.parallel.tensor_parallel_size
                budget -= graph_memory_estimate(self.config, runner.dtype, tp_size) + block_bytes
        else:
            budget = cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
            # A cache that leaves most of the host's memory free is allocated as set, without the
            # profiling pass (a forward and a sampling at the batch limits, seconds of the start-up),
            # as vLLM's CPU backend does; a larger one is checked against the profiled peak.
            if budget > host_available_bytes() * _UNPROFILED_SHARE:
                profile = profile_host_memory(runner.profile_run)
                # Leave the host headroom for the activations the profile measured, plus 10%.
                room = int((profile.available_after - profile.peak_bytes) * 0.9)
                if budget > room:
                    logger.warning(
                        "kv_cache_memory of %.2f GiB does not fit beside the profiled peak; using %.2f GiB",
                        budget / GiB,
                        room / GiB,
                    )
                    budget = room
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: one block needs {block_bytes} bytes, {max(budget, 0)} are left; "
                "lower max_num_batched_tokens / max_num_seqs or raise kv_cache_memory / gpu_memory_utilization"
            )
        return int(num_blocks), num_cpu_blocks

    def _most_blocks_swapped_at_once(self) -> int:
        """What the swap pool can ever hold: the scheduler admits no request while one is swapped
        out, so the rows swapped out and running are at most max_num_seqs, each row of at most
        max_model_len tokens and its draft's lookahead. A tiny model's blocks are small enough that
        swap_space alone would make millions of them, each a host-side object of the scheduler's."""
        speculative = self.config.speculative.speculative_config
        lookahead = speculative.num_speculative_tokens if speculative is not None else 0
        row_blocks = cdiv(self.config.model.max_model_len + lookahead, self.config.cache.block_size)
        return self.config.scheduler.max_num_seqs * row_blocks

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Allocate the KV cache, then capture the decode graphs over it where they are used.

        With graphs the cache holds one block more than the scheduler knows of: the padding rows of
        a replayed batch write there and never into a sequence's blocks.
        """
        runner = self.model_runner
        graphs_off = self._cuda_graphs_disabled_reason()
        if graphs_off and self.device.type == "cuda":
            logger.info("decode steps run eagerly: %s", graphs_off)
        else:
            logger.debug("no CUDA graphs: %s", graphs_off)
        self.cache_engine = CacheEngine(
            num_blocks + (0 if graphs_off else 1),
            self.config.cache.block_size,
            runner.kv_cache_spec(),
            runner.kv_cache_dtype,
            self.device,
            num_cpu_blocks,
        )
        runner.kv_caches = self.cache_engine.kv_caches
        if runner.draft is not None:
            runner.draft.initialize_cache(num_blocks, num_cpu_blocks)
        if not graphs_off:
            runner.capture_decode_graphs(padding_block=num_blocks)

    def _cuda_graphs_disabled_reason(self) -> str | None:
        return cuda_graphs_disabled_reason(self.config, self.device, self.model_runner.attention_backend)

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None = None
    ) -> ModelRunnerOutput | None:
        """One step; `grammar_bitmask`, the step's grammar masks still being computed (an in-process
        worker), is waited for only when the step samples."""
        with engine_step():  # the KV cache's background page faults wait
            if scheduler_output.has_block_moves:
                self.cache_engine.move_blocks(scheduler_output)
                if self.model_runner.draft is not None:
                    self.model_runner.draft.move_blocks(scheduler_output)
            output = self.model_runner.execute_model(scheduler_output, grammar_bitmask)
        return output if get_parallel_state().is_driver else None

    def communication_stats(self) -> dict[str, tuple[float, int]]:
        """(seconds, calls) this worker spent in each collective since the last call."""
        return take_comm_times()

    def forward_times(self) -> list[tuple[float, float]]:
        """(start, end) perf_counter times of this worker's recent forward passes."""
        return list(self.model_runner.forward_times)

    def cuda_graph_sizes(self) -> list[int]:
        """The decode batch sizes this worker replays as CUDA graphs; empty when it runs eagerly."""
        graphs = self.model_runner.decode_graphs
        return list(graphs.sizes) if graphs else []

    def kv_cache_shapes(self) -> dict[int, tuple[int, ...]]:
        return {layer: tuple(cache.shape) for layer, cache in self.cache_engine.kv_caches.items()}

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read a LoRA adapter into this worker's host cache; False if it was there already."""
        return self._lora_slots().add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter from this worker's host cache; False if it was not there."""
        return self._lora_slots().remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the LoRA adapters in this worker's host cache, least recently used first."""
        return self._lora_slots().list_loras()

    def _lora_slots(self) -> LoRAWorkerSlots:
        if self.model_runner.lora is None:
            raise ValueError("LoRA adapters are not enabled: start the engine with enable_lora=True")
        return self.model_runner.lora

    def check_health(self) -> None:
        """A worker that can answer is healthy; executors detect the ones that cannot."""

    def process_info(self) -> dict[str, int]:
        """Which process answers as which rank, and the torch threads it runs (for diagnostics)."""
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "num_threads": torch.get_num_threads(),
        }
