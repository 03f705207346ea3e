"""The front end's tokenizer: loaded from local files (engine/models/tokenizer_files.py), and the
chat template that turns a conversation into a prompt."""

from __future__ import annotations

import functools
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine.frontend.chat_tools import tools_in_text
from engine.models.tokenizer_files import load_tokenizer

__all__ = ["load_tokenizer", "render_chat_prompt"]

_PROBE_CONVERSATION = [{"role": "user", "content": "?"}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool", "description": "a probe"}}]


@functools.lru_cache(maxsize=32)
def renders_tools(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> bool:
    """Whether the chat template renders `tools=`: the prompt of a one-message conversation changes
    when a tool is given. Once per tokenizer and template."""
    options: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if chat_template is not None:
        options["chat_template"] = chat_template
    plain = tokenizer.apply_chat_template(_PROBE_CONVERSATION, **options)
    return tokenizer.apply_chat_template(_PROBE_CONVERSATION, tools=_PROBE_TOOLS, **options) != plain


def render_chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A conversation in the model's chat template, as a prompt with its text and token ids.

    `template_kwargs` are further template variables (a server's client may send them). The
    template writes the special tokens itself, so by default tokenizing adds none. `tools` (OpenAI's
    tool definitions) go to the template; one that ignores them gets them, and the conversation's
    tool calls, as text instead (engine/frontend/chat_tools.py). Raises jinja2.TemplateError when
    the template fails on the conversation.
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
    if tools and renders_tools(tokenizer, chat_template):
        text = tokenizer.apply_chat_template(conversation, tools=tools, **options)
    elif tools:
        text = tokenizer.apply_chat_template(tools_in_text(conversation, tools), **options)
    else:
        text = tokenizer.apply_chat_template(conversation, **options)
    return {
        "prompt": text,
        "prompt_token_ids": tokenizer(text, add_special_tokens=add_special_tokens).input_ids,
    }
