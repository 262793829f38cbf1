"""``radixlm-openai``: serve the OpenAI-compatible API with uvicorn."""
from __future__ import annotations

import argparse

from .. import wire
from .app import Settings, create_app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="radixlm-openai",
        description="OpenAI-compatible HTTP API for a RadixLM Triton server (over gRPC).")
    parser.add_argument("--grpc-url", default="localhost:8001",
                        help="the Triton server's gRPC address (default: %(default)s)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--model", default=wire.MODEL_NAME,
                        help="the Triton model that runs the engine (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients give as 'model' (default: --model)")
    parser.add_argument("--default-max-tokens", type=int, default=None,
                        help="max_tokens of requests that set none (default: the engine's)")
    parser.add_argument("--tokenizer", default=None,
                        help="the served model's folder (its tokenizer files): serves "
                             "/tokenize, /detokenize and /tokenizer_info (default: none)")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    settings = Settings(grpc_url=args.grpc_url, triton_model=args.model,
                        served_model_name=args.served_model_name or args.model,
                        default_max_tokens=args.default_max_tokens, tokenizer=args.tokenizer)
    uvicorn.run(create_app(settings), host=args.host, port=args.port,
                log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
