"""llguidance against xgrammar on SmolLM2's vocabulary (49,152 tokens): the measurements behind
raypage's choice of grammar backend (engine/structured/guidance.py).

    .venv/bin/pip install xgrammar   # not a dependency of raypage; only this comparison needs it
    python -m benchmarks.grammar_backends [--seeds 3]

For every schema of the test suite (tests/structured/schemas.py): the time to compile it against the
vocabulary (compact JSON; xgrammar's compile cache off), then the time of each token mask along
outputs SmolLM2 really writes under that schema (generated first, on raypage, at temperature 1.0,
`--seeds` of them per schema), replayed through each backend one token at a time. Then, for JSON
Schema keywords that are hard to enforce, whether each backend refuses the schema or accepts it, and
how many of 40 random walks through its masks (short tokens and the end of sequence favoured, so
that walks end) give JSON that `jsonschema` rejects: a backend must refuse what it does not enforce.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.models.tokenizer_files import tokenizer_json
from tests.structured.schemas import SCHEMAS

VOCAB = 49152
WORDS = (VOCAB + 31) // 32


class Guidance:
    name = "llguidance"

    def __init__(self, tokenizer_text: str, eos: int) -> None:
        import llguidance
        import llguidance.numpy

        self._ll, self._fill = llguidance, llguidance.numpy.fill_next_token_bitmask
        self.tokenizer = llguidance.LLTokenizer(tokenizer_text, n_vocab=VOCAB, eos_token=[eos])

    def compile(self, schema: dict) -> object:
        grammar = self._ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        error = self._ll.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(error)
        return self._ll.LLMatcher(self.tokenizer, grammar)

    def matcher(self, compiled: object) -> object:
        return compiled.deep_copy()  # type: ignore[attr-defined]

    def fill(self, matcher: object, bitmask: np.ndarray) -> None:
        self._fill(matcher, bitmask)

    def accept(self, matcher: object, token: int) -> bool:
        return matcher.consume_token(token)  # type: ignore[attr-defined]


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: object) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=VOCAB)
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict) -> object:
        return self._compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled: object) -> object:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher: object, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(bitmask)  # type: ignore[attr-defined]

    def accept(self, matcher: object, token: int) -> bool:
        return matcher.accept_token(token)  # type: ignore[attr-defined]


def sample_outputs(llm: LLM, seeds: int) -> list[list[list[int]]]:
    """Per schema, the token ids of `seeds` outputs SmolLM2 writes under it (and the end of sequence)."""
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=150,
            structured_outputs=StructuredOutputsParams(json=case.schema),
        )
        for case in SCHEMAS
        for seed in range(seeds)
    ]
    prompts = [
        [{"role": "user", "content": case.prompt + " Answer in JSON."}]
        for case in SCHEMAS
        for _ in range(seeds)
    ]
    outputs = llm.chat(prompts, params, use_tqdm=False)
    eos = llm.get_tokenizer().eos_token_id
    streams = [
        output.outputs[0].token_ids + ([eos] if output.outputs[0].finish_reason == "stop" else [])
        for output in outputs
    ]
    return [streams[index * seeds : (index + 1) * seeds] for index in range(len(SCHEMAS))]


def measure(
    backend: Guidance | XGrammar, streams: list[list[list[int]]]
) -> tuple[list[float], list[float], int]:
    """Compile seconds per schema, seconds per token mask, and the tokens a backend refused."""
    compiles, masks, refused = [], [], 0
    bitmask = np.zeros((1, WORDS), dtype=np.int32)
    for case, case_streams in zip(SCHEMAS, streams, strict=True):
        start = time.perf_counter()
        compiled = backend.compile(case.schema)
        compiles.append(time.perf_counter() - start)
        for tokens in case_streams:
            matcher = backend.matcher(compiled)
            for token in tokens:
                start = time.perf_counter()
                backend.fill(matcher, bitmask)
                masks.append(time.perf_counter() - start)
                if not backend.accept(matcher, token):
                    refused += 1
                    break
    return compiles, masks, refused


KEYWORDS = {
    "uniqueItems": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 3},
        "uniqueItems": True,
        "minItems": 3,
    },
    "not": {"not": {"type": "string"}},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "if/then": {"if": {"type": "integer"}, "then": {"minimum": 1}},
    "minLength": {"type": "string", "minLength": 3, "maxLength": 5},
}


def random_walk_violations(
    backend: Guidance | XGrammar, schema: dict, decode: Callable[[list[int]], str], eos: int
) -> int:
    """How many of 40 random walks through the backend's masks end in JSON that violates `schema`."""
    import jsonschema

    token_lengths = np.array([max(len(decode([token])), 1) for token in range(VOCAB)])
    compiled, rng, bitmask, violations = (
        backend.compile(schema),
        np.random.default_rng(0),
        np.zeros((1, WORDS), np.int32),
        0,
    )
    for _ in range(40):
        matcher, tokens = backend.matcher(compiled), []
        for _ in range(200):
            backend.fill(matcher, bitmask)
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:VOCAB])
            if eos in allowed and (rng.random() < 0.7 or len(allowed) == 1):
                break
            weights = 1.0 / token_lengths[allowed] ** 2
            token = int(rng.choice(allowed, p=weights / weights.sum()))
            backend.accept(matcher, token)
            tokens.append(token)
        else:
            continue  # no end within 200 tokens: not counted
        try:
            jsonschema.validate(json.loads(decode(tokens)), schema)
        except (ValueError, jsonschema.ValidationError):
            violations += 1
    return violations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(dtype="bfloat16")
    streams = sample_outputs(llm, args.seeds)
    model = llm.llm_engine.config.model
    tokenizer = llm.get_tokenizer()
    backends = [
        Guidance(
            tokenizer_json(Path(model.model), model.model_format, model.tokenizer), tokenizer.eos_token_id
        )
    ]
    try:
        backends.append(XGrammar(tokenizer))
    except ImportError:
        print("xgrammar is not installed: `.venv/bin/pip install xgrammar` to compare with it")
    num_tokens = sum(len(tokens) for case in streams for tokens in case)
    print(f"{len(SCHEMAS)} schemas, {num_tokens} tokens of SmolLM2's outputs under them")
    for backend in backends:
        compiles, masks, refused = measure(backend, streams)
        print(
            f"{backend.name}: compile median {statistics.median(compiles) * 1e3:.2f} ms, max "
            f"{max(compiles) * 1e3:.2f} ms; mask per row mean {statistics.mean(masks) * 1e6:.1f} us, median "
            f"{statistics.median(masks) * 1e6:.1f} us, p99 {np.percentile(masks, 99) * 1e6:.0f} us"
            + (f"; refused {refused} of the outputs' tokens" if refused else "")
        )
    print(
        "keywords: refused at compile, or accepted with the number of 40 random walks that violate the schema"
    )
    for keyword, schema in KEYWORDS.items():
        line = []
        for backend in backends:
            try:
                violations = random_walk_violations(backend, schema, tokenizer.decode, tokenizer.eos_token_id)
            except Exception as exc:  # each backend has its own error type
                line.append(f"{backend.name} refuses ({type(exc).__name__})")
            else:
                line.append(f"{backend.name} accepts, {violations}/40 walks violate")
        print(f"  {keyword}: " + "; ".join(line))
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
