"""RadixLM's engine: radix KV cache, paged pools, continuous-batching scheduler, model
runner, sampling and structured decoding. Runs without a Triton server (CPU or GPU)."""
from .config import EngineConfig
from .engine import Engine
from .outputs import ChoiceScore, RequestOutput, StepOutput, TokenLogprob
from .sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "StepOutput",
           "TokenLogprob", "ChoiceScore"]
