"""The Triton side of a request, over the stub's ``triton_python_backend_utils``: reading
its inputs and parameters, answering it (``serving.ResponseSink``), and the metric
families of the model (``backend.metrics.MetricFactory``).

Which calls are round trips to the server process (python_backend's stub): a response
send, ``is_cancelled`` and every metric update each wait for tritonserver; a request's
inputs, parameters, requested outputs, timeout and response sender were put in shared
memory with the request and cost none. The round trips are counted by kind in an
``IpcCounts`` (the debug stats report them).
"""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from backend import wire
from backend.diagnostics import IpcCounts

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

class TritonResponseSink:
    """``serving.ResponseSink`` over one request's response sender."""

    def __init__(self, request, ipc: IpcCounts) -> None:
        self._ipc = ipc
        self._request = request
        self._sender = request.get_response_sender()
        # Only the outputs the client asked for (none named: all of them). Each output
        # tensor is one more shared-memory block per streamed response.
        try:
            self.wanted = frozenset(request.requested_output_names()) or None
        except AttributeError:  # an older python backend
            self.wanted = None

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        wanted = self.wanted
        tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()
                   if wanted is None or name in wanted]
        self._ipc.response_sends += 1
        try:
            self._sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                              flags=_FINAL if final else 0)
        finally:
            if final:
                self._release()

    def send_error(self, message: str, cancelled: bool = False) -> None:
        code = pb_utils.TritonError.CANCELLED if cancelled else pb_utils.TritonError.INVALID_ARG
        error = pb_utils.TritonError(message, code)
        self._ipc.error_sends += 1
        try:
            self._sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error),
                              flags=_FINAL)
        finally:
            self._release()

    def _release(self) -> None:
        """Drop the request at its final response. Triton counts a request in flight
        (and will not unload the model) until the stub's request object is destroyed;
        the bookkeeping that still points at this sink may sit in a reference cycle that
        only the cyclic collector frees, and this process allocates too little for that
        to run soon."""
        self._request = None
        self._sender = None

    def is_cancelled(self) -> bool:
        # One IPC round trip to the server process (~30-70 us): the loop polls it for
        # every pending request, so ask once (the request's flag is the sender's too).
        request = self._request
        if request is None:
            return True
        self._ipc.cancel_polls += 1
        return request.is_cancelled()


class TritonMetricFactory:
    """``backend.metrics.MetricFactory`` over ``pb_utils.MetricFamily``: one family per
    metric name, kept until ``close`` (Triton wants a family to outlive its metrics)."""

    def __init__(self, ipc: IpcCounts) -> None:
        self._ipc = ipc
        self._families: dict[str, object] = {}

    def _family(self, name: str, description: str, kind):
        if name not in self._families:
            self._families[name] = pb_utils.MetricFamily(name=name, description=description,
                                                         kind=kind)
        return self._families[name]

    def counter(self, name, description, labels):
        family = self._family(name, description, pb_utils.MetricFamily.COUNTER)
        return _CountedMetric(family.Metric(labels=labels), self._ipc)

    def gauge(self, name, description, labels):
        family = self._family(name, description, pb_utils.MetricFamily.GAUGE)
        return _CountedMetric(family.Metric(labels=labels), self._ipc)

    def histogram(self, name, description, labels, buckets):
        kind = getattr(pb_utils.MetricFamily, "HISTOGRAM", None)  # Triton 2.49+
        if kind is None:
            raise NotImplementedError("this Python backend has no histogram metrics")
        metric = self._family(name, description, kind).Metric(labels=labels, buckets=list(buckets))
        return _CountedMetric(metric, self._ipc)

    def close(self) -> None:
        self._families.clear()


class _CountedMetric:
    """A ``pb_utils`` metric whose updates (one round trip each) are counted."""

    __slots__ = ("_metric", "_ipc")

    def __init__(self, metric, ipc: IpcCounts) -> None:
        self._metric = metric
        self._ipc = ipc

    def increment(self, value: float) -> None:
        self._ipc.metric_increments += 1
        self._metric.increment(value)

    def set(self, value: float) -> None:
        self._ipc.metric_sets += 1
        self._metric.set(value)

    def observe(self, value: float) -> None:
        self._ipc.metric_observes += 1
        self._metric.observe(value)


def read_inputs(request) -> dict[str, np.ndarray]:
    # one inputs() call: pb_utils.get_input_tensor_by_name rebuilds the request's whole
    # input list for every name it looks up
    return {name: tensor.as_numpy() for tensor in request.inputs()
            if (name := tensor.name()) in _INPUT_NAMES}


_INPUT_NAMES = frozenset(wire.INPUT_NAMES)


def read_parameters(request) -> dict:
    text = request.parameters()
    if not text:
        return {}
    try:
        parameters = json.loads(text)
    except json.JSONDecodeError as exc:
        raise wire.InputError(f"request parameters are not valid JSON: {exc}") from exc
    return parameters if isinstance(parameters, dict) else {}
