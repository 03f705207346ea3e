"""Quantized linear layers (kernels/quant_linear.py) against bf16 ones of the same shape, on the CPU.

    python -m benchmarks.bench_quant_linear [--rows 1 64] [--rounds 10] [--threads 2] [--cold-mib 768]
        [--formats Q4_1 Q8_0 Q4_K Q6_K]

For each shape (SmolLM2-135M's MLP projections and LM head, a 1B Llama's MLP projections), Q4_1 and
Q8_0 weights (or --formats) run `quantized_linear`; bf16 weights run `F.linear` as it is, and in
the form kernels/linear.py prepares for this CPU. At one row every call reads its weight from memory, as a
decode step does: each variant cycles through copies of its weight adding up to --cold-mib (this
machine's L3 is large), and GB/s counts the weight bytes each call reads. Larger batches are bound
by arithmetic, not memory: they use a few copies and report GFLOP/s. Variants run interleaved,
round after round, each figure the median of the rounds: the cores are shared and single runs noisy.
The weights are random blocks, not quantized from real values: the time does not depend on them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.build import cpu_kernels_available
from kernels.linear import best_weight_form, linear, prepare_weight
from kernels.quant_linear import QuantizedWeight, pack_gguf_weight, quantized_linear

# (name, in, out): SmolLM2-135M's down, gate (one of the fused pair) and LM head, a 1B Llama's MLP.
SHAPES = [
    ("smollm2 gate", 576, 1536),
    ("smollm2 down", 1536, 576),
    ("smollm2 lm_head", 576, 49152),
    ("1b gate", 2048, 8192),
    ("1b down", 8192, 2048),
]
# ggml type id, weights and bytes per block, where in a block its float16 scales are.
FORMATS = {
    "Q4_1": (3, 32, 20, (0, 2)),
    "Q8_0": (8, 32, 34, (0,)),
    "Q4_K": (12, 256, 144, (0, 2)),
    "Q6_K": (14, 256, 210, (208,)),
}
WARM_COPIES = 3


def random_blocks(name: str, out_features: int, in_features: int) -> QuantizedWeight:
    """A packed weight of random quants (and K-quant sub-scales) and small positive float16 scales."""
    ggml_type, block_weights, block_bytes, scale_offsets = FORMATS[name]
    blocks = torch.randint(
        0, 256, (out_features * in_features // block_weights, block_bytes), dtype=torch.uint8
    )
    for offset in scale_offsets:
        blocks[:, offset : offset + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    return pack_gguf_weight(blocks, ggml_type, (out_features, in_features))


def variants(
    in_features: int, out_features: int, copies: int, formats: list[str]
) -> dict[str, tuple[list, Callable, int]]:
    """name -> (copies of the weight, call(x, weight), bytes of one weight)."""
    bf16 = [torch.randn(out_features, in_features).bfloat16() for _ in range(copies)]
    prepared = [prepare_weight(w, best_weight_form(w)) for w in bf16]
    table: dict[str, tuple[list, Callable, int]] = {
        "bf16 F.linear": (bf16, F.linear, bf16[0].nbytes),
        f"bf16 {best_weight_form(bf16[0]).value}": (prepared, linear, bf16[0].nbytes),
    }
    # K-quants need rows of whole blocks of 256, which SmolLM2's 576 are not (GGUF files keep such
    # tensors in 32-block formats).
    for name in (name for name in formats if in_features % FORMATS[name][1] == 0):
        weights = [random_blocks(name, out_features, in_features) for _ in range(copies)]
        table[name] = (weights, quantized_linear, weights[0].nbytes)
    return table


def time_shape(
    rows: int, in_features: int, out_features: int, args: argparse.Namespace
) -> dict[str, tuple[float, int]]:
    """name -> (median seconds per call, bytes of its weight) of each variant."""
    largest = in_features * out_features * 2  # bf16's bytes
    copies = max(1, args.cold_mib * 2**20 // largest) if rows == 1 else WARM_COPIES
    table = variants(in_features, out_features, copies, args.formats)
    x = torch.randn(rows, in_features).bfloat16()
    seconds: dict[str, list[float]] = {name: [] for name in table}
    with torch.inference_mode():
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, (weights, call, _) in table.items():
                start = time.perf_counter()
                for weight in weights:
                    call(x, weight)
                seconds[name].append((time.perf_counter() - start) / len(weights))
    return {name: (statistics.median(seconds[name][1:]), table[name][2]) for name in table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cold-mib", type=int, default=768, help="weight bytes each variant cycles through")
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=["Q4_1", "Q8_0"])
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the C++ kernels could not be built here (see the log line above)")
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        for label, in_features, out_features in SHAPES:
            figures = []
            for name, (seconds, weight_bytes) in time_shape(rows, in_features, out_features, args).items():
                rate = (
                    f"{weight_bytes / seconds / 1e9:.1f} GB/s"
                    if rows == 1
                    else f"{2 * rows * in_features * out_features / seconds / 1e9:.0f} GFLOP/s"
                )
                figures.append(f"{name} {seconds * 1e6:.0f} us ({rate})")
            print(f"{rows} rows, {label} ({in_features} -> {out_features}): " + ", ".join(figures))


if __name__ == "__main__":
    main()
