"""The ensemble's `preprocessing` model: prompt -> ``input_ids`` for the engine model.

Served as model_repository/preprocessing/1/model.py (a symlink to this file). Several
CPU instances tokenize in parallel, off the engine's process. The rules are in
textproc.py; this file only moves tensors.

Inputs (all optional, see textproc.prompt_ids): ``text_input`` (string), ``messages``
(string, JSON chat), ``apply_chat_template`` (bool), ``exclude_input_in_output`` (bool,
passed on to the engine; unset, it is the engine model's default: true when ``stream``
is, false otherwise, so a whole answer starts with its prompt).
Outputs: ``input_ids`` (INT64 [-1]) and ``exclude_input_in_output`` (BOOL [1]).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# This file's real folder (ensemble/), so that its sibling textproc.py imports.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import textproc  # noqa: E402
from backend.stub_watch import StubLink, protect_shm_region  # noqa: E402


def _text(request, name: str) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise textproc.RequestError(f"'{name}' must hold exactly one string")
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise textproc.RequestError(f"'{name}' is not valid UTF-8") from None
    return str(value)


def _flag(request, name: str, default: bool = False) -> bool:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    array = tensor.as_numpy()
    if array.size != 1:
        raise textproc.RequestError(f"'{name}' must hold exactly one boolean")
    return bool(array.reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args) -> None:
        protect_shm_region()  # before any text passes through it
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = textproc.tokenizer_dir(parameters, Path(args["model_repository"]))
        self.tokenizer = textproc.load_tokenizer(path)
        pb_utils.Logger.log_info(f"preprocessing: tokenizer from {path}")
        # radixlm-serve stops the server if this stub dies (backend/stub_watch.py)
        self.watch = StubLink.open_logged(args["model_name"], args["model_instance_name"],
                                          pb_utils.Logger.log_error)

    def finalize(self) -> None:
        if self.watch is not None:
            self.watch.close()

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = textproc.prompt_ids(self.tokenizer, text=_text(request, "text_input"),
                                          messages=_text(request, "messages"),
                                          apply_chat_template=_flag(request, "apply_chat_template"))
                exclude = _flag(request, "exclude_input_in_output",
                                default=_flag(request, "stream"))
                outputs = [pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int64)),
                           pb_utils.Tensor("exclude_input_in_output", np.array([exclude]))]
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            except textproc.RequestError as exc:
                responses.append(_error(str(exc)))
            except Exception as exc:  # a bug must fail this request only
                pb_utils.Logger.log_error(f"preprocessing: {exc!r}")
                responses.append(_error(f"preprocessing failed: {exc}"))
        return responses


def _error(message: str):
    error = pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
