"""The cost of structured outputs in the step loop: a decode step of a batch under JSON schemas against
the same batch unconstrained, and the compile time of grammars.

    python -m benchmarks.structured_outputs [--rows 64] [--steps 64] [--rounds 5] [--dtype bfloat16]

Three batches of `--rows` requests each, in interleaved rounds on one engine (in-process, as
`LLM` runs it): every row under a JSON schema, none, and half of them. The schema (an array of at
least 40 people objects: keys, enums, bounded integers, strings, booleans) cannot end within
`--steps` tokens, and the unconstrained rows ignore EOS, so every row decodes for the whole
measurement. A step is timed around `EngineCore.step` (schedule, the grammar's bitmask, the
forward pass, the mask applied, sampling, the matchers advanced), prefill steps left out. Each
round reports the median decode step of each batch; the summary, the median and the range of the
rounds' ratios to the unconstrained batch (a round's batches run back to back, so a ratio is
little moved by the machine's speed drifting between rounds). Then the compile time of every schema of the test suite (tests/structured/schemas.py)
against the model's vocabulary, as the engine's compile thread runs it for an uncached schema.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path

from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.tokenizer import render_chat_prompt
from engine.models.tokenizer_files import tokenizer_json
from engine.process.core import EngineCore
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured.manager import BACKEND

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 40}
TOPICS = [
    "a hospital",
    "a school",
    "a start-up",
    "an orchestra",
    "a football club",
    "a library",
    "a bakery",
    "a lab",
]


def batch_params(rows: int, constrained: int, steps: int, round_index: int) -> list[SamplingParams]:
    """`constrained` rows under the schema, the rest free; every row runs `steps` tokens or more."""
    return [
        SamplingParams(
            temperature=1.0,
            seed=round_index * rows + row,
            max_tokens=steps + 2,
            ignore_eos=row >= constrained,
            structured_outputs=StructuredOutputsParams(json=PEOPLE) if row < constrained else None,
        )
        for row in range(rows)
    ]


def decode_step_times(engine: LLMEngine, params: list[SamplingParams]) -> list[float]:
    """Seconds of each step in which every row of the batch decodes one token."""
    core: EngineCore = engine.engine_core.engine_core  # type: ignore[attr-defined]
    for row, row_params in enumerate(params):
        prompt = render_chat_prompt(
            engine.tokenizer,
            [{"role": "user", "content": f"List the people of {TOPICS[row % len(TOPICS)]} as JSON."}],
        )
        request, _ = engine.input_processor.process(uuid.uuid4().hex, prompt, row_params)
        core.add_request(request)
    times = []
    while core.has_unfinished_requests():
        decoding = all(
            seq.num_computed_tokens == seq.num_tokens - 1
            for request in core.scheduler.running
            for seq in request.live_seqs
        )
        full = decoding and len(core.scheduler.running) == len(params) and not core.scheduler.waiting
        start = time.perf_counter()
        core.step()
        if full:
            times.append(time.perf_counter() - start)
    return times


def compile_times(engine: LLMEngine) -> list[float]:
    """Seconds to compile each test schema's grammar against the model's vocabulary (what the
    engine's compile thread does for a schema it has not cached)."""
    from tests.structured.schemas import SCHEMAS

    model = engine.config.model
    eos = [engine.input_processor.eos_token_id, *model.hf_config.eos_token_ids]
    backend = BACKEND(
        tokenizer_json(Path(model.model), model.model_format, model.tokenizer),
        model.hf_config.vocab_size,
        eos,
    )
    times = []
    for case in SCHEMAS:
        start = time.perf_counter()
        backend.compile(BACKEND.grammar_text(StructuredOutputsParams(json=case.schema)))
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_flat(dtype=args.dtype, max_num_seqs=args.rows))
    batches = {"unconstrained": 0, "all constrained": args.rows, "half constrained": args.rows // 2}
    decode_step_times(
        engine, batch_params(args.rows, args.rows, 4, args.rounds)
    )  # warm-up: the grammar compiles
    medians: dict[str, list[float]] = {name: [] for name in batches}
    for round_index in range(args.rounds):
        # Every other round in reverse order, so that a drift of the machine's speed favours none.
        order = list(batches) if round_index % 2 == 0 else list(reversed(batches))
        for name in order:
            times = decode_step_times(engine, batch_params(args.rows, batches[name], args.steps, round_index))
            medians[name].append(statistics.median(times))
        line = ", ".join(f"{name} {medians[name][-1] * 1e3:.2f} ms" for name in batches)
        print(f"round {round_index + 1} (median decode step): {line}", flush=True)
    for name in ("all constrained", "half constrained"):
        ratios = [m / u for m, u in zip(medians[name], medians["unconstrained"], strict=True)]
        print(
            f"{name}: {statistics.median(ratios):.3f}x the unconstrained {args.rows}-row decode step "
            f"(median of the rounds' ratios; {min(ratios):.3f}-{max(ratios):.3f})"
        )
    compiles = compile_times(engine)
    print(
        f"grammar compile time of the {len(compiles)} test schemas: median {statistics.median(compiles) * 1e3:.2f} ms, "
        f"max {max(compiles) * 1e3:.2f} ms"
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
