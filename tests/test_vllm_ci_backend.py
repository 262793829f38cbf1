"""Port of the vLLM backend's ci/L0_backend_vllm/vllm_backend/vllm_backend_test.py.

Upstream runs vllm_opt (OPT-125m) on localhost:8001 with explicit model control, loads
and unloads a copy of it next to a Python model and an ensemble, fails to load two
broken copies, and checks the prompt echo (exclude_input_in_output). Here: `llm` (and
`ensemble`, where it applies) on the session's server; the load/unload tests run on a
server of their own in explicit model-control mode over a repository made the same way
(a copy of `llm`, a Python add/sub model, a one-step ensemble, two broken copies: an
unknown engine setting, a model path that does not exist). Expected texts are our
engine's (the in-process reference engine's greedy output), not OPT's.
"""
from __future__ import annotations

import re
import shutil
import textwrap
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from conftest import ADMIN_TOKEN, MODEL_REPOSITORY, _stop, start_server
from vllm_ci_util import TestResultCollector, UserData, callback, create_vllm_request

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = [
    "The most dangerous animal is",
    "The capital of France is",
    "The future of AI is",
]
SAMPLING_PARAMETERS = {"temperature": "0", "top_p": "1"}

ADD_SUB = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''
ADD_SUB_CONFIG = '''
name: "add_sub"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU } ]
'''
ENSEMBLE_CONFIG = '''
name: "ensemble_model"
platform: "ensemble"
max_batch_size: 0
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] },
        { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling { step [ {
  model_name: "llm_load_test" model_version: -1
  input_map { key: "text_input" value: "text_input" }
  input_map { key: "stream" value: "stream" }
  input_map { key: "sampling_parameters" value: "sampling_parameters" }
  output_map { key: "text_output" value: "text_output" } } ] }
'''


class AdminClient(grpcclient.InferenceServerClient):
    """Upstream's client with the server's admin token on model control, which our server
    restricts (upstream's calls are otherwise unchanged)."""

    HEADERS = {"triton-grpc-protocol-radixlm-admin-token": ADMIN_TOKEN}

    def load_model(self, model_name, headers=None, **kwargs):
        return super().load_model(model_name, headers={**self.HEADERS, **(headers or {})},
                                  **kwargs)

    def unload_model(self, model_name, headers=None, **kwargs):
        return super().unload_model(model_name, headers={**self.HEADERS, **(headers or {})},
                                    **kwargs)


