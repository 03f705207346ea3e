"""MultiprocExecutor: worker subprocesses match the in-process worker, answer collective calls in
rank order, report a worker's exception with its rank, and turn a dead worker into EngineDeadError."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import psutil
import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.config_resolve import resolve_engine_config
from engine.exceptions import EngineDeadError
from engine.executor.base import Executor
from engine.executor.multiproc import MultiprocExecutor
from engine.executor.ray_distributed import RayDistributedExecutor
from engine.executor.uniproc import UniProcExecutor
from engine.process.core import EngineCore
from tests.distributed.background_steps import BackgroundSteps
from tests.distributed.engine_runs import assert_idle, generate_and_shut_down
from tests.engine_proc.helpers import process_exists
from tests.model.tiny_models import write_tiny_model

SETTINGS = {"dtype": "float32", "num_kv_blocks": 64}
PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
DEATH_NOTICE_S = 10.0  # how long a killed worker may take to fail the in-flight step


def _config(model: Path | None = None, **settings: object) -> EngineConfig:
    return resolve_engine_config(
        EngineConfig.from_flat(model=None if model is None else str(model), **SETTINGS, **settings)
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 heads, 2 KV heads: splits evenly over two tensor-parallel ranks.
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tp2_executor(tiny_model: Path):
    executor = MultiprocExecutor(_config(tiny_model, tensor_parallel_size=2))
    executor.initialize_kv_cache()
    yield executor
    executor.shutdown()


def test_backend_choice():
    assert Executor.get_class(EngineConfig.from_flat()) is UniProcExecutor
    assert Executor.get_class(EngineConfig.from_flat(distributed_executor_backend="mp")) is MultiprocExecutor
    assert Executor.get_class(EngineConfig.from_flat(tensor_parallel_size=2)) is MultiprocExecutor
    ray_config = EngineConfig.from_flat(distributed_executor_backend="ray")
    assert Executor.get_class(ray_config) is RayDistributedExecutor


@pytest.fixture(scope="module")
def uni_greedy(tiny_model: Path) -> list[list[int]]:
    """Greedy tokens of the in-process worker, without speculation."""
    uni = LLM(str(tiny_model), **SETTINGS, distributed_executor_backend="uni")
    try:
        return [out.outputs[0].token_ids for out in uni.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        uni.llm_engine.shutdown()


def test_mp_greedy_outputs_equal_uni(tiny_model: Path, uni_greedy: list[list[int]]):
    # The tiny model: what is compared is the executor's plumbing, not the weights (SmolLM2's GGUF
    # is loaded by worker processes in test_parallel_model.py); it has no EOS, so every output is
    # full length.
    mp = LLM(str(tiny_model), **SETTINGS, distributed_executor_backend="mp")
    try:
        got = [out.outputs[0].token_ids for out in mp.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        mp.llm_engine.shutdown()
    assert got == uni_greedy
    assert all(len(ids) == GREEDY.max_tokens for ids in got)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_draft_model_beside_a_parallel_target_keeps_its_greedy_outputs(
    tiny_model: Path, uni_greedy: list[list[int]], tp: int, pp: int
):
    # The whole draft runs on the sampling rank beside that rank's share of the target; drafting
    # the target with itself, nearly every draft is accepted, so multi-token rows cross every rank.
    spec = {"model": str(tiny_model), "num_speculative_tokens": 3}
    mp = LLM(
        str(tiny_model),
        **SETTINGS,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        speculative_config=spec,
    )
    try:
        got = [out.outputs[0].token_ids for out in mp.generate(PROMPTS, GREEDY, use_tqdm=False)]
        stats = mp.get_stats()["spec_decode"]
    finally:
        mp.llm_engine.shutdown()
    assert got == uni_greedy
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens > 0


def _core(llm: LLM) -> EngineCore:
    """The engine core of an LLM built with multiprocess_mode=False."""
    return llm.llm_engine.engine_core.engine_core


def _record_steps_in_flight(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many steps were in flight each time the core scheduled one, from now on."""
    in_flight: list[int] = []
    schedule = core.scheduler.schedule

    def recording():
        in_flight.append(len(core.batch_queue))
        return schedule()

    monkeypatch.setattr(core.scheduler, "schedule", recording)
    return in_flight


