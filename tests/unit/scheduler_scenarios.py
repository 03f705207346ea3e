"""Hypothesis strategies that draw scheduler scenarios for the randomized scheduler tests: a cache,
limits, and requests (plain, parallel sampling, beam search) with the model function that answers them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from engine.sched.request import Request
from tests.unit.scheduler_helpers import (
    make_beam_request,
    make_request,
    seq_index,
)

VOCAB = 5  # tiny, so that prompts and outputs often share blocks and EOS turns up
EOS = 4


def token_fn(seq_id: str, tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens) * 7 + 3 * seq_index(seq_id)) % VOCAB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    priority: int
    arrival_step: int
    eos: int | None
    abort_step: int | None  # abort at this step (if still alive) ...
    abort_mid_step: bool  # ... between schedule() and update_from_output() instead of before
    n: int = 1
    best_of: int | None = None
    beam_width: int | None = None
    length_penalty: float = 1.0
    stop: tuple[int, int, bool] | None = None  # (step, index, mid step): stop_sequence there

    @property
    def num_seqs(self) -> int:
        return self.beam_width or self.best_of or self.n

    def blocks_alone(self, block_size: int, max_model_len: int) -> int:
        """Blocks that are always enough for this request running alone: a sequence never computes
        its last (sampled) token, and every live sequence holds at most its own table."""
        longest = min(len(self.prompt) + self.max_tokens - 1, max_model_len)
        return self.num_seqs * max(cdiv(longest, block_size), 1)


@dataclass
class Scenario:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    specs: list[Spec]
    stray_aborts: list[int]  # steps at which an unknown id is aborted
    num_cpu_blocks: int = 0
    preemption_mode: str | None = None
    # Every request fits the cache alone, so none may be cut short for the want of blocks.
    fits_alone: bool = False


@st.composite
def scenarios(
    draw, spare_cache_tokens: int, max_requests: int, max_prompt: int, max_arrival_step: int = 6
) -> Scenario:
    token = st.integers(0, VOCAB - 2)  # prompts avoid EOS so that it comes from sampling
    prefixes = draw(st.lists(st.lists(token, max_size=max_prompt), min_size=1, max_size=3))
    specs = []
    for _ in range(draw(st.integers(1, max_requests))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(token, max_size=max_prompt // 2))
        specs.append(
            Spec(
                prompt=prompt or [0],
                max_tokens=draw(st.integers(1, 10)),
                priority=draw(st.integers(0, 2)),
                arrival_step=draw(st.integers(0, max_arrival_step)),
                eos=draw(st.sampled_from([None, EOS])),
                abort_step=draw(st.none() | st.none() | st.integers(0, 25)),
                abort_mid_step=draw(st.booleans()),
            )
        )
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    # Size the cache around the longest prompt, so that it is often under pressure (preemption)
    # and only sometimes too small for a prompt (ignored requests).
    longest = max(len(spec.prompt) for spec in specs)
    cache_tokens = longest + draw(st.integers(-2, spare_cache_tokens))
    return Scenario(
        block_size=block_size,
        num_blocks=max(1, cache_tokens // block_size),
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_model_len=draw(st.sampled_from([64, 64, 64, 40, 16, 8, 5])),
        enable_prefix_caching=draw(st.booleans() | st.just(True)),
        specs=specs,
        stray_aborts=draw(st.lists(st.integers(0, 10), max_size=2)),
        num_cpu_blocks=draw(st.sampled_from([0, 0, 2, 8])),
        preemption_mode=draw(st.sampled_from([None, None, "recompute", "swap"])),
    )


@st.composite
def pressured_scenarios(draw) -> Scenario:
    """Few blocks, several long-lived requests at once, no early stops: preemption is common."""
    sc = draw(scenarios(spare_cache_tokens=6, max_requests=5, max_prompt=10, max_arrival_step=1))
    specs = [replace(spec, eos=None, max_tokens=max(spec.max_tokens, 4)) for spec in sc.specs]
    block_size = min(sc.block_size, 2)
    longest = max(len(spec.prompt) for spec in specs)
    return replace(
        sc,
        specs=specs,
        max_model_len=64,
        max_num_seqs=max(sc.max_num_seqs, 2),
        block_size=block_size,
        # Room for the longest prompt and a little more: two requests rarely fit side by side.
        num_blocks=longest // block_size + draw(st.integers(1, 3)),
    )


@st.composite
def group_scenarios(draw, fits_alone: bool) -> Scenario:
    """Plain, n, best_of and beam requests, arriving close together; a small CPU pool; stops and aborts.

    With `fits_alone`, the cache holds any one request at its largest (and barely more), so requests
    contend for it without any being cut short; otherwise it may be smaller than that.
    """
    token = st.integers(0, VOCAB - 2)
    prefixes = draw(st.lists(st.lists(token, min_size=1, max_size=8), min_size=1, max_size=2))
    specs = []
    for _ in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["plain", "n", "n", "best_of", "beam", "beam"]))
        spec = Spec(
            prompt=draw(st.sampled_from(prefixes)) + draw(st.lists(token, max_size=3)),
            max_tokens=draw(st.integers(1, 8) | st.integers(4, 8)),
            priority=draw(st.integers(0, 1)),
            arrival_step=draw(st.integers(0, 1)),
            eos=draw(st.sampled_from([None, None, EOS])),
            abort_step=draw(st.none() | st.none() | st.none() | st.integers(0, 15)),
            abort_mid_step=draw(st.booleans()),
        )
        if kind == "n":
            spec.n = draw(st.integers(2, 3))
        elif kind == "best_of":
            spec.n = draw(st.integers(1, 2))
            spec.best_of = draw(st.integers(spec.n + 1, 3))
        elif kind == "beam":
            spec.beam_width = draw(st.integers(1, 3))
            spec.length_penalty = draw(st.sampled_from([1.0, 0.5, 2.0]))
        if kind in ("n", "best_of") and draw(st.integers(0, 3)) == 0:
            spec.stop = (
                draw(st.integers(1, 10)),
                draw(st.integers(0, spec.num_seqs - 1)),
                draw(st.booleans()),
            )
        specs.append(spec)
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.sampled_from([64, 64, 12, 8]))
    largest = max(spec.blocks_alone(block_size, max_model_len) for spec in specs)
    num_blocks = (
        largest + draw(st.integers(0, 2)) if fits_alone else max(1, largest - draw(st.integers(0, 6)))
    )
    widest = max(spec.num_seqs for spec in specs)
    return Scenario(
        block_size=block_size,
        num_blocks=num_blocks,
        # Mostly room for every request (some too wide for it are ignored).
        max_num_seqs=draw(st.integers(widest, 9) | st.integers(1, 9)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
        max_model_len=max_model_len,
        enable_prefix_caching=draw(st.booleans() | st.just(True)),
        specs=specs,
        stray_aborts=[],
        num_cpu_blocks=draw(st.sampled_from([0, 3, 8, 32, 32, 32])),
        preemption_mode=draw(st.sampled_from([None, None, None, "recompute", "swap"])),
        fits_alone=fits_alone,
    )


def build_request(spec: Spec, request_id: str, arrival_time: float) -> Request:
    if spec.beam_width is not None:
        return make_beam_request(
            request_id,
            spec.prompt,
            beam_width=spec.beam_width,
            max_tokens=spec.max_tokens,
            eos_token_id=spec.eos,
            length_penalty=spec.length_penalty,
            priority=spec.priority,
            arrival_time=arrival_time,
        )
    return make_request(
        request_id,
        spec.prompt,
        max_tokens=spec.max_tokens,
        eos_token_id=spec.eos,
        priority=spec.priority,
        arrival_time=arrival_time,
        n=spec.n,
        best_of=spec.best_of,
    )
