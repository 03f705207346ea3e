"""`raypage bench serve`: latency and throughput of an OpenAI-compatible server under load.

Seeded random prompts (token ids, so lengths are exact) go to `/v1/completions` with streaming on,
`max_tokens` = the output length and `ignore_eos`, arriving as a Poisson process at each requested
rate ("inf": all at once). Per request it records the time to first token (TTFT), the gaps between
streamed chunks (ITL), the time per output token after the first (TPOT) and the end-to-end latency;
it reports their mean, median and p99 with request and token throughput, writes a JSON result, and
draws latency against request rate when given several rates.

`--dataset prefix-groups` makes the prompts share prefixes: `--num-groups` prefixes of `--prefix-len`
tokens, each prompt one of them plus `--input-len` tokens of its own, the groups interleaved round
robin (the workload that tells routing policies apart: where a request lands decides whether its
prefix is cached). With a server started with `--enable-prompt-tokens-details` the summary reports
the prefix-cache hit rate: the share of prompt tokens the server's caches held.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import random
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from cluster.bench.throughput import TOKEN_ID_RANGE, positive_int

WARMUP_OUTPUT_TOKENS = 4
DATASETS = ("random", "prefix-groups")


@dataclasses.dataclass
class RequestResult:
    """What one streamed request measured."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Register `serve` under `raypage bench`."""
    parser = benchmarks.add_parser(
        "serve",
        help="latency and throughput of a running OpenAI-compatible server",
        description="Streams seeded random completions at Poisson request rates against a running server.",
    )
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)"
    )
    parser.add_argument("--model", help="model name to send (default: the server's first /v1/models entry)")
    parser.add_argument("--api-key", help="sent as Authorization: Bearer")
    parser.add_argument(
        "--request-rate",
        nargs="+",
        default=[math.inf],  # a list default is not passed through `type`
        type=_rate,
        help="requests per second, one run each; inf sends all at once (default: inf)",
    )
    parser.add_argument(
        "--num-prompts", type=positive_int, default=100, help="requests per run (default: 100)"
    )
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default="random",
        help="random prompts, or prefix-groups: shared prefixes, interleaved (default: random)",
    )
    parser.add_argument(
        "--input-len",
        type=positive_int,
        default=128,
        help="prompt tokens (prefix-groups: each prompt's own, after its group's prefix) (default: 128)",
    )
    parser.add_argument(
        "--num-groups", type=positive_int, default=16, help="prefix-groups: shared prefixes (default: 16)"
    )
    parser.add_argument(
        "--prefix-len", type=positive_int, default=512, help="prefix-groups: prefix tokens (default: 512)"
    )
    parser.add_argument("--output-len", type=positive_int, default=128, help="output tokens (default: 128)")
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times (default: 0)")
    parser.add_argument("--max-concurrency", type=positive_int, help="most requests in flight at once")
    parser.add_argument(
        "--output-json", type=Path, metavar="PATH", help="default: bench-results/serve-<time>.json"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="PNG", help="latency against rate (default: next to the JSON)"
    )
    parser.set_defaults(handler=run, command_parser=parser, check_args=check_args)


def check_args(args: argparse.Namespace) -> None:
    """Fail before the benchmark runs when the plot it would draw cannot be drawn."""
    if len(args.request_rate) > 1:
        require_matplotlib()


def require_matplotlib() -> None:
    """matplotlib is an optional extra: only this plot needs it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "plotting latency against several request rates needs matplotlib: pip install 'raypage[bench]'"
        )


def make_prompts(num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [_random_tokens(rng, input_len) for _ in range(num_prompts)]


def make_prefix_group_prompts(
    num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int, seed: int
) -> list[list[int]]:
    """Prompt i: the prefix of group i % num_groups, then `suffix_len` tokens of its own."""
    rng = random.Random(seed)
    prefixes = [_random_tokens(rng, prefix_len) for _ in range(num_groups)]
    return [prefixes[index % num_groups] + _random_tokens(rng, suffix_len) for index in range(num_prompts)]


def _random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(count)]


def workload_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The prompts of one run, as --dataset says."""
    if args.dataset == "prefix-groups":
        return make_prefix_group_prompts(
            args.num_prompts, args.num_groups, args.prefix_len, args.input_len, args.seed
        )
    return make_prompts(args.num_prompts, args.input_len, args.seed)


def arrival_delays(num_prompts: int, rate: float, seed: int) -> list[float]:
    """Gaps between request starts: exponential (a Poisson process) at `rate`, none at inf."""
    if math.isinf(rate):
        return [0.0] * num_prompts
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(num_prompts)]


