"""Port of the vLLM backend's ci/L0_backend_vllm/accuracy_test/accuracy_test.py.

Upstream compares the served model's greedy answers with vLLM's own engine run in the
test process (baselines written beforehand), for plain prompts and for a choice
constraint given as vLLM's ``structured_outputs``. Here the baseline is our engine run
in the test process with the served model's settings (the ``reference_engine``), and
the served models are `llm` and `ensemble`.
"""
from __future__ import annotations

import json
from functools import partial

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from vllm_ci_util import TestResultCollector, UserData, callback, create_vllm_request

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = [
    "The most dangerous animal is",
    "The capital of France is",
    "The future of AI is",
]
STRUCTURED_PROMPTS = ["Classify intent of the sentence: Harry Potter is underrated. "]
SAMPLING_PARAMETERS = {"temperature": 0, "top_p": 1}


def baseline_outputs(engine, prompts, structured_generation=None) -> list[bytes]:
    """Prompt + greedy answer of each prompt, from the engine in this process."""
    params = dict(SAMPLING_PARAMETERS)
    if structured_generation:
        params["choices"] = structured_generation["choice"]
    outs = engine.generate(prompts, params)
    return [(p + o.text).encode("utf-8") for p, o in zip(prompts, outs)]


@pytest.fixture(autouse=True)
def _server(request, triton_server, reference_engine):
    request.instance.triton_client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    request.instance.engine = reference_engine
    yield
    request.instance.triton_client.close()


class VLLMTritonAccuracyTest(TestResultCollector):
    vllm_model_name = "llm"

    def _triton_outputs(self, prompts, sampling_parameters) -> list[bytes]:
        user_data = UserData()
        self.triton_client.start_stream(callback=partial(callback, user_data))
        for i, prompt in enumerate(prompts):
            request_data = create_vllm_request(prompt, i, False, sampling_parameters,
                                               self.vllm_model_name)
            self.triton_client.async_stream_infer(
                model_name=self.vllm_model_name, request_id=request_data["request_id"],
                inputs=request_data["inputs"], outputs=request_data["outputs"],
                parameters=request_data["parameters"])
        outputs = {}
        for _ in prompts:
            result = user_data._completed_requests.get(timeout=120)
            self.assertIsNot(type(result), InferenceServerException, str(result))
            output = result.as_numpy("text_output")
            self.assertIsNotNone(output, "`text_output` should not be None")
            outputs[int(result.get_response().id)] = output[0]
        self.triton_client.stop_stream()
        return [outputs[i] for i in range(len(prompts))]

    def test_vllm_model(self):
        python_vllm_output = baseline_outputs(self.engine, PROMPTS)
        self.assertEqual(len(python_vllm_output), len(PROMPTS))
        self.assertEqual(self._triton_outputs(PROMPTS, SAMPLING_PARAMETERS), python_vllm_output)

    def test_structured_outputs(self):
        structured_outputs_params = {"choice": ["Positive", "Negative"]}
        python_vllm_output = baseline_outputs(self.engine, STRUCTURED_PROMPTS,
                                              structured_outputs_params)
        sampling_params = dict(SAMPLING_PARAMETERS)
        sampling_params["structured_outputs"] = json.dumps(structured_outputs_params)
        triton_vllm_output = self._triton_outputs(STRUCTURED_PROMPTS, sampling_params)
        self.assertEqual(triton_vllm_output, python_vllm_output)
        answer = triton_vllm_output[0].decode()[len(STRUCTURED_PROMPTS[0]):]
        self.assertIn(answer, structured_outputs_params["choice"])


class EnsembleAccuracyTest(VLLMTritonAccuracyTest):
    """The same through the `ensemble` model (text in, text out)."""

    vllm_model_name = "ensemble"
