"""AsyncLLMEngine: streaming, aborts and cancellation, validation, stats, a dying core.

Each test drives the engine with its own `asyncio.run` (the engine follows the running loop) and
bounds every wait, so that a broken engine fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from engine import EngineConfig, RequestOutputKind, SamplingParams
from engine.exceptions import EngineDeadError
from engine.frontend.async_llm_engine import AsyncLLMEngine
from engine.frontend.stats import IterationStats
from engine.outputs import SchedulerStats

from .helpers import process_exists

PROMPT = "Once upon a time"
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
TIMEOUT_S = 60  # generous for a loaded CI machine; a hang still ends


class RecordingLogger:
    """A stat logger that keeps everything it is given."""

    def __init__(self) -> None:
        self.records: list[tuple[object, IterationStats]] = []

    def record(self, scheduler_stats, iteration_stats: IterationStats) -> None:
        self.records.append((scheduler_stats, iteration_stats))


@pytest.fixture(scope="module")
def stat_logger():
    return RecordingLogger()


@pytest.fixture(scope="module")
def engine(stat_logger, engine_settings):
    engine = AsyncLLMEngine.from_config(EngineConfig.from_flat(**engine_settings), stat_loggers=[stat_logger])
    yield engine
    engine.shutdown()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


async def collect(engine, prompt, params, request_id):
    return [output async for output in engine.generate(prompt, params, request_id)]


async def wait_for_idle(engine, timeout_s: float = 10.0) -> dict:
    """The stats once nothing runs or waits and no block is held (they arrive with the core's next
    message, which follows every abort)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.get_stats()
        if stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0.0:
            return stats
        assert time.monotonic() < deadline, f"the core still holds work: {stats}"
        await asyncio.sleep(0.02)


def test_deltas_add_up_to_the_cumulative_output(engine):
    def params(kind):
        return SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, output_kind=kind)

    async def main():
        return await asyncio.gather(
            collect(engine, PROMPT, params(RequestOutputKind.DELTA), "delta"),
            collect(engine, PROMPT, params(RequestOutputKind.CUMULATIVE), "cumulative"),
            collect(engine, PROMPT, params(RequestOutputKind.FINAL_ONLY), "final"),
        )

    deltas, cumulative, final = run(main())
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    assert len(deltas) == len(cumulative) > 1
    assert len(final) == 1 and final[0].finished
    last = cumulative[-1].outputs[0]
    assert "".join(o.outputs[0].text for o in deltas) == last.text == final[0].outputs[0].text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == last.token_ids
    # Two requests, so their steps may batch differently: their logprobs agree to float rounding.
    delta_logprobs = [p for o in deltas for p in o.outputs[0].logprobs]
    assert [p.keys() for p in delta_logprobs] == [p.keys() for p in last.logprobs]
    assert [v.logprob for p in delta_logprobs for v in p.values()] == pytest.approx(
        [v.logprob for p in last.logprobs for v in p.values()], abs=1e-4
    )
    # Every cumulative output extends the one before.
    for before, after in itertools.pairwise(cumulative):
        assert after.outputs[0].text.startswith(before.outputs[0].text)
    assert deltas[-1].outputs[0].finish_reason == last.finish_reason == "length"


def test_parallel_sequences_interleave_as_deltas(engine):
    def params(kind):
        return SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, output_kind=kind)

    async def main():
        # One after the other: in one batch the two requests' rows could sit at different places of
        # a matmul, whose last bits (and so a seeded draw near a boundary) may depend on the place.
        deltas = await collect(engine, PROMPT, params(RequestOutputKind.DELTA), "n2-delta")
        return deltas, await collect(engine, PROMPT, params(RequestOutputKind.CUMULATIVE), "n2-cumulative")

    deltas, cumulative = run(main())
    texts = {0: "", 1: ""}
    for output in deltas:
        for completion in output.outputs:
            texts[completion.index] += completion.text
    assert {0, 1} <= {c.index for o in deltas[:-1] for c in o.outputs}
    assert [texts[0], texts[1]] == [c.text for c in cumulative[-1].outputs]
    assert texts[0] != texts[1]


def test_stop_strings_finish_the_sequence_in_the_core(engine):
    async def main():
        greedy = SamplingParams(temperature=0.0, max_tokens=10, output_kind=RequestOutputKind.DELTA)
        full = "".join([o.outputs[0].text for o in await collect(engine, PROMPT, greedy, "unstopped")])
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        stopped = msgspec.structs.replace(greedy, stop=[stop])
        outputs = await collect(engine, PROMPT, stopped, "stopped")
        return full, stop, outputs, await wait_for_idle(engine)

    full, stop, outputs, stats = run(main())
    assert "".join(o.outputs[0].text for o in outputs) == full[: full.index(stop)]
    assert outputs[-1].outputs[0].stop_reason == stop and stats["kv_cache_usage"] == 0.0


