"""cache_salt, the prefix cache's tenant isolation: a request's salt is an extra key of its first KV
block's hash (vLLM's rule), so only requests with the same salt share cached blocks, an unsalted
request included; forks (n > 1), beams and a preempted request's recompute keep it. The input
processor refuses a salt that is not a non-empty string, naming the field.

Cache hits are counted as the user sees them: the `num_cached_tokens` of the request's outputs.
"""

from __future__ import annotations

import hashlib
from array import array

import msgspec
import pytest

from engine.frontend.input_processor import InputProcessor, prompt_cache_salt
from engine.outputs import EngineCoreRequest
from engine.sampling_params import SamplingParams
from engine.sched.block_pool import chain_block_hashes
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from tests.unit.kv_cache_helpers import BS, admit
from tests.unit.scheduler_helpers import (
    FakeWorker,
    indexed_scheduler_and_worker,
    make_beam_request,
    make_request,
    outputs_by_id,
    run_until_done,
    scheduler_and_worker,
    step,
)
from tests.unit.scheduler_invariants import assert_all_free

PROMPT = list(range(100, 110))  # two full blocks of 4 and a partial one
OTHER_PROMPT = list(range(200, 210))


def blake2b(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=16).digest()


def tokens(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


# ---- the hashes ---------------------------------------------------------------------------------


def test_the_salt_is_an_extra_key_of_the_first_block_only() -> None:
    """Computed here on its own: blake2b over (parent hash, the block's int64 token ids, extra key),
    the salt's UTF-8 bytes being the first block's extra key and no other block's."""
    first = blake2b(b"\0" * 16, tokens(PROMPT[:4]), "tenant-ä".encode())
    second = blake2b(first, tokens(PROMPT[4:8]))
    assert chain_block_hashes(PROMPT, BS, cache_salt="tenant-ä") == [first, second]


def test_different_salts_share_no_block_hash_and_equal_salts_all() -> None:
    unsalted = chain_block_hashes(PROMPT, BS)
    salted = chain_block_hashes(PROMPT, BS, cache_salt="a")
    assert chain_block_hashes(PROMPT, BS, cache_salt="a") == salted
    other = chain_block_hashes(PROMPT, BS, cache_salt="b")
    # Every block differs, not just the first: the later hashes chain the salted one.
    assert all(len({x, y, z}) == 3 for x, y, z in zip(unsalted, salted, other, strict=True))


def test_a_salt_extends_the_hashes_it_started() -> None:
    """The manager extends a sequence's hashes as it grows: the salt must not re-enter later."""
    hashes = chain_block_hashes(PROMPT[:4], BS, cache_salt="a")
    assert chain_block_hashes(PROMPT, BS, hashes, cache_salt="a") == chain_block_hashes(
        PROMPT, BS, cache_salt="a"
    )


# ---- the KV cache manager -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first_salt", "second_salt", "num_hit_tokens"),
    [
        ("a", "a", 8),  # same tenant: both full blocks
        ("a", "b", 0),  # another tenant
        (None, "a", 0),  # a salted request never sees the shared, unsalted cache ...
        ("a", None, 0),  # ... and an unsalted one never sees a tenant's
        (None, None, 8),
    ],
)
def test_only_requests_with_equal_salts_share_cached_blocks(
    first_salt: str | None, second_salt: str | None, num_hit_tokens: int
) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    first = make_request("first", PROMPT, cache_salt=first_salt).seqs[0]
    admit(kv, first)
    kv.free(first)
    second = make_request("second", PROMPT, cache_salt=second_salt).seqs[0]
    hits, hit_tokens = kv.get_computed_blocks(second)
    assert hit_tokens == num_hit_tokens and len(hits) == num_hit_tokens // BS


# ---- through the scheduler, as the user sees it -------------------------------------------------


def cached_tokens(scheduler: Scheduler, worker: FakeWorker, request: Request) -> int:
    """Run `request` alone to the end; the cached-token count its first output reports."""
    scheduler.add_request(request)
    _, outputs = step(scheduler, worker)
    reported = outputs_by_id(outputs)[request.request_id].num_cached_tokens
    run_until_done(scheduler, worker)
    return reported


