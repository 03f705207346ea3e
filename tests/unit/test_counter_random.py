"""Seeded draws: SplitMix64 on the device against a plain-Python SplitMix64, and their spread."""

from __future__ import annotations

import torch

from engine.sample.counter_random import as_int64_keys, splitmix64_uniform
from engine.worker.input_batch import position_seed

MASK = 2**64 - 1


def splitmix64_outputs(state: int, count: int) -> list[int]:
    """SplitMix64 as its authors wrote it (Steele, Lea and Flood): add the golden gamma, then mix."""
    outputs = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        outputs.append(z ^ (z >> 31))
    return outputs


def test_a_seeded_rows_draws_are_splitmix64_outputs():
    for seed in (0, 1234, 2**63 - 1, 2**64 - 1):
        # Output position p draws with the key position_seed(seed, p): SplitMix64's state after p
        # steps, so its mixed value is the generator's (p - 1)-th output for p >= 1.
        keys = [position_seed(seed, position) for position in range(1, 65)]
        drawn = splitmix64_uniform(torch.tensor(as_int64_keys(keys), dtype=torch.int64))
        expected = [(value >> 40) * 2.0**-24 for value in splitmix64_outputs(seed, 64)]
        assert drawn.tolist() == expected


def test_draws_over_positions_are_uniform():
    keys = [position_seed(42, position) for position in range(20000)]
    drawn = splitmix64_uniform(torch.tensor(as_int64_keys(keys), dtype=torch.int64))
    assert drawn.min() >= 0.0 and drawn.max() < 1.0
    # Ten equal bins hold 2000 draws each within five standard deviations (sqrt(2000 * 0.9) ~ 42).
    counts = torch.histc(drawn, bins=10, min=0.0, max=1.0)
    assert ((counts - 2000).abs() < 5 * 42.5).all(), counts.tolist()
