"""The machine's memory bandwidth, and the share of it batch-1 decoding draws on each weight path.

    python -m benchmarks.decode_bandwidth [--rounds 3] [--model PATH]

Bandwidth: reading a 1 GiB tensor with torch's sum on all of torch's threads, the best of five
passes after one to warm up (a read-only stream, as a decode step's weight traffic is). Per path
(a GGUF file kept in its blocks, and dequantized to bf16 with `quantization="none"`; a Hugging
Face folder dense in bf16, and quantized to int8 blocks with `quantization="int8"`): the bytes
one decode step reads of weights (every linear weight and norm, the LM head whole, the embedding's
one row left out), times the steady decode rate at batch 1 (the time of 288 output tokens less
that of 32, so prefill and start-up drop out), against the bandwidth. Fresh engine per path and
round, the paths' order alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from engine import LLM, SamplingParams
from kernels.gguf_blocks import BlockLinearWeight
from kernels.huge_pages import wait_for_prefaults
from parallel.layers import ParallelLMHead, VocabParallelEmbedding

GGUF_PATHS = {"GGUF blocks": None, "dense bf16": "none"}
CHECKPOINT_PATHS = {"dense bf16": None, "int8 blocks": "int8"}
PROMPT = {"prompt_token_ids": list(range(200, 264))}


def read_bandwidth(gib: int = 1) -> float:
    """Bytes per second torch's sum reads from a tensor far larger than the caches."""
    data = torch.ones(gib << 28, dtype=torch.float32)
    data.sum()
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        passes.append(data.nbytes / (time.perf_counter() - start))
    return max(passes)


def weight_bytes_per_step(model: nn.Module) -> int:
    """The weight bytes one decode step of batch 1 reads."""
    total = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            continue  # a step looks up one row of the table
        if isinstance(module, ParallelLMHead) and module.tied_logits_weight is not None:
            total += _nbytes(module.tied_logits_weight)
            continue
        for value in (*module._parameters.values(), module.__dict__.get("weight")):
            if value is not None:
                total += _nbytes(value)
    return total


def _nbytes(weight: torch.Tensor | BlockLinearWeight) -> int:
    # numel, not the storage: prepared weights may be opaque (oneDNN) tensors without one.
    return weight.nbytes if isinstance(weight, BlockLinearWeight) else weight.numel() * weight.element_size()


def decode_rate(llm: LLM) -> float:
    """Output tokens per second of batch-1 decoding alone."""

    def seconds(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        return time.perf_counter() - start

    wait_for_prefaults()  # the KV cache's pages, faulted in on a thread after start-up
    seconds(32)
    return (288 - 32) / (seconds(288) - seconds(32))


def loaded_model(llm: LLM) -> nn.Module:
    """The model of an in-process engine's one worker."""
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--model", default=None, help="a GGUF file or a Hugging Face folder (default: the packaged SmolLM2)"
    )
    args = parser.parse_args()
    paths = CHECKPOINT_PATHS if args.model and not args.model.endswith(".gguf") else GGUF_PATHS
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)", flush=True)
    shares: dict[str, list[float]] = {path: [] for path in paths}
    for round_index in range(args.rounds):
        order = list(paths) if round_index % 2 == 0 else list(paths)[::-1]
        for path in order:
            llm = LLM(model=args.model, dtype="bfloat16", quantization=paths[path])
            step_bytes = weight_bytes_per_step(loaded_model(llm))
            rate = decode_rate(llm)
            llm.llm_engine.shutdown()
            shares[path].append(step_bytes * rate / bandwidth)
            print(
                f"round {round_index + 1} {path}: {step_bytes / 1e6:.1f} MB a step, {rate:.1f} tok/s, "
                f"{step_bytes * rate / 1e9:.2f} GB/s = {shares[path][-1]:.0%} of the bandwidth",
                flush=True,
            )
    for path, values in shares.items():
        print(
            f"SHARE {path}: median {statistics.median(values):.0%} "
            f"(rounds {', '.join(f'{value:.0%}' for value in values)})"
        )


if __name__ == "__main__":
    main()
