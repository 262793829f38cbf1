"""Port of the vLLM backend's ci/L0_check_health_vllm/check_health_test.py.

Upstream makes a mock vLLM engine fail its health check: the request that finds it
unhealthy fails, the model is unloaded (not ready), and the next request finds no
model. Our engine's equivalent of an unhealthy engine is a dead engine loop (a debug
request injects that fault when RADIXLM_FAULT_INJECTION=1): the request in flight
fails with the reason, readiness goes false, and the server stops (the default
RADIXLM_ON_ENGINE_FAILURE=shutdown; an orchestrator restarts it), so the last request
finds no server. The healthy case runs on the session's server as `llm`.
"""
from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import ADMIN_PARAMETERS, SERVED_MODEL, _stop, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]


class TestCheckHealth:
    _model_name = SERVED_MODEL
    _sampling_parameters = {"temperature": "0", "top_p": "1"}
    _prompt = "In this example,"

    def _get_inputs(self, prompt, stream=True, sampling_parameters=None):
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"),
                  grpcclient.InferInput("stream", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([stream], dtype=bool))
        if sampling_parameters is not None:
            tensor = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
            tensor.set_data_from_numpy(np.array(
                [json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_))
            inputs.append(tensor)
        return inputs

    def _callback(self, result, error):
        self._responses.append({"result": result, "error": error})

    def _llm_infer(self, url, parameters=None):
        inputs = self._get_inputs(self._prompt, stream=True,
                                  sampling_parameters=self._sampling_parameters)
        self._responses = []
        with grpcclient.InferenceServerClient(url) as client:
            client.start_stream(self._callback)
            try:
                client.async_stream_infer(self._model_name, inputs=inputs,
                                          parameters=parameters or self._sampling_parameters)
            except InferenceServerException as exc:  # no server: the stream broke at once
                if not self._responses:
                    self._responses.append({"result": None, "error": exc})
            client.stop_stream()

    def _assert_text_output_valid(self, expected_text):
        text_output = ""
        for response in self._responses:
            result, error = response["result"], response["error"]
            assert error is None
            text_output += result.as_numpy(name="text_output")[0].decode("utf-8")
        assert len(text_output) > 0, "output is empty"
        assert text_output == expected_text  # upstream: "is a sentence" (OPT's English)

    def _assert_infer_exception(self, expected_exception_message):
        assert len(self._responses) == 1
        for response in self._responses:
            result, error = response["result"], response["error"]
            assert result is None
            assert re.search(expected_exception_message, str(error)), str(error)

    def _assert_model_ready(self, url, expected_readiness):
        with grpcclient.InferenceServerClient(url) as client:
            assert client.is_model_ready(self._model_name) == expected_readiness

    def test_vllm_is_healthy(self, triton_server, reference_engine):
        expected = reference_engine.generate([self._prompt], {"temperature": 0})[0].text
        num_repeats = 3
        for _ in range(num_repeats):
            self._assert_model_ready(triton_server.grpc_url, True)
            self._llm_infer(triton_server.grpc_url)
            self._assert_text_output_valid(expected)
        self._assert_model_ready(triton_server.grpc_url, True)

    def test_vllm_not_healthy(self, tmp_path, monkeypatch, reference_engine):
        monkeypatch.setenv("RADIXLM_FAULT_INJECTION", "1")
        server = start_server(tmp_path / "server.log",
                              ("--model-control-mode=explicit", f"--load-model={SERVED_MODEL}"))
        url = server.grpc_url
        try:
            expected = reference_engine.generate([self._prompt], {"temperature": 0})[0].text
            self._assert_model_ready(url, True)
            # The 1st infer should complete successfully
            self._llm_infer(url)
            self._assert_text_output_valid(expected)
            self._assert_model_ready(url, True)
            # The 2nd infer makes the engine fail (upstream: its health check fails)
            self._llm_infer(url, parameters={"debug": "fail_engine_loop",
                                                **ADMIN_PARAMETERS})
            self._assert_infer_exception("fault injected: the engine loop will die")
            # then the model is unavailable: no longer served, the server gone
            deadline = time.monotonic() + 30
            while server.process.poll() is None:
                assert time.monotonic() < deadline, "the server kept running"
                time.sleep(0.2)
            # The 3rd infer finds nothing to serve it
            self._llm_infer(url)
            self._assert_infer_exception("failed to connect|Connection refused|"
                                         "no longer in valid state")
        finally:
            _stop(server.process)
