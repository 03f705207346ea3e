"""POST /tokenize and /detokenize (vLLM's extensions): the server's own tokenizer and chat template,
so that clients can count tokens exactly as the engine will."""

from __future__ import annotations

from http import HTTPStatus

from cluster.openai.errors import OpenAIError
from cluster.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from cluster.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """The tokenize and detokenize handlers."""

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.resolve_model(request.model)
        if request.messages is not None:
            token_ids = self.render_chat(
                request.messages,
                request.add_generation_prompt,
                add_special_tokens=bool(request.add_special_tokens),
            ).token_ids
        else:
            add_special_tokens = request.add_special_tokens is not False
            token_ids = self.tokenizer(request.prompt, add_special_tokens=add_special_tokens).input_ids
        token_strs = self.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids, token_strs=token_strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.resolve_model(request.model)
        vocab_size = self.engine.input_processor.vocab_size
        outside = [token for token in request.tokens if not 0 <= token < vocab_size]
        if outside:
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"token id {outside[0]} is out of vocabulary (valid ids are 0 to {vocab_size - 1})",
                "tokens",
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
