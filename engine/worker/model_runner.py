"""Runs one step on one worker: scheduler deltas in, flat model inputs built, forward, sample.

Order within a batch: requests with a single query token (decodes) first, longest first, then
prefill chunks, so that attention backends can batch decodes of similar length together.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.config import EngineConfig
from engine.forward_context import set_forward_context
from engine.kv_cache_manager import cdiv
from engine.models.arch_config import ArchConfig
from engine.models.layers import PagedAttention
from engine.models.loader import load_model
from engine.models.model_files import resolve_model_source
from engine.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.sample.sampler import Sampler, SamplingMetadata
from engine.sampling_params import SamplingParams
from engine.worker.cache_engine import CacheEngine
from engine.worker.input_batch import InputBatch
from kernels.attention import AttentionMetadata, get_attention_backend

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and the persistent batch of one worker."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, device: torch.device) -> None:
        self.config = config
        self.arch = arch
        self.device = device
        self.dtype: torch.dtype = getattr(torch, config.model.dtype)
        self.block_size = config.cache.block_size
        max_model_len = config.model.max_model_len
        assert max_model_len is not None, "resolve_engine_config() sets max_model_len"
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs, cdiv(max_model_len, self.block_size), arch.vocab_size, device
        )
        generator = torch.Generator(device=device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self.attention_backend = get_attention_backend()
        self.kv_caches: dict[int, torch.Tensor] = {}
        self.model: torch.nn.Module | None = None

    def load_model(self) -> None:
        source = resolve_model_source(self.config.model.model)
        self.model = load_model(source, self.arch, self.dtype, self.device)

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        order = self._batch_order(scheduler_output.num_scheduled_tokens)
        input_ids, positions, meta, logits_rows = self._prepare_inputs(
            order, scheduler_output.num_scheduled_tokens
        )
        sample_ids = [order[i] for i in logits_rows]
        with set_forward_context(meta, self.kv_caches, self.attention_backend):
            hidden = self.model(input_ids, positions)
        query_ends = torch.tensor([meta.query_start_loc[i + 1] - 1 for i in logits_rows], device=self.device)
        logits = self.model.compute_logits(hidden[query_ends])
        tokens = self.sampler(logits, self._sampling_metadata(sample_ids)).tolist()
        for req_id in order:
            self.input_batch.requests[req_id].num_computed_tokens += scheduler_output.num_scheduled_tokens[
                req_id
            ]
        return ModelRunnerOutput(req_ids=sample_ids, sampled_token_ids=[[token] for token in tokens])

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            batch.remove(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            batch.add(new)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_tokens, new_blocks, num_computed in zip(
            cached.req_ids,
            cached.new_token_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = batch.requests[req_id]
            state.token_ids.extend(new_tokens)
            state.num_computed_tokens = num_computed
            batch.append_blocks(state, new_blocks)

    def _batch_order(self, num_scheduled: dict[str, int]) -> list[str]:
        """Decodes first, longest first (attention batches them in runs of similar length), then prefills."""
        requests = self.input_batch.requests
        decodes = sorted(
            (req_id for req_id, n in num_scheduled.items() if n == 1),
            key=lambda req_id: requests[req_id].num_computed_tokens,
            reverse=True,
        )
        return decodes + [req_id for req_id, n in num_scheduled.items() if n > 1]

    def _prepare_inputs(
        self, order: list[str], num_scheduled: dict[str, int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids and positions, the attention metadata, and which requests sample."""
        states = [self.input_batch.requests[req_id] for req_id in order]
        query_lens = np.array([num_scheduled[req_id] for req_id in order], dtype=np.int64)
        starts = np.array([state.num_computed_tokens for state in states], dtype=np.int64)
        seq_lens = starts + query_lens
        query_start_loc = np.concatenate(([0], np.cumsum(query_lens)))
        req_of_token = np.repeat(np.arange(len(order)), query_lens)
        positions = starts[req_of_token] + np.arange(query_start_loc[-1]) - query_start_loc[req_of_token]
        rows = np.array([state.row for state in states])
        block_table = self.input_batch.block_table[rows, : cdiv(int(seq_lens.max()), self.block_size)]
        slot_mapping = block_table[req_of_token, positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )
        input_ids = np.fromiter(
            (
                token
                for state, start, n in zip(states, starts, query_lens, strict=True)
                for token in state.token_ids[start : start + n]
            ),
            dtype=np.int64,
            count=int(query_start_loc[-1]),
        )
        # A request samples when this step reaches its last known token (not mid-prefill).
        logits_rows = [i for i, state in enumerate(states) if seq_lens[i] == len(state.token_ids)]
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            block_table=self._to_device(block_table),
            seq_lens=self._to_device(seq_lens),
            query_start_loc=query_start_loc.tolist(),
            seq_lens_list=seq_lens.tolist(),
            num_decodes=int(np.count_nonzero(query_lens == 1)),
            block_size=self.block_size,
        )
        return self._to_device(input_ids), self._to_device(positions), meta, logits_rows

    def _sampling_metadata(self, sample_ids: list[str]) -> SamplingMetadata:
        batch = self.input_batch
        states = [batch.requests[req_id] for req_id in sample_ids]
        rows = np.array([state.row for state in states], dtype=np.int64)
        temperature = batch.temperature[rows]
        top_k, top_p = batch.top_k[rows], batch.top_p[rows]
        return SamplingMetadata(
            temperature=self._to_device(temperature),
            all_greedy=bool((temperature < 1e-5).all()),
            top_k=self._to_device(top_k) if (top_k < self.arch.vocab_size).any() else None,
            top_p=self._to_device(top_p) if (top_p < 1.0).any() else None,
            generators={i: state.generator for i, state in enumerate(states) if state.generator is not None},
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    # ---- start-up ------------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward pass and sampling at the batch limits, so peak activation memory can be measured."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.config.model.max_model_len)
        num_seqs = min(sched.max_num_seqs, num_tokens)
        per_seq = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        blocks_per_seq = cdiv(max(per_seq), self.block_size)
        # A scratch cache just big enough for this batch, every sequence on its own blocks.
        scratch = CacheEngine(
            num_seqs * blocks_per_seq, self.block_size, self.kv_cache_spec(), self.dtype, self.device
        ).kv_caches
        saved, self.kv_caches = self.kv_caches, scratch
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        try:
            for i, length in enumerate(per_seq):
                block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                self.input_batch.add(NewRequestData(f"profile-{i}", [0] * length, [], params, block_ids, 0))
            order = [f"profile-{i}" for i in range(num_seqs)]
            input_ids, positions, meta, rows = self._prepare_inputs(
                order, dict(zip(order, per_seq, strict=True))
            )
            with set_forward_context(meta, self.kv_caches, self.attention_backend):
                hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden[: len(rows)])
            self.sampler(logits, self._sampling_metadata([order[i] for i in rows]))
        finally:
            for req_id in [f"profile-{i}" for i in range(num_seqs)]:
                self.input_batch.remove(req_id)
            self.kv_caches = saved

    def kv_cache_spec(self) -> dict[int, tuple[int, int]]:
        """(kv_heads, head_dim) of each layer this worker holds, by global layer index."""
        attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        return {layer.layer_index: (layer.num_kv_heads, layer.head_dim) for layer in attn_layers}
