"""docs/configuration.md, generated from the code that defines the settings, so that it cannot drift.

    python -m cluster.config_reference            # print the markdown
    python -m cluster.config_reference --write    # write docs/configuration.md
    python -m cluster.config_reference --check    # exit 1 when docs/configuration.md differs

The engine's settings come from the pydantic sections of `engine.config.EngineConfig` (their CLI
flags are derived from the same fields by `cluster.engine_args`), the Serve keys from
`cluster.serve.args.ServeOptions`, and the server flags of `raypage serve` and `raypage api-server`
from the command's own argparse parser (`cluster.cli.build_parser`).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from cluster.engine_args import flag_name
from engine.config import EngineConfig

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REGENERATE = "python -m cluster.config_reference --write"
# The argparse groups of a command that are not its own server flags: the engine group has its own
# tables (generated from the fields), and argparse's default groups hold only --help here.
_SKIPPED_GROUPS = ("engine", "options", "positional arguments")

_HEADER = f"""# Configuration

Every engine setting, Serve key and server flag, generated from the code by `{REGENERATE}`
(do not edit by hand: `tests/unit/test_configuration_doc.py` fails when this file and the code
differ). Back to the [README](../README.md).

Engine settings are flat keys with vLLM's names. Each is accepted as an `LLM(...)` keyword, a key of a
flat YAML file (`LLM.from_config("configs/engine/smollm2.yaml")`, `--config FILE`, a Serve config's
`args`) and a dashed flag of `raypage generate`, `chat`, `api-server`, `serve` and `python -m
cluster.jobs.batch`; a flag overrides the file, which overrides the default. The keys are grouped
into the pydantic models of `engine/config.py`, which forbid unknown keys: a bad value or an unknown
key is an error that names it.
"""


def _format_type(annotation: Any) -> str:
    """A short, readable spelling of a field's type: `int | None`, `'PACK' | 'SPREAD'`, `list[int]`."""
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(value) for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_format_type(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_format_type(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(info: FieldInfo) -> str:
    """The field's numeric bounds (pydantic's gt/ge/lt/le), e.g. "> 0, ≤ 1024"."""
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    return ", ".join(
        f"{sign} {getattr(item, name)}"
        for item in info.metadata
        for name, sign in signs.items()
        if getattr(item, name, None) is not None
    )


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _field_row(key: str, info: FieldInfo, with_flag: bool) -> str:
    type_text = _format_type(info.annotation)
    bounds = _bounds(info)
    if bounds:
        type_text += f", {bounds}"
    default = "required" if info.default is PydanticUndefined else f"`{info.default!r}`"
    flag = f"`{flag_name(key)}`"
    if info.annotation is bool:  # cluster.engine_args makes booleans --flag / --no-flag switches
        flag += f", `--no-{flag_name(key)[2:]}`"
    cells = [f"`{key}`", *([flag] if with_flag else []), f"`{type_text}`"]
    cells += [_cell(default), _cell(info.description or "")]
    return "| " + " | ".join(cells) + " |"


def _model_table(model: type[BaseModel], with_flag: bool) -> list[str]:
    head = (
        "| key | flag | type | default | description |"
        if with_flag
        else "| key | type | default | description |"
    )
    rule = "| --- " * (5 if with_flag else 4) + "|"
    rows = [_field_row(key, info, with_flag) for key, info in model.model_fields.items()]
    return [head, rule, *rows]


def _summary(model: type[BaseModel]) -> str:
    """The first line of a model's docstring."""
    return (model.__doc__ or "").strip().splitlines()[0]


def _engine_section() -> list[str]:
    lines = ["## Engine settings", ""]
    for section, info in EngineConfig.model_fields.items():
        model = info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        lines += [f"### {model.__name__} (`{section}`)", "", _summary(model), ""]
        lines += [*_model_table(model, with_flag=True), ""]
    return lines


def _serve_section() -> list[str]:
    # Imported here: Ray Serve is needed only for this section.
    from cluster.serve.args import ENGINE_FILE_KEY, MODEL_KEYS, MODELS_KEY, ServeOptions

    model_keys = ", ".join(f"`{key}`" for key in MODEL_KEYS)
    return [
        "## Serve keys (`ServeOptions`)",
        "",
        f"The args of `cluster.serve_app:build_app` (a Serve config's `args:`) are `{ENGINE_FILE_KEY}` (a flat "
        "engine YAML file), flat engine keys that override it, and these keys "
        "(`cluster/serve/args.py`). "
        f"With `{MODELS_KEY}:` (one mapping per model), {model_keys} belong to each model's entry and the "
        "other keys beside the list. `raypage serve` sets them from its flags (below).",
        "",
        *_model_table(ServeOptions, with_flag=False),
        "",
    ]


def _action_row(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    invocation = formatter._format_action_invocation(action)
    help_text = formatter._expand_help(action) if action.help else ""
    return f"| `{_cell(invocation)}` | {_cell(help_text)} |"


def _command_groups(parser: argparse.ArgumentParser) -> Iterable[tuple[str, list[str]]]:
    """(group title, its table rows) for each of a command's own flag groups."""
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        if group.title in _SKIPPED_GROUPS:
            continue
        rows = [_action_row(formatter, action) for action in group._group_actions if action.dest != "help"]
        if rows:
            yield group.title or "", rows


def _flags_section() -> list[str]:
    # Imported here: the command tree imports Ray Serve and the HTTP stack.
    from cluster.cli import build_parser

    commands = next(
        action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)
    )
    # A group two commands share (the server flags) is listed once, naming both.
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for name in ("api-server", "serve"):
        for title, rows in _command_groups(commands.choices[name]):
            groups.setdefault(title, ([], rows))[0].append(f"`raypage {name}`")
    lines = [
        "## Server flags",
        "",
        "The flags of `raypage api-server` and `raypage serve` besides the engine settings above "
        "(`cluster/openai/api_server.py`, `cluster/serve/command.py`).",
        "",
    ]
    for title, (names, rows) in groups.items():
        suffix = f": {title}" if title else ""
        lines += [f"### {' and '.join(names)}{suffix}", "", "| flag | description |", "| --- | --- |"]
        lines += [*rows, ""]
    return lines


def render() -> str:
    """The whole of docs/configuration.md."""
    lines = [_HEADER, *_engine_section(), *_serve_section(), *_flags_section()]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print, write or check docs/configuration.md; 1 when --check finds it out of date."""
    parser = argparse.ArgumentParser(
        prog="python -m cluster.config_reference", description=__doc__.splitlines()[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name} in docs/")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when docs/{DOC_PATH.name} is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
    elif args.check:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"docs/{DOC_PATH.name} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
