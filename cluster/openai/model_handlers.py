"""The route handlers of each model an app serves, and which of them a request's `model` addresses
(one app can serve several models, each over its own engine client, as a Ray Serve ingress in front
of one LLMServer deployment per model does; a model's LoRA adapters are addressed by their own names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from cluster.openai.engine_client import EngineClient
from cluster.openai.protocol import ModelCard
from cluster.openai.serving_chat import OpenAIServingChat
from cluster.openai.serving_completion import OpenAIServingCompletion
from cluster.openai.serving_models import (
    LoRASources,
    OpenAIServingModels,
    adapter_name_taken,
    model_not_found,
)
from cluster.openai.serving_tokenize import OpenAIServingTokenization


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model of the app: the engine client that runs it, the names clients call it by, and
    where its LoRA adapters come from."""

    engine: EngineClient
    names: list[str]
    lora: LoRASources = dataclasses.field(default_factory=LoRASources)


@dataclasses.dataclass(frozen=True)
class ModelHandlers:
    """The names and adapters, and the completion, chat and tokenization handlers of one model."""

    models: OpenAIServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization


class ModelRouter:
    """Picks the handlers of the model a request names (or of the model whose adapter it names);
    `on_lora_request(model, adapter, count)` counts the engine requests that run with an adapter."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        default_timeout_s: float | None,
        prompt_tokens_details: bool,
        auto_tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        on_lora_request: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.handlers = []
        for model in models:
            served = OpenAIServingModels(model.engine, model.names, model.lora, on_lora_request)
            self.handlers.append(
                ModelHandlers(
                    served,
                    OpenAIServingCompletion(served, default_timeout_s, prompt_tokens_details),
                    OpenAIServingChat(
                        served, default_timeout_s, prompt_tokens_details, auto_tool_parser, reasoning_parser
                    ),
                    OpenAIServingTokenization(served),
                )
            )
        self._by_name = {
            name: handlers for handlers in self.handlers for name in handlers.models.served_model_names
        }

    def for_model(self, requested: str | None) -> ModelHandlers:
        """The handlers of the model named `requested`, or whose adapter it names (the first model
        when it names none); 404 when nothing has that name. With one model its handlers check the
        name themselves."""
        if len(self.handlers) == 1 or not requested:
            return self.handlers[0]
        if requested in self._by_name:
            return self._by_name[requested]
        owner = self._adapter_owner(requested)
        if owner is None:
            raise model_not_found(requested)
        return owner

    def model_cards(self) -> list[ModelCard]:
        """GET /v1/models: every served name of every model, and every adapter."""
        return [card for handlers in self.handlers for card in handlers.models.model_cards()]

    async def init_static_loras(self) -> None:
        """Load every model's static adapters; ValueError (the server does not start) for a bad one."""
        for handlers in self.handlers:
            await handlers.models.init_static_loras()

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load an adapter of the first model (the one a request that names none gets); 400 when the
        name is taken, by any model or adapter, or the adapter is bad."""
        first, *others = self.handlers
        if any(handlers.models.serves(lora_name) for handlers in others):
            raise adapter_name_taken(lora_name)
        await first.models.load_lora_adapter(lora_name, lora_path)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload the adapter of whichever model has it; 404 when none has."""
        owner = next((h for h in self.handlers if lora_name in h.models.lora_requests), self.handlers[0])
        await owner.models.unload_lora_adapter(lora_name)

    @property
    def engines(self) -> list[EngineClient]:
        return [handlers.models.engine for handlers in self.handlers]

    def _adapter_owner(self, requested: str) -> ModelHandlers | None:
        return next((handlers for handlers in self.handlers if handlers.models.serves(requested)), None)
