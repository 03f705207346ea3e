"""Loading the tokenizer from local files: a Hugging Face folder, or the GGUF header itself.

Building a fast tokenizer from a GGUF vocabulary takes seconds, so the result is saved once under
$XDG_CACHE_HOME/raypage/tokenizers (keyed by the file's path, size and modification time) and
loaded from there afterwards.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.models.model_files import ModelSource


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "raypage" / "tokenizers"


def _gguf_cache_dir(path: Path) -> Path:
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    return _cache_root() / hashlib.blake2b(key.encode(), digest_size=12).hexdigest()


def _load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    cached = _gguf_cache_dir(path)
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
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"tokenizer {tokenizer!r}: no such folder (tokenizers are read from local files only)"
            )
        return AutoTokenizer.from_pretrained(path)
    if source.format == "gguf":
        return _load_gguf_tokenizer(source.path)
    return AutoTokenizer.from_pretrained(source.path)


def render_chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> dict[str, Any]:
    """A conversation in the model's chat template, as a prompt with its text and token ids.

    `template_kwargs` are further template variables (a server's client may send them). The
    template writes the special tokens itself, so by default tokenizing adds none. Raises
    jinja2.TemplateError when the template fails on the conversation.
    """
    options = {
        **(template_kwargs or {}),
        # Ours win over the given kwargs: the text, not ids, must come back.
        "tokenize": False,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    if chat_template is not None:
        options["chat_template"] = chat_template
    text = tokenizer.apply_chat_template(conversation, **options)
    return {
        "prompt": text,
        "prompt_token_ids": tokenizer(text, add_special_tokens=add_special_tokens).input_ids,
    }
