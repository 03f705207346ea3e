"""Engine metrics: vLLM's Prometheus metrics under a `raypage:` prefix, and a periodic log line.

Both are `StatLogger`s: the engine calls `record(scheduler_stats, iteration_stats)` after every
step. Scheduler state (running, waiting, KV usage) is also refreshed from `get_stats()` when
/metrics is scraped, so that the gauges fall back to zero when the engine goes idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.frontend.stats import IterationStats
from engine.outputs import SchedulerStats

logger = logging.getLogger(__name__)

PREFIX = "raypage:"
# vLLM's buckets, so that dashboards built for vLLM read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def _as_dict(stats: msgspec.Struct | Mapping[str, Any]) -> Mapping[str, Any]:
    return msgspec.structs.asdict(stats) if isinstance(stats, msgspec.Struct) else stats


def _section_totals(stats: Mapping[str, Any], section: str) -> dict[str, Any]:
    """A nested section's values (speculative decoding's, LoRA's) as flat keys `<section>_<name>`
    (none without it)."""
    values = stats.get(section)
    return {} if values is None else {f"{section}_{key}": value for key, value in _as_dict(values).items()}


def lora_request_counter(registry: CollectorRegistry) -> Counter:
    """Engine requests run with each LoRA adapter, counted by the HTTP app as it sends them."""
    return Counter(
        PREFIX + "lora_adapter_requests",
        "Requests run with each LoRA adapter",
        ["model_name", "lora_name"],
        registry=registry,
    )


class EngineStatsSource(Protocol):
    """What a scrape refreshes the metrics from: the engine's latest counters, and its adapters."""

    def get_stats(self) -> dict[str, Any]: ...

    async def list_loras(self) -> list[int]: ...


