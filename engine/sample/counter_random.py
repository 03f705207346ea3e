"""Uniform random numbers as a pure function of a 64-bit key, computed on the device.

A seeded request draws output token p from `splitmix64_uniform(position_seed(seed, p))`
(engine/worker/input_batch.py): SplitMix64's p-th output from the state `seed` (Steele, Lea and
Flood, 2014), its increment being the golden gamma that position_seed adds. A request's draws then
depend on nothing but its seed and the position, whatever batch, preemption or speculation it goes
through, and the whole batch's seeded draws are a few vectorized integer operations on the device
instead of a generator reseeded and called per row from the host.
"""

from __future__ import annotations

import torch


def _as_int64(value: int) -> int:
    """A 64-bit unsigned constant as the signed int64 with the same bits."""
    return value - 2**64 if value >= 2**63 else value


_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)


def _shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts signed integers arithmetically)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_uniform(keys: torch.Tensor) -> torch.Tensor:
    """[n] int64 keys (64-bit patterns) -> [n] float32 uniforms in [0, 1): SplitMix64's output
    function (integer products wrap modulo 2**64 on every torch device), its top 24 bits scaled."""
    mixed = keys ^ _shift_right(keys, 30)
    mixed = mixed * _MIX_1
    mixed = mixed ^ _shift_right(mixed, 27)
    mixed = mixed * _MIX_2
    mixed = mixed ^ _shift_right(mixed, 31)
    return _shift_right(mixed, 40).to(torch.float32) * 2.0**-24


def as_int64_keys(keys: list[int]) -> list[int]:
    """Unsigned 64-bit keys as the signed values an int64 tensor holds."""
    return [_as_int64(key) for key in keys]
