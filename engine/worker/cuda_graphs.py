"""CUDA graphs of the model's decode forward pass at bucketed batch sizes (vLLM's CUDAGraphRunner).

A decode step launches hundreds of small kernels whose launch time, not their work, bounds a small
batch; replaying a captured graph launches them all at once. Graphs are captured at start-up,
after the KV cache is allocated, for vLLM's batch sizes (1, 2, 4, then multiples of 8 up to
max_num_seqs, at most 256), largest first so that the smaller ones reuse its memory pool. They read
and write static buffers: a decode-only step copies its inputs into them, pads the batch to the
next captured size and replays; every other step (prefill chunks, a batch past the largest size)
runs eagerly.

Padded rows must not write into any sequence's blocks: they decode one token at slot 0 of a block
the scheduler never hands out (the worker allocates one block more than it reports), with a
sequence length of 1.

Graphs need a CUDA device, one pipeline stage (a stage boundary sends tensors from Python), and an
attention backend whose decode path reads only device tensors, which it says with a true
`cuda_graph_safe` attribute: host lists such as `seq_lens_list` would be frozen at their capture
values. `enforce_eager` turns graphs off, as in vLLM.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time

import torch

from engine.config import ResolvedEngineConfig
from engine.forward_context import set_forward_context
from kernels.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

BATCH_SIZE_ALIGNMENT = 8  # vLLM's _BATCH_SIZE_ALIGNMENT
MAX_CAPTURE_SIZE = 256  # vLLM's largest captured decode batch
# Each captured graph keeps its kernels' parameters and launch data on the device; vLLM sees a few MB each.
PER_GRAPH_BYTES = 2 * 2**20


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's decode batch sizes to capture: 1, 2, 4, then multiples of 8, up to max_num_seqs
    rounded up to the next of them, and never past 256."""
    sizes = [1, 2, 4, *range(BATCH_SIZE_ALIGNMENT, MAX_CAPTURE_SIZE + 1, BATCH_SIZE_ALIGNMENT)]
    limit = min(padded_batch_size(max_num_seqs, sizes) or MAX_CAPTURE_SIZE, MAX_CAPTURE_SIZE)
    return [size for size in sizes if size <= limit]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows, or None past the largest (run eagerly)."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def cuda_graphs_disabled_reason(
    config: ResolvedEngineConfig, device: torch.device, backend: AttentionBackend
) -> str | None:
    """None when decode steps run as CUDA graphs; else why they run eagerly."""
    if config.model.enforce_eager:
        return "enforce_eager is set"
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the device is {device.type}"
    if config.lora.enable_lora:
        return "LoRA adapters group each step's rows by adapter on the host"
    if config.parallel.pipeline_parallel_size > 1:
        return "pipeline stages pass tensors between processes from Python, outside any graph"
    if not getattr(backend, "cuda_graph_safe", False):
        name = getattr(backend, "__name__", type(backend).__name__)
        return f"the attention backend {name} reads host-side lengths in decode, which a graph would freeze"
    return None


