"""The `raypage` command: serve, api-server, generate, chat and bench.

raypage serve --config configs/engine/smollm2.yaml --host 127.0.0.1 --port 8000 [--address HOST:PORT]
raypage generate "The capital of France is" --max-tokens 16
raypage chat "Name three colors." --system "You are terse." --dtype float32
raypage bench throughput --num-prompts 64 --input-len 128 --output-len 128
raypage api-server --host 127.0.0.1 --port 8000 --api-key KEY
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cluster.engine_args import add_engine_args, engine_settings_from_args
from engine.sampling_params import SamplingParams

# A handler gets the parsed arguments and the checked flat engine settings.
Handler = Callable[[argparse.Namespace, dict[str, Any]], None]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command tree; with `only`, that command's arguments and the other commands' names.

    Each leaf command sets `handler`, `command_parser` (for its usage line in errors) and optionally
    `check_args`, which raises ValueError on bad arguments before any weights are loaded.

    A command's module is imported only when its arguments are added: `raypage api-server` then
    never imports Ray and Serve, nor `raypage serve` the benchmarks, each seconds of its start-up;
    and none is imported at the top, since a spawned engine core imports this module again as its
    main module.
    """
    parser = argparse.ArgumentParser(prog="raypage", description="raypage LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = _add_one_request_command(
        commands, "generate", run_generate, "complete one prompt", "Print the completion of one prompt."
    )
    generate.add_argument("prompt", help="text to complete")
    chat = _add_one_request_command(
        commands,
        "chat",
        run_chat,
        "reply to one chat message",
        "Print the model's reply to one message, rendered with its chat template.",
    )
    chat.add_argument("message", help="the user's message")
    chat.add_argument("--system", metavar="TEXT", help="system prompt")

    serve_app = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API with Ray Serve",
        description="Run the Ray Serve app (an OpenAI ingress in front of LLMServer replicas) on a "
        "Ray cluster, joined at --address or started here, until SIGINT or SIGTERM.",
    )
    if only in (None, "serve"):
        from cluster.serve import command as serve_command

        serve_command.add_parser_args(serve_app)
        add_engine_args(serve_app)
        serve_app.set_defaults(
            handler=serve_command.run_serve, command_parser=serve_app, check_args=serve_command.check_args
        )

    server = commands.add_parser(
        "api-server",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions and friends with uvicorn.",
    )
    if only in (None, "api-server"):
        from cluster.openai import api_server

        api_server.add_server_args(server)
        add_engine_args(server)
        server.set_defaults(
            handler=api_server.run_api_server, command_parser=server, check_args=api_server.check_args
        )

    bench = commands.add_parser("bench", help="benchmarks", description="Benchmarks with JSON results.")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    if only in (None, "bench"):
        from cluster.bench import serve, throughput

        throughput.add_parser(benchmarks)
        serve.add_parser(benchmarks)
    return parser


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "Per-request sampling; the engine's --seed seeds the sampler."
    )
    group.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default: 0.0, for repeatable output)"
    )
    # Unset filters keep SamplingParams' own defaults (no filtering).
    group.add_argument("--top-p", type=float, default=argparse.SUPPRESS, help="nucleus sampling mass")
    group.add_argument("--top-k", type=int, default=argparse.SUPPRESS, help="sample from the k likeliest")


def _add_one_request_command(
    commands: argparse._SubParsersAction, name: str, handler: Handler, help_text: str, description: str
) -> argparse.ArgumentParser:
    """A command that runs one request through an offline LLM: sampling and engine flags, both
    checked before any weights load."""
    parser = commands.add_parser(name, help=help_text, description=description)
    _add_sampling_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=handler, command_parser=parser, check_args=_sampling_params)
    return parser


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    filters = {name: getattr(args, name) for name in ("top_p", "top_k") if hasattr(args, name)}
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, **filters)


def run_generate(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """Print the completion of `args.prompt`."""
    from engine import LLM  # (see build_parser: not in a spawned core's imports)

    params = _sampling_params(args)
    llm = LLM(**settings)
    output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(output.outputs[0].text)


def run_chat(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """Print the reply to `args.message` (after `args.system` when given)."""
    from engine import LLM

    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    llm = LLM(**settings)
    output = llm.chat(messages, params, use_tqdm=False)[0]
    print(output.outputs[0].text)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `raypage` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word (the top level has no option but --help).
    args = build_parser(next((word for word in argv if not word.startswith("-")), None)).parse_args(argv)
    command_parser: argparse.ArgumentParser = args.command_parser
    try:
        settings = engine_settings_from_args(args)
        check_args = getattr(args, "check_args", None)
        if check_args is not None:
            check_args(args)
    except ValueError as exc:
        command_parser.error(str(exc))  # exits with status 2, after the command's usage line
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    handler: Handler = args.handler
    handler(args, settings)


if __name__ == "__main__":
    main()
