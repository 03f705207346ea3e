"""The names one model is served under: its own, and those of its LoRA adapters (vLLM's
OpenAIServingModels), each adapter a `LoRARequest` that a request's `model` picks.

Adapters come from three places:
- static modules (`--lora-modules name=path`, or vLLM's JSON form), loaded when the server starts;
- a dynamic loading folder (Ray Serve LLM's `dynamic_lora_loading_path`): `<base>:<adapter>` names
  the PEFT folder `<folder>/<adapter>`, taken on first use;
- `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` at run time, when runtime updating is
  allowed (`--allow-runtime-lora-updating`, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).

The server numbers its adapters itself (`lora_int_id`, from 1), as vLLM does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

from cluster.openai.engine_client import EngineClient
from cluster.openai.errors import OpenAIError
from cluster.openai.protocol import ModelCard
from engine.lora.request import LoRARequest

# vLLM's switch for the runtime load and unload routes (off unless set to true or 1).
RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# A PEFT adapter folder holds this file; the dynamic folder's adapters are the subfolders that do.
ADAPTER_CONFIG = "adapter_config.json"
# The adapter part of `<base>:<adapter>`: one plain folder name, never a path out of the folder.
_ADAPTER_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def runtime_lora_updating_allowed(flag: bool = False) -> bool:
    """Whether the runtime load/unload routes are served: the flag, or vLLM's environment variable."""
    return flag or os.environ.get(RUNTIME_LORA_UPDATING_ENV, "").strip().lower() in ("1", "true")


