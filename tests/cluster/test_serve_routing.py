"""KV-cache-aware routing between two LLMServer replicas behind the separate ingress, on this
module's local Ray cluster: a workload of many shared prefixes, interleaved, whose prefixes fill more
than one replica's KV cache but less than both, where `kv_aware` must reach at least 1.5x the
prefix-cache hit rate of Serve's `pow2` (measured by the server's own usage.prompt_tokens_details),
and so must `prefix_text`, run beside them. Plus, without a cluster, the routing rule itself and the
routers' keys, salted with a request's cache_salt as the replicas salt their block hashes."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from ray import serve
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from cluster.bench.serve import make_prefix_group_prompts
from cluster.serve.routing import (
    KVAwareRouter,
    PrefixAffinityRouter,
    PrefixTextRouter,
    choose_by_prefix,
    prefix_hits,
)
from cluster.serve_app import build_app
from engine.sampling_params import SamplingParams
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request
from tests.cluster.local_ray_cluster import serve_url_fixture
from tests.model.tiny_models import write_tiny_model

APP = "raypage"
BLOCK_SIZE = 16
# 64 blocks per replica; each request holds its prefix's 6 blocks and one more (suffix and output).
ENGINE = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64, "block_size": BLOCK_SIZE}
GROUPS, REQUESTS_PER_GROUP = 14, 8
# One output token: the hit rate counts prompt tokens only, and decode steps would only add time.
PREFIX_TOKENS, SUFFIX_TOKENS, MAX_TOKENS = 6 * BLOCK_SIZE, 8, 1
# One round of the 14 groups needs 14 x 7 = 98 blocks: more than one replica's 64, less than both's
# 128. Split by group (7 each: 49 blocks), every replica keeps its groups' prefixes until they come
# back; spread at random, a prefix comes back to a replica that has seen the other 13 since.


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "model")


POLICIES = ("kv_aware", "pow2", "prefix_text")
# Each policy's two-replica app (2 x 1 CPU and its ingress's 0.5), all three at once.
base_url = serve_url_fixture(num_cpus=8)


def policy_app(model: Path, policy: str) -> serve.RunTarget:
    """A two-replica app routing by `policy`, at /<policy>."""
    args = {
        "model": str(model),
        **ENGINE,
        "served_model_name": "m",
        "num_replicas": 2,
        "routing_policy": policy,
        "ingress_cpus": 0.5,
        "enable_prompt_tokens_details": True,
        "log_stats_interval": 0,
    }
    return serve.RunTarget(build_app(args), name=f"{APP}-{policy}", route_prefix=f"/{policy}")


def hit_rate(url: str) -> float:
    """The share of prompt tokens the replicas' prefix caches held, on the app at `url`, fresh."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt_tokens = cached_tokens = 0
    # `raypage bench serve --dataset prefix-groups`'s prompts: GROUPS prefixes, round robin.
    workload = make_prefix_group_prompts(GROUPS * REQUESTS_PER_GROUP, GROUPS, PREFIX_TOKENS, SUFFIX_TOKENS, 0)
    for prompt in workload:
        usage = client.completions.create(
            model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        ).usage
        prompt_tokens += usage.prompt_tokens
        cached_tokens += usage.prompt_tokens_details.cached_tokens
    return cached_tokens / prompt_tokens