def test_the_user_sees_hits_only_under_the_same_salt() -> None:
    scheduler, worker = scheduler_and_worker(num_blocks=32)
    assert cached_tokens(scheduler, worker, make_request("plain", PROMPT, max_tokens=2)) == 0
    assert cached_tokens(scheduler, worker, make_request("a1", PROMPT, max_tokens=2, cache_salt="a")) == 0
    assert cached_tokens(scheduler, worker, make_request("b1", PROMPT, max_tokens=2, cache_salt="b")) == 0
    assert cached_tokens(scheduler, worker, make_request("a2", PROMPT, max_tokens=2, cache_salt="a")) == 8
    assert cached_tokens(scheduler, worker, make_request("plain2", PROMPT, max_tokens=2)) == 8
    assert_all_free(scheduler)


def test_parallel_samples_and_beams_publish_their_blocks_under_the_salt() -> None:
    """Every sequence of an n > 1 or beam search request writes salted blocks (its outputs' too),
    so that its tenant, and only its tenant, finds the prompt and the outputs in the cache."""
    scheduler, worker = indexed_scheduler_and_worker(num_blocks=64)
    # Prompts of their own: a probe publishes its blocks (under its salt) too.
    requests = [
        make_request("sampled", PROMPT, n=2, seed=1, max_tokens=6, cache_salt="a"),
        make_beam_request("beams", OTHER_PROMPT, beam_width=2, max_tokens=6, ignore_eos=True, cache_salt="a"),
    ]
    for request in requests:
        scheduler.add_request(request)
    generated, _ = run_until_done(scheduler, worker)
    for request in requests:
        # The first sequence (the best beam) continued: its prompt and its first generated block.
        continued = [*request.prompt_token_ids, *generated[request.request_id][:2], 7]
        for salt, expected in (("a", 12), ("b", 0), (None, 0)):
            probe = make_request(f"{request.request_id}-{salt}", continued, max_tokens=1, cache_salt=salt)
            assert cached_tokens(scheduler, worker, probe) == expected, (request.request_id, salt)
    assert_all_free(scheduler)


def test_a_recomputed_request_keeps_its_salt() -> None:
    """A salted request preempted by recompute finds its own salted blocks again, and what it
    writes after stays its tenant's."""
    scheduler, worker = scheduler_and_worker(num_blocks=5)
    a = make_request("a", range(1, 9), max_tokens=2, priority=0)
    b = make_request("b", range(11, 19), max_tokens=3, priority=1, cache_salt="b")
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, worker)
    step(scheduler, worker)  # a takes the last free block; b finds none and preempts itself
    assert b.status == RequestStatus.PREEMPTED
    out, _ = step(scheduler, worker)
    (readmitted,) = out.scheduled_new_seqs
    assert readmitted.num_computed_tokens == 8  # both of its salted blocks were still cached
    run_until_done(scheduler, worker)
    full = [*range(11, 19), *b.seqs[0].output_token_ids]  # 11 tokens: 2 full blocks
    assert cached_tokens(scheduler, worker, make_request("b2", full, max_tokens=1, cache_salt="b")) == 8
    assert cached_tokens(scheduler, worker, make_request("plain", full, max_tokens=1)) == 0
    assert_all_free(scheduler)


def test_with_prefix_caching_off_a_salt_is_accepted_and_nothing_is_shared() -> None:
    scheduler, worker = scheduler_and_worker(num_blocks=16, enable_prefix_caching=False)
    for request_id in ("a1", "a2"):
        request = make_request(request_id, PROMPT, max_tokens=1, cache_salt="a")
        assert cached_tokens(scheduler, worker, request) == 0


# ---- the input processor ------------------------------------------------------------------------


def test_the_input_processor_carries_the_salt_to_the_core() -> None:
    processor = InputProcessor(None, max_model_len=64, vocab_size=1000, eos_token_id=None)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=1)
    request, _ = processor.process("r", {"prompt_token_ids": PROMPT, "cache_salt": "a"}, params)
    # As the core process receives it (msgpack over ZeroMQ).
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert Request.from_engine_core_request(received).cache_salt == "a"
    request, _ = processor.process("r", {"prompt_token_ids": PROMPT}, params)
    assert request.cache_salt is None


@pytest.mark.parametrize("salt", ["", 7, b"bytes", "\ud800"])
def test_a_salt_that_is_not_a_non_empty_string_is_refused_by_name(salt: object) -> None:
    with pytest.raises(ValueError, match=r"^cache_salt must be"):
        prompt_cache_salt({"prompt_token_ids": PROMPT, "cache_salt": salt})


def test_no_salt_and_a_null_salt_are_none() -> None:
    assert prompt_cache_salt("text") is None
    assert prompt_cache_salt({"prompt": "text", "cache_salt": None}) is None
