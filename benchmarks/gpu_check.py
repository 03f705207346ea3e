"""The GPU check: one command that, on a bare machine with torch and Triton (the project's other
dependencies carried as wheels), runs in a few minutes on one GPU (its time on an H200 is in docs/gpu.md):

1. every GPU attention backend the selector knows ("triton", "flash_attn") against
   kernels/attention/reference.py at real sizes (Llama-3-8B heads, contexts up to 4k, bf16);
2. `raypage bench throughput` on random-weight Llamas written at run time, of SmolLM2-135M's shape,
   of ~1B and of ~8B parameters (random weights run at the speed of real ones: the benchmark
   ignores end-of-sequence tokens): eager (--enforce-eager), with CUDA graphs, and with graphs and
   async scheduling, reporting output tokens/s, the decode step's median time against the time
   reading its bytes takes at the GPU's peak bandwidth (the weights, less the embedding table, plus
   the batch's KV cache), and so the share of HBM bandwidth it achieves;
3. `pytest -m gpu` over the modules that hold CUDA-only tests, last, so that a run cut short by a
   time limit still has the figures.

    python -m benchmarks.gpu_check --out results/          # on the GPU machine
    python -m benchmarks.gpu_check --models llama-1b llama-8b --skip-pytest --out results/
    python -m benchmarks.gpu_check --dry-run --out /tmp/x  # its Python parts on the CPU, tiny

Results: summary.json and summary.md in --out, and the table on stdout. The benchmark runs call the
throughput command's own handler in a subprocess each (so each run starts with a clean GPU), without
the rest of the `raypage` CLI, whose Ray and HTTP imports the bare machine lacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

H200_HBM_BYTES_PER_S = 4.8e12
# Peak HBM bandwidth by device name (the first that the name contains); the H200's otherwise.
PEAK_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100": 2.0e12}
GPU_BACKENDS = ("triton", "flash_attn")


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a random-weight Llama written for the benchmark."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    def hf_config(self, vocab_size: int) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "hidden_act": "silu",
        }


SMOLLM2_SHAPE = LlamaShape(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3)
# ~1.2B parameters with SmolLM2's 49152-token vocabulary (Llama-3.2-1B's shape but 16 layers).
LLAMA_1B = LlamaShape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8)
# ~7.7B parameters: Llama-3-8B's shape with SmolLM2's vocabulary.
LLAMA_8B = LlamaShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8)
GPU_SHAPES = {"smollm2": SMOLLM2_SHAPE, "llama-1b": LLAMA_1B, "llama-8b": LLAMA_8B}
# (label, flags) of each engine mode a model runs in.
MODES = (
    ("eager", ["--enforce-eager"]),
    ("graphs", ["--no-enforce-eager"]),
    ("graphs-async", ["--no-enforce-eager", "--async-scheduling"]),
)
LLAMA_TINY = LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)


def write_random_llama(folder: Path, shape: LlamaShape, device: torch.device) -> Path:
    """A Hugging Face Llama folder (config.json, model.safetensors, SmolLM2's tokenizer) with
    random bf16 weights, drawn on `device` (seconds on a GPU for 1B parameters)."""
    from safetensors.torch import save_file

    from engine.frontend.tokenizer import load_tokenizer
    from engine.models.model_files import ModelSource, packaged_model_path

    tokenizer = load_tokenizer(ModelSource(packaged_model_path(), "gguf"))
    config = shape.hf_config(len(tokenizer))
    head_dim = shape.hidden // shape.heads
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {
        "model.embed_tokens.weight": weight(config["vocab_size"], shape.hidden),
        "lm_head.weight": weight(config["vocab_size"], shape.hidden),
        "model.norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
    }
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": weight(shape.heads * head_dim, shape.hidden),
            prefix + "self_attn.k_proj.weight": weight(shape.kv_heads * head_dim, shape.hidden),
            prefix + "self_attn.v_proj.weight": weight(shape.kv_heads * head_dim, shape.hidden),
            prefix + "self_attn.o_proj.weight": weight(shape.hidden, shape.heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(shape.intermediate, shape.hidden),
            prefix + "mlp.up_proj.weight": weight(shape.intermediate, shape.hidden),
            prefix + "mlp.down_proj.weight": weight(shape.hidden, shape.intermediate),
            prefix + "input_layernorm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
        }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    return folder


def decode_step_bytes(arch: Any, dtype_bytes: int, batch: int, mean_context: float) -> float:
    """Bytes one decode step must read from memory at least: every weight once (the embedding table
    only by row, so not at all when the LM head is a separate matrix) and every sequence's keys and
    values. `arch` is an engine ArchConfig."""
    per_layer = (
        arch.hidden_size * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim  # q, k, v
        + arch.num_heads * arch.head_dim * arch.hidden_size  # o
        + 3 * arch.hidden_size * arch.intermediate_size  # gate, up, down
    )
    weights = arch.num_layers * per_layer + arch.vocab_size * arch.hidden_size  # + the LM head
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim
    return (weights + batch * mean_context * kv_per_token) * dtype_bytes


def hbm_share(bytes_per_step: float, step_s: float, peak: float = H200_HBM_BYTES_PER_S) -> float:
    return bytes_per_step / step_s / peak


def peak_hbm_bytes_per_s(device_name: str) -> float:
    """The peak memory bandwidth of a GPU named `device_name` (torch.cuda.get_device_name)."""
    return next(
        (peak for name, peak in PEAK_HBM_BYTES_PER_S.items() if name in device_name), H200_HBM_BYTES_PER_S
    )


# ---- stage 1: attention backends at real sizes -----------------------------------------------


def check_backends(
    names: tuple[str, ...], device: torch.device, *, real_sizes: bool = True
) -> dict[str, dict[str, Any]]:
    """Each named backend against the reference on one mixed batch; a backend that cannot run here
    reports why instead. Real sizes: Llama-3-8B's 32 heads over 8 KV heads of 128, 64 decodes of
    1-4k context, a fresh 2k prefill and a 512-token chunk over a 1k prefix."""
    from kernels.attention import AttentionParams, get_attention_backend
    from kernels.attention.flash_attn import FLASH_ATTN_PAGE_MULTIPLE
    from kernels.attention.reference import reference_attention
    from tests.kernels.random_batch import random_paged_batch

    if real_sizes:
        specs = [(4096 - 47 * i, 1) for i in range(64)] + [(0, 2048), (1024, 512)]
        dims = dict(heads=32, kv_heads=8, head_dim=128)
    else:
        specs = [(40, 1), (17, 1), (0, 9), (12, 5)]
        dims = dict(heads=4, kv_heads=2, head_dim=16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        # flash-attn pages the cache only in multiples of 256 tokens; the others take the default 16.
        block_size = FLASH_ATTN_PAGE_MULTIPLE if name == "flash_attn" else 16
        try:
            backend = get_attention_backend(name, device, block_size)
        except (ValueError, RuntimeError) as exc:
            results[name] = {"status": "unavailable", "reason": str(exc)}
            continue
        batch = random_paged_batch(specs, block_size=block_size, dtype=dtype, device=device, **dims)
        params = AttentionParams(dims["head_dim"] ** -0.5)
        expected_cache = batch.kv_cache.clone()
        expected = reference_attention(
            batch.query, batch.key, batch.value, expected_cache, batch.meta, params
        )
        try:
            out = backend(batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, params)
        except (RuntimeError, ImportError) as exc:
            results[name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            continue
        error = (out.float() - expected.float()).abs().max().item()
        cache_ok = torch.equal(batch.kv_cache, expected_cache)
        ok = error <= (2e-2 if dtype != torch.float32 else 1e-4) and cache_ok
        results[name] = {
            "status": "ok" if ok else "mismatch",
            "max_abs_error": error,
            "cache_writes_equal": cache_ok,
        }
    return results


# ---- stage 2: throughput --------------------------------------------------------------------


def run_throughput(argv: list[str]) -> None:
    """`raypage bench throughput ARGV` through the command's own parser and handler."""
    import logging

    from cluster.bench import throughput
    from cluster.engine_args import engine_settings_from_args

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="raypage bench")
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", *argv])
    args.handler(args, engine_settings_from_args(args))


