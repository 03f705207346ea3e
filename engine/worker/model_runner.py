"""Runs one step on one worker: scheduler deltas in, flat model inputs built, forward, sample.

Order within a batch: requests with a single query token (decodes) first, longest first, then
sequences verifying speculative drafts, then prefill chunks, so that attention backends can batch
decodes of similar length together. On the CPU each row of a sequence verifying drafts is attended
as a decode of its own (the context up to its position): the decode kernel's sums, so that its
tokens are those decoding one at a time would give, where the prefill kernel adds in another order.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time

import numpy as np
import torch

from engine.config import ResolvedEngineConfig
from engine.forward_context import set_forward_context
from engine.lora.worker_slots import LoRAWorkerSlots
from engine.models.fused_layers import fuse_decoder_layers
from engine.models.layers import PagedAttention
from engine.models.loader import load_model
from engine.models.model_files import ModelSource
from engine.outputs import (
    LogprobsLists,
    ModelRunnerOutput,
    NewSequenceData,
    PendingBitmask,
    RunningSequenceDeltas,
    SchedulerOutput,
)
from engine.sample.grammar_mask import apply_grammar_bitmask
from engine.sample.metadata import SamplingMetadata, build_sampling_metadata
from engine.sample.sampler import LogprobsTensors, Sampler, compute_logprobs
from engine.sampling_params import SamplingParams
from engine.sched.kv_cache_manager import cdiv
from engine.spec_decode.draft_model import DraftModel
from engine.transfers import host_to_device
from engine.worker.cache_engine import CacheEngine, resolve_kv_cache_dtype
from engine.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from engine.worker.draft_rows import AcceptedTokens, SampleRow, accept_drafts, sample_rows
from engine.worker.input_batch import InputBatch, WorkerSequenceState
from engine.worker.step_io import StepBuffers, results_to_host
from kernels.attention import AttentionMetadata, get_attention_backend
from kernels.lora import LoRABatch
from parallel.pipeline import IntermediateTensors, receive_from_previous_stage, send_to_next_stage
from parallel.state import get_parallel_state

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and the persistent batch of one worker."""

    def __init__(self, config: ResolvedEngineConfig, device: torch.device) -> None:
        self.config = config
        self.arch = config.model.hf_config
        self.device = device
        self.dtype: torch.dtype = getattr(torch, config.model.dtype)
        self.block_size = config.cache.block_size
        sched = config.scheduler
        self.input_batch = InputBatch(
            sched.max_num_seqs,
            cdiv(config.model.max_model_len, self.block_size),
            self.arch.vocab_size,
            device,
        )
        self.step_buffers = StepBuffers(sched.max_num_batched_tokens, sched.max_num_seqs, device)
        generator = torch.Generator(device=device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self.attention_backend = get_attention_backend(
            config.model.attention_backend, device, self.block_size
        )
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.cache.kv_cache_dtype, self.dtype, self.attention_backend, device
        )
        self.kv_caches: dict[int, torch.Tensor] = {}
        self._drafts: dict[str, list[int]] = {}  # this step's speculative drafts, by sequence
        self.model: torch.nn.Module | None = None
        # A speculative draft model, on the rank that samples (engine/spec_decode/draft_model.py).
        self.draft: DraftModel | None = None
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_decode_graphs, on CUDA only
        self.lora: LoRAWorkerSlots | None = None  # the adapter slots, with enable_lora
        # (start, end) perf_counter times of recent forward passes: shows pipeline stages overlapping.
        self.forward_times: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)

    def load_model(self) -> None:
        self.model = load_model(
            ModelSource.of(self.config.model),
            self.arch,
            self.dtype,
            self.device,
            self.config.parallel.pipeline_partition,
            self.config.model.quantization,
        )
        if self.config.lora.enable_lora:
            # Before any fusing: an adapted projection adds its adapters' products after the matmul.
            self.lora = LoRAWorkerSlots(self.model, self.arch, self.config.lora, self.dtype, self.device)
        fused = (
            0
            if self.lora is not None
            else fuse_decoder_layers(self.model, self.attention_backend, self.block_size, self.kv_cache_dtype)
        )
        if fused:
            logger.info("%d decoder layers run as one C++ call each (engine/models/fused_layers.py)", fused)
        speculative = self.config.speculative.speculative_config
        if speculative is not None and speculative.method == "draft_model" and get_parallel_state().is_driver:
            self.draft = DraftModel(self.config, self.dtype, self.device, self.kv_cache_dtype)

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None = None
    ) -> ModelRunnerOutput:
        # The step's host writes go into the staging memory the last step's copies read.
        self.step_buffers.guard.wait()
        try:
            return self._execute(scheduler_output, grammar_bitmask)
        finally:
            self.step_buffers.guard.mark()

    def _execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: PendingBitmask | None
    ) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        num_scheduled = scheduler_output.num_scheduled_tokens
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(seq_ids=[], sampled_token_ids=[])
        order = self._batch_order(num_scheduled)
        input_ids, positions, meta, query_start_loc, logits_rows = self._prepare_inputs(order, num_scheduled)
        hidden = self._forward(input_ids, positions, meta, self._lora_batch(order, num_scheduled))
        if not get_parallel_state().is_last_stage:
            self._advance(order, num_scheduled)
            return ModelRunnerOutput(seq_ids=[], sampled_token_ids=[])
        states = [self.input_batch.seqs[order[i]] for i in logits_rows]
        query_ends = [query_start_loc[i + 1] - 1 for i in logits_rows]
        rows = sample_rows(states, query_ends, scheduler_output.scheduled_spec_decode_tokens)
        prompt_rows = self._prompt_logprob_rows(order, query_start_loc)
        # One LM-head pass for the sampling rows and any prompt positions asking for log-probabilities.
        logit_indices = [row.hidden_index for row in rows]
        logit_indices += [index for _, indices, _ in prompt_rows for index in indices]
        output = ModelRunnerOutput(seq_ids=[], sampled_token_ids=[])
        sampled = None
        prompt_logprobs: dict[str, LogprobsTensors] = {}
        if logit_indices:  # else every sequence is mid-prefill, with no prompt logprobs wanted
            logits = self.model.compute_logits(
                hidden[self.step_buffers.logit_rows.put(np.array(logit_indices))]
            )
            prompt_logprobs = self._prompt_logprobs(prompt_rows, logits[len(rows) :])
        if rows:
            # The masks come with the step, or (computed beside the forward pass) arrive now.
            masks = (
                grammar_bitmask.result() if grammar_bitmask is not None else scheduler_output.grammar_bitmask
            )
            if masks is not None:
                apply_grammar_bitmask(logits[: len(rows)], [row.state.seq_id for row in rows], masks)
            sampled = self.sampler(logits[: len(rows)], self._sampling_metadata(rows))
        # The step's one wait: every result the host reads comes over together.
        sampled_ids, sampled_logprobs, prompt_logprobs = results_to_host(sampled, prompt_logprobs)
        output.prompt_logprobs = {
            seq_id: LogprobsLists(*t.tolists()) for seq_id, t in prompt_logprobs.items()
        }
        accepted: list[AcceptedTokens] = []
        if rows:
            accepted = accept_drafts(rows, sampled_ids)
            output.seq_ids = [seq.seq_id for seq in accepted]
            output.sampled_token_ids = [seq.tokens for seq in accepted]
            output.logprobs = self._sampled_logprobs(states, accepted, sampled_logprobs)
        if self.draft is not None:
            output.spec_token_ids = self._propose_drafts(
                input_ids, positions, meta, accepted, scheduler_output
            )
        # Kept as the next step's inputs where it computes them before the scheduler sends them.
        for seq in accepted:
            self.input_batch.seqs[seq.seq_id].token_ids.extend(seq.tokens)
        self._advance(order, num_scheduled)
        return output

    def _propose_drafts(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        accepted: list[AcceptedTokens],
        scheduler_output: SchedulerOutput,
    ) -> dict[str, list[int]]:
        """The draft model's proposals after each sequence's newest token, for those the scheduler
        asked (the draft runs over the step's tokens in any case, to keep its cache filled)."""
        wanted = set(scheduler_output.draft_seq_ids)
        proposing = [seq for seq in accepted if seq.seq_id in wanted]
        states = [self.input_batch.seqs[seq.seq_id] for seq in proposing]
        # The newest token sits after the sequence's known tokens and this step's other new ones.
        newest = [
            (seq.tokens[-1], len(state.token_ids) + len(seq.tokens) - 1)
            for seq, state in zip(proposing, states, strict=True)
        ]
        rows = self.input_batch.block_table[[state.row for state in states]]
        proposals = self.draft.propose(input_ids, positions, meta, newest, rows)
        return {seq.seq_id: drafts for seq, drafts in zip(proposing, proposals, strict=True)}

    def _lora_batch(self, order: list[str], num_scheduled: dict[str, int]) -> LoRABatch | None:
        """The step's rows grouped by LoRA adapter slot; None when no row runs an adapter (or
        adapters are off), so that the projections skip their hooks' work."""
        if self.lora is None:
            return None
        lora_ids = [self.input_batch.seqs[seq_id].lora_int_id for seq_id in order]
        if not any(lora_ids):
            return None
        query_lens = np.array([num_scheduled[seq_id] for seq_id in order], dtype=np.int64)
        return self.lora.batch(lora_ids, query_lens, self.device)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora_batch: LoRABatch | None = None,
    ) -> torch.Tensor:
        """This stage's part of the forward pass: hidden states on the last stage; before it, the
        intermediate tensors are sent on to the next stage (and None is returned)."""
        intermediate = None
        if not get_parallel_state().is_first_stage:
            intermediate = receive_from_previous_stage(
                len(positions), self.arch.hidden_size, self.dtype, self.device
            )
        start = time.perf_counter()
        hidden = self.decode_graphs.replay(input_ids, positions, meta) if self.decode_graphs else None
        if hidden is None:
            with set_forward_context(meta, self.kv_caches, self.attention_backend, lora_batch):
                hidden = self.model(input_ids, positions, intermediate)
        self.forward_times.append((start, time.perf_counter()))
        if isinstance(hidden, IntermediateTensors):
            send_to_next_stage(hidden)
            return None
        return hidden

    def _advance(self, order: list[str], num_scheduled: dict[str, int]) -> None:
        for seq_id in order:
            self.input_batch.seqs[seq_id].num_computed_tokens += num_scheduled[seq_id]

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self._drafts = scheduler_output.scheduled_spec_decode_tokens
        batch = self.input_batch
        for seq_id in scheduler_output.finished_seq_ids:
            batch.remove(seq_id)
        for new in scheduler_output.scheduled_new_seqs:
            batch.add(new)
        if scheduler_output.lora_loads:
            self.lora.load_slots(scheduler_output.lora_loads)
        cached = scheduler_output.scheduled_cached_seqs
        for seq_id, new_tokens, table_start, new_blocks, num_computed in zip(
            cached.seq_ids,
            cached.new_token_ids,
            cached.block_table_starts,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = batch.seqs[seq_id]
            state.add_known_tokens(new_tokens)
            state.num_computed_tokens = num_computed
            batch.set_blocks(state, table_start, new_blocks)

    def _batch_order(self, num_scheduled: dict[str, int]) -> list[str]:
        """Decodes first, longest first (attention batches them in runs of similar length), then
        sequences with drafts, then prefills."""
        seqs = self.input_batch.seqs
        decodes = sorted(
            (seq_id for seq_id, n in num_scheduled.items() if n == 1),
            key=lambda seq_id: seqs[seq_id].num_computed_tokens,
            reverse=True,
        )
        longer = [seq_id for seq_id, n in num_scheduled.items() if n > 1]
        drafted = [seq_id for seq_id in longer if self._drafts.get(seq_id)]
        return decodes + drafted + [seq_id for seq_id in longer if not self._drafts.get(seq_id)]

    def _prepare_inputs(
        self, order: list[str], num_scheduled: dict[str, int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """Flat input ids and positions, the attention metadata, each sequence's first token row
        (and the end), and which sequences sample.

        Computed on the host from the persistent batch's host copies, written into the step
        buffers and sent without waiting; the block tables are gathered from the device's copy.
        """
        states = [self.input_batch.seqs[seq_id] for seq_id in order]
        query_lens = np.array([num_scheduled[seq_id] for seq_id in order], dtype=np.int64)
        starts = np.array([state.num_computed_tokens for state in states], dtype=np.int64)
        seq_lens = starts + query_lens
        query_start_loc = np.concatenate(([0], np.cumsum(query_lens)))
        req_of_token = np.repeat(np.arange(len(order)), query_lens)
        positions = starts[req_of_token] + np.arange(query_start_loc[-1]) - query_start_loc[req_of_token]
        rows = np.array([state.row for state in states])
        table_width = cdiv(int(seq_lens.max()), self.block_size)
        host_table = self.input_batch.block_table
        slot_mapping = host_table[rows[req_of_token], positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )
        drafts = [self._drafts.get(seq_id, ()) for seq_id in order]
        num_decodes = int(np.count_nonzero(query_lens == 1))
        attended = (query_start_loc, seq_lens, np.arange(len(order)), num_decodes)
        num_drafted = sum(1 for seq_drafts in drafts if seq_drafts)
        if num_drafted and self.device.type == "cpu":
            attended = _drafted_rows_as_decodes(query_start_loc, seq_lens, num_decodes, num_drafted)
        input_ids = np.fromiter(
            (
                token
                for state, seq_drafts, start, n in zip(states, drafts, starts, query_lens, strict=True)
                # A sequence's drafts are scheduled whole, right after its last known token.
                for token in itertools.chain(state.token_ids[start : start + n], seq_drafts)
            ),
            dtype=np.int64,
            count=int(query_start_loc[-1]),
        )
        # A request samples when this step reaches its last known token and drafts (not mid-prefill).
        logits_rows = [
            i for i, state in enumerate(states) if seq_lens[i] == len(state.token_ids) + len(drafts[i])
        ]
        attended_starts, attended_lens, attended_entries, attended_decodes = attended
        buffers = self.step_buffers
        table_rows = buffers.table_rows.put(rows[attended_entries])
        meta = AttentionMetadata(
            slot_mapping=buffers.slot_mapping.put(slot_mapping),
            block_table=self.input_batch.device_block_table[table_rows, :table_width],
            seq_lens=buffers.seq_lens.put(attended_lens),
            query_start_loc=attended_starts.tolist(),
            seq_lens_list=attended_lens.tolist(),
            num_decodes=attended_decodes,
            block_size=self.block_size,
            query_start_loc_device=buffers.query_start_loc.put(attended_starts),
        )
        starts_list = query_start_loc.tolist()
        return (
            buffers.input_ids.put(input_ids),
            buffers.positions.put(positions),
            meta,
            starts_list,
            logits_rows,
        )

    def _sampling_metadata(self, rows: list[SampleRow]) -> SamplingMetadata:
        persistent_rows = np.array([row.state.row for row in rows], dtype=np.int64)
        meta = build_sampling_metadata(
            [row.state.sampling_params for row in rows],
            self.input_batch.sampling_values(self.step_buffers.sample_rows.put(persistent_rows)),
            [row.state.prompt_token_ids for row in rows],
            [row.output_token_ids for row in rows],
            [row.state.seed_key(row.offset) for row in rows],
            [row.state.eos_token_id for row in rows],
        )
        # The scheduler decides how many log-probabilities each sequence returns (beam search and
        # best_of need some the user did not ask for).
        wanted = [row.state.num_logprobs for row in rows if row.state.num_logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else None
        return meta

    @staticmethod
    def _sampled_logprobs(
        states: list[WorkerSequenceState], accepted: list[AcceptedTokens], logprobs: LogprobsTensors | None
    ) -> list[LogprobsLists | None]:
        """Each sequence's log-probabilities at the rows its tokens were sampled from."""
        if logprobs is None:
            return []
        token_ids, values, ranks = logprobs.tolists()
        results: list[LogprobsLists | None] = []
        for state, seq in zip(states, accepted, strict=True):
            if state.num_logprobs is None:
                results.append(None)
                continue
            span = range(seq.first_row, seq.first_row + len(seq.tokens))
            width = state.num_logprobs + 1
            results.append(
                LogprobsLists(
                    [token_ids[row][:width] for row in span],
                    [values[row][:width] for row in span],
                    [ranks[row] for row in span],
                )
            )
        return results

    def _prompt_logprob_rows(
        self, order: list[str], query_start_loc: list[int]
    ) -> list[tuple[WorkerSequenceState, list[int], list[int]]]:
        """(state, hidden rows, next prompt tokens) of every prompt position this step computes for
        a sequence that asked for prompt log-probabilities (position p predicts prompt token p+1)."""
        rows = []
        for i, seq_id in enumerate(order):
            state = self.input_batch.seqs[seq_id]
            start = state.num_computed_tokens
            end = min(start + query_start_loc[i + 1] - query_start_loc[i], state.num_prompt_tokens - 1)
            if state.num_prompt_logprobs is None or start >= end:
                continue
            first_row = query_start_loc[i]
            rows.append(
                (
                    state,
                    list(range(first_row, first_row + end - start)),
                    state.token_ids[start + 1 : end + 1],
                )
            )
        return rows

    def _prompt_logprobs(
        self, rows: list[tuple[WorkerSequenceState, list[int], list[int]]], logits: torch.Tensor
    ) -> dict[str, LogprobsTensors]:
        results = {}
        offset = 0
        for state, indices, next_tokens in rows:
            chunk = logits[offset : offset + len(indices)]
            offset += len(indices)
            next_ids = host_to_device(np.array(next_tokens, dtype=np.int64), self.device)
            results[state.seq_id] = compute_logprobs(chunk, next_ids, state.num_prompt_logprobs)
        return results

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
            num_seqs * blocks_per_seq, self.block_size, self.kv_cache_spec(), self.kv_cache_dtype, self.device
        ).kv_caches
        saved, self.kv_caches = self.kv_caches, scratch
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=self.config.model.max_logprobs)
        seqs = [
            NewSequenceData(
                f"profile-{i}",
                [0] * length,
                [],
                params,
                list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                0,
                num_logprobs=params.logprobs,
            )
            for i, length in enumerate(per_seq)
        ]
        profile = SchedulerOutput(
            scheduled_new_seqs=seqs,
            scheduled_cached_seqs=RunningSequenceDeltas(),
            num_scheduled_tokens={seq.seq_id: len(seq.prompt_token_ids) for seq in seqs},
            total_num_scheduled_tokens=num_tokens,
        )
        try:
            self.execute_model(profile)
        finally:
            for seq in seqs:
                self.input_batch.remove(seq.seq_id)
            self.kv_caches = saved

    def capture_decode_graphs(self, padding_block: int) -> None:
        """Capture the decode graphs over the allocated KV cache (engine/worker/cuda_graphs.py)."""
        self.decode_graphs = capture_decode_graphs(
            self.config,
            self.model,
            self.kv_caches,
            self.attention_backend,
            padding_block,
            self.input_batch.block_table.shape[1],
            self.device,
        )

    def kv_cache_spec(self) -> dict[int, tuple[int, int]]:
        """(kv_heads, head_dim) of each layer this worker holds, by global layer index."""
        attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        return {layer.layer_index: (layer.num_kv_heads, layer.head_dim) for layer in attn_layers}


def _drafted_rows_as_decodes(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_decodes: int, num_drafted: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The attention's view of a batch whose `num_drafted` sequences after its `num_decodes` decodes
    verify drafts: each of their rows a decode of its own, over its sequence's blocks up to its
    position. Returns (query_start_loc, seq_lens, the sequence of each entry, num_decodes) of that
    view."""
    drafted = slice(num_decodes, num_decodes + num_drafted)
    query_lens = np.diff(query_start_loc)[drafted]
    owner = np.repeat(np.arange(num_decodes, num_decodes + num_drafted), query_lens)
    # Row r of a sequence of query_len q and seq_len L sees L - q + r + 1 tokens.
    row_in_seq = np.arange(owner.size) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    row_lens = seq_lens[owner] - np.repeat(query_lens, query_lens) + row_in_seq + 1
    rest = np.arange(num_decodes + num_drafted, seq_lens.size)
    entries = np.concatenate((np.arange(num_decodes), owner, rest))
    lens = np.concatenate((seq_lens[:num_decodes], row_lens, seq_lens[rest]))
    num_rows = num_decodes + owner.size  # one query row each
    entry_query_lens = np.concatenate((np.ones(num_rows, dtype=np.int64), np.diff(query_start_loc)[rest]))
    starts = np.concatenate(([0], np.cumsum(entry_query_lens)))
    return starts, lens, entries, num_rows
