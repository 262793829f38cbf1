"""The model's config.pbtxt ``parameters``: engine settings (``EngineConfig``), the
serving layer's own (``engine_process``), and what describes the model to clients."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from backend.core.config import EngineConfig

# config.pbtxt parameters that describe the model to clients (published by the backend
# from the model's tokenizer files when config.pbtxt does not set them); not engine settings.
MODEL_INFO_PARAMETERS = ("chat_template", "eos_token", "bos_token")
# config.pbtxt parameters of the serving layer, not of EngineConfig: engine_process
# ("auto", the default: on for CUDA devices; "true": the engine steps in a child process
# of the stub; "false": in a thread of the stub) and request_timeout_s (below)
SERVING_PARAMETERS = ("engine_process", "request_timeout_s")
DEFAULT_REQUEST_TIMEOUT_S = 600.0

_PATH_KEYS = ("model_path", "tokenizer_path")
# Where relative model paths may also live: the project root holding backend/ (this file
# is backend/model_config.py; with an editable install it stays in the project).
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _convert(key: str, annotation: str, text: str) -> Any:
    text = text.strip()
    if "None" in annotation and text.lower() in ("", "none", "null"):
        return None
    try:
        if annotation.startswith("bool"):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if annotation.startswith("int"):
            return int(text)
        if annotation.startswith("float"):
            return float(text)
    except ValueError:
        raise ValueError(f"model parameter {key}={text!r} is not a valid {annotation}") from None
    return text


def engine_process_wanted(parameters: Mapping[str, str], device: str,
                          instances: int = 1, tensor_parallel_size: int = 1) -> bool:
    """The ``engine_process`` parameter: true, false, or auto (the default: on for CUDA
    devices, where the host's per-step work competes with response sending, wherever
    several instances of the model share a device: they then share one engine process,
    and for tensor-parallel engines, whose rank 0 starts the other ranks from a Python
    interpreter of its own; on CPU with one instance the forward pass itself is the step,
    and a process would only add a hop)."""
    text = parameters.get("engine_process", "auto")
    if text.strip().lower() == "auto":
        return device.startswith("cuda") or instances > 1 or tensor_parallel_size > 1
    wanted = _convert("engine_process", "bool", text)
    if not wanted and tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 needs engine_process true (or auto): "
                         "rank 0 starts the other ranks from its own process")
    return wanted


def check_tensor_parallel_instance(kind: str, device_id: int, tensor_parallel_size: int) -> None:
    """A tensor-parallel engine on GPU d takes GPUs d .. d + size - 1. Run it as a
    KIND_MODEL instance (GPUs 0 .. size - 1), or as KIND_GPU instances on GPUs that are
    multiples of the size (``gpus: [0, 2, 4, 6]`` at size 2: one engine per GPU pair)."""
    if tensor_parallel_size > 1 and kind == "GPU" and device_id % tensor_parallel_size:
        raise ValueError(
            f"a KIND_GPU instance on GPU {device_id} would share GPUs with the one on GPU "
            f"{device_id - device_id % tensor_parallel_size} at tensor_parallel_size "
            f"{tensor_parallel_size}: use instance_group [ {{ count: 1, kind: KIND_MODEL }} ]"
            f" or list gpus that are multiples of {tensor_parallel_size}")


def request_timeout_s(parameters: Mapping[str, str]) -> float | None:
    """The ``request_timeout_s`` parameter: how long a request that is not streamed may
    run before it is cancelled (600 s by default; 0: no limit).

    Why: Triton 2.51's HTTP frontend does not read the connection while a request runs,
    so a client of ``generate`` that disconnects is never seen (only a streamed response
    fails to send, and gRPC cancels); without a limit its request would generate to its
    end. A client may ask for less with Triton's request ``timeout`` parameter."""
    text = parameters.get("request_timeout_s", "").strip()
    value = DEFAULT_REQUEST_TIMEOUT_S if not text else _convert("request_timeout_s", "float", text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"model parameter request_timeout_s={text!r} must be a finite "
                         "number of seconds >= 0")
    return value or None


