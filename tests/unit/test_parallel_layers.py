"""Sharded layers cut the right slice of a checkpoint tensor for each rank: the slices of all
ranks, put back together by hand, give the unsharded layer's result."""

from __future__ import annotations

import pytest
import torch

import parallel.state as parallel_state
from parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@pytest.fixture
def as_rank(monkeypatch):
    """Build layers as if this process were TP rank `rank` of `size` (no collectives are run)."""

    def use(rank: int, size: int) -> None:
        monkeypatch.setattr(
            parallel_state, "_state", parallel_state.ParallelState(tp_rank=rank, tp_size=size)
        )

    return use


def load(layer, tensor, *shard):
    layer.weight.weight_loader(layer.weight, tensor, *shard)
    return layer


def test_column_parallel_shards_concatenate_to_the_full_output(as_rank):
    weight, x = torch.randn(8, 5), torch.randn(3, 5)
    parts = []
    for rank in range(2):
        as_rank(rank, 2)
        parts.append(load(ColumnParallelLinear(5, 8), weight)(x))
    torch.testing.assert_close(torch.cat(parts, dim=1), x @ weight.T)


def test_row_parallel_partial_sums_add_up(as_rank):
    weight, x = torch.randn(4, 6), torch.randn(3, 6)
    total = torch.zeros(3, 4)
    for rank in range(3):
        as_rank(rank, 3)
        layer = load(RowParallelLinear(6, 4), weight)
        total += x[:, rank * 2 : rank * 2 + 2] @ layer.weight.T
    torch.testing.assert_close(total, x @ weight.T)


def test_merged_column_places_gate_and_up_per_rank(as_rank):
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    as_rank(1, 2)
    layer = MergedColumnParallelLinear(4, [6, 6])
    load(layer, gate, 0)
    load(layer, up, 1)
    torch.testing.assert_close(layer.weight, torch.cat([gate[3:], up[3:]]))


@pytest.mark.parametrize("tp_size,kv_heads", [(2, 2), (4, 2)])
def test_qkv_splits_heads_and_replicates_kv_when_short(as_rank, tp_size, kv_heads):
    heads, dim, hidden = 4, 3, 5
    q, k, v = (
        torch.randn(heads * dim, hidden),
        torch.randn(kv_heads * dim, hidden),
        torch.randn(kv_heads * dim, hidden),
    )
    for rank in range(tp_size):
        as_rank(rank, tp_size)
        layer = QKVParallelLinear(hidden, dim, heads, kv_heads)
        for shard, tensor in (("q", q), ("k", k), ("v", v)):
            load(layer, tensor, shard)
        q_heads = heads // tp_size
        kv_head = rank * kv_heads // tp_size  # with replication, neighbouring ranks share a KV head
        kv_local = max(kv_heads // tp_size, 1)
        expected = torch.cat(
            [
                q[rank * q_heads * dim : (rank + 1) * q_heads * dim],
                k[kv_head * dim : (kv_head + kv_local) * dim],
                v[kv_head * dim : (kv_head + kv_local) * dim],
            ]
        )
        torch.testing.assert_close(layer.weight, expected)


def test_qkv_rejects_heads_not_divisible(as_rank):
    as_rank(0, 2)
    with pytest.raises(ValueError, match="number of attention heads"):
        QKVParallelLinear(9, 1, 9, 3)


def test_vocab_parallel_embedding_rows_and_padding(as_rank):
    table = torch.randn(7, 3)  # 7 rows over 2 ranks: 4 each, the last rank padded with one zero row
    as_rank(1, 2)
    layer = load(VocabParallelEmbedding(7, 3), table)
    torch.testing.assert_close(layer.weight[:3], table[4:])
    assert torch.count_nonzero(layer.weight[3]) == 0
    assert (layer.vocab_start, layer.vocab_end) == (4, 7)