def _copy_llm(repo, name: str, edit=lambda text: text) -> None:
    (repo / name / "1").mkdir(parents=True)
    text = (MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    text = re.sub(r'^name: "llm"', f'name: "{name}"', text, flags=re.M)
    (repo / name / "config.pbtxt").write_text(edit(text))


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    """A server in explicit model-control mode with the upstream test's repository."""
    repo = tmp_path_factory.mktemp("vllm_ci_models")
    shutil.copytree(MODEL_REPOSITORY / "llm", repo / "llm")
    _copy_llm(repo, "llm_load_test")
    _copy_llm(repo, "vllm_invalid_1", lambda t: t + '\nparameters: { key: "invalid_attribute"'
                                                   ' value: { string_value: "true" } }\n')
    _copy_llm(repo, "vllm_invalid_2", lambda t: t.replace(
        'string_value: "models/default"', 'string_value: "invalid_model"'))
    (repo / "add_sub" / "1").mkdir(parents=True)
    (repo / "add_sub" / "1" / "model.py").write_text(textwrap.dedent(ADD_SUB))
    (repo / "add_sub" / "config.pbtxt").write_text(ADD_SUB_CONFIG)
    (repo / "ensemble_model" / "1").mkdir(parents=True)
    (repo / "ensemble_model" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    # Triton's strict readiness is false in this repository (it holds models that are
    # not loaded), and the engine model takes a server that is not ready for one that is
    # stopping: readiness stays plain liveness here.
    server = start_server(tmp_path_factory.mktemp("explicit") / "server.log",
                          (f"--model-repository={repo}", "--model-control-mode=explicit",
                           "--load-model=llm", "--strict-readiness=false"))
    try:
        yield server
    finally:
        _stop(server.process)


@pytest.fixture(scope="module")
def expected(reference_engine):
    """The greedy answer (16 tokens, vLLM's default length) to each prompt."""
    outs = reference_engine.generate(PROMPTS, {"temperature": 0, "top_p": 1})
    return {p: o.text for p, o in zip(PROMPTS, outs)}


class _VllmModelTests(TestResultCollector):
    __test__ = False  # the shared tests; the classes below run them, each on its model
    vllm_model_name = "llm"

    def _test_vllm_model(self, prompts, sampling_parameters, stream, send_parameters_as_tensor,
                         exclude_input_in_output=None, expected_output=None, model_name=None):
        model_name = model_name or self.vllm_model_name
        user_data = UserData()
        number_of_vllm_reqs = len(prompts)
        self.triton_client.start_stream(callback=partial(callback, user_data))
        for i in range(number_of_vllm_reqs):
            request_data = create_vllm_request(prompts[i], i, stream, sampling_parameters,
                                               model_name, send_parameters_as_tensor,
                                               exclude_input_in_output=exclude_input_in_output)
            self.triton_client.async_stream_infer(
                model_name=model_name, request_id=request_data["request_id"],
                inputs=request_data["inputs"], outputs=request_data["outputs"],
                parameters=sampling_parameters)
        results = {}
        for _ in range(number_of_vllm_reqs):
            result = user_data._completed_requests.get(timeout=120)
            self.assertIsNot(type(result), InferenceServerException, str(result))
            output = result.as_numpy("text_output")
            self.assertIsNotNone(output, "`text_output` should not be None")
            results[int(result.get_response().id)] = output
        if expected_output is not None:
            for i in range(number_of_vllm_reqs):
                self.assertEqual(results[i], expected_output[i])
        self.triton_client.stop_stream()

    def _expected(self, prompt: str, prepend: bool) -> list[bytes]:
        return [((prompt if prepend else "") + self.answers[prompt]).encode("utf-8")]

    def test_exclude_input_in_output_default(self):
        """Not streaming, exclude_input_in_output unset: the prompt leads the answer."""
        prompt = "The capital of France is"
        self._test_vllm_model([prompt], SAMPLING_PARAMETERS, stream=False,
                              send_parameters_as_tensor=True,
                              expected_output=self._expected(prompt, True))

    def test_exclude_input_in_output_false(self):
        prompt = "The capital of France is"
        self._test_vllm_model([prompt], SAMPLING_PARAMETERS, stream=False,
                              send_parameters_as_tensor=True, exclude_input_in_output=False,
                              expected_output=self._expected(prompt, True))

    def test_exclude_input_in_output_true(self):
        prompt = "The capital of France is"
        self._test_vllm_model([prompt], SAMPLING_PARAMETERS, stream=False,
                              send_parameters_as_tensor=True, exclude_input_in_output=True,
                              expected_output=self._expected(prompt, False))


@pytest.fixture(autouse=True)
def _clients(request, triton_server, expected):
    if isinstance(request.instance, _VllmModelTests):
        request.instance.triton_client = grpcclient.InferenceServerClient(triton_server.grpc_url)
        request.instance.answers = expected
        yield
        request.instance.triton_client.close()
    else:
        yield


class VLLMTritonBackendTest(_VllmModelTests):
    """Upstream's test class on `llm`."""

    __test__ = True


class EnsembleTritonBackendTest(_VllmModelTests):
    """The same echo tests through the `ensemble` model (text in, text out)."""

    __test__ = True
    vllm_model_name = "ensemble"


class TestModelLoading:
    """Upstream's load/unload tests, on the explicit model-control server."""

    python_model_name = "add_sub"
    ensemble_model_name = "ensemble_model"
    vllm_load_test = "llm_load_test"

    def test_vllm_triton_backend(self, explicit_server, expected):
        client = AdminClient(explicit_server.grpc_url)
        client.load_model(self.vllm_load_test)
        assert client.is_model_ready(self.vllm_load_test)
        client.load_model(self.python_model_name)
        assert client.is_model_ready(self.python_model_name)
        # ensembles over the engine load next to it
        client.load_model(self.ensemble_model_name)
        assert client.is_model_ready(self.ensemble_model_name)
        client.unload_model(self.ensemble_model_name)
        client.unload_model(self.vllm_load_test)
        assert not client.is_model_ready(self.vllm_load_test)
        self._test_python_model(client)
        client.load_model(self.vllm_load_test)
        assert client.is_model_ready(self.vllm_load_test)
        client.unload_model(self.python_model_name)
        assert not client.is_model_ready(self.python_model_name)
        for as_tensor in (True, False):
            tests = _VllmModelTests("_test_vllm_model")
            tests.triton_client = client
            tests._test_vllm_model(PROMPTS, SAMPLING_PARAMETERS, stream=False,
                                   send_parameters_as_tensor=as_tensor,
                                   model_name=self.vllm_load_test,
                                   expected_output=[(p + expected[p]).encode() for p in PROMPTS])
        client.unload_model(self.vllm_load_test)
        assert not client.is_model_ready(self.vllm_load_test)
        client.close()

    def test_model_with_invalid_attributes(self, explicit_server):
        client = AdminClient(explicit_server.grpc_url)
        with pytest.raises(InferenceServerException, match="invalid_attribute"):
            client.load_model("vllm_invalid_1")

    def test_vllm_invalid_model_name(self, explicit_server):
        client = AdminClient(explicit_server.grpc_url)
        with pytest.raises(InferenceServerException, match="invalid_model"):
            client.load_model("vllm_invalid_2")

    @staticmethod
    def _test_python_model(client) -> None:
        a = np.random.rand(4).astype(np.float32)
        b = np.random.rand(4).astype(np.float32)
        inputs = [grpcclient.InferInput("INPUT0", a.shape, np_to_triton_dtype(a.dtype)),
                  grpcclient.InferInput("INPUT1", b.shape, np_to_triton_dtype(b.dtype))]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"),
                   grpcclient.InferRequestedOutput("OUTPUT1")]
        response = client.infer("add_sub", inputs, request_id="10", outputs=outputs)
        assert np.allclose(a + b, response.as_numpy("OUTPUT0"))
        assert np.allclose(a - b, response.as_numpy("OUTPUT1"))
