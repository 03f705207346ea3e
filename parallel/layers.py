"""Megatron-style sharded layers. Each parameter carries a `weight_loader` that cuts this rank's slice
out of the full checkpoint tensor, so model files never compute ranks.

Column-parallel layers split their output features, row-parallel layers their input features (and
all-reduce the partial sums); the embedding and LM head split the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_ops import silu_and_mul
from kernels.gguf_blocks import BlockLinearWeight, GGUFBlocks
from kernels.linear import WeightForm, best_weight_form, linear, prepare_weight, silu_and_mul_linear
from parallel.comm import tensor_parallel_all_gather, tensor_parallel_all_reduce
from parallel.state import get_parallel_state

WeightLoader = Callable[..., None]
# Adds LoRA adapters' products to a projection's output, in place: lora(x, out) (engine/lora/layers.py).
LoRAHook = Callable[[torch.Tensor, torch.Tensor], None]


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"{name}: checkpoint slice has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def _copy_rows(
    layer: _PreparableLinear, param: torch.Tensor, offset: int, size: int, loaded: Any, name: str
) -> None:
    """Fill rows [offset, offset + size) of a linear layer's weight (or bias) from `loaded`; GGUF
    blocks are kept as they are, for the layer to pack once it has all its rows (`prepare`)."""
    if not isinstance(loaded, GGUFBlocks):
        _copy_checked(param.data.narrow(0, offset, size), loaded, name)
        return
    if loaded.shape != (size, param.shape[1]):
        raise ValueError(
            f"{name}: checkpoint slice has shape {loaded.shape}, expected {(size, param.shape[1])}"
        )
    layer.weight_blocks[offset] = loaded


def _shard(loaded: torch.Tensor, dim: int, index: int, size: int, parts: int, name: str) -> torch.Tensor:
    """Shard `index` of `parts` equal ones along `dim`, after checking that the checkpoint tensor
    has exactly parts * size there (a larger one would otherwise be cut silently)."""
    if loaded.shape[dim] != size * parts:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {size * parts} along dim {dim}"
        )
    return loaded.narrow(dim, index * size, size)


def _parameter(shape: Sequence[int], loader: WeightLoader, dtype: torch.dtype | None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def _name_checkpoint_shards(layer: nn.Module, shards: tuple[object, ...]) -> None:
    """Mark the parameters of a layer that fuses several checkpoint tensors with the shard ids that
    must each be loaded (a model's load_weights checks that none is missing)."""
    for param in layer.parameters(recurse=False):
        param.checkpoint_shards = shards  # type: ignore[attr-defined]


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Loader of a parameter every rank holds whole (norms, replicated layers)."""
    _copy_checked(param, loaded, "replicated parameter")


class _TensorParallelModule(nn.Module):
    """A layer whose weights are split over the tensor-parallel group: this rank's place in it."""

    def __init__(self) -> None:
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size


class _PreparableLinear(_TensorParallelModule):
    """A linear layer whose loaded weight can be kept in the form this CPU multiplies by fastest
    (see kernels/linear.py)."""

    weight: nn.Parameter | BlockLinearWeight
    # Blocks of output rows the weight stacks, each packed on its own (kernels/linear.py).
    weight_shards = 1
    # The LoRA adapters of this projection, where they are enabled; added before any all-reduce,
    # since the adapters' partial products over a row-parallel input sum like the base's.
    lora: LoRAHook | None = None

    def __init__(self) -> None:
        super().__init__()
        # Rows loaded as GGUF blocks, by their first row; packed by `prepare`.
        self.weight_blocks: dict[int, GGUFBlocks] = {}

    def prepare(self, form: WeightForm | None = None) -> None:
        """Keep the weight in `form` (by default this machine's fastest for it), or multiply from its
        GGUF blocks where it was loaded as such; call after loading."""
        if self.weight_blocks and self._keep_blocks():
            return
        form = form or best_weight_form(self.weight, self.weight_shards)
        if form is not WeightForm.PLAIN:
            self.weight = nn.Parameter(
                prepare_weight(self.weight, form, self.weight_shards), requires_grad=False
            )

    def _keep_blocks(self) -> bool:
        """Replace the weight by its GGUF blocks, packed, where every row came as blocks; otherwise
        (a part in a format without a kernel came dequantized) widen the blocks into the weight."""
        blocks, self.weight_blocks = self.weight_blocks, {}
        if sum(part.shape[0] for part in blocks.values()) == self.weight.shape[0]:
            del self.weight  # never written: its pages were never touched
            self.weight = BlockLinearWeight([blocks[offset] for offset in sorted(blocks)])
            return True
        for offset, part in blocks.items():
            self.weight.data.narrow(0, offset, part.shape[0]).copy_(part.dequantize())
        return False


class ColumnParallelLinear(_PreparableLinear):
    """y = x W^T + b with W split by output rows; each rank returns its slice of y."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output size")
        self.weight = _parameter((self.output_size_per_partition, input_size), self.weight_loader, dtype)
        self.bias = _parameter((self.output_size_per_partition,), self.weight_loader, dtype) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        name = "column-parallel weight"
        _copy_rows(self, param, 0, size, _shard(loaded, 0, self.tp_rank, size, self.tp_size, name), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora(x, out)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate and up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, dtype)
        if len(set(self.output_sizes)) == 1:
            self.weight_shards = len(self.output_sizes)
        _name_checkpoint_shards(self, tuple(range(len(self.output_sizes))))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        name = f"merged column shard {shard_id}"
        _copy_rows(self, param, offset, size, _shard(loaded, 0, self.tp_rank, size, self.tp_size, name), name)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate, up] projection (this rank's slices of both): a gated MLP's
        activation, computed in the matmul's epilogue where the weight is in panels (and no adapter
        adds to the projection first)."""
        if self.lora is not None:
            return silu_and_mul(self(x))
        return silu_and_mul_linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, split by attention head.

    With grouped-query attention each rank keeps num_kv_heads / tp_size KV heads; when there are
    fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp_size = get_parallel_state().tp_size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "number of attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.kv_replicas = _divide(tp_size, num_kv_heads, "tensor_parallel_size over KV heads")
            self.num_kv_heads = 1
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local * tp_size, bias, dtype)
        _name_checkpoint_shards(self, ("q", "k", "v"))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        name = f"{shard_id} proj"
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        parts = self.tp_size // (1 if shard_id == "q" else self.kv_replicas)
        _copy_rows(self, param, offset, size, _shard(loaded, 0, rank, size, parts, name), name)