def test_async_scheduling_on_tensor_parallel_workers_keeps_greedy_outputs(
    tiny_model: Path, uni_greedy: list[list[int]], monkeypatch: pytest.MonkeyPatch
):
    """Every step after the first is planned while the previous one runs: its decodes compute the
    tokens that both ranks sampled, which the scheduler learns only afterwards. Unseeded sampling
    too: both ranks draw from generators seeded alike, and the batches are those of a synchronous
    engine (no EOS, no stop one step late), so the draws are a synchronous tensor-parallel
    engine's. (Not the in-process worker's: the ranks' partial sums round otherwise than one sum,
    and at temperature 1 the tiny model's flat distribution lets that flip a draw.)"""
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    synchronous = LLM(str(tiny_model), **SETTINGS, multiprocess_mode=False, tensor_parallel_size=2)
    try:
        synchronous.generate(PROMPTS, GREEDY, use_tqdm=False)  # the same draws before as below
        expected = [
            out.outputs[0].token_ids for out in synchronous.generate(PROMPTS, unseeded, use_tqdm=False)
        ]
    finally:
        synchronous.llm_engine.shutdown()
    llm = LLM(
        str(tiny_model),
        **SETTINGS,
        multiprocess_mode=False,  # the core in this process, so that the test sees its steps
        tensor_parallel_size=2,
        async_scheduling=True,
    )
    core = _core(llm)
    assert isinstance(core.executor, MultiprocExecutor) and core.scheduler.async_scheduling
    in_flight = _record_steps_in_flight(core, monkeypatch)
    try:
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        ahead = in_flight.count(1)
        sampled = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, unseeded, use_tqdm=False)]
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert got == uni_greedy
    assert max(in_flight) == 1 and ahead >= GREEDY.max_tokens - 1, in_flight
    assert sampled == expected
    assert_idle(stats)


def test_async_scheduling_between_pipeline_stages_keeps_greedy_outputs(
    tiny_model: Path, uni_greedy: list[list[int]]
):
    # Pipeline stages overlap through their own batch queue: the flag is accepted, with no
    # placeholders (the first stage never sees the last stage's samples). The core in its own
    # process, as an mp engine runs by default.
    llm = LLM(str(tiny_model), **SETTINGS, pipeline_parallel_size=2, async_scheduling=True)
    assert llm.llm_engine.config.scheduler.async_scheduling
    got, stats = generate_and_shut_down(llm, PROMPTS, GREEDY)
    assert got == uni_greedy
    assert_idle(stats)


def test_async_scheduling_under_preemption_keeps_greedy_and_seeded_outputs(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
):
    """Ten blocks of 16 tokens hold too little: the single sequences are preempted by recompute, the
    group of three by swapping, while their newest tokens are still placeholders in a step in flight;
    the tokens are those of a roomy synchronous engine."""
    long_greedy = SamplingParams(temperature=0.0, max_tokens=40)
    seeded = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=7, max_tokens=40)
    params = [long_greedy, seeded, long_greedy]
    roomy = LLM(str(tiny_model), **SETTINGS, distributed_executor_backend="uni")
    try:
        expected = [
            [c.token_ids for c in out.outputs] for out in roomy.generate(PROMPTS, params, use_tqdm=False)
        ]
    finally:
        roomy.llm_engine.shutdown()
    assert len({tuple(ids) for ids in expected[1]}) == 3  # three different samples

    tight = LLM(
        str(tiny_model),
        **{**SETTINGS, "num_kv_blocks": 10},
        swap_space=0.01,
        multiprocess_mode=False,
        tensor_parallel_size=2,
        async_scheduling=True,
    )
    scheduler = _core(tight).scheduler
    preempted: list[tuple[str, list[int]]] = []  # (how, each sequence's placeholders) per preemption
    preempt = scheduler._preempt

    def recording(request, plan):
        pending = [seq.num_pending_tokens for seq in request.live_seqs]
        preempt(request, plan)
        preempted.append((request.status.name, pending))

    monkeypatch.setattr(scheduler, "_preempt", recording)
    try:
        got = [[c.token_ids for c in out.outputs] for out in tight.generate(PROMPTS, params, use_tqdm=False)]
        stats = tight.get_stats()
        kv = scheduler.kv_cache_manager
        cpu_blocks_free = (kv.cpu_pool.num_free_blocks, kv.cpu_pool.num_blocks)
    finally:
        tight.llm_engine.shutdown()
    assert got == expected
    for how in ("PREEMPTED", "SWAPPED"):  # by recompute, by swapping; with a token in flight
        assert any(kind == how and any(pending) for kind, pending in preempted), preempted
    assert stats["num_preemptions"] == len(preempted)
    assert_idle(stats)
    assert cpu_blocks_free[0] == cpu_blocks_free[1]


