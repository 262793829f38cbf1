"""Client for the `llm` model over Triton's HTTP ``generate`` / ``generate_stream`` endpoints.

The same calls as the gRPC ``TritonClient`` (generate, generate_stream, score,
model_config, chat_template), for programs that name the server by an ``http://`` URL as
SGLang programs do. Standard library only. Triton writes a one-element output as a JSON
scalar and a longer one as a list; ``_getter`` turns both back into arrays for the
shared codec in wire.py.
"""
from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Any, Iterator, Sequence

import numpy as np

from . import wire
from .chat_template import ChatTemplate
from .client import sampling_params
from .errors import ServerError
from .results import Chunk, GenerateResult, ScoreResult, merge_chunks

TIMEOUT_S = 3600.0


def _getter(body: dict[str, Any]):
    def get(name: str) -> np.ndarray | None:
        if name not in body:
            return None
        value = body[name]
        return np.asarray(value if isinstance(value, list) else [value], dtype=np.object_)
    return get


class HttpTritonClient:
    def __init__(self, url: str = "http://localhost:8000", model: str = wire.MODEL_NAME,
                 headers: dict[str, str] | None = None,
                 ssl_context: ssl.SSLContext | None = None):
        self.url = url.rstrip("/")
        self.model = model
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        self._ssl = ssl_context
        self._config: dict | None = None

    # -- the calls --------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], request_id: str | None = None,
                 **params) -> GenerateResult:
        body = self._post("generate", self._request(prompt, params, False), request_id)
        return merge_chunks(self._chunks(body))

    def generate_stream(self, prompt: str | Sequence[int], request_id: str | None = None,
                        **params) -> Iterator[Chunk]:
        request = self._request(prompt, params, True)
        with self._open("generate_stream", request, request_id) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                body = json.loads(line[len("data:"):])
                if "error" in body:
                    raise ServerError(body["error"], request_id)
                yield from self._chunks(body)

    def score(self, prompt: str, choices: Sequence[str],
              request_id: str | None = None) -> ScoreResult:
        request = self._request(prompt, {}, False)
        request[wire.CHOICES] = json.dumps(list(choices))
        body = self._post("generate", request, request_id)
        get = _getter(body)
        scores = wire.decode_choice_scores(get)
        if scores is None:
            raise ServerError("scoring response carried no choice_scores", request_id)
        chunk = wire.decode_chunk(get)
        return ScoreResult(tuple(scores), chunk.num_input_tokens, chunk.num_cached_tokens)

    def flush_cache(self) -> bool:
        """Ask the server to drop every cached prefix no request uses; False when it
        refuses (a server may restrict debug requests)."""
        try:
            self._post("generate", {"parameters": wire.flush_cache_parameters(os.environ)}, None)
        except ServerError:
            return False
        return True

    def model_config(self) -> dict:
        if self._config is None:
            url = f"{self.url}/v2/models/{self.model}/config"
            request = urllib.request.Request(url, headers=self._headers)
            with self._urlopen(request, None) as response:
                self._config = json.loads(response.read())
        return self._config

    def chat_template(self) -> ChatTemplate:
        params = self.model_config().get("parameters", {})

        def param(key: str) -> str:
            return params.get(key, {}).get("string_value", "")

        return ChatTemplate.from_jinja(param(wire.CHAT_TEMPLATE_PARAM),
                                       eos_token=param(wire.EOS_TOKEN_PARAM))

    def close(self) -> None:
        """Nothing to release: every call opens its own connection."""

    # -- plumbing ---------------------------------------------------------------------------
    def _request(self, prompt, params: dict[str, Any], stream: bool) -> dict[str, Any]:
        params = sampling_params(params)
        request: dict[str, Any] = {
            wire.STREAM: stream, wire.EXCLUDE_INPUT_IN_OUTPUT: True,
            wire.SAMPLING_PARAMETERS: wire.sampling_json(params),
            # the server sends an optional output only when its return_* input asks
            **{flag: True for flag in wire.return_flags(params)},
        }
        if isinstance(prompt, str):
            request[wire.TEXT_INPUT] = prompt
        else:
            request[wire.INPUT_IDS] = [int(t) for t in prompt]
        return request

    @staticmethod
    def _chunks(body: dict[str, Any]) -> list[Chunk]:
        return [c for c in wire.decode_chunks(_getter(body))
                if c.text or c.output_ids or c.finish_reason]

    def _post(self, endpoint: str, request: dict[str, Any],
              request_id: str | None) -> dict[str, Any]:
        with self._open(endpoint, request, request_id) as response:
            return json.loads(response.read())

    def _open(self, endpoint: str, request: dict[str, Any], request_id: str | None):
        """The response of one POST; ``request_id`` only names the request in errors."""
        url = f"{self.url}/v2/models/{self.model}/{endpoint}"
        data = json.dumps(request).encode("utf-8")
        return self._urlopen(urllib.request.Request(url, data=data, headers=self._headers,
                                                    method="POST"), request_id)

    def _urlopen(self, request: urllib.request.Request, request_id: str | None):
        try:
            return urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self._ssl)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            try:
                message = json.loads(text).get("error", text)
            except ValueError:
                message = text
            raise ServerError(message or f"HTTP {exc.code}", request_id) from exc
        except urllib.error.URLError as exc:
            raise ServerError(f"cannot reach {request.full_url}: {exc.reason}",
                              request_id) from exc
