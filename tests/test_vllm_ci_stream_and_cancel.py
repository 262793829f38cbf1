"""Ports of the vLLM backend's ci/L0_backend_vllm/enabled_stream/enabled_stream_test.py,
request_cancellation/request_cancellation_test.py and, of multi_lora/multi_lora_test.py,
the request naming an adapter the server does not serve (our engine serves none).

Upstream's model vllm_opt on localhost:8001 is `llm` here (and `ensemble` where it
applies) on the session's server. After the cancellation test, this suite also checks
what upstream cannot see from a client: every KV slot came back (debug stats).
"""
from __future__ import annotations

import asyncio
import time
from functools import partial

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio_grpcclient
from tritonclient.utils import InferenceServerException

from conftest import server_stats
from vllm_ci_util import UserData, callback, create_vllm_request

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.mark.parametrize("model_name", ["llm", "ensemble"])
def test_vllm_model_enabled_stream(triton_server, model_name):
    async def run():
        async with aio_grpcclient.InferenceServerClient(url=triton_server.grpc_url) as client:
            prompts = ["The most dangerous animal is", "The future of AI is"]
            sampling_parameters = {"temperature": "0", "top_p": "1"}

            async def request_iterator():
                for i, prompt in enumerate(prompts):
                    yield create_vllm_request(prompt, i, True, sampling_parameters, model_name)

            responses, finished = 0, 0
            async for result, error in client.stream_infer(inputs_iterator=request_iterator()):
                assert error is None, str(error)
                assert result is not None
                assert result.as_numpy("text_output") is not None, "`text_output` is None"
                responses += 1
                params = result.get_response().parameters
                finished += params["triton_final_response"].bool_param
                if finished == len(prompts):  # the stream stays open: stop at both ends
                    break
            return responses

    assert asyncio.run(asyncio.wait_for(run(), 120)) > 2  # streamed, not whole


@pytest.mark.parametrize("model_name", ["llm", "ensemble"])
def test_request_cancellation(triton_server, model_name, send_parameters_as_tensor=True):
    with grpcclient.InferenceServerClient(url=triton_server.grpc_url) as triton_client:
        user_data = UserData()
        sampling_parameters = {"temperature": "0.75", "top_p": "0.9"}
        triton_client.start_stream(callback=partial(callback, user_data))
        for i in range(100):
            prompt = f"Write an original and creative poem of at least {100 + i} words."
            request_data = create_vllm_request(prompt, i, False, sampling_parameters,
                                               model_name, send_parameters_as_tensor)
            triton_client.async_stream_infer(
                model_name=model_name, request_id=request_data["request_id"],
                inputs=request_data["inputs"], outputs=request_data["outputs"],
                parameters=sampling_parameters)
        triton_client.stop_stream(cancel_requests=True)
        assert not user_data._completed_requests.empty()
        result = user_data._completed_requests.get()
        assert isinstance(result, InferenceServerException)
        assert result.status() == "StatusCode.CANCELLED"
        assert user_data._completed_requests.empty()
    # the engine aborted them all and has every KV slot back
    deadline = time.monotonic() + 30
    while (stats := server_stats(triton_server))["num_running"] or stats["num_waiting"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    assert stats["kv_tokens_in_use_by_requests"] == 0 and stats["integrity_ok"]


def test_none_exist_lora(triton_server):
    """A request naming a LoRA adapter gets the vLLM backend's kind of refusal."""
    with grpcclient.InferenceServerClient(url=triton_server.grpc_url) as triton_client:
        user_data = UserData()
        triton_client.start_stream(callback=partial(callback, user_data))
        sampling_parameters = {"temperature": "0", "top_p": "1", "lora_name": "bactrian"}
        request_data = create_vllm_request("Instruct: What is the capital city of France?\n"
                                           "Output:", 0, False, sampling_parameters, "llm",
                                           exclude_input_in_output=True)
        triton_client.async_stream_infer(
            model_name="llm", request_id=request_data["request_id"],
            inputs=request_data["inputs"], outputs=request_data["outputs"],
            parameters={"temperature": "0", "top_p": "1"})
        result = user_data._completed_requests.get(timeout=60)
        triton_client.stop_stream()
    assert isinstance(result, InferenceServerException)
    assert "LoRA feature is not enabled" in result.message() and "bactrian" in result.message()
