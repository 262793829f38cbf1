"""The ensemble's `postprocessing` model: one engine response -> its ``text_output``.

Served as model_repository/postprocessing/1/model.py (a symlink to this file). Each call
is stateless: the engine sends the ids that precede the response's new ids
(``context_ids``), which is all ``decode_window`` needs (textproc.response_text). The
token counts and finish reason pass through, so that every ensemble response comes out
of this one step whole.

Inputs, all outputs of the engine model (Triton allows a step's inputs to come from one
decoupled model only): ``output_ids``, ``context_ids`` (INT32 [-1]); ``llm_text_output``,
``llm_finish_reason`` (string); ``llm_num_input_tokens``, ``llm_num_output_tokens``,
``llm_num_cached_tokens`` (UINT32); ``llm_input_text`` (the prompt, when the request keeps
it in its output); ``cancel_token``. The request's parameters and the config.pbtxt
parameter ``skip_special_tokens`` give the text options (textproc.TextOptions).
Outputs: ``text_output``, ``finish_reason``, ``num_input_tokens``, ``num_output_tokens``,
``num_cached_tokens``.

Cancellation: Triton does not cancel a request an ensemble has already handed to a
composing model when the ensemble's client cancels; it only marks the ensemble's later
steps cancelled. So each run here checks its own request: when it is cancelled, it sends
the engine's ``cancel_token`` back to the engine model (a request with the parameter
``cancel``), which aborts the generation and frees its KV slots. The engine sends an
empty response now and then to a request that asked for a cancel token, so that this
check also runs while a long answer is generated without streaming. This model is
decoupled so that such an empty response produces no ensemble response (a request here
then ends with no response at all).
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

_PASSED_THROUGH = (("llm_num_input_tokens", "num_input_tokens"),
                   ("llm_num_output_tokens", "num_output_tokens"),
                   ("llm_num_cached_tokens", "num_cached_tokens"))
_NOT_FINISHED = "None"  # the engine's finish_reason of a sample still running
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _array(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _strings(request, name: str) -> list[str]:
    array = _array(request, name)
    if array is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


def _ids(request, name: str) -> list[int]:
    array = _array(request, name)
    return [] if array is None else [int(i) for i in array.reshape(-1)]


def _parameters(request) -> dict:
    """The ensemble request's parameters (Triton forwards them to every step)."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except json.JSONDecodeError:
        return {}
    return parameters if isinstance(parameters, dict) else {}


class TritonPythonModel:
    def initialize(self, args) -> None:
        protect_shm_region()  # before any text passes through it
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = textproc.tokenizer_dir(parameters, Path(args["model_repository"]))
        self.tokenizer = textproc.load_tokenizer(path)
        self.eos_ids = textproc.eos_token_ids(path, self.tokenizer)
        self.skip_special_tokens = parameters.get("skip_special_tokens", "true").lower() \
            in ("true", "1", "yes")
        self.engine_model = parameters.get("engine_model", "llm")
        pb_utils.Logger.log_info(f"postprocessing: tokenizer from {path}")
        # radixlm-serve stops the server if this stub dies (backend/stub_watch.py)
        self.watch = StubLink.open_logged(args["model_name"], args["model_instance_name"],
                                          pb_utils.Logger.log_error)

    def finalize(self) -> None:
        if self.watch is not None:
            self.watch.close()

    def execute(self, requests):
        for request in requests:
            response = self._respond(request)
            sender = request.get_response_sender()
            if response is None:
                sender.send(flags=_FINAL)
            else:
                sender.send(response, flags=_FINAL)
        return None

    def _respond(self, request):
        """The response to one engine response, or None for none (a heartbeat)."""
        try:
            if request.is_cancelled():
                self._cancel_engine_request(request)
                return pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(
                        "request cancelled", pb_utils.TritonError.CANCELLED))
            # one entry per sample (n > 1 answers arrive as one response whose output_ids
            # are the samples' ids back to back, split by num_output_tokens)
            raw_reasons = _strings(request, "llm_finish_reason") or [_NOT_FINISHED]
            reasons = ["" if r == _NOT_FINISHED else r for r in raw_reasons]
            ids, context = _ids(request, "output_ids"), _ids(request, "context_ids")
            if not ids and not any(reasons):
                return None  # a heartbeat
            engine_texts = _strings(request, "llm_text_output") or [None] * len(reasons)
            options = textproc.TextOptions.from_parameters(_parameters(request),
                                                           self.skip_special_tokens)
            counts = _ids(request, "llm_num_output_tokens") if len(reasons) > 1 else [len(ids)]
            lead = "".join(_strings(request, "llm_input_text"))  # the prompt, when kept
            texts, start = [], 0
            for reason, count, engine_text in zip(reasons, counts, engine_texts):
                texts.append(lead + textproc.response_text(
                    self.tokenizer, self.eos_ids, ids[start:start + count], context, reason,
                    options, engine_text=engine_text))
                start += count
            outputs = [pb_utils.Tensor("text_output", np.array([t.encode("utf-8") for t in texts],
                                                               dtype=np.object_)),
                       pb_utils.Tensor("finish_reason", np.array(
                           [r.encode() for r in raw_reasons], dtype=np.object_))]
            for source, name in _PASSED_THROUGH:
                array = _array(request, source)
                values = array.reshape(-1) if array is not None else np.zeros(0)
                outputs.append(pb_utils.Tensor(name, values.astype(np.uint32)))
            return pb_utils.InferenceResponse(output_tensors=outputs)
        except Exception as exc:  # a bug must fail this response only
            pb_utils.Logger.log_error(f"postprocessing: {exc!r}")
            error = pb_utils.TritonError(f"postprocessing failed: {exc}")
            return pb_utils.InferenceResponse(output_tensors=[], error=error)

    def _cancel_engine_request(self, request) -> None:
        """Hand the engine request's cancel token back to the engine model."""
        token = "".join(_strings(request, "cancel_token"))
        if not token:
            return
        cancel = pb_utils.InferenceRequest(model_name=self.engine_model, inputs=[],
                                           requested_output_names=["text_output"],
                                           parameters={"cancel": token})
        for response in cancel.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_warn(f"postprocessing: cancelling the engine request "
                                         f"failed: {response.error().message()}")
