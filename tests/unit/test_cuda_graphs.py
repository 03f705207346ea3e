"""CUDA graph bookkeeping that needs no GPU: vLLM's capture sizes, the bucket a batch pads to, when
graphs are off and why, the memory set aside for them, the padding of a decode step into the static
buffers, and the enforce_eager setting."""

from __future__ import annotations

import argparse

import pytest
import torch

from cluster.engine_args import add_engine_args, engine_settings_from_args
from engine.config import EngineConfig, ResolvedEngineConfig
from engine.config_resolve import resolve_engine_config
from engine.worker.cuda_graphs import (
    DecodeBuffers,
    capture_sizes,
    cuda_graphs_disabled_reason,
    graph_memory_estimate,
    padded_batch_size,
)
from kernels.attention import AttentionMetadata
from kernels.attention.flash_attn import flash_attn_attention
from kernels.attention.sdpa import sdpa_attention

CUDA = torch.device("cuda")


def test_capture_sizes_follow_vllm():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]  # max_num_seqs rounded up to a multiple of 8
    full = capture_sizes(256)
    assert full[:5] == [1, 2, 4, 8, 16] and full[-1] == 256 and len(full) == 35
    assert capture_sizes(1024) == full  # never past 256


def test_a_batch_pads_to_the_next_captured_size():
    sizes = capture_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 63, 64)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        64,
        64,
    ]
    assert padded_batch_size(65, sizes) is None  # larger than every graph: eager


@pytest.fixture(scope="module")
def config() -> ResolvedEngineConfig:
    return resolve_engine_config(EngineConfig.from_flat(max_model_len=512, max_num_seqs=64))


def test_graphs_run_only_where_they_can(config):
    safe = flash_attn_attention  # reads only device tensors in decode
    assert cuda_graphs_disabled_reason(config, CUDA, safe) is None
    assert "CUDA device, the device is cpu" in cuda_graphs_disabled_reason(config, torch.device("cpu"), safe)
    eager = config.model_copy(update={"model": config.model.model_copy(update={"enforce_eager": True})})
    assert cuda_graphs_disabled_reason(eager, CUDA, safe) == "enforce_eager is set"
    staged = config.model_copy(
        update={"parallel": config.parallel.model_copy(update={"pipeline_parallel_size": 2})}
    )
    assert "pipeline stages" in cuda_graphs_disabled_reason(staged, CUDA, safe)
    assert "sdpa_attention reads host-side lengths" in cuda_graphs_disabled_reason(
        config, CUDA, sdpa_attention
    )


def test_graph_memory_estimate_grows_with_the_batch_and_shrinks_with_tp(config):
    small = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"max_num_seqs": 8})})
    one = graph_memory_estimate(config, torch.bfloat16, 1)
    assert graph_memory_estimate(small, torch.bfloat16, 1) < one
    assert graph_memory_estimate(config, torch.bfloat16, 2) < one
    assert graph_memory_estimate(config, torch.float32, 1) > one
    assert 0 < one < 2**30  # SmolLM2-135M at 64 rows: megabytes, not gigabytes


def decode_metadata(seq_lens: list[int], tables: list[list[int]], block_size: int) -> AttentionMetadata:
    slots = [
        table[(n - 1) // block_size] * block_size + (n - 1) % block_size
        for n, table in zip(seq_lens, tables, strict=True)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_table=torch.tensor(tables),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens_list=seq_lens,
        num_decodes=len(seq_lens),
        block_size=block_size,
    )


def test_a_decode_step_fills_the_buffers_and_pads_into_the_spare_block():
    block_size, padding_block = 4, 9
    buffers = DecodeBuffers.allocate(8, 5, padding_block, block_size, torch.device("cpu"))
    meta = decode_metadata([7, 3, 2], [[3, 5], [1, 0], [2, 0]], block_size)
    buffers.fill(torch.tensor([11, 12, 13]), torch.tensor([6, 2, 1]), meta, size=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [6, 2, 1, 0]
    assert buffers.slot_mapping[:4].tolist() == [5 * 4 + 2, 1 * 4 + 2, 2 * 4 + 1, padding_block * block_size]
    assert buffers.seq_lens[:4].tolist() == [7, 3, 2, 1]
    assert buffers.block_table[0].tolist() == [3, 5, 9, 9, 9]  # past its blocks: the padding block
    assert buffers.block_table[3].tolist() == [padding_block] * 5
    # A later, smaller step leaves no trace of the earlier one in its padded rows.
    buffers.fill(torch.tensor([21]), torch.tensor([4]), decode_metadata([5], [[6, 7]], block_size), size=2)
    assert buffers.input_ids[:2].tolist() == [21, 0] and buffers.seq_lens[:2].tolist() == [5, 1]
    assert buffers.block_table[1].tolist() == [padding_block] * 5
    captured = buffers.metadata(2)  # what a graph of 2 rows reads: views of the same buffers
    assert captured.seq_lens.data_ptr() == buffers.seq_lens.data_ptr() and captured.num_decodes == 2


def test_enforce_eager_setting():
    assert EngineConfig().model.enforce_eager is False  # vLLM's default: graphs on
    assert EngineConfig.from_flat(enforce_eager=True).model.enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig.from_flat(enforce_eager="sometimes")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_settings_from_args(parser.parse_args(["--enforce-eager"])) == {"enforce_eager": True}
    assert engine_settings_from_args(parser.parse_args(["--no-enforce-eager"])) == {"enforce_eager": False}
