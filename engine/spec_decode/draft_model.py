"""A draft model beside the target in the worker that samples: it proposes each sequence's next
k tokens greedily, and the target verifies them in the next step (engine/worker/draft_rows.py).

The draft keeps a paged KV cache of its own over the same block ids as the target's, so the
scheduler's block tables, prefix cache, copies and swaps serve both. Every step it runs on the
step's tokens (filling its cache where the target filled its own), then k single-token steps from
each proposing sequence's newest token, writing into lookahead slots the scheduler allocated past
the verified tokens (freed again with the rejected drafts). Its proposals are its argmax: a point
mass, for which accepting the target's sample where it equals the draft is the rejection sampler.
It is a whole model on one rank (`single_rank`), whatever the target's tensor parallelism.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.config import ResolvedEngineConfig
from engine.forward_context import set_forward_context
from engine.models.fused_layers import fuse_decoder_layers
from engine.models.layers import PagedAttention
from engine.models.loader import load_model
from engine.models.model_files import ModelSource
from engine.outputs import SchedulerOutput
from engine.sched.kv_cache_manager import cdiv
from engine.worker.cache_engine import CacheEngine
from kernels.attention import AttentionMetadata, get_attention_backend
from parallel.state import single_rank


class DraftModel:
    """The draft model, its KV cache and its proposals."""

    def __init__(
        self,
        config: ResolvedEngineConfig,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: torch.dtype,
    ) -> None:
        spec = config.speculative.speculative_config
        assert spec is not None and spec.model is not None and spec.hf_config is not None
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.dtype, self.device, self.kv_cache_dtype = dtype, device, kv_cache_dtype
        self.backend = get_attention_backend(config.model.attention_backend, device, self.block_size)
        with single_rank():
            self.model = load_model(
                ModelSource(Path(spec.model), spec.model_format), spec.hf_config, dtype, device
            )
            fuse_decoder_layers(self.model, self.backend, self.block_size, kv_cache_dtype)
        self.cache_engine: CacheEngine | None = None

    def kv_cache_spec(self) -> dict[int, tuple[int, int]]:
        layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        return {layer.layer_index: (layer.num_kv_heads, layer.head_dim) for layer in layers}

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_engine = CacheEngine(
            num_blocks,
            self.block_size,
            self.kv_cache_spec(),
            self.kv_cache_dtype,
            self.device,
            num_cpu_blocks,
        )

    def move_blocks(self, scheduler_output: SchedulerOutput) -> None:
        self.cache_engine.move_blocks(scheduler_output)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        with set_forward_context(meta, self.cache_engine.kv_caches, self.backend):
            return self.model(input_ids, positions, None)

    # All on this rank alone: the draft's layers and its LM head are whole here, and the other
    # ranks of a tensor-parallel target take no part in any of its collectives.
    @single_rank()
    def propose(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        newest: list[tuple[int, int]],
        block_rows: np.ndarray,
    ) -> list[list[int]]:
        """Run the draft over the step's tokens, then propose k tokens after each of `newest`
        ((token, its position) of a proposing sequence, whose block table is that row of `block_rows`)."""
        self._forward(input_ids, positions, meta)
        if not newest:
            return []
        # Decode rows go longest first (AttentionMetadata's order): sort, and unsort the proposals.
        order = sorted(range(len(newest)), key=lambda i: -newest[i][1])
        tokens = torch.tensor([newest[i][0] for i in order], dtype=torch.long, device=self.device)
        positions_now = np.array([newest[i][1] for i in order], dtype=np.int64)
        rows = block_rows[order]
        proposals = []
        for _ in range(self.num_speculative_tokens):
            step_meta = self._decode_metadata(positions_now, rows)
            hidden = self._forward(tokens, torch.from_numpy(positions_now).to(self.device), step_meta)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            proposals.append(tokens)
            positions_now = positions_now + 1
        by_order = torch.stack(proposals, dim=1).tolist()
        result: list[list[int]] = [[] for _ in newest]
        for rank, index in enumerate(order):
            result[index] = by_order[rank]
        return result

    def _decode_metadata(self, positions: np.ndarray, rows: np.ndarray) -> AttentionMetadata:
        """One query token a sequence, at `positions`, over the blocks of `rows`."""
        table = rows[:, : cdiv(int(positions.max()) + 1, self.block_size)]
        slots = table[np.arange(len(positions)), positions // self.block_size] * self.block_size
        seq_lens = positions + 1
        return AttentionMetadata(
            slot_mapping=self._to_device(slots + positions % self.block_size),
            block_table=self._to_device(table),
            seq_lens=self._to_device(seq_lens),
            query_start_loc=list(range(len(positions) + 1)),
            seq_lens_list=seq_lens.tolist(),
            num_decodes=len(positions),
            block_size=self.block_size,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
