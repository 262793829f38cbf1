"""``RuntimeEndpoint``: the backend SGLang programs name by URL.

    radixlm.set_default_backend(radixlm.RuntimeEndpoint("http://localhost:8000"))

``http://`` / ``https://`` talk to Triton's HTTP port (``generate``, ``generate_stream``);
``grpc://host:port`` or a bare ``host:port`` to its gRPC port.
"""
from __future__ import annotations

import ssl
from urllib.parse import urlsplit

from .backend import Triton
from .chat_template import ChatTemplate
from .client import TritonClient
from .http_client import HttpTritonClient

CHAT_TEMPLATES = {"chatml": ChatTemplate.chatml}


def _ssl_context(verify: bool | str | None) -> ssl.SSLContext | None:
    if verify is None or verify is True:
        return None
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=verify)


class RuntimeEndpoint(Triton):
    """The `llm` model of the Triton server at ``base_url``.

    ``api_key`` is sent as a bearer token (HTTP only); ``verify`` is False, or a CA bundle,
    for ``https://``; ``chat_template_name`` ("chatml") overrides the model's own template.
    """

    def __init__(self, base_url: str, api_key: str | None = None,
                 verify: bool | str | None = None, chat_template_name: str | None = None,
                 model: str = "llm"):
        parts = urlsplit(base_url if "://" in base_url else f"grpc://{base_url}")
        if not parts.hostname:
            raise ValueError(f"RuntimeEndpoint: no host in {base_url!r}")
        if parts.scheme in ("http", "https"):
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            client = HttpTritonClient(f"{parts.scheme}://{parts.netloc}", model, headers,
                                      _ssl_context(verify) if parts.scheme == "https" else None)
        elif parts.scheme == "grpc":
            if api_key:
                raise ValueError("RuntimeEndpoint: api_key is sent over HTTP only")
            client = TritonClient(parts.netloc, model)
        else:
            raise ValueError(f"RuntimeEndpoint: unsupported scheme {parts.scheme!r} in "
                             f"{base_url!r} (http, https or grpc)")
        super().__init__(client=client)
        self.base_url = base_url
        if chat_template_name is not None:
            if chat_template_name not in CHAT_TEMPLATES:
                raise ValueError(f"RuntimeEndpoint: unknown chat_template_name "
                                 f"{chat_template_name!r}; known: {', '.join(CHAT_TEMPLATES)}")
            self._template = CHAT_TEMPLATES[chat_template_name]()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"
