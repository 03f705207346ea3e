"""Offline batch inference, meant to run as a Ray job: JSONL prompts in, JSONL results out.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m cluster.jobs.batch --config configs/engine/smollm2.yaml \\
        --input /data/prompts.jsonl --output /data/results.jsonl [engine flags]

Input lines: see `cluster.jobs.batch_lines`. Output lines: id (the line's own, else its line
number), text, finish_reason, prompt_tokens, completion_tokens. A line that cannot run is logged
with its number and the reason, and skipped; so is a line whose id an earlier line has (results are
keyed by id). Every valid line is queued at once, so the scheduler batches them continuously.

Jobs resume (see `cluster.jobs.batch_results`): each result is written and flushed as soon as its
line finishes, and a job run again with the same --output skips the lines whose results are there,
so a killed job loses nothing and repeats nothing; the summary says how many were done before.
Once every line has run, the output is in input order. To start afresh, remove the output file.

Relative paths resolve against the job's working directory, which under `ray job submit` is Ray's
unpacked copy of --working-dir: give absolute paths.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from cluster.engine_args import add_engine_args, engine_settings_from_args
from cluster.jobs.batch_lines import BatchLine, parse_batch_line
from cluster.jobs.batch_results import ResultsFile, result_key
from engine.config import EngineConfig
from engine.frontend.input_processor import PromptType
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.tokenizer import render_chat_prompt
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind

# Under `python -m` this module's __name__ is "__main__"; log under its real name.
logger = logging.getLogger("cluster.jobs.batch")


class SkippedLines:
    """The numbers of the input lines that could not run; each is logged when it is skipped."""

    def __init__(self) -> None:
        self.numbers: list[int] = []

    def skip(self, number: int, reason: str) -> None:
        logger.warning("line %d skipped: %s", number, reason)
        self.numbers.append(number)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.jobs.batch",
        description="Generate a completion for every line of a JSONL file, with one engine.",
    )
    parser.add_argument(
        "--input", required=True, type=Path, help='JSONL: {"id"?, "prompt" | "messages", sampling fields?}'
    )
    parser.add_argument(
        "--output",
        required=True,
        type=Path,
        help="JSONL results, one per valid input line; an existing one is resumed: its lines are not run again",
    )
    parser.add_argument(
        "--progress-interval", type=float, default=10.0, help="seconds between progress logs (default: 10)"
    )
    add_engine_args(parser)
    return parser


def parse_input(text: str, skipped: SkippedLines) -> list[BatchLine]:
    """The valid lines of a JSONL text; the others go to `skipped`. Line numbers start at 1."""
    rows = text.split("\n")  # not splitlines(): JSON strings may hold a raw U+2028
    if rows[-1] == "":  # the file's final newline ends a line, it does not start one
        rows.pop()
    lines = []
    for number, row in enumerate(rows, start=1):
        try:
            lines.append(parse_batch_line(number, row))
        except ValueError as exc:
            skipped.skip(number, str(exc))
    return lines


def engine_prompt(line: BatchLine, tokenizer: PreTrainedTokenizerBase) -> PromptType:
    """What the engine generates from: the prompt, or the messages in the model's chat template."""
    if line.prompt is not None:
        return line.prompt
    return render_chat_prompt(tokenizer, line.messages)


def run_lines(
    engine: LLMEngine,
    lines: list[BatchLine],
    skipped: SkippedLines,
    progress_interval: float,
    results: ResultsFile,
) -> None:
    """Queue every line the engine accepts, step until all finish, and append each result to
    `results` as it finishes."""
    queued: dict[str, BatchLine] = {}  # by request id (the line number as a string)
    first_line_of: dict[str, int] = {}  # by result key
    for line in lines:
        # Only the final output is wanted, so the front end need not build the ones before it.
        params = msgspec.structs.replace(line.sampling_params, output_kind=RequestOutputKind.FINAL_ONLY)
        request_id = str(line.number)
        try:
            engine.add_request(request_id, engine_prompt(line, engine.tokenizer), params)
        # Too long a prompt, a token id outside the vocabulary, a template the messages break, ...
        except (ValueError, TemplateError) as exc:
            skipped.skip(line.number, str(exc))
            continue
        # Checked once the engine took the line, so that a line it refuses is told why.
        first = first_line_of.setdefault(result_key(line.id), line.number)
        if first != line.number:
            engine.abort_request(request_id)
            skipped.skip(
                line.number, f"line {first} has the same id {line.id!r}, and results are keyed by id"
            )
            continue
        queued[request_id] = line
    logger.info("running %d lines (%d skipped)", len(queued), len(skipped.numbers))
    num_finished = 0
    last_report = time.monotonic()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not output.finished or output.request_id not in queued:
                continue
            num_finished += 1
            line = queued[output.request_id]
            if output.error:  # the scheduler gave up on it, e.g. a prompt larger than the whole KV cache
                skipped.skip(line.number, f"the engine could not run it: {output.error}")
            else:
                results.append(result_record(line, output))
        if time.monotonic() - last_report >= progress_interval:
            logger.info("progress: %d/%d lines done", num_finished, len(queued))
            last_report = time.monotonic()


def result_record(line: BatchLine, output: RequestOutput) -> dict[str, Any]:
    completion = output.outputs[0]
    return {
        "id": line.id,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the batch; 0 when at least one line ran, 1 when none could or the input is unreadable."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = engine_settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2 before any weights are loaded
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        text = args.input.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        logger.error("cannot read the input file %s: %s", args.input.resolve(), exc)
        return 1
    try:
        results = ResultsFile(args.output)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        logger.error("cannot resume from the output file %s: %s", args.output.resolve(), exc)
        return 1
    skipped = SkippedLines()
    lines = parse_input(text, skipped)
    pending = [line for line in lines if not results.is_done(line.id)]
    if results.num_done_before:
        logger.info(
            "resuming %s: %d lines were done before, %d to run",
            args.output.resolve(),
            results.num_done_before,
            len(pending),
        )
    if pending:
        engine = LLMEngine(EngineConfig.from_flat(**settings))
        try:
            run_lines(engine, pending, skipped, args.progress_interval, results)
        finally:
            engine.shutdown()
            results.close()
    if results.records:
        results.close_in_order(line.id for line in lines)
    numbers = ", ".join(map(str, sorted(skipped.numbers)))
    before = f" ({results.num_done_before} of them before this run)" if results.num_done_before else ""
    logger.info(
        "%d lines done%s, %d skipped%s",
        len(results.records),
        before,
        len(skipped.numbers),
        f": lines {numbers}" if numbers else "",
    )
    if not results.records:
        logger.error("no line of %s could run", args.input.resolve())
        return 1
    logger.info("results written to %s", args.output.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
