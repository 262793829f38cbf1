"""RadixLM's engine: radix KV cache, paged pools, continuous-batching scheduler, model
runner, sampling and structured decoding. Runs without a Triton server (CPU or GPU).

The names below are loaded on first use, so that importing a torch-free part of the
package (``backend.core.detokenizer``, ``backend.core.config``, the policy modules)
does not import torch and transformers."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineConfig": "config", "Engine": "engine", "SamplingParams": "sampling_params",
    "RequestOutput": "outputs", "StepOutput": "outputs", "TokenLogprob": "outputs",
    "ChoiceScore": "outputs", "EngineHandle": "handle", "GenerateRequest": "handle",
    "ScoreRequest": "handle", "OutputBatch": "handle", "EngineDied": "handle",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
