"""Tools in a chat prompt, for chat templates that do not render them.

Templates written for tool calling (Qwen, Hermes, Llama 3.1, Mistral) take `tools=` and render an
assistant's `tool_calls` and the `tool` messages that answer them. A template that ignores them
(SmolLM2's among many) would drop the tools silently, and the model would never learn what it may
call. For those, the conversation is rewritten before it is rendered (the documented fallback, in
the Hermes format that most open models are tuned on):

- the tools' JSON definitions go into the system message (appended to the conversation's own, or
  in a system message of their own), with an instruction to answer with `<tool_call>` blocks;
- an assistant message's tool calls become `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  lines after its text; `tool` messages keep their role and content.
"""

from __future__ import annotations

import json
from typing import Any

_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tools_in_text(conversation: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tools described in its system message and every assistant tool
    call written out as text (for a template that renders neither)."""
    described = _INSTRUCTIONS.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    messages = [_calls_in_text(message) for message in conversation]
    if messages and messages[0].get("role") == "system":
        own = messages[0].get("content") or ""
        messages[0] = {**messages[0], "content": f"{own}\n\n{described}" if own else described}
    else:
        messages.insert(0, {"role": "system", "content": described})
    return messages


def _calls_in_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    blocks = [
        "<tool_call>\n"
        + json.dumps(
            {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}, ensure_ascii=False
        )
        + "\n</tool_call>"
        for call in calls
    ]
    text = "\n".join([message["content"], *blocks] if message.get("content") else blocks)
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": text}
