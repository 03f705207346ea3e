"""RayDistributedExecutor on a real three-node Ray cluster (one machine; nodes told apart by node id).

The head node runs the driver and no worker; each of the two worker nodes offers two `raypage_worker`
slots, which every worker bundle asks for, so a TP=2 x PP=2 engine must put one pipeline stage on each
worker node, its tensor-parallel pair together.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from engine import LLM, EngineConfig, LoRARequest, SamplingParams
from engine.config_resolve import resolve_engine_config
from engine.exceptions import EngineDeadError
from engine.executor.ray_distributed import RayDistributedExecutor
from engine.executor.ray_utils import rank_order
from engine.process.core import EngineCore
from tests.distributed.background_steps import BackgroundSteps
from tests.distributed.engine_runs import assert_idle, generate_and_shut_down
from tests.model.hf_reference import hf_greedy
from tests.model.lora_adapters import merged_reference, write_peft_adapter
from tests.model.tiny_models import write_tiny_model
from tests.model.tiny_moe import write_tiny_moe

pytestmark = pytest.mark.slow

OBJECT_STORE_BYTES = 100 * 1024 * 1024
WORKER_BUNDLE = {"CPU": 1.0, "raypage_worker": 1.0}
SETTINGS = {"dtype": "float32", "num_kv_blocks": 64, "placement_bundle": WORKER_BUNDLE}
PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
DEATH_NOTICE_S = 10.0  # how long a dead worker may take to fail the in-flight step


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
            # Notice a removed node within about three seconds.
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, resources={"raypage_worker": 2}, object_store_memory=OBJECT_STORE_BYTES)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 heads and 2 KV heads split over two TP ranks; 2 layers, one per pipeline stage.
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> list[list[int]]:
    """Greedy tokens of the single-process engine."""
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=64, distributed_executor_backend="uni")
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _config(model: Path, **settings: object) -> EngineConfig:
    return resolve_engine_config(EngineConfig.from_flat(model=str(model), **{**SETTINGS, **settings}))


def _worker_nodes() -> list[str]:
    return [
        node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("raypage_worker")
    ]


def _placement_groups() -> set[str]:
    """Ids of the cluster's placement groups that are not removed."""
    return {
        group_id
        for group_id, group in ray.util.placement_group_table().items()
        if group["state"] != "REMOVED"
    }


