"""The `<think>…</think>` formats of vLLM's `deepseek_r1` and `qwen3` reasoning parsers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster.openai.reasoning_parsers.base import ReasoningParser, ReasoningStart


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and QwQ: the chat template ends the prompt with `<think>\\n`, so the output
    usually has no start tag; everything before the first `</think>` is reasoning (all of it when the
    output has none), a leading `<think>` (older templates) is dropped."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 and Qwen3.5: as deepseek_r1 (vLLM's current qwen3 rule: Qwen3 writes `<think>` itself,
    Qwen3.5's template puts it in the prompt), and the request's `chat_template_kwargs`
    `{"enable_thinking": false}` (Qwen3's switch) makes the whole output content."""

    name = "qwen3"

    @classmethod
    def reasoning_start(
        cls, prompt_text: str, template_kwargs: Mapping[str, Any], constrained: bool
    ) -> ReasoningStart:
        if template_kwargs.get("enable_thinking") is False:
            return ReasoningStart.CONTENT
        return super().reasoning_start(prompt_text, template_kwargs, constrained)
