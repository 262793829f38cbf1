"""RadixLM client: gRPC client for the `llm` model and the SGLang-style frontend language."""
from .aio import AsyncTritonClient
from .backend import BaseBackend, Triton
from .chat_template import ChatTemplate
from .client import Stream, TritonClient
from .errors import ProgramError, ServerError
from .ir import assistant, gen, select, system, user
from .program import Function, function, get_default_backend, set_default_backend
from .results import Chunk, ChoiceScore, GenerateResult, ScoreResult
from .state import ForkGroup, ProgramState

__all__ = [
    "AsyncTritonClient", "BaseBackend", "ChatTemplate", "ChoiceScore", "Chunk", "ForkGroup",
    "Function", "GenerateResult", "ProgramError", "ProgramState", "ScoreResult", "ServerError",
    "Stream", "Triton", "TritonClient", "assistant", "function", "gen", "get_default_backend",
    "select", "set_default_backend", "system", "user",
]
__version__ = "0.1.0"
