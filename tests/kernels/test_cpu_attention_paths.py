"""The table that picks the CPU attention path (kernels/attention/cpu_paged.py): its choice for every
combination of the conditions it reads, against the rules as its docstring states them, and the
docstring's table against the code's. The kernels' own checks are stubbed, so this runs on any CPU,
with or without the C++ kernels."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from kernels.attention import AttentionParams, cpu_paged
from kernels.attention.cpu_paged import CPU_ATTENTION_PATHS, cpu_attention_path
from tests.kernels.random_batch import specs_metadata


def documented_path(
    rows: str, on_cpu: bool, int8: bool, plain: bool, amx: bool, tiled: bool, cascade: bool
) -> str:
    """The rules of cpu_paged.py's docstring, written out on their own."""
    if not on_cpu:
        return "sdpa"
    if int8:
        return "int8"
    if plain and amx:
        return "amx"
    if rows == "decode":
        return "cascade_decode" if plain and tiled and cascade else "paged_decode"
    return "tiled_prefill" if tiled else "sdpa_prefill"


@pytest.mark.parametrize(
    ("rows", "on_cpu", "int8", "plain", "amx", "tiled", "cascade"),
    list(itertools.product(("decode", "prefill"), *[(True, False)] * 6)),
)
def test_each_combination_of_conditions_takes_the_documented_path(
    rows, on_cpu, int8, plain, amx, tiled, cascade, monkeypatch
):
    monkeypatch.setattr(cpu_paged, "amx_serves", lambda kv_cache: amx)
    monkeypatch.setattr(cpu_paged, "tiled_serves", lambda query, kv_cache: tiled)
    monkeypatch.setattr(cpu_paged, "cascade_blocks", lambda meta: 3 if cascade else 0)
    device = "cpu" if on_cpu else "meta"  # the meta device: tensors off the CPU, without a GPU
    query = torch.empty(2, 6, 16, device=device)
    kv_cache = torch.empty(2, 2, 4, 16, 16, device=device, dtype=torch.int8 if int8 else torch.bfloat16)
    meta = specs_metadata([(20, 1), (0, 5)], torch.zeros(2, 2, dtype=torch.long), [0] * 6, 16, "cpu")
    # A plain layer, or one with a sliding window (a soft cap routes alike: test_attention_window.py).
    params = AttentionParams(0.25) if plain else AttentionParams(0.25, sliding_window=8)
    expected = documented_path(rows, on_cpu, int8, plain, amx, tiled, cascade)
    assert cpu_attention_path(rows, query, kv_cache, meta, params) == expected


def test_off_the_cpu_no_kernel_is_asked_whether_it_serves(monkeypatch):
    for check in ("amx_serves", "tiled_serves", "cascade_blocks"):
        monkeypatch.setattr(cpu_paged, check, lambda *args: pytest.fail("a CPU kernel was consulted"))
    query, kv_cache = torch.empty(1, 2, 16, device="meta"), torch.empty(2, 1, 1, 16, 16, device="meta")
    meta = specs_metadata([(3, 1)], torch.zeros(1, 1, dtype=torch.long), [0], 16, "cpu")
    assert cpu_attention_path("decode", query, kv_cache, meta, AttentionParams(0.25)) == "sdpa"


def test_the_docstring_lists_the_table_in_its_order_and_its_words():
    listed = re.findall(r"^\| (\w+) +\| (.+?) +\|$", cpu_paged.__doc__, flags=re.MULTILINE)
    assert listed[1:] == [(path.name, path.when) for path in CPU_ATTENTION_PATHS]  # [0]: the header
