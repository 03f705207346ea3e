"""Batch-1 decoding with each decoder layer as one C++ call, against the same engine layer by layer.

    python -m benchmarks.fused_layers [--model PATH] [--rounds 4]

One engine in this process (the packaged Q4_1 GGUF by default, bf16 activations), its KV cache
faulted in before timing. The steady decode rate of one 128-token prompt: 128 output tokens timed
as the difference of a 160-token and a 32-token generation, so the prefill and the start drop out.
Each round times both modes, fused first in odd rounds and layer by layer first in even ones, by
setting each layer's `fused` call or clearing it (engine/models/fused_layers.py). Prints each
round, then the median (range) per mode and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import LLM, SamplingParams
from kernels.huge_pages import wait_for_prefaults

PROMPT = {"prompt_token_ids": list(range(200, 328))}


def decode_rate(llm: LLM) -> float:
    """Output tokens per second of batch-1 decoding, prefill excluded."""
    elapsed = []
    for max_tokens in (32, 160):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(PROMPT, params, use_tqdm=False)
        elapsed.append(time.perf_counter() - start)
    return 128 / (elapsed[1] - elapsed[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a GGUF file or Hugging Face folder (default: packaged)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16", max_model_len=2048, multiprocess_mode=False)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    layers = list(runner.model.model.stage_layers)
    calls = [layer.fused for layer in layers]
    if not any(calls):
        raise SystemExit("no decoder layer of this model runs fused here (engine/models/fused_layers.py)")
    print(f"{sum(call is not None for call in calls)} of {len(layers)} layers fused")
    wait_for_prefaults()
    decode_rate(llm)  # warm-up
    rates: dict[str, list[float]] = {"fused": [], "layer by layer": []}
    for round_index in range(args.rounds):
        modes = list(rates) if round_index % 2 == 0 else list(reversed(rates))
        for mode in modes:
            for layer, call in zip(layers, calls, strict=True):
                layer.fused = call if mode == "fused" else None
            rates[mode].append(decode_rate(llm))
        print(f"round {round_index + 1}: " + ", ".join(f"{mode} {rates[mode][-1]:.1f}" for mode in rates))
    for mode, values in rates.items():
        print(f"{mode}: median {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) tok/s")
    ratio = statistics.median(rates["fused"]) / statistics.median(rates["layer by layer"])
    print(f"fused / layer by layer: {ratio:.2f}")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
