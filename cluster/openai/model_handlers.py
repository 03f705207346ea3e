"""The route handlers of each model an app serves, and which of them a request's `model` addresses
(one app can serve several models, each over its own engine client, as a Ray Serve ingress in front
of one LLMServer deployment per model does)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from http import HTTPStatus

from cluster.openai.engine_client import EngineClient
from cluster.openai.errors import OpenAIError
from cluster.openai.protocol import ModelCard
from cluster.openai.serving_chat import OpenAIServingChat
from cluster.openai.serving_completion import OpenAIServingCompletion
from cluster.openai.serving_tokenize import OpenAIServingTokenization


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model of the app: the engine client that runs it and the names clients call it by."""

    engine: EngineClient
    names: list[str]


@dataclasses.dataclass(frozen=True)
class ModelHandlers:
    """The completion, chat and tokenization handlers of one model."""

    model: ServedModel
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization


class ModelRouter:
    """Picks the handlers of the model a request names."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        default_timeout_s: float | None,
        prompt_tokens_details: bool,
        auto_tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.handlers = [
            ModelHandlers(
                model,
                OpenAIServingCompletion(model.engine, model.names, default_timeout_s, prompt_tokens_details),
                OpenAIServingChat(
                    model.engine,
                    model.names,
                    default_timeout_s,
                    prompt_tokens_details,
                    auto_tool_parser,
                    reasoning_parser,
                ),
                OpenAIServingTokenization(model.engine, model.names),
            )
            for model in models
        ]
        self._by_name = {name: handlers for handlers in self.handlers for name in handlers.model.names}

    def for_model(self, requested: str | None) -> ModelHandlers:
        """The handlers of the model named `requested` (the first model when it names none); 404 when
        no model has that name. With one model its handlers check the name themselves."""
        if len(self.handlers) == 1 or not requested:
            return self.handlers[0]
        if requested not in self._by_name:
            raise OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{requested}` does not exist.", "model")
        return self._by_name[requested]

    def model_cards(self) -> list[ModelCard]:
        """GET /v1/models: every served name of every model."""
        return [
            ModelCard(
                id=name,
                root=handlers.model.engine.config.model.model,
                max_model_len=handlers.model.engine.config.model.max_model_len,
            )
            for handlers in self.handlers
            for name in handlers.model.names
        ]

    @property
    def engines(self) -> list[EngineClient]:
        return [handlers.model.engine for handlers in self.handlers]