async def send_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    """Stream one completion, timing every chunk that carries text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    )
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens == output_len
        if not result.ok:
            result.error = f"got {result.output_tokens} output tokens, expected {output_len}"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_rate(
    client: httpx.AsyncClient, model: str, prompts: list[list[int]], args: argparse.Namespace, rate: float
) -> dict[str, Any]:
    """One run at one request rate: every prompt, Poisson arrivals, summarized."""
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))

    async def limited(prompt: list[int]) -> RequestResult:
        async with limit:
            return await send_request(client, model, prompt, args.output_len)

    tasks = []
    start = time.perf_counter()
    for prompt, delay in zip(prompts, arrival_delays(len(prompts), rate, args.seed), strict=True):
        await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(prompt)))
    results = await asyncio.gather(*tasks)
    return summarize(results, time.perf_counter() - start, rate)


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)

    def stats(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"mean_ms": None, "median_ms": None, "p99_ms": None}
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return {
            "mean_ms": 1000 * statistics.fmean(values),
            "median_ms": 1000 * statistics.median(values),
            "p99_ms": 1000 * p99,
        }

    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "prefix_cache_hit_rate": prefix_cache_hit_rate(done),
        "ttft": stats([r.ttft for r in done]),
        "tpot": stats([r.tpot for r in done if r.tpot is not None]),
        "itl": stats([gap for r in done for gap in r.itls]),
        "e2e_latency": stats([r.latency for r in done]),
    }


def prefix_cache_hit_rate(results: list[RequestResult]) -> float | None:
    """The share of prompt tokens the server's prefix caches held; None when it does not report them."""
    if not results or any(r.cached_tokens is None for r in results):
        return None
    return sum(r.cached_tokens or 0 for r in results) / sum(r.prompt_tokens for r in results)


async def benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        warmup = await send_request(
            client, model, make_prompts(1, args.input_len, -1)[0], WARMUP_OUTPUT_TOKENS
        )
        if not warmup.ok:
            raise SystemExit(f"raypage bench serve: error: the warm-up request failed: {warmup.error}")
        prompts = workload_prompts(args)
        return [await run_rate(client, model, prompts, args, rate) for rate in args.request_rate]


def run(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """Handler of `raypage bench serve` (engine settings do not apply: the server has its own)."""
    runs = asyncio.run(benchmark(args))
    for summary in runs:
        print_summary(summary)
    now = datetime.now().astimezone()
    path = args.output_json or Path("bench-results") / f"serve-{now:%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    workload = {
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        **(
            {"num_groups": args.num_groups, "prefix_len": args.prefix_len}
            if args.dataset == "prefix-groups"
            else {}
        ),
    }
    record = {
        "benchmark": "serve",
        "timestamp": now.isoformat(timespec="seconds"),
        "workload": workload,
        "runs": runs,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"Results written to {path}")
    if len(runs) > 1:
        plot = args.plot or path.with_suffix(".png")
        plot_latency(runs, plot)
        print(f"Plot written to {plot}")


def print_summary(summary: dict[str, Any]) -> None:
    def line(name: str, metric: dict[str, float | None]) -> str:
        if metric["mean_ms"] is None:
            return f"  {name}: n/a"
        return (
            f"  {name}: mean {metric['mean_ms']:.1f} ms, median {metric['median_ms']:.1f} ms, "
            f"p99 {metric['p99_ms']:.1f} ms"
        )

    print(
        f"Request rate {summary['request_rate']}: {summary['completed']} completed, {summary['failed']} failed "
        f"in {summary['duration_s']:.1f} s; {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_throughput']:.1f} output tok/s"
    )
    if summary["prefix_cache_hit_rate"] is not None:
        print(f"  prefix-cache hit rate: {summary['prefix_cache_hit_rate']:.1%} of prompt tokens")
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        print(line(name.upper(), summary[name]))
    for error in summary["errors"]:
        print(f"  error: {error}")


def plot_latency(runs: list[dict[str, Any]], path: Path) -> None:
    """Median TTFT, TPOT and end-to-end latency against request rate (inf drawn at the right end)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    finite = [r["request_rate"] for r in runs if r["request_rate"] != "inf"]
    right_end = (max(finite) * 1.5) if finite else 1.0
    rates = [right_end if r["request_rate"] == "inf" else r["request_rate"] for r in runs]
    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    for axis, name in zip(axes, ("ttft", "tpot", "e2e_latency"), strict=True):
        axis.plot(rates, [r[name]["median_ms"] for r in runs], marker="o", label="median")
        axis.plot(rates, [r[name]["p99_ms"] for r in runs], marker="x", linestyle="--", label="p99")
        axis.set_title(name.upper().replace("_", " "))
        axis.set_xlabel("request rate (req/s; inf drawn rightmost)")
        axis.set_ylabel("ms")
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive or inf, got {text}")
    return value
