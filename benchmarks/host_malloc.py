"""The sampler's step with glibc's default malloc thresholds and with kernels.host_malloc's.

    python -m benchmarks.host_malloc --rounds 3

Each round runs both settings, each in a fresh process (the thresholds are process-wide and stay
set): `Sampler` on SmolLM2-sized bf16 logits (49,152 tokens) of 1, 10 and 64 rows at temperature
1.0, the median of 50 calls after 5 warm-up calls, time and minor page faults alike. Prints
each run, then the median (range) per size and the kept / default ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

VOCAB = 49152
ROWS = (1, 10, 64)
CALLS = 50


def measure(keep_freed: bool) -> dict[str, dict[str, float]]:
    """Median milliseconds and minor page faults per sampler call, by row count, in this process."""
    from engine.sample.metadata import build_sampling_metadata, sampling_values
    from engine.sample.sampler import Sampler
    from engine.sampling_params import SamplingParams
    from kernels.host_malloc import keep_freed_host_memory

    if keep_freed and not keep_freed_host_memory():
        raise SystemExit("glibc's malloc thresholds could not be set here")
    results = {}
    for rows in ROWS:
        params = [SamplingParams(temperature=1.0, max_tokens=16) for _ in range(rows)]
        values = sampling_values(params, VOCAB, torch.device("cpu"))
        meta = build_sampling_metadata(
            params, values, [[1]] * rows, [[]] * rows, [None] * rows, [None] * rows
        )
        sampler = Sampler(torch.Generator().manual_seed(0))
        logits = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
        for _ in range(5):
            sampler(logits, meta)
        times, faults = [], []
        for _ in range(CALLS):
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            sampler(logits, meta)
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
        # Medians: the heap growing once within the calls (a few MB faulted in by one of them) is
        # not what a call costs.
        results[str(rows)] = {"ms": statistics.median(times) * 1000, "faults": statistics.median(faults)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["default", "kept"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT", json.dumps(measure(args.child == "kept")))
        return
    runs: dict[str, list[dict]] = {"default": [], "kept": []}
    for _ in range(args.rounds):
        for mode in runs:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.host_malloc", "--child", mode],
                capture_output=True,
                text=True,
                check=True,
            )
            result = json.loads(done.stdout.split("RESULT ", 1)[1])
            runs[mode].append(result)
            print(mode, json.dumps(result), flush=True)
    for rows in map(str, ROWS):
        medians = {}
        for mode, results in runs.items():
            values = [result[rows]["ms"] for result in results]
            faults = statistics.median(result[rows]["faults"] for result in results)
            medians[mode] = statistics.median(values)
            print(
                f"{rows} rows, {mode}: {medians[mode]:.3f} ms ({min(values):.3f}-{max(values):.3f}), "
                f"{faults:.0f} page faults a call"
            )
        print(f"RATIO {rows} rows kept/default: {medians['kept'] / medians['default']:.3f}")


if __name__ == "__main__":
    main()