def _wait_gone(pids: list[int], timeout_s: float = DEATH_NOTICE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(psutil.pid_exists(pid) for pid in pids)


def test_ranks_keep_tensor_parallel_groups_on_one_node():
    # Bundles as a PACK placement might return them: interleaved over two nodes.
    assert rank_order(["b", "a", "b", "a"], driver_node="a", tp_size=2) == [1, 3, 0, 2]
    assert rank_order(["b", "c", "b", "c"], driver_node="a", tp_size=2) == [0, 2, 1, 3]


def test_tp2_pp2_across_nodes_matches_the_single_process_engine(cluster, tiny_model, expected):
    groups_before = _placement_groups()
    llm = LLM(
        str(tiny_model),
        multiprocess_mode=False,  # the core in this process, so that the test sees its executor
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        **SETTINGS,
    )
    executor = llm.llm_engine.engine_core.engine_core.executor
    assert isinstance(executor, RayDistributedExecutor)
    try:
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == expected
        nodes = executor.worker_nodes
        assert set(nodes) == set(_worker_nodes())
        # Ranks 0-1 are stage 0, ranks 2-3 stage 1: each stage on one node, the stages on two.
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
        pids = [info["pid"] for info in llm.collective_rpc("process_info")]
        assert len(set(pids)) == 4 and os.getpid() not in pids
    finally:
        llm.llm_engine.shutdown()
    assert _wait_gone(pids), "shutdown left worker actors running"
    assert _placement_groups() == groups_before


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_async_scheduling_matches_the_single_process_engine(
    cluster, tiny_model, expected, tp: int, pp: int, monkeypatch: pytest.MonkeyPatch
):
    """With one stage the next step is planned while the actors run the current one, its decodes on
    the tokens both ranks sampled; with two the flag is accepted and the stages' own batch queue
    overlaps them, without placeholders."""
    llm = LLM(
        str(tiny_model),
        multiprocess_mode=False,  # the core in this process, so that the test sees its steps
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="ray",
        async_scheduling=True,
        **SETTINGS,
    )
    core = llm.llm_engine.engine_core.engine_core
    assert isinstance(core.executor, RayDistributedExecutor)
    assert core.scheduler.async_scheduling == (pp == 1)
    in_flight: list[int] = []  # steps in flight each time one is scheduled
    schedule = core.scheduler.schedule

    def recording():
        in_flight.append(len(core.batch_queue))
        return schedule()

    monkeypatch.setattr(core.scheduler, "schedule", recording)
    got, stats = generate_and_shut_down(llm, PROMPTS, GREEDY)
    assert got == expected
    if pp == 1:
        assert in_flight.count(1) >= GREEDY.max_tokens - 1, in_flight
    assert_idle(stats)


def test_lora_adapters_on_ray_workers_equal_the_merged_reference(cluster, tiny_model, tmp_path):
    """TP = 2 x PP = 2 actors each hold their shard of an adapter, loaded into the slot the
    scheduler chose: the tokens are transformers' with the adapter merged by hand."""
    adapter = write_peft_adapter(tmp_path / "adapter", tiny_model, rank=8, seed=3)
    prompt = [1, 5, 9, 200, 31, 7]
    expected = hf_greedy(merged_reference(tiny_model, adapter), prompt, GREEDY.max_tokens)
    llm = LLM(
        str(tiny_model),
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        enable_lora=True,
        max_lora_rank=8,
        **SETTINGS,
    )
    try:
        output = llm.generate(
            {"prompt_token_ids": prompt},
            GREEDY,
            use_tqdm=False,
            lora_request=LoRARequest("adapter", 1, str(adapter)),
        )
    finally:
        llm.llm_engine.shutdown()
    assert list(output[0].outputs[0].token_ids) == expected


def test_mixtral_expert_parallel_matches_the_single_process_engine(cluster, tmp_path):
    # Two whole experts of four on each of the TP pair's workers.
    model = write_tiny_moe(tmp_path / "mixtral", family="mixtral")
    single = LLM(str(model), dtype="float32", num_kv_blocks=64, distributed_executor_backend="uni")
    expected = [out.outputs[0].token_ids for out in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(
        str(model),
        multiprocess_mode=False,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        distributed_executor_backend="ray",
        **SETTINGS,
    )
    try:
        assert isinstance(llm.llm_engine.engine_core.engine_core.executor, RayDistributedExecutor)
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == expected
    finally:
        llm.llm_engine.shutdown()


def test_killed_worker_actor_fails_in_flight_requests(cluster, tiny_model, expected):
    # The engine core in its own process, a Ray driver of its own that joins this cluster.
    llm = LLM(str(tiny_model), tensor_parallel_size=2, distributed_executor_backend="ray", **SETTINGS)
    try:
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == expected
        pids = [info["pid"] for info in llm.collective_rpc("process_info")]
        long_run = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
        errors: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate(PROMPTS, long_run, use_tqdm=False)
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive(), "generation ended before the fault"
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        thread.join(DEATH_NOTICE_S)
        assert not thread.is_alive(), "the in-flight requests did not fail"
        assert time.monotonic() - killed_at < DEATH_NOTICE_S
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
        assert "Ray worker rank 1" in str(errors[0]) and "died" in str(errors[0])
        # The surviving worker, blocked in an all-reduce with the dead one, is stopped too.
        assert _wait_gone(pids)
    finally:
        llm.llm_engine.shutdown()


def test_removed_node_fails_the_in_flight_step(cluster, tiny_model):
    core = EngineCore(
        _config(tiny_model, pipeline_parallel_size=2, placement_strategy="SPREAD"), RayDistributedExecutor
    )
    executor = core.executor
    assert len(set(executor.worker_nodes)) == 2
    steps = BackgroundSteps(core)
    thread, errors = steps.thread, steps.errors
    try:
        assert steps.stepping.wait(60), "generation did not start"
        doomed = next(node for node in cluster.worker_nodes if node.node_id == executor.worker_nodes[1])
        removed_at = time.monotonic()
        cluster.remove_node(doomed, allow_graceful=False)
        thread.join(DEATH_NOTICE_S)
        assert not thread.is_alive(), "the in-flight step did not notice the removed node"
        assert time.monotonic() - removed_at < DEATH_NOTICE_S
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
        # Rank 1 died with its node; rank 0 may have noticed first, its all-reduce cut off.
        assert re.search(
            r"Ray worker rank [01] \(node \w+ at [\d.]+\) (died|failed in a step)", str(errors[0])
        )
        with pytest.raises(EngineDeadError, match="Ray worker rank"):
            executor.check_health()
    finally:
        core.shutdown()
        # Give the cluster its second worker node back.
        cluster.add_node(num_cpus=2, resources={"raypage_worker": 2}, object_store_memory=OBJECT_STORE_BYTES)
    core.shutdown()  # harmless the second time


def test_placement_timeout_names_the_missing_resources(cluster, tiny_model):
    groups_before = _placement_groups()
    config = _config(tiny_model, tensor_parallel_size=2, placement_bundle={"GPU": 1}, placement_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"GPU needs 2, 0 of 0 available") as error:
        RayDistributedExecutor(config)
    assert time.monotonic() - started < 30
    assert "placement_timeout_s=2" in str(error.value)
    assert _placement_groups() == groups_before
