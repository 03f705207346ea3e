"""Every command in the README's shell blocks names something that exists: a Makefile target, a
`raypage` subcommand and its flags, a Python module and its flags, a route of the OpenAI app."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from pathlib import Path
from unittest import mock
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def readme_commands() -> list[str]:
    """Command lines of the README's shell blocks: continuations joined, comments and, in console
    blocks, output lines (those without a `$ ` prompt) left out."""
    commands = []
    for language, body in FENCE.findall((ROOT / "README.md").read_text()):
        if language not in SHELL_LANGUAGES:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*):", text, re.MULTILINE))


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name, if it has any."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_flags(parser: argparse.ArgumentParser, args: list[str], where: str) -> None:
    known = {option for action in parser._actions for option in action.option_strings}
    for arg in args:
        if arg.startswith("--"):
            assert arg.split("=")[0] in known, f"{where}: {arg.split('=')[0]} is not a flag of {parser.prog}"


def check_raypage(args: list[str], command: str) -> None:
    from cluster.cli import build_parser

    parser = build_parser()
    rest = list(args)
    # Descend through subcommands (`raypage bench throughput`) while the next word names one.
    while rest and (choices := subcommands(parser)):
        assert rest[0] in choices, f"{command!r}: {rest[0]!r} is not a subcommand of {parser.prog}"
        parser = choices[rest.pop(0)]
    check_flags(parser, rest, repr(command))


def check_python_module(args: list[str], command: str) -> None:
    assert args[:1] == ["-m"], f"{command!r}: only `python -m MODULE` commands are checked"
    module_name, flags = args[1], args[2:]
    assert importlib.util.find_spec(module_name) is not None, f"{command!r}: no module {module_name}"
    build_parser = getattr(importlib.import_module(module_name), "build_parser", None)
    if build_parser is not None:
        check_flags(build_parser(), flags, repr(command))


def check_curl(args: list[str], command: str) -> None:
    from cluster.openai.app import ServerSettings, build_app

    engine = mock.MagicMock()
    engine.config.model.max_model_len = 2048
    routes = {route.path for route in build_app(engine, ServerSettings(served_model_names=["m"])).routes}
    for url in (arg for arg in args if arg.startswith("http")):
        assert urlparse(url).path in routes, (
            f"{command!r}: the OpenAI app serves no route {urlparse(url).path}"
        )


def check_command(command: str) -> None:
    words = shlex.split(command)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    program, args = Path(words[0]).name, words[1:]
    if program == "make":
        for target in (arg for arg in args if not arg.startswith("-") and "=" not in arg):
            assert target in makefile_targets(), f"{command!r}: no Makefile target {target!r}"
    elif program == "raypage":
        check_raypage(args, command)
    elif program.startswith("python"):
        check_python_module(args, command)
    elif program == "ray" and args[:2] == ["job", "submit"]:
        assert "--" in args, f"{command!r}: the entrypoint follows `--`"
        entrypoint = args[args.index("--") + 1 :]
        check_command(shlex.join(entrypoint))
    elif program == "curl":
        check_curl(args, command)
    else:
        pytest.fail(f"{command!r}: no check for {program!r}; add one to {Path(__file__).name}")


def test_the_readme_has_commands() -> None:
    commands = readme_commands()
    assert any(command.startswith("make serve") for command in commands)
    assert any(command.startswith("ray job submit") for command in commands)


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_exists(command: str) -> None:
    check_command(command)


@pytest.mark.parametrize(
    "command",
    [
        "make no-such-target",
        "raypage no-such-command",
        "raypage serve --no-such-flag 1",
        "raypage bench throughput --no-such-flag",
        "python -m cluster.no_such_module",
        "ray job submit -- python -m cluster.jobs.batch --no-such-flag",
        "curl http://127.0.0.1:8000/v1/no-such-route",
    ],
)
def test_a_wrong_command_fails(command: str) -> None:
    with pytest.raises(AssertionError):
        check_command(command)