def bench(label: str, argv: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """One throughput run in a subprocess; its JSON results, or the error that ended it."""
    result_path = out / f"throughput-{label}.json"
    command = [sys.executable, "-c", "import sys; from benchmarks.gpu_check import run_throughput; "
               "run_throughput(sys.argv[1:])", *argv, "--output-json", str(result_path)]  # fmt: skip
    print(f"== bench {label}: {' '.join(argv)}", flush=True)
    try:
        done = subprocess.run(command, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "timeout_s": timeout_s}
    log = done.stdout + done.stderr
    (out / f"throughput-{label}.log").write_text(log)
    if done.returncode != 0:
        return {"status": "failed", "tail": log[-2000:]}
    # What the worker said about graphs: captured (and at which sizes), or why decode ran eagerly.
    graphs = [
        line for line in log.splitlines() if "CUDA graphs" in line or "decode steps run eagerly" in line
    ]
    return {
        "status": "ok",
        "cuda_graphs": graphs[-1] if graphs else "not used",
        **json.loads(result_path.read_text()),
    }


def summarize_bench(
    results: dict[str, Any], arch: Any, batch: int, mean_context: float, peak: float = H200_HBM_BYTES_PER_S
) -> dict[str, Any]:
    """Output tokens/s and, from the median (decode) step time, the time reading the step's bytes
    takes at the peak bandwidth `peak`, and the HBM bandwidth share."""
    if results.get("status") != "ok":
        return {"status": results.get("status")}
    step_s = results["step_time_median_ms"] / 1000
    dtype_bytes = 4 if results["engine"]["dtype"] == "float32" else 2
    step_bytes = decode_step_bytes(arch, dtype_bytes, batch, mean_context)
    return {
        "status": "ok",
        "cuda_graphs": results["cuda_graphs"],
        "output_tokens_per_s": results["output_tokens_per_s"],
        "decode_step_ms": results["step_time_median_ms"],
        "decode_bytes_per_step": step_bytes,
        "read_time_ms": step_bytes / peak * 1000,
        "hbm_share": hbm_share(step_bytes, step_s, peak),
    }


# ---- the whole check ------------------------------------------------------------------------


# The modules that hold gpu tests. The others are left out: tests/cluster and tests/distributed
# import Ray and the HTTP stack, which a bare GPU machine lacks, and hold no gpu test.
GPU_TEST_FILES = [
    "tests/kernels/test_triton_attention.py",
    "tests/kernels/test_flash_attn.py",
    "tests/kernels/test_attention_selector.py",
    "tests/model/test_gpu_paths.py",
]


def run_pytest(out: Path, timeout_s: float) -> dict[str, Any]:
    """`pytest -m gpu` over the modules that hold gpu tests; its status and summary line."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-rs",
        *GPU_TEST_FILES,
    ]
    print("== pytest -m gpu", flush=True)
    log_path = out / "pytest-gpu.log"
    # Written as it runs, so that a run cut short still shows which tests passed.
    with log_path.open("w") as log:
        try:
            done = subprocess.run(command, timeout=timeout_s, stdout=log, stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "timeout_s": timeout_s}
    lines = log_path.read_text().strip().splitlines()
    summary = lines[-1] if lines else ""
    # 5: nothing collected, which on a machine without CUDA is every gpu test skipped, not a failure.
    return {"status": "ok" if done.returncode in (0, 5) else "failed", "summary": summary}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=Path("gpu-check"), help="results folder (default: gpu-check)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the Python parts on the CPU: tiny model and workload, small kernel sizes, no pytest",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=64, help="requests, and so the decode batch (default: 64)"
    )
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens (default: 512)")
    parser.add_argument("--output-len", type=int, default=256, help="output tokens (default: 256)")
    parser.add_argument("--skip-pytest", action="store_true", help="leave out stage 3")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(GPU_SHAPES),
        default=list(GPU_SHAPES),
        help="random Llamas to benchmark (default: all)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=[label for label, _ in MODES],
        default=[label for label, _ in MODES],
        help="engine modes each model runs in (default: all)",
    )
    parser.add_argument(
        "--bench-timeout-s", type=float, default=120.0, help="per benchmark run (default: 120)"
    )
    parser.add_argument("--pytest-timeout-s", type=float, default=180.0, help="for stage 3 (default: 180)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from engine.models.model_files import read_arch_config, resolve_model_source

    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here (use --dry-run for the CPU parts)")
    if args.dry_run:
        args.num_prompts, args.input_len, args.output_len = min(args.num_prompts, 4), 16, 8
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_hbm_bytes_per_s(device_name)
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name,
        "peak_hbm_bytes_per_s": peak,
        "torch": torch.__version__,
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
        },
    }
    print("== attention backends against the reference", flush=True)
    names = GPU_BACKENDS if device.type == "cuda" else ("sdpa", *GPU_BACKENDS)
    summary["backends"] = check_backends(names, device, real_sizes=not args.dry_run)
    save_summary(summary, args.out, started)
    # The dry run checks the script on one tiny model; the GPU run measures the shapes asked for.
    shapes = (
        {"llama-tiny": LLAMA_TINY} if args.dry_run else {label: GPU_SHAPES[label] for label in args.models}
    )
    workload = [
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
    ]
    engine = ["--device", device.type, "--max-num-seqs", str(args.num_prompts), "--max-model-len", "2048"]
    if args.dry_run:
        engine += ["--num-kv-blocks", "64", "--dtype", "float32"]
    # Mean context of a decode step: the prompt plus half the output, on average over the run.
    mean_context = args.input_len + args.output_len / 2
    summary["bench"] = {}
    for label, shape in shapes.items():
        # Written just before its runs, so that a run cut short has the smaller models' figures.
        model = str(write_random_llama(args.out / label, shape, device))
        arch = read_arch_config(resolve_model_source(model))
        for mode, flags in MODES:
            if mode not in args.modes:
                continue
            run = bench(
                f"{label}-{mode}",
                [*workload, *engine, "--model", model, *flags],
                args.out,
                args.bench_timeout_s,
            )
            summary["bench"][f"{label}-{mode}"] = summarize_bench(
                run, arch, args.num_prompts, mean_context, peak
            )
            save_summary(summary, args.out, started)
    # The tests last: the figures above come back even when the tests overrun the machine's time.
    if not (args.dry_run or args.skip_pytest):
        summary["pytest_gpu"] = run_pytest(args.out, timeout_s=args.pytest_timeout_s)
        save_summary(summary, args.out, started)
    print(markdown_table(summary), flush=True)
    return summary


def save_summary(summary: dict[str, Any], out: Path, started: float) -> None:
    """Write what is known so far, so that a run cut short by its time limit still leaves figures."""
    summary["elapsed_s"] = time.perf_counter() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown_table(summary))


def markdown_table(summary: dict[str, Any]) -> str:
    """The figures docs/gpu.md records: backends, then tokens/s and HBM share per run."""
    lines = [f"GPU check of {summary['date']} on {summary['device']} (torch {summary['torch']})", ""]
    if "pytest_gpu" in summary:
        lines += [
            f"pytest -m gpu: {summary['pytest_gpu']['status']} ({summary['pytest_gpu'].get('summary', '')})",
            "",
        ]
    lines += ["| backend | status | max abs error vs reference |", "| --- | --- | --- |"]
    for name, result in summary["backends"].items():
        lines.append(
            f"| {name} | {result['status']} | {result.get('max_abs_error', result.get('reason', ''))} |"
        )
    peak_tb_s = summary.get("peak_hbm_bytes_per_s", H200_HBM_BYTES_PER_S) / 1e12
    lines += [
        "",
        f"| run | output tok/s | decode step (ms) | its bytes at {peak_tb_s:.2f} TB/s (ms) | HBM share |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, result in summary.get("bench", {}).items():
        if result["status"] != "ok":
            lines.append(f"| {label} | {result['status']} | | | |")
            continue
        lines.append(
            f"| {label} | {result['output_tokens_per_s']:.0f} | {result['decode_step_ms']:.2f} "
            f"| {result['read_time_ms']:.2f} | {result['hbm_share']:.1%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
