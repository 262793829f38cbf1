"""Port of the vLLM backend's samples/client.py, its getting-started client.

Upstream's script reads prompts from a file, streams them all to the model over the
asyncio gRPC client with string-valued sampling parameters (``"temperature": "0.1"``,
``"max_tokens": "100"``), writes every response's text to a results file grouped by
request id, and prints "PASS: vLLM example". Here it runs in the test process against
`llm` and `ensemble`, streaming and not, with upstream's four sample prompts.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = ["Hello, my name is", "The most dangerous animal is", "The capital of France is",
           "The future of AI is"]


class LLMClient:
    def __init__(self, url: str, model: str, streaming_mode: bool, iterations: int = 1,
                 offset: int = 0) -> None:
        self._url = url  # the asyncio client is made in the loop that runs it
        self._model, self._streaming_mode = model, streaming_mode
        self._iterations, self._offset = iterations, offset
        self._results_dict: dict[str, list[bytes]] = {}
        self.errors: list[str] = []

    async def async_request_iterator(self, prompts, sampling_parameters):
        for iteration in range(self._iterations):
            for i, prompt in enumerate(prompts):
                prompt_id = self._offset + (len(prompts) * iteration) + i
                self._results_dict[str(prompt_id)] = []
                yield self.create_request(prompt, self._streaming_mode, prompt_id,
                                          sampling_parameters)

    async def process_stream(self, prompts, sampling_parameters):
        pending = len(prompts) * self._iterations
        responses = self._client.stream_infer(
            inputs_iterator=self.async_request_iterator(prompts, sampling_parameters))
        async for result, error in responses:
            if error:
                self.errors.append(str(error))
                pending -= 1
            else:
                for text in result.as_numpy("text_output"):
                    self._results_dict[result.get_response().id].append(text)
                pending -= result.get_response().parameters["triton_final_response"].bool_param
            if pending == 0:  # the stream stays open: stop once every request has ended
                break

    async def run(self, results_file) -> str:
        self._client = grpcclient.InferenceServerClient(url=self._url)
        sampling_parameters = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}
        await self.process_stream(PROMPTS, sampling_parameters)
        with open(results_file, "w") as file:
            for request_id, texts in self._results_dict.items():
                for text in texts:
                    file.write(text.decode("utf-8"))
                    file.write("\n")
                file.write("\n=========\n\n")
        await self._client.close()
        return "PASS: vLLM example" if not self.errors else "FAIL: vLLM example"

    def create_request(self, prompt, stream, request_id, sampling_parameters,
                       send_parameters_as_tensor=True):
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"),
                  grpcclient.InferInput("stream", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([stream], dtype=bool))
        if send_parameters_as_tensor:
            tensor = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
            tensor.set_data_from_numpy(np.array(
                [json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_))
            inputs.append(tensor)
        return {"model_name": self._model, "inputs": inputs,
                "outputs": [grpcclient.InferRequestedOutput("text_output")],
                "request_id": str(request_id), "parameters": sampling_parameters}


@pytest.mark.parametrize("model", ["llm", "ensemble"])
@pytest.mark.parametrize("streaming_mode", [False, True])
def test_the_sample_client_passes(triton_server, tmp_path, model, streaming_mode):
    client = LLMClient(triton_server.grpc_url, model, streaming_mode)
    results_file = tmp_path / "results.txt"
    verdict = asyncio.run(asyncio.wait_for(client.run(results_file), 300))
    assert verdict == "PASS: vLLM example", client.errors
    assert sorted(client._results_dict) == [str(i) for i in range(len(PROMPTS))]
    assert results_file.read_bytes().decode("utf-8") == "".join(
        "".join(t.decode("utf-8") + "\n" for t in texts) + "\n=========\n\n"
        for texts in client._results_dict.values())
    for request_id, texts in client._results_dict.items():
        text = b"".join(texts).decode("utf-8")
        assert text, request_id
        if not streaming_mode:  # a whole answer starts with its prompt
            assert len(texts) == 1 and text.startswith(PROMPTS[int(request_id)])
        else:
            assert len(texts) > 1  # streamed
