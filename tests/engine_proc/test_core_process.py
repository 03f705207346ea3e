"""EngineCore in its own process: the sync ZeroMQ client against the in-process core."""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.config_resolve import resolve_engine_config
from engine.exceptions import EngineDeadError, EngineStartupError
from engine.outputs import EngineCoreRequest
from engine.process.core_client import SyncMPClient

from .helpers import PROMPTS, SETTINGS, process_exists, process_is_running, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def proc_llm(engine_settings):
    llm = LLM(multiprocess_mode=True, **engine_settings)
    yield llm
    llm.llm_engine.shutdown()


def core_client(llm: LLM) -> SyncMPClient:
    return llm.llm_engine.engine_core


def texts(outputs) -> list[list[str]]:
    return [[c.text for c in output.outputs] for output in outputs]


def test_greedy_outputs_equal_the_in_process_core():
    # SmolLM2 here, not the tiny model: the two cores' logits differ in their last bits (their thread
    # counts differ), which can move a seeded draw over one of the tiny model's many near-equal
    # probabilities; SmolLM2's peaked distributions keep the draws apart.
    proc_llm = LLM(multiprocess_mode=True, **SETTINGS)
    try:
        assert isinstance(proc_llm.llm_engine.engine_core, SyncMPClient)
        inproc = LLM(**SETTINGS)  # the default for the uni executor: the core in this process
        seeded = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, logprobs=2)
        for params in (GREEDY, seeded):
            expected = inproc.generate(PROMPTS, params, use_tqdm=False)
            got = proc_llm.generate(PROMPTS, params, use_tqdm=False)
            assert texts(got) == texts(expected)
            assert [[c.token_ids for c in o.outputs] for o in got] == [
                [c.token_ids for c in o.outputs] for o in expected
            ]
        # Same tokens and ranks; the values may differ in the last float32 bits (thread counts differ).
        for got_position, expected_position in zip(
            got[0].outputs[0].logprobs, expected[0].outputs[0].logprobs, strict=True
        ):
            assert got_position.keys() == expected_position.keys()
            for token, logprob in got_position.items():
                assert logprob.rank == expected_position[token].rank
                assert logprob.logprob == pytest.approx(expected_position[token].logprob, abs=1e-4)
        assert proc_llm.get_stats()["num_kv_blocks"] == SETTINGS["num_kv_blocks"]
    finally:
        proc_llm.llm_engine.shutdown()


def test_only_listed_methods_can_be_called_in_the_core(proc_llm):
    client = proc_llm.llm_engine.engine_core
    with pytest.raises(RuntimeError, match="'shutdown' is not a utility method"):
        client.call_utility("shutdown")
    client.call_utility("check_health")
    assert not client.errored


def test_stop_strings_reach_the_core(proc_llm):
    full = proc_llm.generate("Count: 1, 2, 3,", GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
    cut = proc_llm.generate("Count: 1, 2, 3,", params, use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[: full.index(stop)]
    # get_stats answers after every message sent before it: the core has finished the sequence.
    stats = proc_llm.get_stats()
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running_reqs"] == 0


def test_abort_frees_blocks_in_the_core(proc_llm):
    engine = proc_llm.llm_engine
    engine.add_request("long", "Once upon a time", LONG)
    while not engine.step():
        pass
    assert proc_llm.get_stats()["kv_cache_usage"] > 0
    engine.abort_request("long")
    stats = proc_llm.get_stats()
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running_reqs"] == 0
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_engines_side_by_side(proc_llm, engine_settings):
    other = LLM(multiprocess_mode=True, **engine_settings)
    try:
        first, second = core_client(proc_llm), core_client(other)
        assert first.core_pid != second.core_pid and first.socket_dir != second.socket_dir
        # Requests in flight in both at once, stepped alternately.
        engines = [proc_llm.llm_engine, other.llm_engine]
        for engine in engines:
            engine.add_request("same-id", PROMPTS[0], GREEDY)
        results = {}
        while any(engine.has_unfinished_requests() for engine in engines):
            for index, engine in enumerate(engines):
                for output in engine.step():
                    if output.finished:
                        results[index] = output.outputs[0].text
        assert results[0] == results[1] != ""
    finally:
        other.llm_engine.shutdown()


def test_shutdown_leaves_no_process_or_socket_directory(engine_settings):
    llm = LLM(multiprocess_mode=True, **engine_settings)
    client = core_client(llm)
    pid, socket_dir = client.core_pid, client.socket_dir
    assert process_exists(pid) and Path(socket_dir).is_dir()
    llm.llm_engine.shutdown()
    assert not process_exists(pid) and not Path(socket_dir).exists()
    llm.llm_engine.shutdown()  # twice is fine


def test_a_collected_engine_stops_its_core(engine_settings):
    llm = LLM(multiprocess_mode=True, **engine_settings)
    pid = core_client(llm).core_pid
    del llm
    gc.collect()
    assert wait_until(lambda: not process_exists(pid), timeout_s=10)


def test_killed_core_fails_the_waiting_step_within_seconds(engine_settings):
    llm = LLM(multiprocess_mode=True, **engine_settings)
    engine = llm.llm_engine
    try:
        engine.add_request("doomed", PROMPTS[0], LONG)
        engine.step()
        os.kill(core_client(llm).core_pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"EngineCore process \d+ died \(killed by SIGKILL\)"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 5
        with pytest.raises(EngineDeadError):
            engine.add_request("after", PROMPTS[0], GREEDY)
    finally:
        engine.shutdown()


def test_an_error_in_the_step_loop_reaches_the_client_and_ends_the_process(engine_settings):
    config = resolve_engine_config(EngineConfig.from_flat(**engine_settings))
    client = SyncMPClient(config)
    try:
        request = EngineCoreRequest("twice", [1, 2, 3], GREEDY, eos_token_id=None, arrival_time=time.time())
        client.add_request(request)
        client.add_request(request)  # the scheduler refuses a live id: a bug the core cannot survive
        with pytest.raises(
            EngineDeadError, match=r"EngineCore encountered an error: .*'twice' is already in use"
        ):
            while True:
                client.get_output()
        assert wait_until(lambda: not process_is_running(client.core_pid), timeout_s=10)
        with pytest.raises(EngineDeadError, match="already in use"):
            client.get_stats()
    finally:
        client.shutdown()


def test_startup_failure_carries_the_cores_message(engine_settings):
    # Passes the front end's checks; fails where the KV cache is sized, in the core process (after
    # a profiling pass kept small by the batch limits).
    with pytest.raises(
        EngineStartupError, match=r"EngineCore failed to start: .*no memory left for the KV cache"
    ):
        LLM(
            engine_settings["model"],
            multiprocess_mode=True,
            dtype="float32",
            device="cpu",
            kv_cache_memory=1,
            max_num_batched_tokens=16,
            max_num_seqs=16,
        )
