"""The C++ norm, rotary and SiLU-and-multiply ops against the same formulas computed independently
in float64: a float32 result within float32 rounding of the exact one, a bf16/fp16 result equal to
torch's operator-by-operator path (the same roundings) but for the order of the norm's float32 sum
and the exponential's last place. Widths that are not a multiple of the vector width run the
kernels' one-at-a-time tails too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (9, 576), (64, 576), (300, 576), (9, 100)])
def test_rms_norm_and_its_residual_add(dtype: torch.dtype, rows: int, hidden: int) -> None:
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype)
    weight = torch.rand(hidden, dtype=dtype) + 0.5
    check(
        fused_ops.rms_norm(x, weight, EPS),
        exact_rms_norm(x, weight),
        fused_ops.rms_norm_torch(x, weight, EPS),
    )
    total = x + residual  # the sum is rounded to the dtype first, as the model's residual stream is
    normed, summed = fused_ops.add_rms_norm(x.clone(), residual.clone(), weight, EPS)
    assert torch.equal(summed, total)
    check(normed, exact_rms_norm(total, weight), fused_ops.rms_norm_torch(total, weight, EPS))


def test_norms_of_3d_activations_keep_their_shape() -> None:
    x, residual = torch.randn(2, 5, 576, dtype=torch.bfloat16), torch.randn(2, 5, 576, dtype=torch.bfloat16)
    weight = torch.rand(576, dtype=torch.bfloat16) + 0.5
    normed = fused_ops.rms_norm(x, weight, EPS)
    assert normed.shape == x.shape
    check(normed, exact_rms_norm(x, weight), fused_ops.rms_norm_torch(x, weight, EPS))
    total = x + residual
    normed, summed = fused_ops.add_rms_norm(x.clone(), residual.clone(), weight, EPS)
    assert normed.shape == x.shape and torch.equal(summed, total)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "head_dim"), [(1, 64), (9, 64), (64, 64), (9, 40)])
def test_rotary_rotates_views_of_the_fused_projection_in_place(
    dtype: torch.dtype, rows: int, head_dim: int
) -> None:
    torch.manual_seed(rows)
    max_position = 4096
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_position).float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(rows, 15 * head_dim, dtype=dtype)
    q, k, _ = qkv.split([9 * head_dim, 3 * head_dim, 3 * head_dim], dim=-1)
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


def exact_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (64, 1536), (300, 1536), (9, 100)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, width: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * width, dtype=dtype) * 4  # gates from deep in both tails of the sigmoid
    got = fused_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    torch_path = F.silu(gate) * up
    assert got.shape == (rows, width) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact_silu_and_mul(x), rtol=1e-6, atol=1e-30)
        torch.testing.assert_close(got, torch_path, rtol=1e-6, atol=1e-30)
    else:
        # Two roundings of the exact value, as torch's two operators round it ...
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got.double(), exact_silu_and_mul(x), rtol=2 * eps, atol=1e-6)
        # ... and torch's own result but where the exponential's last place tips a rounding: one
        # unit of silu's, which the product's rounding may turn into two of its own.
        torch.testing.assert_close(got, torch_path, rtol=2 * eps, atol=0)
        assert (got != torch_path).sum() <= max(1, got.numel() // 1000)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_the_edges_of_the_exponential(dtype: torch.dtype) -> None:
    """Gates where e^-|x| underflows or overflows, infinities and NaN give what torch's
    x / (1 + e^-x) gives (-inf: -inf / inf, NaN), 32 of them so that vector lanes see each."""
    special = [0.0, -0.0, 1e-3, -1e-3, 20.0, -20.0, 80.0, -80.0, 1e4, -1e4]
    special += [float("inf"), float("-inf"), float("nan")]
    gate = torch.tensor(special * 3, dtype=torch.float32)[:32].to(dtype)
    x = torch.cat((gate, torch.full_like(gate, 1.5))).unsqueeze(0)
    got = fused_ops.silu_and_mul(x)
    want = F.silu(gate) * 1.5
    torch.testing.assert_close(got[0], want, rtol=2 * torch.finfo(dtype).eps, atol=1e-30, equal_nan=True)
    assert torch.equal(got[0].isnan(), want.isnan())


def test_silu_and_mul_keeps_leading_dimensions_and_reads_row_strided_views() -> None:
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(x), F.silu(gate) * up, rtol=0.008, atol=0)
    wide = torch.randn(5, 80, dtype=torch.bfloat16)
    view = wide[:, :64]  # row stride 80
    gate, up = view.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(view), F.silu(gate) * up, rtol=0.008, atol=0)


def test_without_the_kernels_the_torch_path_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_ops, "cpu_kernels_available", lambda: False)
    x = torch.randn(3, 64)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(fused_ops.silu_and_mul(x), F.silu(gate) * up)
    logits = torch.randn(3, 50)
    assert torch.equal(fused_ops.argmax_rows(logits), logits.argmax(dim=-1))
