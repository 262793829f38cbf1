"""Who may use the administrative side of the server: a token, sent as a header.

Triton's administrative APIs (logging settings, tracing, shared-memory registration, model
loading and the repository index) are open to every client unless tritonserver restricts
them (``--http-restricted-api`` / ``--grpc-restricted-protocol``, which demand a header).
radixlm-serve and the image restrict them (``backend.server_flags``) to the header
``radixlm-admin-token: <token>`` over HTTP (``triton-grpc-protocol-radixlm-admin-token``
over gRPC: Triton's prefix), the token being ``RADIXLM_ADMIN_TOKEN`` (a random one nobody
knows when it is not set, which keeps them closed). Our own administrative request, the
``debug: stats`` request of the engine model, follows the same rule: over gRPC
tritonserver forwards the header to the model as a request parameter
(``--grpc-header-forward-pattern``); Triton 2.51's HTTP ``generate`` endpoint forwards no
headers, so there the token goes in the request's ``parameters`` under the header's name.
The stub compares what came with the token in its environment; without one (a plain
``tritonserver`` started with no ``RADIXLM_ADMIN_TOKEN``) debug requests are refused.
"""
from __future__ import annotations

import hmac
import os
import secrets
from typing import Mapping, MutableMapping

ADMIN_TOKEN_ENV = "RADIXLM_ADMIN_TOKEN"
ADMIN_HEADER = "radixlm-admin-token"
# Triton checks gRPC restricted protocols against this header (its fixed prefix + our key)
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
_HEADER_NAMES = (ADMIN_HEADER, GRPC_ADMIN_HEADER)
# Kept open: health, metadata, inference, model-config (clients read the chat template
# from it) and statistics (what the metrics port says anyway).
RESTRICTED_APIS = ("logging", "trace", "shared-memory", "model-repository")


def ensure_token(environ: MutableMapping[str, str]) -> str:
    """The admin token of ``environ``; a random one, set there, when it has none."""
    token = environ.get(ADMIN_TOKEN_ENV, "").strip()
    if not token:
        token = secrets.token_urlsafe(32)
        environ[ADMIN_TOKEN_ENV] = token
    return token


def check_token(token: str) -> str:
    """Triton's flag syntax (``<apis>:<key>=<value>``) and HTTP headers limit the token
    to printable characters without ``:``, ``=``, ``,`` or spaces."""
    if not token or any(c in ":=, \t\r\n" or not c.isprintable() for c in token):
        raise ValueError(f"{ADMIN_TOKEN_ENV} must be printable, without spaces, ':', '=' "
                         "or ','")
    return token


def take_presented(parameters: MutableMapping[str, object]) -> list[str]:
    """Remove the admin token (a forwarded header, or a parameter of that name) from a
    request's parameters, so that it never reaches the engine; its values."""
    found = [key for key in parameters if key.lower() in _HEADER_NAMES]
    return [str(parameters.pop(key)) for key in found]


def admitted(presented: list[str], environ: Mapping[str, str] | None = None) -> bool:
    token = (os.environ if environ is None else environ).get(ADMIN_TOKEN_ENV, "")
    return bool(token) and any(hmac.compare_digest(value.encode(), token.encode())
                               for value in presented)


def refusal() -> str:
    return (f"debug requests are restricted: send the server's admin token "
            f"({ADMIN_TOKEN_ENV}) as the request parameter or gRPC header '{ADMIN_HEADER}'")