class RowParallelLinear(_PreparableLinear):
    """y = x W^T + b with W split by input columns; the partial sums are all-reduced."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input size")
        self.weight = _parameter((output_size, self.input_size_per_partition), self.weight_loader, dtype)
        self.bias = _parameter((output_size,), default_weight_loader, dtype) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        name = "row-parallel weight"
        _copy_rows(
            self, param, 0, param.shape[0], _shard(loaded, 1, self.tp_rank, size, self.tp_size, name), name
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.weight)
        if self.lora is not None:
            self.lora(x, partial)
        out = tensor_parallel_all_reduce(partial)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(_TensorParallelModule):
    """Token embedding with the vocabulary split in contiguous ranges across ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_partition
        self.vocab_end = min(self.vocab_start + self.per_partition, num_embeddings)
        self.weight = _parameter((self.per_partition, embedding_dim), self.weight_loader, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"vocabulary: checkpoint has {loaded.shape[0]} rows, config says {self.num_embeddings}"
            )
        rows = self.vocab_end - self.vocab_start
        if isinstance(loaded, GGUFBlocks):
            # This rank's rows packed once for the quantized kernels, on the parameter: the
            # embedding looks its rows up there and an LM head, tied or not, multiplies by it. The
            # dense table is never written, so its pages never take memory.
            shard = loaded.narrow(0, self.vocab_start, rows)
            param.block_table = BlockLinearWeight([shard])  # type: ignore[attr-defined]
            return
        param.data.zero_()
        _copy_checked(param.data[:rows], loaded[self.vocab_start : self.vocab_end], "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        embedded = self._rows(local_ids).masked_fill(outside.unsqueeze(-1), 0)
        return tensor_parallel_all_reduce(embedded)

    def _rows(self, local_ids: torch.Tensor) -> torch.Tensor:
        table = getattr(self.weight, "block_table", None)
        if table is not None:
            return table.lookup(local_ids, self.weight.dtype)
        return F.embedding(local_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto a vocabulary split like the embedding; logits gathered for sampling."""

    is_tied = False  # whether the weight is the embedding's own (tie_word_embeddings)

    # A prepared copy of a weight tied to the embedding, whose lookups need the plain table.
    tied_logits_weight: torch.Tensor | BlockLinearWeight | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.is_tied = True

    def prepare(self, form: WeightForm | None = None) -> None:
        """Keep the weight in `form` (by default this machine's fastest for it), or a copy in that
        form when the embedding shares it; multiply by the checkpoint's GGUF blocks where they
        were kept."""
        packed = getattr(self.weight, "block_table", None)
        if packed is not None:
            if self.is_tied:
                self.tied_logits_weight = packed
            else:
                del self.weight  # never written: its pages were never touched
                self.weight = packed
            return
        form = form or best_weight_form(self.weight)
        if form is WeightForm.PLAIN:
            return
        if self.is_tied:
            self.tied_logits_weight = prepare_weight(self.weight, form)
        else:
            self.weight = nn.Parameter(prepare_weight(self.weight, form), requires_grad=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.tied_logits_weight is None else self.tied_logits_weight
        local = linear(hidden, weight)
        if local.shape[-1] < self.per_partition:  # packed blocks hold only a last shard's real rows
            local = F.pad(local, (0, self.per_partition - local.shape[-1]))
        logits = tensor_parallel_all_gather(local, dim=-1)
        return logits[..., : self.num_embeddings]


def prepare_linear_weights(model: nn.Module, form: WeightForm | None = None) -> None:
    """Keep every linear weight of a loaded model in `form`, by default this machine's fastest."""
    for module in model.modules():
        if isinstance(module, (_PreparableLinear, ParallelLMHead)):
            module.prepare(form)
