"""RadixLM client: gRPC/HTTP clients for the `llm` model and SGLang's frontend language.

SGLang programs move over with ``import radixlm as sgl`` and a backend that names the
server: ``sgl.set_default_backend(sgl.RuntimeEndpoint("http://localhost:8000"))``.
"""
from .aio import AsyncTritonClient
from .api import (Anthropic, Engine, LiteLLM, OpenAI, Runtime, VertexAI, assistant, assistant_begin, assistant_end, flush_cache,
                  gen, gen_int, gen_string, get_server_info, image, select, separate_reasoning,
                  system, system_begin, system_end, user, user_begin, user_end, video)
from .backend import BaseBackend, Triton
from .chat_template import ChatTemplate
from .choices import (ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection,
                      token_length_normalized, unconditional_likelihood_normalized)
from .client import Stream, TritonClient
from .endpoint import RuntimeEndpoint
from .errors import ProgramError, ServerError
from .global_config import global_config
from .http_client import HttpTritonClient
from .ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from .program import Function, function, get_default_backend, set_default_backend
from .results import Chunk, ChoiceScore, GenerateResult, ScoreResult
from .state import ForkGroup, ProgramState

__all__ = [
    "Anthropic", "LiteLLM", "OpenAI", "VertexAI", "AsyncTritonClient", "BaseBackend", "ChatTemplate", "ChoiceScore", "ChoicesDecision",
    "ChoicesSamplingMethod", "Chunk", "Engine", "ForkGroup", "Function", "GenerateResult",
    "HttpTritonClient", "ProgramError", "ProgramState", "REGEX_BOOL", "REGEX_FLOAT",
    "REGEX_INT", "REGEX_STR", "Runtime", "RuntimeEndpoint", "ScoreResult", "ServerError",
    "Stream", "Triton", "TritonClient", "assistant", "assistant_begin", "assistant_end",
    "flush_cache", "function", "gen", "gen_int", "gen_string", "get_default_backend",
    "get_server_info", "global_config", "greedy_token_selection", "image", "select",
    "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end", "video",
]
__version__ = "0.1.0"