def test_collective_rpc_gathers_results_in_rank_order(tp2_executor: MultiprocExecutor):
    infos = tp2_executor.collective_rpc("process_info")
    assert [info["rank"] for info in infos] == [0, 1]
    assert [info["pid"] for info in infos] == tp2_executor.worker_pids
    assert os.getpid() not in tp2_executor.worker_pids
    # The host's cores are split between the two workers.
    assert infos[0]["num_threads"] == infos[1]["num_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    # Each tensor-parallel rank holds one of the model's two KV heads: (K/V, heads, blocks, ...).
    shapes = tp2_executor.collective_rpc("kv_cache_shapes")
    assert len(shapes) == 2
    assert all(shape[1] == 1 for rank_shapes in shapes for shape in rank_shapes.values())


def test_workers_listen_on_loopback_only(tp2_executor: MultiprocExecutor):
    """The rendezvous is a file in a private directory (torch's TCPStore would listen on every
    interface), and gloo's connections between the ranks are on loopback."""
    assert stat.S_IMODE(os.stat(tp2_executor._workers.rendezvous_dir).st_mode) == 0o700
    listening = [
        conn.laddr.ip
        for pid in tp2_executor.worker_pids
        for conn in psutil.Process(pid).net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening


def test_worker_exception_names_rank_and_method(tp2_executor: MultiprocExecutor):
    with pytest.raises(RuntimeError, match="worker rank 0 failed in no_such_method") as error:
        tp2_executor.collective_rpc("no_such_method", (1,), {"key": 2})
    assert "AttributeError" in str(error.value)  # the worker's traceback text comes along
    assert not isinstance(error.value, EngineDeadError)
    # Rank 1's unread answer to the failed call is skipped: the next call gets its own answers.
    assert [info["rank"] for info in tp2_executor.collective_rpc("process_info")] == [0, 1]
    tp2_executor.check_health()


def test_killed_worker_fails_the_in_flight_step(tiny_model: Path):
    core = EngineCore(_config(tiny_model, tensor_parallel_size=2), MultiprocExecutor)
    executor = core.executor
    pids = executor.worker_pids
    steps = BackgroundSteps(core)
    thread, errors = steps.thread, steps.errors
    try:
        assert steps.stepping.wait(60), "generation did not start"
        # Rank 0 is then left waiting in an all-reduce for rank 1, which never comes.
        os.kill(pids[1], signal.SIGKILL)
        thread.join(DEATH_NOTICE_S)
        assert not thread.is_alive(), "the in-flight step did not notice the dead worker"
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
        assert f"worker rank 1 (pid {pids[1]}) died (killed by SIGKILL)" in str(errors[0])
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            executor.check_health()
        with pytest.raises(EngineDeadError):
            executor.collective_rpc("process_info")
        # The monitor stops the surviving worker without waiting for shutdown.
        deadline = time.monotonic() + DEATH_NOTICE_S
        while process_exists(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_exists(pids[0])
    finally:
        core.shutdown()
    core.shutdown()  # harmless the second time
    assert all(not process_exists(pid) for pid in pids)


def test_shutdown_stops_every_worker_and_is_idempotent(tiny_model: Path):
    executor = MultiprocExecutor(_config(tiny_model))
    pid = executor.worker_pids[0]
    assert process_exists(pid)
    executor.shutdown()
    assert not process_exists(pid)
    executor.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        executor.collective_rpc("process_info")
