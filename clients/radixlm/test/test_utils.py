"""``sglang.test.test_utils``: the command line and backend of SGLang's benchmark scripts.

The defaults point at a local server's HTTP port (Triton's 8000); ``--port 8001`` with
``--host grpc://127.0.0.1`` goes over gRPC instead.
"""
from __future__ import annotations

import argparse

from ..endpoint import RuntimeEndpoint

DEFAULT_HOST = "http://127.0.0.1"
DEFAULT_PORT = 8000


def add_common_sglang_args_and_parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--host", type=str, default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--backend", type=str, default="srt")
    parser.add_argument("--result-file", type=str, default="result.jsonl")
    parser.add_argument("--raw-result-file", type=str)
    return parser.parse_args()


def select_sglang_backend(args: argparse.Namespace) -> RuntimeEndpoint:
    if not args.backend.startswith("srt"):
        raise ValueError(f"backend {args.backend!r}: only the server's own backend ('srt', a "
                         "RuntimeEndpoint) is available here")
    return RuntimeEndpoint(f"{args.host}:{args.port}")
