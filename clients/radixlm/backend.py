"""The backend contract the interpreter runs programs against, and its Triton implementation."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

from . import wire
from .chat_template import ChatTemplate
from .client import TritonClient
from .http_client import HttpTritonClient
from .results import GenerateResult, ScoreResult, merge_chunks

OnText = Callable[[str], None]


class BaseBackend(ABC):
    """A model server as the language sees it: generate text, score choices, render roles."""

    @abstractmethod
    def generate(self, prompt: str, params: dict[str, Any],
                 on_text: OnText | None = None) -> GenerateResult:
        """Generate a continuation of ``prompt`` with wire sampling ``params``.

        When ``on_text`` is given it is called with each new piece as it is produced; the
        pieces concatenate to the result's ``text``. Failures raise (``ServerError``).
        """

    @abstractmethod
    def score(self, prompt: str, choices: Sequence[str]) -> ScoreResult:
        """Log-probabilities of each choice's tokens following ``prompt``, in choice order."""

    def chat_template(self) -> ChatTemplate:
        """Role prefixes and suffixes of the served model."""
        return ChatTemplate.chatml()

    def cache_prefix(self, prompt: str) -> GenerateResult:
        """Prefill ``prompt`` once so that requests extending it hit the prefix cache."""
        return self.generate(prompt, {"max_tokens": 1, "temperature": 0.0})

    def unconditional_prompt(self) -> str:
        """The text choices are scored after when they must be scored "without context"
        (``unconditional_likelihood_normalized``): the model's end-of-text token."""
        raise NotImplementedError(f"{type(self).__name__} cannot score choices without context")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template()

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def flush_cache(self) -> bool:
        raise NotImplementedError("the server has no endpoint that empties its prefix cache")

    def close(self) -> None:
        """Release connections."""


class Triton(BaseBackend):
    """Runs programs against the `llm` model of a Triton server, over gRPC (``TritonClient``)
    or HTTP (``HttpTritonClient``)."""

    def __init__(self, url: str = "localhost:8001", model: str = "llm",
                 client: "TritonClient | HttpTritonClient | None" = None):
        self.client = client or TritonClient(url, model)
        self._template: ChatTemplate | None = None
        self._lock = threading.Lock()

    def generate(self, prompt: str, params: dict[str, Any],
                 on_text: OnText | None = None) -> GenerateResult:
        if on_text is None:
            return self.client.generate(prompt, **params)
        chunks = []
        for chunk in self.client.generate_stream(prompt, **params):
            chunks.append(chunk)
            if chunk.text and chunk.index == 0:
                on_text(chunk.text)
        return merge_chunks(chunks)

    def score(self, prompt: str, choices: Sequence[str]) -> ScoreResult:
        return self.client.score(prompt, choices)

    def chat_template(self) -> ChatTemplate:
        with self._lock:
            if self._template is None:
                self._template = self.client.chat_template()
            return self._template

    def _parameters(self) -> dict[str, str]:
        params = self.client.model_config().get("parameters", {})
        return {k: v.get("string_value", "") for k, v in params.items()}

    def unconditional_prompt(self) -> str:
        params = self._parameters()
        token = params.get(wire.EOS_TOKEN_PARAM) or params.get(wire.BOS_TOKEN_PARAM)
        if not token:
            raise ValueError("scoring choices without context needs the model's eos_token or "
                             "bos_token (model config parameters); the server publishes neither")
        return token

    def get_model_name(self) -> str:
        return self._parameters().get("model_path") or self.client.model

    def get_server_info(self) -> dict[str, Any]:
        params = self._parameters()
        model_path = params.get("model_path", "")
        return {"model": self.client.model, "model_path": model_path,
                "tokenizer_path": params.get("tokenizer_path") or model_path,
                "parameters": params}

    def flush_cache(self) -> bool:
        return self.client.flush_cache()

    def close(self) -> None:
        self.client.close()