def wait_until_deleted(names: list[str], timeout_s: float = 60.0) -> None:
    """Until Serve lists none of the apps `names`; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while left := set(names) & set(serve.status().applications):
        assert time.monotonic() < deadline, f"apps not deleted after {timeout_s} s: {sorted(left)}"
        time.sleep(0.2)


@pytest.mark.slow
def test_kv_aware_routing_hits_the_prefix_cache_more_than_pow2(base_url: str, model: Path) -> None:
    # Started together, the apps' replicas overlap their start-ups (most of this test's time); each
    # app's workload still runs alone, one after the other, on caches no other request has touched.
    serve.run_many([policy_app(model, policy) for policy in POLICIES])
    try:
        rates = {policy: hit_rate(f"{base_url}/{policy}") for policy in POLICIES}
    finally:
        # Deleted together, their replicas drain and stop at once; then wait until all three are gone.
        for policy in POLICIES:
            serve.delete(f"{APP}-{policy}", _blocking=False)
        wait_until_deleted([f"{APP}-{policy}" for policy in POLICIES])
    print("prefix-cache hit rates:", rates)
    # Every request after its group's first could hit: at most 7/8 of 96/104 of the prompt tokens.
    assert rates["kv_aware"] > 0.5
    assert rates["kv_aware"] >= 1.5 * rates["pow2"], rates
    # prefix_text routes by the prompt's text rather than the replicas' reported blocks, and must
    # beat pow2 by the same margin (a measured run: kv_aware 0.81, pow2 0.47, prefix_text 0.81).
    assert rates["prefix_text"] >= 1.5 * rates["pow2"], rates


def test_the_longest_prefix_wins_unless_its_replica_is_too_busy() -> None:
    keys = [b"a", b"b", b"c"]
    assert prefix_hits(keys, {b"a", b"b"}) == 2
    assert prefix_hits(keys, {b"b", b"c"}) == 0  # a chain: nothing past the first miss counts
    hits, loads = {"x": 2, "y": 0}, {"x": 3.0, "y": 0.0}
    assert choose_by_prefix(hits, loads, margin=3) == "x"
    assert choose_by_prefix(hits, loads, margin=2) == "y"  # x is 3 requests busier: over the margin
    # No hit: the least loaded, or within the margin of it the emptier cache.
    assert (
        choose_by_prefix({"x": 0, "y": 0}, {"x": 9.0, "y": 0.0}, margin=8, occupancy={"x": 0, "y": 50}) == "y"
    )
    assert (
        choose_by_prefix({"x": 0, "y": 0}, {"x": 1.0, "y": 0.0}, margin=8, occupancy={"x": 0, "y": 50}) == "x"
    )
    assert choose_by_prefix({"x": 0, "y": 0}, {"x": 1.0, "y": 0.0}, margin=8) == "y"


def make_router(router_class: type[PrefixAffinityRouter]) -> PrefixAffinityRouter:
    """A router as Serve builds it for the LLMServer deployment, with the replicas' block size."""
    router = router_class(DeploymentID(name="LLMServer", app_name=APP), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BLOCK_SIZE)
    return router


def test_kv_aware_keys_are_the_salted_hashes_the_replica_reports() -> None:
    """The router salts a prompt's keys as the replica's KV cache salts its blocks: a salted
    prompt's keys are in the summary of a replica that cached it under that salt, and in no other
    tenant's (nor under no salt), so a tenant is routed to where its own prefix is cached."""
    token_ids = list(range(1, 3 * BLOCK_SIZE + 2))  # three full blocks
    router = make_router(KVAwareRouter)

    def summary_after(cache_salt: str | None) -> set[bytes]:
        kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
        request = Request("r", token_ids, SamplingParams(), None, 0.0, cache_salt=cache_salt)
        seq = request.seqs[0]
        kv.allocate_slots(seq, seq.num_tokens)
        summary = kv.prefix_cache_summary()
        return {summary[i : i + 8] for i in range(0, len(summary), 8)}

    prompt = {"prompt": "ignored", "prompt_token_ids": token_ids}
    keys = {salt: router.prompt_keys({**prompt, "cache_salt": salt}) for salt in ("a", "b", None)}
    assert router.prompt_keys({**prompt, "cache_salt": "a"}) == keys["a"] and len(keys["a"]) == 3
    for cached_under in ("a", "b", None):
        held = summary_after(cached_under)
        for salt, salt_keys in keys.items():
            assert prefix_hits(salt_keys, held) == (3 if salt == cached_under else 0), (cached_under, salt)


def test_prefix_text_keys_are_salted_too() -> None:
    router = make_router(PrefixTextRouter)
    prompt = {"prompt": "x" * 200}
    plain, salted = router.prompt_keys(prompt), router.prompt_keys({**prompt, "cache_salt": "a"})
    assert router.prompt_keys({**prompt, "cache_salt": "a"}) == salted and len(salted) == len(plain) == 3
    other = router.prompt_keys({**prompt, "cache_salt": "b"})
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, salted, other, strict=True))
