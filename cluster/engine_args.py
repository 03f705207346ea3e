"""Engine settings as command-line flags, generated from the engine's config models.

Every flat key of `EngineConfig` becomes a dashed flag (`max_num_seqs` -> `--max-num-seqs`), plus
`--config FILE` for a flat YAML engine config. Flags default to `argparse.SUPPRESS`, so only what the
user passed reaches the engine and the pydantic models stay the only place defaults live.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from pydantic.fields import FieldInfo

from engine.config import EngineConfig, checked_flat_settings


def flag_name(key: str) -> str:
    """The command-line flag of a flat engine key."""
    return "--" + key.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per flat engine setting to `parser`, in an "engine" group."""
    group = parser.add_argument_group(
        "engine", "Engine settings; flags override the --config file, which overrides the defaults."
    )
    group.add_argument(
        "--config",
        dest="engine_config_file",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="flat YAML engine config, e.g. configs/engine/smollm2.yaml",
    )
    for key, (_, info) in EngineConfig.flat_fields().items():
        group.add_argument(flag_name(key), dest=key, default=argparse.SUPPRESS, **_flag_options(info))


def engine_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flat engine settings from `--config` and the flags actually given, checked.

    Raises ValueError with a message naming the bad flag (or the file and key) when the settings
    would not make a valid `EngineConfig`, so that callers can fail before loading any weights.
    """
    flags = {key: getattr(args, key) for key in EngineConfig.flat_fields() if hasattr(args, key)}
    path = getattr(args, "engine_config_file", None)
    return checked_flat_settings(path, flags, "--config", flag_name)


def _flag_options(info: FieldInfo) -> dict[str, Any]:
    """argparse options for one field: switches for booleans, choices for literals, else a string.

    Values stay strings for pydantic to convert, so that the CLI accepts exactly what the YAML
    and keyword forms accept (such as '4GiB' for a byte count).
    """
    # '%' would be read as a format directive by argparse's help formatter.
    help_text = (info.description or "").replace("%", "%%")
    if info.default is not None:
        help_text += f" (default: {info.default})"
    if info.annotation is bool:
        return {"action": argparse.BooleanOptionalAction, "help": help_text}
    choices = _literal_choices(info.annotation)
    if choices:
        return {"choices": choices, "help": help_text}
    return {"help": help_text}


def _literal_choices(annotation: Any) -> list[str] | None:
    """The allowed values of a Literal (or an optional Literal) annotation, else None."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(value) for value in typing.get_args(annotation)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return _literal_choices(members[0])
    return None
