"""What LoRA adapters cost a decode step, and what loading one costs.

    python -m benchmarks.lora_step [--model PATH] [--rows 64] [--adapters 4] [--rank 16] [--rounds 3]

Three engines over the same model (default: the packaged SmolLM2), started once each: the base
engine (LoRA off), the LoRA engine running the base model's rows only, and the LoRA engine with the
rows split evenly over `--adapters` random adapters of rank `--rank` on every projection. A decode
step's time is that of `--rows` requests decoding 65 tokens less that of the same requests
decoding 1 (prefill and start-up drop out), over 64; rounds interleave the three, and every figure
is the median with the range of the rounds. Adapter load: reading one adapter from disk into the
host cache (`LLM.add_lora`), and copying it into a device slot.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.peft_files import projection_shape
from tests.model.lora_adapters import ALL_PROJECTIONS, write_adapter_files

PROMPT_TOKENS = 32
DECODE_TOKENS = 64


def write_adapters(llm: LLM, folder: Path, count: int, rank: int) -> list[LoRARequest]:
    arch = llm.llm_engine.config.model.hf_config
    shapes = {name: projection_shape(arch, name) for name in ALL_PROJECTIONS}
    return [
        LoRARequest(
            f"adapter{index}",
            index + 1,
            str(
                write_adapter_files(
                    folder / f"adapter{index}",
                    shapes,
                    arch.num_layers,
                    "benchmark",
                    rank=rank,
                    alpha=2.0 * rank,
                    seed=index,
                    std=0.02,
                )
            ),
        )
        for index in range(count)
    ]


def timed_generate(llm: LLM, rows: int, max_tokens: int, loras: list[LoRARequest | None]) -> float:
    prompts = [{"prompt_token_ids": [100 + row + i for i in range(PROMPT_TOKENS)]} for row in range(rows)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    per_row = [loras[row * len(loras) // rows] for row in range(rows)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=per_row)
    return time.perf_counter() - start


def decode_step_ms(llm: LLM, rows: int, loras: list[LoRARequest | None]) -> float:
    """One decode step of `rows` sequences: 65 tokens' time less 1 token's, over 64 steps."""
    llm.reset_prefix_cache()
    prefill = timed_generate(llm, rows, 1, loras)
    llm.reset_prefix_cache()
    whole = timed_generate(llm, rows, DECODE_TOKENS + 1, loras)
    return (whole - prefill) / DECODE_TOKENS * 1e3


def slot_load_ms(llm: LLM, lora: LoRARequest) -> float:
    """Copying an adapter held in host memory into a device slot (the in-process worker's)."""
    slots = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.lora
    start = time.perf_counter()
    slots.load_slots({0: lora})
    return (time.perf_counter() - start) * 1e3


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="Hugging Face folder or GGUF file (default: packaged SmolLM2)"
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    common = {"max_num_seqs": args.rows, "kv_cache_memory": "1GiB", "enable_prefix_caching": False}
    base = LLM(args.model, **common)
    lora = LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    with tempfile.TemporaryDirectory() as folder:
        adapters = write_adapters(lora, Path(folder), args.adapters, args.rank)
        reads = []
        for adapter in adapters:
            start = time.perf_counter()
            lora.add_lora(adapter)
            reads.append((time.perf_counter() - start) * 1e3)
        copies = [slot_load_ms(lora, adapter) for adapter in adapters]
        runs = {
            "base engine (LoRA off)": (base, [None]),
            "LoRA engine, base rows": (lora, [None]),
            f"LoRA engine, {args.adapters} adapters": (lora, adapters),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for llm, loras in runs.values():  # warm-up: every adapter loaded, every path run
            decode_step_ms(llm, args.rows, loras)
        for _ in range(args.rounds):
            for name, (llm, loras) in runs.items():
                times[name].append(decode_step_ms(llm, args.rows, loras))
    print(f"decode step of {args.rows} rows, ms, median (range) of {args.rounds} rounds")
    base_times = times["base engine (LoRA off)"]
    for name, values in times.items():
        ratios = [value / reference for value, reference in zip(values, base_times, strict=True)]
        print(f"  {name:<28} {summary(values)}   x{summary(ratios)} of the base engine")
    print(
        f"adapter of rank {args.rank}: read from disk {summary(reads)} ms, copied into a slot {summary(copies)} ms"
    )
    base.llm_engine.shutdown()
    lora.llm_engine.shutdown()


if __name__ == "__main__":
    main()
