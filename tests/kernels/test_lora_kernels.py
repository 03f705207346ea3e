"""The batched LoRA kernels (kernels/csrc/lora.cpp, kernels/triton_lora.py) and the torch loop of
kernels/lora.py against the formula, one row at a time in float64.

The C++ kernel's paths are chosen by shape here: AMX tiles (bf16, on a CPU with AMX) where the
input size is a multiple of 32, the shrink width of 16, the rank even and the parts whole tiles of
16 columns; dot-product tiles and float32 multiply-adds elsewhere (the "odd-sizes" case, and every
float32 and float16 case). Triton runs in its interpreter without CUDA (tests/conftest.py), where
shapes must stay small; a subprocess without the interpreter compiles its kernels for an H100/H200
(sm_90) as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kernels.build import cpu_kernels_available
from kernels.lora import LoRABatch, add_lora, add_lora_reference
from kernels.triton_lora import triton_add_lora

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# |got - expected| <= RTOL * |expected| + ATOL: the kernels round the exact sum once (half a unit
# in the last place, at most 2^-8 of the value in bf16, 2^-11 in float16, 2^-24 in float32), and
# their float32 sums differ from float64 by a little more than ATOL's share of the values (about 1).
RTOL = {torch.float32: 2e-7, torch.bfloat16: 2**-8, torch.float16: 2**-11}
ATOL = 2e-6
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"]
)
ON_CPU_KERNELS = pytest.mark.skipif(
    DEVICE.type != "cpu" or not cpu_kernels_available(), reason="the C++ CPU kernels"
)


@dataclass(frozen=True)
class Case:
    """A projection with adapters: its sizes, and the slot of each row (-1: the base model's)."""

    in_features: int
    slice_sizes: tuple[int, ...]
    rank: int
    num_slots: int
    token_slots: tuple[int, ...]


def shuffled(counts: Sequence[int], base_rows: int, seed: int) -> tuple[int, ...]:
    """Rows of slot s `counts[s]` times and `base_rows` rows of the base model, in a random order."""
    slots = np.concatenate(
        [np.full(count, slot) for slot, count in enumerate(counts)] + [np.full(base_rows, -1)]
    )
    return tuple(int(s) for s in np.random.default_rng(seed).permutation(slots))


CASES = {
    # A decode of one row; QKV-like parts of unequal sizes.
    "one-row": Case(64, (64, 16, 16), 16, 4, (2,)),
    # 64 rows: base rows mixed in, slots of 30 rows (two blocks of 16), 1 row, none and 17 rows.
    "mixed-qkv": Case(96, (64, 16, 16), 16, 4, shuffled([30, 1, 0, 17], 16, seed=1)),
    # Gate/up-like: two equal parts, rank 8, a slot with a single row, an empty slot.
    "gate-up-rank8": Case(64, (48, 48), 8, 4, shuffled([20, 0, 1, 35], 8, seed=2)),
    # Fewer blocks of 16 rows than threads: the expand split by columns instead of rows.
    "one-adapter": Case(64, (64, 32), 16, 2, shuffled([0, 9], 3, seed=5)),
    # Sizes off every tile: input 100, parts of 40 and 24, rank 5 (the non-tile paths for bf16).
    "odd-sizes": Case(100, (40, 24), 5, 3, shuffled([9, 3, 13], 12, seed=3)),
    # SmolLM2's QKV projection, 64 rows over four adapters of rank 16.
    "smollm2-qkv": Case(576, (576, 192, 192), 16, 4, shuffled([16, 16, 16, 16], 0, seed=4)),
}


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(out, x, lora_a, lora_b) with values of about 1 in out, x and the added products."""
    generator = torch.Generator().manual_seed(seed)
    rows, out_features = len(case.token_slots), sum(case.slice_sizes)
    parts = len(case.slice_sizes)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)

    return (
        randn(rows, out_features),
        randn(rows, case.in_features),
        randn(case.num_slots, parts * case.rank, case.in_features, scale=case.in_features**-0.5),
        randn(case.num_slots, out_features, case.rank, scale=case.rank**-0.5),
    )


def expected(
    out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, case: Case
) -> torch.Tensor:
    """out + B_s (A_s x) row by row in float64, part by part: each part's output features times its
    own rank columns of the shrink."""
    result = out.double().cpu().clone()
    x, lora_a, lora_b = x.double().cpu(), lora_a.double().cpu(), lora_b.double().cpu()
    rank = case.rank
    for row, slot in enumerate(case.token_slots):
        if slot < 0:
            continue
        offset = 0
        for part, size in enumerate(case.slice_sizes):
            shrunk = lora_a[slot, part * rank : (part + 1) * rank] @ x[row]
            result[row, offset : offset + size] += lora_b[slot, offset : offset + size] @ shrunk
            offset += size
    return result


def batch_of(case: Case) -> LoRABatch:
    return LoRABatch.from_token_slots(np.array(case.token_slots), case.num_slots, DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float = ATOL) -> None:
    error = (got.double().cpu() - want).abs()
    bound = rtol * want.abs() + atol
    worst = int(torch.argmax(error - bound))
    assert bool((error <= bound).all()), f"error {error.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g}"


def assert_base_rows_untouched(got: torch.Tensor, out: torch.Tensor, case: Case) -> None:
    base = [row for row, slot in enumerate(case.token_slots) if slot < 0]
    assert torch.equal(got[base], out[base])


def test_batch_groups_rows_by_slot():
    batch = LoRABatch.from_token_slots(np.array([2, -1, 0, 2, -1, 0, 3]), 4, torch.device("cpu"))
    assert batch.token_order.tolist() == [2, 5, 0, 3, 6]
    assert batch.slot_starts_list == (0, 2, 2, 4, 5)
    assert batch.active_slots == [0, 2, 3]


@ON_CPU_KERNELS
@DTYPES
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_kernel_matches_the_formula(name, dtype):
    case = CASES[name]
    out, x, lora_a, lora_b = make_inputs(case, dtype)
    got = out.clone()
    add_lora(got, x, lora_a, lora_b, case.slice_sizes, batch_of(case))  # CPU tensors: the C++ kernel
    assert_close(got, expected(out, x, lora_a, lora_b, case), RTOL[dtype])
    assert_base_rows_untouched(got, out, case)


@ON_CPU_KERNELS
@pytest.mark.parametrize("threads", [1, 8])
def test_cpu_kernel_splits_over_any_number_of_threads(threads):
    # One thread runs every block; eight (more than the five blocks of 16 rows) split the expand by
    # columns instead of by rows.
    case = CASES["mixed-qkv"]
    out, x, lora_a, lora_b = make_inputs(case, torch.bfloat16)
    got = out.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        add_lora(got, x, lora_a, lora_b, case.slice_sizes, batch_of(case))
    finally:
        torch.set_num_threads(before)
    assert_close(got, expected(out, x, lora_a, lora_b, case), RTOL[torch.bfloat16])


@ON_CPU_KERNELS
@pytest.mark.parametrize("rank", [2, 6, 8, 12, 32, 64])
def test_cpu_kernel_takes_any_rank(rank):
    # bf16 on AMX: the split shrink rows run over one to six steps of 32 values, against B's pairs
    # repeated with a period of rank / 2 (kernels/csrc/lora.cpp, split_depth).
    case = Case(64, (64, 32, 32), rank, 3, shuffled([9, 20, 4], 7, seed=rank))
    out, x, lora_a, lora_b = make_inputs(case, torch.bfloat16)
    got = out.clone()
    add_lora(got, x, lora_a, lora_b, case.slice_sizes, batch_of(case))
    assert_close(got, expected(out, x, lora_a, lora_b, case), RTOL[torch.bfloat16])


@ON_CPU_KERNELS
def test_cpu_kernel_takes_any_layout():
    case = CASES["mixed-qkv"]
    out, x, lora_a, lora_b = make_inputs(case, torch.bfloat16)
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)  # x's rows twice as far apart
    got = out.t().contiguous().t()  # out's features strided: added to a copy, copied back
    batch = batch_of(case)
    torch.ops.raypage.add_lora(
        got,
        wide[:, : case.in_features],
        lora_a.transpose(1, 2).contiguous().transpose(1, 2),
        lora_b,
        case.slice_sizes,
        batch.token_order,
        batch.slot_starts,
    )
    assert_close(got, expected(out, x, lora_a, lora_b, case), RTOL[torch.bfloat16])


@ON_CPU_KERNELS
def test_cpu_kernel_rejects_mixed_dtypes():
    case = CASES["one-row"]
    out, x, lora_a, lora_b = make_inputs(case, torch.bfloat16)
    with pytest.raises(RuntimeError, match="lora_a must be"):
        add_lora(out, x, lora_a.float(), lora_b, case.slice_sizes, batch_of(case))


@ON_CPU_KERNELS
def test_cpu_kernel_rejects_a_row_outside_out():
    case = CASES["one-row"]
    out, x, lora_a, lora_b = make_inputs(case, torch.float32)
    batch = LoRABatch(torch.tensor([1]), torch.tensor([0, 0, 1, 1, 1]), (0, 0, 1, 1, 1))
    with pytest.raises(RuntimeError, match="token_order holds row 1"):
        torch.ops.raypage.add_lora(
            out, x, lora_a, lora_b, case.slice_sizes, batch.token_order, batch.slot_starts
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["mixed-qkv", "gate-up-rank8"])
def test_reference_matches_the_formula(name, dtype):
    # The torch loop rounds the shrink, the expand and the sum to the dtype in turn: a few roundings
    # of values of about 1 in bf16, not one.
    case = CASES[name]
    out, x, lora_a, lora_b = make_inputs(case, dtype)
    got = out.clone()
    add_lora_reference(got, x, lora_a, lora_b, case.slice_sizes, batch_of(case))
    rtol = RTOL[dtype] if dtype == torch.float32 else 2**-8
    assert_close(
        got, expected(out, x, lora_a, lora_b, case), rtol, atol=1e-5 if dtype == torch.float32 else 2**-6
    )
    assert_base_rows_untouched(got, out, case)


def test_unsupported_dtype_takes_the_reference():
    case = CASES["gate-up-rank8"]
    out, x, lora_a, lora_b = make_inputs(case, torch.float64)
    got = out.clone()
    add_lora(got, x, lora_a, lora_b, case.slice_sizes, batch_of(case))
    assert_close(got, expected(out, x, lora_a, lora_b, case), 1e-12, atol=1e-12)


def test_rows_without_an_adapter_change_nothing():
    case = Case(64, (32, 32), 8, 2, (-1, -1, -1))
    out, x, lora_a, lora_b = make_inputs(case, torch.bfloat16)
    got = out.clone()
    add_lora(got, x, lora_a, lora_b, case.slice_sizes, batch_of(case))
    assert torch.equal(got, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["one-row", "gate-up-rank8"])
def test_triton_matches_the_formula(name, dtype):
    # Small blocks, so that a slot's rows and a part's columns span several programs. The
    # interpreter truncates float32 to bf16 where the GPU rounds to nearest: a whole unit, not half.
    case = CASES[name]
    out, x, lora_a, lora_b = make_inputs(case, dtype)
    got = out.clone()
    triton_add_lora(
        got, x, lora_a, lora_b, case.slice_sizes, batch_of(case), block_m=16, block_n=16, block_k=16
    )
    rtol = 2 * RTOL[dtype] if DEVICE.type == "cpu" else RTOL[dtype]
    assert_close(got, expected(out, x, lora_a, lora_b, case), rtol)
    assert_base_rows_untouched(got, out, case)


def test_triton_kernels_compile_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("ok") == 4, done.stdout


AOT_SCRIPT = """
from kernels.triton_lora import lora_expand_kernel, lora_shrink_kernel
from tests.kernels.triton_aot import compile_for_gpu

for kernel, pointers in (
    (lora_shrink_kernel, {"x_ptr": "*bf16", "a_ptr": "*bf16", "shrunk_ptr": "*fp32"}),
    (lora_expand_kernel, {"shrunk_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16"}),
):
    types = {name: "i32" for name in kernel.arg_names if name.islower()}
    types |= pointers | {"token_order_ptr": "*i64", "slot_starts_ptr": "*i64"}
    for block_m in (16, 64):
        constants = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64}
        constants |= {"FP32_DOT": False} if kernel is lora_shrink_kernel else {"NUM_PARTS": 3}
        compile_for_gpu(kernel, types, constants)
        print("ok")
"""
