"""An OpenAI-compatible HTTP server in front of the `llm` model's Triton gRPC endpoint.

``radixlm-openai --grpc-url localhost:8001 --port 8080`` serves ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` and ``/health`` (see clients/README.md).
Needs the ``openai`` extra: ``pip install 'radixlm[openai]'``.
"""
from .app import Settings, create_app

__all__ = ["Settings", "create_app"]
