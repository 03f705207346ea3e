"""Where a model's tokenizer lives on disk, for every process that needs it.

A Hugging Face folder carries its own `tokenizer.json` (or a separate tokenizer folder does). A GGUF
file carries its vocabulary in its header, which transformers turns into a fast tokenizer in
seconds: the front end saves that tokenizer once under $XDG_CACHE_HOME/raypage/tokenizers (keyed by
the file's path, size and modification time, and the transformers version) and loads it from there
afterwards. The engine core reads the same files when a grammar needs the vocabulary, without
importing transformers when they are there.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.models.model_files import ModelSource

TOKENIZER_JSON = "tokenizer.json"


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "raypage" / "tokenizers"


def gguf_tokenizer_dir(path: Path) -> Path:
    """The folder a GGUF file's converted tokenizer is (or will be) saved in."""
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{importlib.metadata.version('transformers')}"
    return _cache_root() / hashlib.blake2b(key.encode(), digest_size=12).hexdigest()


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a GGUF file: from the cache, or converted (and cached) first."""
    from transformers import AutoTokenizer

    cached = gguf_tokenizer_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cached.parent))
    try:
        tokenizer.save_pretrained(staging)
        staging.rename(cached)  # atomic: a concurrent loader sees all of it or nothing
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race, or the disk is read-only
    return tokenizer


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer from local files: `tokenizer` (a folder) if given, else the model's own."""
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"tokenizer {tokenizer!r}: no such folder (tokenizers are read from local files only)"
            )
        return _load_folder_tokenizer(path)
    if source.format == "gguf":
        return load_gguf_tokenizer(source.path)
    return _load_folder_tokenizer(source.path)


def _load_folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer on a folder, given the folder's config.json as a plain PretrainedConfig when it
    has one. Left to find the config itself, AutoTokenizer builds the family's own config class,
    whose import (the family's modeling helpers, torch's distributed tensors) is about a second of
    each server's start-up, to read the model_type and tokenizer_class that the plain one holds too."""
    from transformers import AutoTokenizer, PretrainedConfig

    config_file = folder / "config.json"
    if not config_file.is_file():
        return AutoTokenizer.from_pretrained(folder)
    config = PretrainedConfig.from_dict(json.loads(config_file.read_text()))
    config.name_or_path = str(folder)  # as AutoConfig names it: some rules match on it
    return AutoTokenizer.from_pretrained(folder, config=config)


def tokenizer_json(model_path: Path, model_format: str, tokenizer: str | None = None) -> str:
    """The model's fast tokenizer as the `tokenizers` library's JSON: read from its file where one
    is on disk (transformers is then not imported), else from the tokenizer transformers loads."""
    if tokenizer is not None:
        folder = Path(tokenizer).expanduser()
    elif model_format == "gguf":
        folder = gguf_tokenizer_dir(model_path)
    else:
        folder = model_path
    if (folder / TOKENIZER_JSON).is_file():
        return (folder / TOKENIZER_JSON).read_text()
    if tokenizer is None and model_format == "gguf":
        loaded = load_gguf_tokenizer(model_path)
    else:
        loaded = _load_folder_tokenizer(folder)
    if not loaded.is_fast:
        raise ValueError(f"{folder}: structured outputs need a fast tokenizer (a tokenizer.json)")
    return loaded.backend_tokenizer.to_str()