def graph_memory_estimate(config: ResolvedEngineConfig, dtype: torch.dtype, tp_size: int) -> int:
    """Bytes the captured graphs hold beyond the KV cache: the memory pool of the largest graph
    (every activation of one decode layer at the largest batch, twice over for the allocator's
    rounding and the attention backend's temporaries), which the smaller graphs share, plus each
    graph's own launch data. The worker takes it from the KV cache's budget before sizing it."""
    arch = config.model.hf_config
    sizes = capture_sizes(config.scheduler.max_num_seqs)
    head_dim = arch.head_dim
    heads = max(arch.num_heads // tp_size, 1)
    kv_heads = max(arch.num_kv_heads // tp_size, 1)
    per_token = (
        2 * arch.hidden_size  # residual and hidden states
        + (heads + 2 * kv_heads) * head_dim  # q, k, v
        + heads * head_dim  # attention output
        + 3 * arch.intermediate_size // tp_size  # gate and up, their product
    )
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * sizes[-1] * per_token * element + len(sizes) * PER_GRAPH_BYTES


@dataclasses.dataclass
class DecodeBuffers:
    """The static inputs every captured graph reads, sized for the largest one."""

    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    slot_mapping: torch.Tensor  # [max_size] int64
    block_table: torch.Tensor  # [max_size, max_blocks] int64
    seq_lens: torch.Tensor  # [max_size] int64
    padding_block: int
    block_size: int

    @classmethod
    def allocate(
        cls, max_size: int, max_blocks: int, padding_block: int, block_size: int, device: torch.device
    ) -> DecodeBuffers:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        buffers = cls(
            zeros(max_size),
            zeros(max_size),
            zeros(max_size),
            zeros(max_size, max_blocks),
            zeros(max_size),
            padding_block,
            block_size,
        )
        buffers.pad(0, max_size)
        return buffers

    def metadata(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` rows is captured with: views of the buffers, so that a
        replay reads whatever `fill` last wrote. Its host lists hold capture-time values only."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_table=self.block_table[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=list(range(size + 1)),
            seq_lens_list=[1] * size,
            num_decodes=size,
            block_size=self.block_size,
        )

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int
    ) -> None:
        """Copy one decode step's inputs into the first rows and pad the rest up to `size`."""
        num_seqs, width = meta.num_seqs, meta.block_table.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.block_table[:num_seqs, :width].copy_(meta.block_table)
        # Entries past a sequence's last block are never read (its length bounds every read), but
        # they would otherwise keep a finished sequence's block ids: point them at the padding block.
        self.block_table[:num_seqs, width:].fill_(self.padding_block)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.pad(num_seqs, size)

    def pad(self, start: int, end: int) -> None:
        """Rows start..end decode token 0 at position 0 into the padding block, as a sequence of length 1."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(self.padding_block * self.block_size)
        self.block_table[start:end].fill_(self.padding_block)
        self.seq_lens[start:end].fill_(1)


class DecodeGraphs:
    """Captured decode graphs by batch size, and the replay of a decode-only step through them."""

    def __init__(self, buffers: DecodeBuffers, sizes: list[int]) -> None:
        self.buffers = buffers
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Each graph's capture-time metadata lives as long as the graph: device tensors a backend made
        # from it on first use (query_start_loc_tensor, cached on the metadata) are read by every
        # replay, and freed they would hand their memory to other tensors.
        self.metadata: dict[int, AttentionMetadata] = {}

    @torch.inference_mode()
    def capture(
        self, model: torch.nn.Module, kv_caches: dict[int, torch.Tensor], backend: AttentionBackend
    ) -> None:
        """Capture the largest batch first: later graphs draw on its memory pool instead of their own."""
        pool = torch.cuda.graph_pool_handle()
        buffers = self.buffers
        for size in reversed(self.sizes):
            meta = self.metadata[size] = buffers.metadata(size)
            with set_forward_context(meta, kv_caches, backend):
                # A warm-up pass outside the graph lets lazy initialization (cuBLAS handles,
                # kernel autotuning) happen where it may allocate and synchronize.
                model(buffers.input_ids[:size], buffers.positions[:size], None)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = model(buffers.input_ids[:size], buffers.positions[:size], None)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The step's hidden states from a graph, or None when the step is not decode-only or is
        larger than every graph (the caller runs it eagerly). The result is a view of the graph's
        static output, valid until the next replay."""
        if meta.num_decodes != meta.num_seqs:
            return None
        size = padded_batch_size(meta.num_seqs, self.sizes)
        if size is None:
            return None
        self.buffers.fill(input_ids, positions, meta, size)
        self.graphs[size].replay()
        return self.outputs[size][: meta.num_seqs]


def capture_decode_graphs(
    config: ResolvedEngineConfig,
    model: torch.nn.Module,
    kv_caches: dict[int, torch.Tensor],
    backend: AttentionBackend,
    padding_block: int,
    max_blocks: int,
    device: torch.device,
) -> DecodeGraphs:
    """Capture every decode size, logging the time and the device memory it took (vLLM's log line)."""
    sizes = capture_sizes(config.scheduler.max_num_seqs)
    buffers = DecodeBuffers.allocate(sizes[-1], max_blocks, padding_block, config.cache.block_size, device)
    graphs = DecodeGraphs(buffers, sizes)
    # The graphs' memory pool, as what the caching allocator reserves beyond live tensors.
    # torch.cuda.graph empties the allocator's cache at each capture, so both readings are taken from
    # an emptied cache: without that, the free memory and the reserved memory before the capture both
    # counted cached blocks that the capture then released (a negative size, seen on an H200).
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    graphs.capture(model, kv_caches, backend)
    torch.cuda.empty_cache()
    taken = torch.cuda.memory_reserved(device) - reserved_before
    logger.info(
        "captured CUDA graphs for decode batch sizes %s in %.1f s, taking %.2f GiB",
        sizes,
        time.perf_counter() - start,
        taken / 2**30,
    )
    return graphs
