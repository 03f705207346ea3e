"""The C++ norm and rotary ops against the same formulas computed independently in float64: a
float32 result within float32 rounding of the exact one, a bf16/fp16 result equal to torch's
operator-by-operator path (the same roundings) but for the order of the norm's float32 sum."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_ops
from kernels.build import cpu_kernels_available

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels could not be built here"
)
EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)


def exact_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x rotated by `angles` ([tokens, dim / 2], the float32 table's), with cos and sin in float64."""
    cos, sin = angles.double().cos().unsqueeze(1), angles.double().sin().unsqueeze(1)
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def check(got: torch.Tensor, exact: torch.Tensor, torch_path: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    else:  # a unit in the last place (of either rounding) where the norm's sum order tips one
        torch.testing.assert_close(got, torch_path, rtol=2 * torch.finfo(got.dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 64, 300])
def test_rms_norm_and_its_residual_add(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, 576, dtype=dtype), torch.randn(rows, 576, dtype=dtype)
    weight = torch.rand(576, dtype=dtype) + 0.5
    check(
        fused_ops.rms_norm(x, weight, EPS),
        exact_rms_norm(x, weight),
        fused_ops.rms_norm_torch(x, weight, EPS),
    )
    total = x + residual  # the sum is rounded to the dtype first, as the model's residual stream is
    normed, summed = fused_ops.add_rms_norm(x.clone(), residual.clone(), weight, EPS)
    assert torch.equal(summed, total)
    check(normed, exact_rms_norm(total, weight), fused_ops.rms_norm_torch(total, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_rotary_rotates_views_of_the_fused_projection_in_place(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    head_dim, max_position = 64, 4096
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_position).float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(rows, 9 * 64 + 2 * 3 * 64, dtype=dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(rows, 9, head_dim), k.view(rows, 3, head_dim)
    positions = torch.randint(0, max_position, (rows,))
    want_q, want_k = exact_rotary(q, angles[positions]), exact_rotary(k, angles[positions])
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    torch_q, torch_k = fused_ops._rotate_torch(q, c, s), fused_ops._rotate_torch(k, c, s)
    got_q, got_k = fused_ops.rotary_embedding(positions, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place, inside the projection's output
    if dtype == torch.float32:
        torch.testing.assert_close(got_q.double(), want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k.double(), want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_q, torch_q) and torch.equal(got_k, torch_k)


def test_positions_outside_the_table_are_refused() -> None:
    q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 64)
    table = torch.zeros(16, 32)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        fused_ops.rotary_embedding(torch.tensor([3, 16]), q, k, table, table)