class PrometheusStatLogger:
    """vLLM's metrics in a private `CollectorRegistry`, so that several apps (or tests) in one
    process each keep their own; `render()` is the /metrics body."""

    def __init__(
        self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self._model_name = model_name
        self._lock = threading.Lock()

        def labeled(metric_type: type, name: str, doc: str, **kwargs: Any) -> Any:
            metric = metric_type(PREFIX + name, doc, ["model_name"], registry=self.registry, **kwargs)
            return metric.labels(model_name)

        self.num_requests_running = labeled(Gauge, "num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = labeled(Gauge, "num_requests_waiting", "Requests waiting to run")
        self.kv_cache_usage = labeled(Gauge, "kv_cache_usage_perc", "KV cache usage (1 means full)")
        # The scheduler reports these as running totals; the counters are fed their increments.
        self.counters = {
            "num_preemptions": labeled(Counter, "num_preemptions", "Preemptions"),
            "prefix_cache_queries": labeled(
                Counter, "prefix_cache_queries", "Tokens looked up in the prefix cache"
            ),
            "prefix_cache_hits": labeled(Counter, "prefix_cache_hits", "Tokens found in the prefix cache"),
            "structured_output_requests": labeled(
                Counter, "structured_output_requests", "Requests under a grammar (structured outputs, tools)"
            ),
            "grammar_compiles": labeled(Counter, "grammar_compiles", "Grammars compiled"),
            "grammar_compile_seconds": labeled(
                Counter, "grammar_compile_seconds", "Seconds spent compiling grammars (off the step loop)"
            ),
            "grammar_cache_hits": labeled(
                Counter, "grammar_cache_hits", "Requests whose grammar was compiled already (cached)"
            ),
            "spec_decode_num_drafts": labeled(
                Counter, "spec_decode_num_drafts", "Sequence steps that verified speculative drafts"
            ),
            "spec_decode_num_draft_tokens": labeled(
                Counter, "spec_decode_num_draft_tokens", "Speculative draft tokens proposed and verified"
            ),
            "spec_decode_num_accepted_tokens": labeled(
                Counter, "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted"
            ),
            "lora_num_loads": labeled(Counter, "lora_loads", "LoRA adapters loaded into a device slot"),
            "lora_num_evictions": labeled(
                Counter, "lora_evictions", "LoRA adapter loads that evicted another adapter from its slot"
            ),
        }
        # vLLM's lora_requests_info: one series, whose labels name the adapters of the running and
        # waiting requests and whose value is the time they were seen.
        self.lora_requests_info = Gauge(
            PREFIX + "lora_requests_info",
            "LoRA adapters of the running and waiting requests (labels); the value is when they were seen",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry,
        )
        self._lora_info_labels: tuple[str, ...] | None = None
        self.lora_loaded_adapters = labeled(
            Gauge, "lora_loaded_adapters", "LoRA adapters the engine holds loaded (in host memory)"
        )
        self.lora_adapter_requests = lora_request_counter(self.registry)
        self.accepted_per_position = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted at each position of the drafts",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._accepted_per_position: list[int] = []
        self._totals = dict.fromkeys(self.counters, 0)
        self.prompt_tokens = labeled(Counter, "prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = labeled(Counter, "generation_tokens", "Tokens generated")
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = labeled(
            Histogram, "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS
        )
        self.inter_token_latency = labeled(
            Histogram, "inter_token_latency_seconds", "Time between two tokens", buckets=ITL_BUCKETS
        )
        self.e2e_request_latency = labeled(
            Histogram,
            "e2e_request_latency_seconds",
            "Request latency, arrival to finish",
            buckets=LATENCY_BUCKETS,
        )
        self.request_queue_time = labeled(
            Histogram,
            "request_queue_time_seconds",
            "Time a request waited to be scheduled",
            buckets=LATENCY_BUCKETS,
        )
        buckets = token_buckets(max_model_len)
        self.request_prompt_tokens = labeled(
            Histogram, "request_prompt_tokens", "Prompt tokens per finished request", buckets=buckets
        )
        self.request_generation_tokens = labeled(
            Histogram, "request_generation_tokens", "Generated tokens per finished request", buckets=buckets
        )

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        if scheduler_stats is not None:
            self.update_scheduler_stats(scheduler_stats)
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for seconds in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(seconds)
        for seconds in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(seconds)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(self._model_name, str(finished.finish_reason)).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)
            self.request_queue_time.observe(finished.queued_time)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)

    def update_scheduler_stats(self, stats: SchedulerStats | Mapping[str, Any]) -> None:
        """Set the gauges, and advance the counters by what the scheduler's totals grew."""
        values = _as_dict(stats)
        values = {**values, **_section_totals(values, "spec_decode"), **_section_totals(values, "lora")}
        self.num_requests_running.set(values.get("num_running_reqs", 0))
        self.num_requests_waiting.set(values.get("num_waiting_reqs", 0))
        self.kv_cache_usage.set(values.get("kv_cache_usage", 0.0))
        with self._lock:  # record() and a scrape may both update the totals
            if values.get("lora") is not None:
                self._update_lora_info(_as_dict(values["lora"]))
            for key, counter in self.counters.items():
                total = values.get(key, 0)
                # A smaller total means the engine core restarted: count from its new zero.
                previous = self._totals[key]
                counter.inc(total - previous if total >= previous else total)
                self._totals[key] = total
            self._count_accepted_per_position(values.get("spec_decode_num_accepted_tokens_per_pos", []))

    def _update_lora_info(self, lora: Mapping[str, Any]) -> None:
        labels = (
            self._model_name,
            str(lora.get("max_loras", 0)),
            ",".join(sorted(lora.get("running") or {})),
            ",".join(sorted(lora.get("waiting") or {})),
        )
        # vLLM keeps every label set it ever showed; only the current one is kept here, so that the
        # series do not pile up as adapters come and go.
        if self._lora_info_labels not in (None, labels):
            self.lora_requests_info.remove(*self._lora_info_labels)
        self._lora_info_labels = labels
        self.lora_requests_info.labels(*labels).set_to_current_time()

    async def refresh(self, engine: EngineStatsSource) -> None:
        """At a scrape: the scheduler's latest state (zero once idle), and with LoRA on (the engine
        reports LoRA stats) the adapters it holds loaded."""
        stats = engine.get_stats()
        self.update_scheduler_stats(stats)
        if stats.get("lora") is not None:
            self.lora_loaded_adapters.set(len(await engine.list_loras()))

    def count_lora_requests(self, model_name: str, lora_name: str, count: int) -> None:
        """`count` more engine requests run with the adapter `lora_name` of `model_name`."""
        self.lora_adapter_requests.labels(model_name, lora_name).inc(count)

    def _count_accepted_per_position(self, totals: list[int]) -> None:
        previous = self._accepted_per_position + [0] * (len(totals) - len(self._accepted_per_position))
        for position, (total, before) in enumerate(zip(totals, previous, strict=False)):
            self.accepted_per_position.labels(self._model_name, str(position)).inc(
                total - before if total >= before else total
            )
        self._accepted_per_position = list(totals)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoggingStatLogger:
    """One log line per interval: prompt and generation throughput, running and waiting requests,
    KV cache usage and prefix cache hit rate. Quiet while the engine has nothing to do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_log = time.monotonic()
        self._stats: Mapping[str, Any] = {}
        self._last_line_idle = True

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        with self._lock:
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens
            if scheduler_stats is not None:
                self._stats = _as_dict(scheduler_stats)

    def log(self, scheduler_stats: SchedulerStats | Mapping[str, Any] | None = None) -> None:
        """Log the throughput since the last call; `scheduler_stats`, when given, is the latest state."""
        now = time.monotonic()
        with self._lock:
            if scheduler_stats is not None:
                self._stats = _as_dict(scheduler_stats)
            elapsed = max(now - self._last_log, 1e-9)
            prompt, generation = self._prompt_tokens, self._generation_tokens
            self._prompt_tokens = self._generation_tokens = 0
            self._last_log = now
            stats = self._stats
        running, waiting = stats.get("num_running_reqs", 0), stats.get("num_waiting_reqs", 0)
        idle = not (prompt or generation or running or waiting)
        if idle and self._last_line_idle:
            return  # one idle line after activity is enough
        self._last_line_idle = idle
        queries = stats.get("prefix_cache_queries", 0)
        hit_rate = stats.get("prefix_cache_hits", 0) / queries if queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt / elapsed,
            generation / elapsed,
            running,
            waiting,
            100.0 * stats.get("kv_cache_usage", 0.0),
            100.0 * hit_rate,
        )