def model_not_found(requested: str) -> OpenAIError:
    """The 404 of a request for a model that nothing serves (vLLM's message)."""
    return OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{requested}` does not exist.", "model")


def adapter_name_taken(lora_name: str) -> OpenAIError:
    """The 400 of a runtime load under a name already served (vLLM's message)."""
    return OpenAIError(
        HTTPStatus.BAD_REQUEST, f"The lora adapter '{lora_name}' has already been loaded.", "lora_name"
    )


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """A static adapter: the name clients use, its PEFT folder, and the base model it belongs to
    (shown as its /v1/models `parent`; None: the served model's first name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str | Mapping[str, Any]) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON object (`{"name", "path", "base_model_name"}`, as text or as a
    mapping from a YAML file); ValueError saying what is wrong."""
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        name, sep, path = value.partition("=")
        if not (sep and name and path):
            raise ValueError(f"LoRA module {value!r}: expected name=path or a JSON object")
        return LoRAModulePath(name, path)
    try:
        fields = json.loads(value) if isinstance(value, str) else dict(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"LoRA module {value!r}: invalid JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"LoRA module {value!r}: expected a JSON object")
    unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
    missing = [key for key in ("name", "path") if not isinstance(fields.get(key), str) or not fields[key]]
    if unknown or missing:
        problem = (
            f"unknown key(s) {unknown}" if unknown else f"{' and '.join(missing)} must be non-empty strings"
        )
        raise ValueError(f"LoRA module {value!r}: {problem} (keys: name, path, base_model_name)")
    return LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))


@dataclasses.dataclass(frozen=True)
class LoRASources:
    """Where a served model's adapters come from: static modules, and the dynamic loading folder."""

    modules: tuple[LoRAModulePath, ...] = ()
    dynamic_path: str | None = None

    def __post_init__(self) -> None:
        names = [module.name for module in self.modules]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"LoRA module name(s) {', '.join(map(repr, repeated))} given more than once")

    @property
    def configured(self) -> bool:
        return bool(self.modules) or self.dynamic_path is not None


class OpenAIServingModels:
    """One model's served names and adapters; `resolve` turns a request's `model` into the name
    its response carries and the adapter (if any) it runs with. `on_lora_request(model, adapter,
    count)` is told of the engine requests that run with an adapter (a metrics counter)."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_names: Sequence[str],
        lora: LoRASources | None = None,
        on_lora_request: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self._lora = lora or LoRASources()
        self._on_lora_request = on_lora_request
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        # Loads and unloads await the engine: one at a time, so that a name is checked and taken at once.
        self._lock = asyncio.Lock()

    @property
    def base_model_name(self) -> str:
        return self.served_model_names[0]

    async def init_static_loras(self) -> None:
        """Load the static modules into the engine; ValueError (the server does not start) for a bad one."""
        for module in self._lora.modules:
            await self._add(module.name, module.path, module.base_model_name)

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The name a request addresses (the first served name when it names none) and its adapter;
        404 when no model or adapter has that name."""
        if not requested:
            return self.base_model_name, None
        if requested in self.served_model_names:
            return requested, None
        lora = self.lora_requests.get(requested)
        dynamic = self._dynamic_folder(requested) if lora is None else None
        if dynamic is not None:
            # Registered on first use; the engine loads and checks it with the request (a bad one
            # is that request's 400).
            base, folder = dynamic
            lora = LoRARequest(requested, next(self._ids), str(folder), base)
            self.lora_requests[requested] = lora
        if lora is None:
            raise model_not_found(requested)
        return requested, lora

    def serves(self, requested: str) -> bool:
        """Whether `requested` names this model or one of its adapters."""
        return (
            requested in self.served_model_names
            or requested in self.lora_requests
            or self._dynamic_folder(requested) is not None
        )

    def count_requests(self, lora: LoRARequest, num_requests: int) -> None:
        """Tell the metrics that `num_requests` engine requests run with `lora`."""
        if self._on_lora_request is not None:
            self._on_lora_request(self.base_model_name, lora.lora_name, num_requests)

    def model_cards(self) -> list[ModelCard]:
        """GET /v1/models: the served names, then each adapter with its base model as `parent` and its
        folder as `root` (vLLM's cards), then the dynamic folder's adapters not used yet."""
        max_model_len = self.engine.config.model.max_model_len
        cards = [
            ModelCard(id=name, root=self.engine.config.model.model, max_model_len=max_model_len)
            for name in self.served_model_names
        ]
        cards += [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=lora.base_model_name or self.base_model_name,
                max_model_len=max_model_len,
            )
            for lora in self.lora_requests.values()
        ]
        for folder in self._dynamic_folders():
            name = f"{self.base_model_name}:{folder.name}"
            if name not in self.lora_requests:
                cards.append(
                    ModelCard(
                        id=name, root=str(folder), parent=self.base_model_name, max_model_len=max_model_len
                    )
                )
        return cards

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """POST /v1/load_lora_adapter: the engine checks and loads the adapter; 400 for a taken name
        or a bad adapter (the engine's message names the adapter and the field)."""
        async with self._lock:
            if self.serves(lora_name):
                raise adapter_name_taken(lora_name)
            try:
                await self._add(lora_name, lora_path, None)
            except ValueError as exc:
                raise OpenAIError(HTTPStatus.BAD_REQUEST, str(exc), "lora_path") from None

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """POST /v1/unload_lora_adapter: requests can no longer name it, and the engine drops it;
        404 for a name that is not loaded."""
        async with self._lock:
            lora = self.lora_requests.pop(lora_name, None)
            if lora is None:
                raise OpenAIError(
                    HTTPStatus.NOT_FOUND, f"The lora adapter '{lora_name}' cannot be found.", "lora_name"
                )
            await self.engine.remove_lora(lora.lora_int_id)

    async def _add(self, name: str, path: str, base_model_name: str | None) -> None:
        lora = LoRARequest(name, next(self._ids), path, base_model_name or self.base_model_name)
        await self.engine.add_lora(lora)
        self.lora_requests[name] = lora

    def _dynamic_folder(self, requested: str) -> tuple[str, Path] | None:
        """The base name and the dynamic folder's adapter folder that `<base>:<adapter>` names."""
        if self._lora.dynamic_path is None:
            return None
        for base in self.served_model_names:
            adapter = requested.removeprefix(base + ":")
            if adapter == requested or not _ADAPTER_FOLDER_NAME.fullmatch(adapter):
                continue
            folder = Path(self._lora.dynamic_path) / adapter
            if folder.is_dir():
                return base, folder
        return None

    def _dynamic_folders(self) -> list[Path]:
        if self._lora.dynamic_path is None:
            return []
        root = Path(self._lora.dynamic_path)
        if not root.is_dir():
            return []
        return sorted(
            folder
            for folder in root.iterdir()
            if _ADAPTER_FOLDER_NAME.fullmatch(folder.name) and (folder / ADAPTER_CONFIG).is_file()
        )
