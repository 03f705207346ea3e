"""The mixture-of-experts kernels (kernels/csrc/moe.cpp, kernels/triton_moe.py) against the plain
per-expert loop of kernels/moe.py, itself checked against the formula one token at a time.

Triton runs in its interpreter without CUDA (tests/conftest.py), where shapes must stay small; a
subprocess without the interpreter compiles the Triton kernel for an H100/H200 (sm_90) as well.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels.build import cpu_kernels_available
from kernels.moe import fused_experts_torch, select_experts
from kernels.triton_moe import align_pairs, triton_fused_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative to the output's largest value: float32 differs by the order of its sums; 16-bit types by
# a last-place rounding that order tips (and the interpreter's truncating bf16 stores).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)


def experts_case(
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype,
    held: int | None = None,
):
    """(hidden states, top-k weights, top-k ids, w13, w2) of a random block; w13 and w2 hold the
    first `held` experts' weights only (the rest are another rank's)."""
    generator = torch.Generator().manual_seed(tokens * 1000 + hidden)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)

    held = experts if held is None else held
    weights, ids = select_experts(torch.randn(tokens, experts, generator=generator), top_k, renormalize=True)
    return (
        randn(tokens, hidden),
        weights.to(DEVICE),
        ids.to(DEVICE),
        randn(held, 2 * inter, hidden, scale=hidden**-0.5),
        randn(held, hidden, inter, scale=inter**-0.5),
    )


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * scale


# (tokens, hidden, intermediate, experts, top_k): a decode, sizes off every vector width, a batch
# that leaves some experts without a token, and 20 rows per expert: more than one tile, and (bf16
# on a CPU with AMX) the tile kernel's path (kernels/csrc/moe_tiles.h).
SHAPES = [(1, 64, 32, 4, 2), (37, 100, 70, 8, 3), (3, 64, 48, 16, 1), (40, 64, 32, 4, 2)]


def test_select_experts_takes_the_softmax_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormalized, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(renormalized.sum(dim=-1), torch.ones(2))


def test_reference_is_the_formula_token_by_token():
    hidden, weights, ids, w13, w2 = experts_case(5, 32, 16, 4, 2, torch.float32)
    expected = torch.zeros_like(hidden)
    for t in range(5):
        for k in range(2):
            gate, up = (w13[ids[t, k]] @ hidden[t]).chunk(2)
            expected[t] += weights[t, k] * (w2[ids[t, k]] @ (F.silu(gate) * up))
    torch.testing.assert_close(fused_experts_torch(hidden, weights, ids, w13, w2), expected)


@pytest.mark.skipif(DEVICE.type != "cpu" or not cpu_kernels_available(), reason="the C++ CPU kernels")
@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=["decode", "odd-sizes", "idle-experts", "many-rows"])
def test_cpu_kernel_matches_the_per_expert_loop(dtype, shape):
    case = experts_case(*shape, dtype)
    assert_close(torch.ops.raypage.moe_experts(*reorder(case)), fused_experts_torch(*case), dtype)


@pytest.mark.skipif(DEVICE.type != "cpu" or not cpu_kernels_available(), reason="the C++ CPU kernels")
@pytest.mark.parametrize("first_expert", [0, 4])
def test_cpu_kernel_skips_the_experts_another_rank_holds(first_expert):
    # Experts 0-3 on one rank, 4-7 on the other: each rank's share adds up to the whole.
    hidden, weights, ids, w13, w2 = experts_case(20, 64, 32, 8, 2, torch.bfloat16)
    mine = (w13[first_expert : first_expert + 4], w2[first_expert : first_expert + 4])
    expected = fused_experts_torch(hidden, weights, ids, *mine, first_expert)
    got = torch.ops.raypage.moe_experts(*reorder((hidden, weights, ids, *mine)), first_expert)
    assert_close(got, expected, torch.bfloat16)
    empty = torch.ops.raypage.moe_experts(*reorder((hidden[:0], weights[:0], ids[:0], *mine)), 0)
    assert empty.shape == (0, 64)


def reorder(case: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The C++ op's argument order: hidden, ids, weights, w13, w2."""
    hidden, weights, ids, w13, w2 = case
    return hidden, ids, weights, w13, w2


def test_align_pairs_gives_each_block_one_expert():
    ids = torch.tensor([2, 0, 2, 5, 2, 0, 1], device=DEVICE)  # 5: another rank's
    pair_ids, block_experts = align_pairs(ids, num_experts=3, block_m=2)
    blocks = pair_ids.view(-1, 2).tolist()
    assert block_experts.tolist()[:4] == [0, 1, 2, 2] and set(block_experts.tolist()[4:]) == {-1}
    assert blocks[:4] == [[1, 5], [6, 7], [0, 2], [4, 7]]  # 7: padding (no pair)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("held", [None, 4], ids=["all-experts", "expert-parallel"])
def test_triton_matches_the_per_expert_loop(dtype, held):
    hidden, weights, ids, w13, w2 = experts_case(21, 48, 40, 8, 2, dtype, held)
    first_expert = 0 if held is None else 4  # this rank holds experts 4-7 of 8
    expected = fused_experts_torch(hidden, weights, ids, w13, w2, first_expert)
    got = triton_fused_experts(
        hidden, weights, ids, w13, w2, first_expert, block_m=16, block_n=16, block_k=16
    )
    assert_close(got, expected, dtype)


def test_triton_kernel_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("ok") == 2, done.stdout


AOT_SCRIPT = """
from kernels.triton_moe import moe_gemm_kernel
from tests.kernels.triton_aot import compile_for_gpu

types = {name: "i32" for name in moe_gemm_kernel.arg_names if name.islower()}
types |= {name: "*bf16" for name in ("a_ptr", "w_ptr", "out_ptr")}
types |= {"pair_ids_ptr": "*i64", "block_experts_ptr": "*i64"}
for gated, block_m in ((True, 64), (False, 16)):
    constants = {"GATED": gated, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64, "FP32_DOT": False}
    compile_for_gpu(moe_gemm_kernel, types, constants)
    print("ok")
"""
