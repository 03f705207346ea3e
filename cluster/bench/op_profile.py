"""Where a run's time goes, by kind of operator: `raypage bench throughput --profile-ops`.

torch.profiler records every operator of the run in this process (the engine core and, with the
uniproc executor, the worker); each operator's own time is filed under a category, and what the
operators do not account for is Python, scheduling and output handling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

# (category, operator names): the first category whose names hold an operator's name takes it.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("projections and LM head (matmuls)", ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")),
    (
        "attention",
        (
            "raypage::paged_decode_attention",
            "raypage::amx_paged_attention",
            "scaled_dot_product",
            "aten::bmm",
            "aten::index_select",
            "aten::masked_fill",
            "aten::_softmax",
        ),
    ),
    ("KV cache writes", ("aten::index_copy", "raypage::reshape_and_cache")),
    (
        "norms and rotary",
        (
            "raypage::rms_norm",
            "raypage::fused_add_rms_norm",
            "raypage::rotary_embedding",
            "aten::pow",
            "aten::mean",
            "aten::rsqrt",
            "aten::cat",
        ),
    ),
    ("activation (silu and mul)", ("raypage::silu_and_mul", "aten::silu", "aten::mul")),
    (
        "sampling",
        (
            "raypage::argmax_rows",
            "aten::argmax",
            "aten::topk",
            "aten::sort",
            "aten::log_softmax",
            "aten::cumsum",
        ),
    ),
    ("embedding", ("aten::embedding",)),
    ("other operators", ("",)),
]


def profile_ops(run: Callable[[], Any]) -> tuple[Any, dict[str, float], float]:
    """(run's result, seconds of operator self time per category, wall seconds of the run)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        result = run()
        wall = time.perf_counter() - start
    seconds = dict.fromkeys((name for name, _ in CATEGORIES), 0.0)
    for event in profiler.key_averages():
        category = next(name for name, prefixes in CATEGORIES if any(p in event.key for p in prefixes))
        seconds[category] += event.self_cpu_time_total / 1e6
    return result, seconds, wall


def print_op_profile(seconds: dict[str, float], wall: float) -> None:
    """One line per category: its share of the run's wall time (CPU time over wall time: with several
    threads an operator's time is counted once, on the thread that called it)."""
    print(f"Operator profile over {wall:.2f} s of wall time (with the profiler's own overhead):")
    for category, spent in seconds.items():
        print(f"  {category:<36} {spent:8.2f} s  {spent / wall:6.1%}")
    rest = max(wall - sum(seconds.values()), 0.0)
    print(f"  {'Python, scheduling, outputs':<36} {rest:8.2f} s  {rest / wall:6.1%}")
