"""The bodies of vLLM's /tokenize and /detokenize routes."""

from __future__ import annotations

from pydantic import BaseModel, model_validator

from cluster.openai.protocol import ChatMessage, OpenAIBaseModel, TokenId


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: a prompt, or messages rendered with the chat template (vLLM's fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(BaseModel):
    """POST /tokenize."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """POST /detokenize."""

    prompt: str
