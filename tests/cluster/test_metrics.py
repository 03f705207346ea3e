"""cluster.metrics: the Prometheus stat logger and the periodic log line, fed by hand."""

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import LoggingStatLogger, PrometheusStatLogger, token_buckets
from engine.frontend.stats import FinishedRequestStats, IterationStats
from engine.outputs import SchedulerStats, SpecDecodeStats


def samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    """Every sample of the /metrics text, keyed by (name, sorted labels without model_name)."""
    result = {}
    for family in text_string_to_metric_families(logger.render().decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            result[(sample.name, labels)] = sample.value
    return result


def finished(reason: str, prompt: int, generated: int) -> FinishedRequestStats:
    return FinishedRequestStats(
        reason, e2e_latency=0.5, queued_time=0.1, num_prompt_tokens=prompt, num_generation_tokens=generated
    )


def test_record_feeds_counters_and_histograms() -> None:
    logger = PrometheusStatLogger("m", max_model_len=1000)
    logger.record(
        SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=10),
        IterationStats(num_prompt_tokens=7, num_generation_tokens=2, time_to_first_tokens=[0.02, 0.03]),
    )
    logger.record(
        SchedulerStats(num_running_reqs=0, prefix_cache_queries=30, prefix_cache_hits=16, num_preemptions=1),
        IterationStats(
            num_generation_tokens=2,
            inter_token_latencies=[0.01, 0.01],
            finished_requests=[finished("length", 3, 2), finished("stop", 4, 2)],
        ),
    )
    values = samples(logger)
    assert values[("raypage:prompt_tokens_total", ())] == 7
    assert values[("raypage:generation_tokens_total", ())] == 4
    assert values[("raypage:prefix_cache_queries_total", ())] == 30  # running totals, not summed
    assert values[("raypage:prefix_cache_hits_total", ())] == 16
    assert values[("raypage:num_preemptions_total", ())] == 1
    assert values[("raypage:request_success_total", (("finished_reason", "length"),))] == 1
    assert values[("raypage:request_success_total", (("finished_reason", "stop"),))] == 1
    assert values[("raypage:time_to_first_token_seconds_count", ())] == 2
    assert values[("raypage:inter_token_latency_seconds_count", ())] == 2
    assert values[("raypage:e2e_request_latency_seconds_count", ())] == 2
    assert values[("raypage:request_queue_time_seconds_sum", ())] == pytest.approx(0.2)
    assert values[("raypage:request_prompt_tokens_sum", ())] == 7
    assert values[("raypage:num_requests_running", ())] == 0
    assert values[("raypage:kv_cache_usage_perc", ())] == 0


def test_scheduler_totals_restarting_from_zero_still_count() -> None:
    logger = PrometheusStatLogger("m", max_model_len=100)
    logger.update_scheduler_stats({"prefix_cache_queries": 50})
    logger.update_scheduler_stats({"prefix_cache_queries": 20})  # a new core counts from 0 again
    assert samples(logger)[("raypage:prefix_cache_queries_total", ())] == 70


def test_speculative_decoding_totals_feed_vllms_counters() -> None:
    logger = PrometheusStatLogger("m", max_model_len=100)
    for drafts, accepted, per_pos in ((3, 5, [3, 2]), (4, 9, [4, 3, 2])):
        stats = SpecDecodeStats(drafts, 2 * drafts, accepted, per_pos)
        logger.update_scheduler_stats(SchedulerStats(spec_decode=stats))
    # As a Ray Serve replica reports them: plain mappings.
    logger.update_scheduler_stats(
        {
            "spec_decode": {
                "num_drafts": 5,
                "num_draft_tokens": 10,
                "num_accepted_tokens": 9,
                "num_accepted_tokens_per_pos": [4, 3, 2],
            }
        }
    )
    got = samples(logger)
    assert got[("raypage:spec_decode_num_drafts_total", ())] == 5
    assert got[("raypage:spec_decode_num_draft_tokens_total", ())] == 10
    assert got[("raypage:spec_decode_num_accepted_tokens_total", ())] == 9
    per_position = [
        got[("raypage:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))]
        for p in range(3)
    ]
    assert per_position == [4, 3, 2]


def test_registries_are_private() -> None:
    first, second = PrometheusStatLogger("a", 100), PrometheusStatLogger("b", 100)
    first.record(None, IterationStats(num_prompt_tokens=5))
    assert samples(first)[("raypage:prompt_tokens_total", ())] == 5
    assert samples(second)[("raypage:prompt_tokens_total", ())] == 0


def test_token_buckets() -> None:
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(4) == [1, 2]


def test_log_line_reports_throughput_then_goes_quiet(caplog: pytest.LogCaptureFixture) -> None:
    logger = LoggingStatLogger()
    logger.record(
        SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5), IterationStats(num_generation_tokens=40)
    )
    with caplog.at_level(logging.INFO, logger="cluster.metrics"):
        logger.log()
        logger.log({"num_running_reqs": 0})  # idle now: one line to say so
        logger.log({"num_running_reqs": 0})  # still idle: nothing
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert "Running: 3 reqs" in lines[0] and "KV cache usage: 50.0%" in lines[0]
    assert "Avg generation throughput: 0.0 tokens/s" in lines[1]