def time_limit_s(streamed: bool, request_timeout: float | None,
                 client_timeout_us: int) -> float | None:
    """A request's time limit: the client's Triton ``timeout`` (microseconds, 0: none) and,
    for a request that is not streamed, the model's ``request_timeout_s``; None: none."""
    limits = [] if streamed or request_timeout is None else [request_timeout]
    if client_timeout_us and client_timeout_us > 0:
        limits.append(client_timeout_us / 1e6)
    return min(limits) if limits else None


# The vLLM backend's switch for its vllm:* metrics (upper case: Triton's convention for
# backend parameters); here they are on unless it is "false".
REPORT_CUSTOM_METRICS = "REPORT_CUSTOM_METRICS"


def vllm_metrics_wanted(parameters: Mapping[str, str]) -> bool:
    """Whether to publish the vllm:* series next to ours (docs/metrics.md). Off unless
    asked, as in the vLLM backend, and for its reason: they observe every generated
    token, and every observation is an IPC round trip from the stub to the server."""
    return _convert(REPORT_CUSTOM_METRICS, "bool",
                    parameters.get(REPORT_CUSTOM_METRICS, "false"))


def instances_on_device(model_config: Mapping[str, Any], kind: str, device_id: int) -> int:
    """How many instances of the model Triton runs on this instance's device: its
    ``instance_group`` counts (a KIND_GPU group places ``count`` instances on each of its
    ``gpus``, every GPU when it lists none)."""
    total = 0
    for group in model_config.get("instance_group") or [{}]:
        count = int(group.get("count", 1) or 1)
        group_kind = str(group.get("kind", "KIND_AUTO")).removeprefix("KIND_")
        if kind == "GPU" and group_kind in ("GPU", "AUTO"):
            gpus = [int(g) for g in group.get("gpus") or []]
            total += count if not gpus or device_id in gpus else 0
        elif kind != "GPU" and group_kind != "GPU":
            total += count
    return max(total, 1)


def resolve_path(value: str, search_dirs: list[Path]) -> str:
    """An absolute path as is; a relative one against the first search dir holding it."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    for base in search_dirs:
        if (base / path).exists():
            return str((base / path).resolve())
    tried = ", ".join(str(b / path) for b in search_dirs)
    raise ValueError(f"{value!r} not found (tried {tried})")


def engine_config_from_parameters(parameters: Mapping[str, str],
                                  search_dirs: list[Path]) -> EngineConfig:
    """EngineConfig from config.pbtxt ``parameters`` (all strings). Every EngineConfig
    field may be set by its name; unknown lower-case keys are an error (upper-case keys
    belong to Triton's Python backend, e.g. EXECUTION_ENV_PATH)."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
    kwargs: dict[str, Any] = {}
    for key, text in parameters.items():
        if key.isupper() or key in MODEL_INFO_PARAMETERS or key in SERVING_PARAMETERS:
            continue
        if key not in fields:
            raise ValueError(f"unknown model parameter {key!r}; known: {', '.join(sorted(fields))}")
        value = _convert(key, fields[key], text)
        if key in _PATH_KEYS and value is not None:
            value = resolve_path(value, search_dirs)
        kwargs[key] = value
    if "model_path" not in kwargs:
        raise ValueError("config.pbtxt must set the parameter 'model_path'")
    return EngineConfig(**kwargs)


def read_model_info(parameters: Mapping[str, str], search_dirs: list[Path]) -> dict[str, str]:
    """chat_template / eos_token / bos_token of the configured model, read from its
    tokenizer files or GGUF metadata (no tokenizer is loaded); {} when unreadable."""
    from backend.core.loaders import tokenizer_info

    try:
        path = parameters.get("tokenizer_path") or parameters["model_path"]
        return tokenizer_info(resolve_path(path, search_dirs)).as_parameters()
    except (KeyError, ValueError, OSError):
        return {}