def test_validation_errors_raise_before_anything_is_queued(engine):
    async def first(prompt, params, request_id):
        return await engine.generate(prompt, params, request_id).__anext__()

    too_long = {"prompt_token_ids": [1] * (engine.config.model.max_model_len + 1)}
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        run(first(too_long, SamplingParams(), "too-long"))
    with pytest.raises(ValueError, match="prompt must not be empty"):
        run(first({"prompt_token_ids": []}, SamplingParams(), "empty"))
    with pytest.raises(ValueError, match="max_logprobs"):
        run(first(PROMPT, SamplingParams(logprobs=100), "many-logprobs"))
    assert not engine.output_processor.requests and not engine._queues
    assert engine.get_stats()["num_waiting_reqs"] == 0


def test_abort_ends_the_stream_and_frees_every_block(engine):
    async def main():
        stream = engine.generate(PROMPT, LONG, "to-abort")
        first = await stream.__anext__()
        assert not first.finished
        await engine.abort("to-abort")
        rest = [output async for output in stream]
        await engine.abort("to-abort")  # finished now: a no-op
        await engine.abort("never-seen")
        # A utility call is answered after every message sent before it: the abort is applied.
        fresh = await engine.engine_core.call_utility_async("get_stats", result_type=SchedulerStats)
        return rest, fresh, await wait_for_idle(engine)

    rest, fresh, stats = run(main())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert fresh.kv_cache_usage == 0.0 and fresh.num_running_reqs == 0
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running_reqs"] == 0


def test_cancelling_or_closing_the_consumer_aborts_the_request(engine):
    async def main():
        started = asyncio.Event()

        async def consume(request_id):
            async for _ in engine.generate(PROMPT, LONG, request_id):
                started.set()

        task = asyncio.create_task(consume("cancelled"))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = engine.generate(PROMPT, LONG, "closed")
        await stream.__anext__()
        await stream.aclose()
        assert not engine.output_processor.requests
        return await wait_for_idle(engine)

    stats = run(main())
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running_reqs"] == 0


def test_stat_loggers_count_tokens_of_known_requests(engine, stat_logger):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = {"five": list(range(100, 105)), "seven": list(range(200, 207))}

    async def main():
        await asyncio.gather(
            *(collect(engine, {"prompt_token_ids": ids}, params, rid) for rid, ids in prompts.items())
        )

    stat_logger.records.clear()
    run(main())
    batches = [stats for _, stats in stat_logger.records]
    assert sum(b.num_prompt_tokens for b in batches) == 5 + 7
    assert sum(b.num_generation_tokens for b in batches) == 2 * 4
    assert len([t for b in batches for t in b.time_to_first_tokens]) == 2
    # One gap per token after each sequence's first.
    assert len([t for b in batches for t in b.inter_token_latencies]) == 2 * 3
    finished = sorted((r for b in batches for r in b.finished_requests), key=lambda r: r.num_prompt_tokens)
    assert [(r.num_prompt_tokens, r.num_generation_tokens, r.finish_reason) for r in finished] == [
        (5, 4, "length"),
        (7, 4, "length"),
    ]
    for request in finished:
        assert 0.0 <= request.queued_time <= request.e2e_latency
    assert all(scheduler_stats is not None for scheduler_stats, _ in stat_logger.records)


def test_killed_core_fails_pending_and_new_requests(engine_settings):
    engine = AsyncLLMEngine.from_config(EngineConfig.from_flat(**engine_settings))
    pid = engine.engine_core.core_pid
    socket_dir = engine.engine_core.socket_dir

    async def main():
        started = asyncio.Event()

        async def consume(request_id):
            async for _ in engine.generate(PROMPT, LONG, request_id):
                started.set()

        pending = [asyncio.create_task(consume(f"pending-{i}")) for i in range(2)]
        await started.wait()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)
        elapsed = time.monotonic() - start
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "died (killed by SIGKILL)" in str(results[0])
        assert elapsed < 5
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.generate(PROMPT, LONG, "new").__anext__()

    try:
        run(main())
    finally:
        engine.shutdown()
    assert not process_exists(pid) and not Path(socket_dir).exists()


def test_shutdown_leaves_no_process(engine):
    # The module's engine: healthy so far, and gone after shutdown (checked at teardown too).
    run(engine.check_health())
    assert not engine.errored
