"""Shared by the tests that run SGLang-style programs against a real tritonserver.

The programs are written as SGLang's users write them (``import radixlm as sgl``, the
default backend set once). On the CPU with the default model's random weights text rarely
ends by itself, so ``CappedBackend`` caps every gen's token budget: the programs keep
their own ``max_tokens`` and the tests still finish in seconds.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

import pytest

try:
    import radixlm as sgl
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm as sgl

from radixlm.backend import BaseBackend, OnText
from radixlm.results import GenerateResult, ScoreResult

MAX_TOKENS = 10

# What a gen constrained by REGEX_INT / REGEX_STR may hold when its budget cut it short.
INT_SO_FAR = r"[-+]?[0-9]*"
STR_SO_FAR = r'(?:"[\w\d\s]*"?)?'


class CappedBackend(BaseBackend):
    """``inner`` with every gen's ``max_tokens`` capped at ``max_tokens``; records the
    budgets the programs asked for and the results (unnamed gens have no meta info)."""

    def __init__(self, inner: BaseBackend, max_tokens: int = MAX_TOKENS):
        self.inner = inner
        self.max_tokens = max_tokens
        self.asked: list[int | None] = []
        self.results: list[tuple[dict[str, Any], GenerateResult]] = []

    def generate(self, prompt: str, params: dict[str, Any],
                 on_text: OnText | None = None) -> GenerateResult:
        self.asked.append(params.get("max_tokens"))
        capped = {**params, "max_tokens": min(params.get("max_tokens", 128), self.max_tokens)}
        result = self.inner.generate(prompt, capped, on_text)
        self.results.append((params, result))
        return result

    def score(self, prompt: str, choices: Sequence[str]) -> ScoreResult:
        return self.inner.score(prompt, choices)

    def cache_prefix(self, prompt: str) -> GenerateResult:
        return self.inner.cache_prefix(prompt)

    def chat_template(self):
        return self.inner.chat_template()

    def unconditional_prompt(self) -> str:
        return self.inner.unconditional_prompt()

    def get_server_info(self) -> dict[str, Any]:
        return self.inner.get_server_info()


@pytest.fixture(scope="module")
def http_endpoint(triton_server):
    endpoint = sgl.RuntimeEndpoint(f"http://{triton_server.http_url}")
    yield endpoint
    endpoint.close()


@pytest.fixture(scope="module")
def grpc_endpoint(triton_server):
    endpoint = sgl.RuntimeEndpoint(f"grpc://{triton_server.grpc_url}")
    yield endpoint
    endpoint.close()


@pytest.fixture
def capped(http_endpoint):
    """The default backend of the programs: the server over HTTP, budgets capped."""
    backend = CappedBackend(http_endpoint)
    sgl.set_default_backend(backend)
    yield backend
    sgl.set_default_backend(None)
