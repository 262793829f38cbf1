"""What Triton's vLLM backend CI tests share (its ci/common/test_util.py), written for
our suite: building a request as those tests build it, and collecting stream results.

The ported tests (tests/test_vllm_ci_*.py) keep the upstream tests' structure and
names, so that each maps to its original; they differ only in the model name and
address (our `llm` and `ensemble` models on the session's server) and in what depends
on the engine (expected texts and counts come from our engine, not from OPT-125m).
"""
from __future__ import annotations

import json
import queue
import unittest

import numpy as np
import tritonclient.grpc as grpcclient


def create_vllm_request(prompt, request_id, stream, sampling_parameters, model_name,
                        send_parameters_as_tensor=True, exclude_input_in_output=None):
    """The inputs, requested output and parameters of one request, as the upstream
    helper makes them: the prompt, the stream flag, the sampling parameters as a JSON
    tensor (and always as request parameters too), and text_output requested."""
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"),
              grpcclient.InferInput("stream", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([stream], dtype=bool))
    if send_parameters_as_tensor:
        tensor = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        tensor.set_data_from_numpy(
            np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_))
        inputs.append(tensor)
    if exclude_input_in_output is not None:
        tensor = grpcclient.InferInput("exclude_input_in_output", [1], "BOOL")
        tensor.set_data_from_numpy(np.array([exclude_input_in_output], dtype=bool))
        inputs.append(tensor)
    return {"model_name": model_name, "inputs": inputs,
            "outputs": [grpcclient.InferRequestedOutput("text_output")],
            "request_id": str(request_id), "parameters": sampling_parameters}


class UserData:
    def __init__(self) -> None:
        self._completed_requests: queue.Queue = queue.Queue()


def callback(user_data: UserData, result, error) -> None:
    user_data._completed_requests.put(error if error else result)


class TestResultCollector(unittest.TestCase):
    """The upstream base class also writes a results file for its shell harness;
    pytest reports the results here."""
