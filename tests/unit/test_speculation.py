"""Speculative decoding's parts the scheduler owns: n-gram proposals (against a brute-force search
written here), the config's checks, and the rollback of rejected drafts in the KV cache."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.config_resolve import QUANTIZED_SPECULATION_MAX_BATCH, resolve_engine_config
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.spec_backoff import SpecBackoff
from engine.sched.speculation import Speculator
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram_proposer import NgramProposer
from kernels.build import cpu_kernels_available
from tests.unit.kv_cache_helpers import BS, admit, make_seq


def brute_force_proposal(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix n-gram, high..low."""
    for n in range(high, low - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_ngram_proposals_match_a_brute_force_search(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
    low = rng.randrange(1, 4)
    high = low + rng.randrange(0, 3)
    config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=low, prompt_lookup_max=high
    )
    assert NgramProposer(config).propose(tokens, max_drafts=5) == brute_force_proposal(tokens, 3, low, high)


def test_proposals_stop_at_the_room_left():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=2)
    proposer = NgramProposer(config)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    assert proposer.propose(tokens, max_drafts=10) == [3, 4, 5, 6]
    assert proposer.propose(tokens, max_drafts=2) == [3, 4]
    assert proposer.propose(tokens, max_drafts=0) == []
    assert proposer.propose([9, 1, 2], max_drafts=10) == []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"method": "eagle", "num_speculative_tokens": 2},
            "method 'eagle' is not supported; supported: ngram",
        ),
        ({"method": "ngram", "num_speculative_tokens": 0}, "greater than or equal to 1"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "at most",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "draft"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_speculative_configs_are_errors_at_start(settings, message):
    with pytest.raises(ValidationError, match=message):
        EngineConfig.from_flat(speculative_config=settings)


@pytest.mark.skipif(not cpu_kernels_available(), reason="GGUF blocks run on the compiled CPU kernels")
@pytest.mark.parametrize(
    ("settings", "limit"),
    [
        ({"dtype": "bfloat16"}, QUANTIZED_SPECULATION_MAX_BATCH),  # the packaged GGUF kept in its blocks
        ({"dtype": "bfloat16", "quantization": "none"}, None),  # dequantized: dense matmuls
        ({"dtype": "float32"}, None),
        ({"dtype": "bfloat16", "disable_by_batch_size": 12}, 12),  # the user's own limit stands
    ],
)
def test_gguf_blocks_speculate_only_at_small_batches_by_default(settings, limit):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    if "disable_by_batch_size" in settings:
        spec["disable_by_batch_size"] = settings.pop("disable_by_batch_size")
    config = resolve_engine_config(EngineConfig.from_flat(speculative_config=spec, **settings))
    assert config.speculative.speculative_config.disable_by_batch_size == limit


def test_rejected_drafts_give_back_their_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    seq = make_seq("a", range(5))
    admit(kv, seq, num_new=4)  # four prompt tokens computed, the fifth is next
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=6)
    speculator = Speculator(config, kv, max_seq_len=100)
    # The fifth token and six drafts: positions 4..10, three blocks in all.
    assert kv.allocate_slots(seq, 7) is not None
    seq.num_computed_tokens += 7
    assert kv.num_free_blocks == 5
    # One draft accepted (two tokens sampled): six tokens computed, the two blocks holding them kept.
    speculator.settle(seq, num_drafts=6, num_sampled=2)
    assert seq.num_computed_tokens == 6 and len(kv.block_ids("a")) == 2 and kv.num_free_blocks == 6
    assert speculator.stats.num_accepted_tokens == 1 and speculator.stats.num_accepted_tokens_per_pos[:2] == [
        1,
        0,
    ]
    kv.free(seq)
    assert kv.num_free_blocks == 8


def test_failing_drafts_pause_proposals_longer_each_time():
    backoff = SpecBackoff()
    assert not backoff.pauses()
    backoff.record(0)
    assert [backoff.pauses() for _ in range(2)] == [True, False]
    backoff.record(0)
    assert [backoff.pauses() for _ in range(3)] == [True, True, False]
    backoff.record(2)  # an accepted draft: propose at every step again
    assert not backoff.pauses()
    for _ in range(20):
        backoff.record(0)
    assert backoff.paused == SpecBackoff.MAX_PAUSE
