"""TritonClient and the Triton language backend over real gRPC, against an in-process fake.

The fake stands in for tritonserver serving a decoupled `llm` model and behaves as Triton
does: one response per step on the request's stream, the final flag as the response
parameter `triton_final_response`, an empty final response only when the client enabled
them, errors as the stream response's error_message. Its "model" replies with the prompt's
words reversed, one word per step.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent import futures

import asyncio
import importlib
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

try:
    import radixlm
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]"
                 "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def _bytes_output(name: str, text: str):
    raw = serialize_byte_tensor(np.array([text.encode()], dtype=np.object_)).item()
    return service_pb2.ModelInferResponse.InferOutputTensor(
        name=name, datatype="BYTES", shape=[1]), raw


def _int_output(name: str, values: list[int]):
    array = np.asarray(values, dtype=np.int32)
    return service_pb2.ModelInferResponse.InferOutputTensor(
        name=name, datatype="INT32", shape=[len(values)]), array.tobytes()


class FakeTritonLLM(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, step_delay: float = 0.0):
        self.step_delay = step_delay
        self.requests: list[dict] = []  # decoded inputs of every request received
        self.cancelled: list[str] = []
        self.preferred: set[str] = set()  # choices that score best, whatever their length
        self._lock = threading.Lock()

    def ModelConfig(self, request, context):
        config = model_config_pb2.ModelConfig(name=request.name)
        config.parameters["chat_template"].string_value = CHAT_TEMPLATE
        config.parameters["eos_token"].string_value = "</s>"
        return service_pb2.ModelConfigResponse(config=config)

    def ModelStreamInfer(self, request_iterator, context):
        for request in request_iterator:
            yield from self._serve(request, context)

    def _serve(self, request, context):
        inputs = self._decode_inputs(request)
        with self._lock:
            self.requests.append(inputs)
        params = json.loads(inputs.get("sampling_parameters", "{}"))
        prompt = inputs.get("text_input", "")
        empty_final = request.parameters["triton_enable_empty_final_response"].bool_param
        if prompt.startswith("error:"):
            yield service_pb2.ModelStreamInferResponse(error_message=prompt[len("error:"):])
            return
        if "choices" in inputs:
            scores = [{"choice": c, "logprob_sum": -float(len(c)), "num_tokens": len(c.split()),
                       "normalized_logprob": 0.0 if c in self.preferred
                       else -float(len(c)) / len(c.split()),
                       "token_logprobs": [-1.0] * len(c.split())}
                      for c in json.loads(inputs["choices"])]
            yield self._response(request, {"choice_scores": json.dumps(scores)}, final=True)
            return
        finished = threading.Event()

        def on_rpc_end():  # gRPC ends the stream early only when the client cancels it
            if not finished.is_set():
                with self._lock:
                    self.cancelled.append(request.id)

        context.add_callback(on_rpc_end)
        words = [w + " " for w in reversed(prompt.split())][: params.get("max_tokens", 64)]
        if "json_schema" in params:
            words = ['{"grade": "B", ', '"strongest": "clarity", ', '"summary": "fine"}']
        if not inputs.get("stream"):
            words = ["".join(words)]
        for i, word in enumerate(words):
            time.sleep(self.step_delay)
            last = i == len(words) - 1
            outputs = {"text_output": word, "num_input_tokens": len(prompt.split()),
                       "num_output_tokens": i + 1, "num_cached_tokens": 2,
                       "finish_reason": "length" if last else ""}
            yield self._response(request, outputs, final=last and not empty_final)
        if empty_final:
            yield self._response(request, {}, final=True)
        finished.set()

    @staticmethod
    def _decode_inputs(request) -> dict:
        decoded = {}
        for tensor, raw in zip(request.inputs, request.raw_input_contents):
            if tensor.datatype == "BYTES":
                decoded[tensor.name] = deserialize_bytes_tensor(raw)[0].decode()
            elif tensor.datatype == "BOOL":
                decoded[tensor.name] = bool(np.frombuffer(raw, dtype=bool)[0])
            else:
                decoded[tensor.name] = np.frombuffer(raw, dtype=np.int32).tolist()
        return decoded

    @staticmethod
    def _response(request, outputs: dict, final: bool):
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        for name, value in outputs.items():
            tensor, raw = (_bytes_output(name, value) if isinstance(value, str)
                           else _int_output(name, [value]))
            response.outputs.append(tensor)
            response.raw_output_contents.append(raw)
        response.parameters["triton_final_response"].bool_param = final
        return service_pb2.ModelStreamInferResponse(infer_response=response)


class Fake:
    def __init__(self, step_delay: float):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        self.model = FakeTritonLLM(step_delay)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.model, self.server)
        self.url = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


@pytest.fixture
def fake():
    server = Fake(step_delay=0.0)
    yield server
    server.server.stop(grace=None)


@pytest.fixture
def slow_fake():
    server = Fake(step_delay=0.05)
    yield server
    server.server.stop(grace=None)


def test_generate_sends_the_wire_inputs_and_returns_the_whole_text(fake):
    with radixlm.TritonClient(fake.url) as client:
        result = client.generate("one two three", max_new_tokens=2, temperature=0.0,
                                 stop="\n")
    assert result.text == "three two "
    assert result.finish_reason == "length"
    assert (result.num_input_tokens, result.num_cached_tokens) == (3, 2)
    sent = fake.model.requests[0]
    assert sent["stream"] is False and sent["exclude_input_in_output"] is True
    assert json.loads(sent["sampling_parameters"]) == {
        "max_tokens": 2, "temperature": 0.0, "stop": ["\n"]}


def test_generate_stream_yields_one_piece_per_step_until_the_final_flag(fake):
    client = radixlm.TritonClient(fake.url)
    chunks = list(client.generate_stream("a b c"))
    assert [c.text for c in chunks] == ["c ", "b ", "a "]
    assert [c.finish_reason for c in chunks] == ["", "", "length"]
    assert [c.num_output_tokens for c in chunks] == [1, 2, 3]
    assert fake.model.requests[0]["stream"] is True


def test_score_returns_each_choices_scores_in_order(fake):
    result = radixlm.TritonClient(fake.url).score("Pick:", ["yes", "no way"])
    assert [s.choice for s in result.scores] == ["yes", "no way"]
    assert [s.normalized_logprob for s in result.scores] == [-3.0, -3.0]
    assert result.best.choice == "yes"  # a tie goes to the first
    assert json.loads(fake.model.requests[0]["choices"]) == ["yes", "no way"]


def test_a_server_error_is_raised_with_the_servers_message(fake):
    client = radixlm.TritonClient(fake.url)
    with pytest.raises(radixlm.ServerError) as info:
        client.generate("error:invalid regex: unbalanced parenthesis")
    assert info.value.message == "invalid regex: unbalanced parenthesis"
    assert client.generate("still serving").text == "serving still "


def test_unknown_sampling_keys_are_rejected_before_sending(fake):
    with pytest.raises(ValueError, match="temprature"):
        radixlm.TritonClient(fake.url).generate("x", temprature=0.5)
    assert fake.model.requests == []


def test_cancel_stops_the_request_on_the_server(slow_fake):
    client = radixlm.TritonClient(slow_fake.url)
    stream = client.generate_stream(" ".join(["w"] * 40), request_id="req-1")
    received = []
    for chunk in stream:
        received.append(chunk)
        if len(received) == 2:
            assert stream.cancel() is True
    assert len(received) == 2
    deadline = time.monotonic() + 5
    while not slow_fake.model.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slow_fake.model.cancelled == ["req-1"]
    assert client.cancel("req-1") is False  # no longer in flight


def test_concurrent_threads_each_get_their_own_answer(slow_fake):
    client = radixlm.TritonClient(slow_fake.url)
    results = [None] * 16

    def worker(i):
        results[i] = client.generate(f"{i} x").text

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [f"x {i} " for i in range(16)]


def test_agenerate_runs_requests_concurrently_on_one_event_loop(slow_fake):
    client = radixlm.TritonClient(slow_fake.url)

    async def main():
        results = await asyncio.gather(*(client.agenerate(f"{i} y") for i in range(8)))
        texts = [r.text for r in results]
        pieces = [c.text async for c in client.agenerate_stream("p q r")]
        with pytest.raises(radixlm.ServerError, match="^bad input$"):
            await client.agenerate("error:bad input")
        return texts, pieces, await client.ascore("Q", ["a", "bb"])

    texts, pieces, scores = asyncio.run(main())
    assert texts == [f"y {i} " for i in range(8)]
    assert asyncio.run(client.agenerate("on a new loop")).text == "loop new a on "
    assert pieces == ["r ", "q ", "p "]
    assert scores.best.choice == "a"


def test_chat_template_comes_from_the_model_config(fake):
    template = radixlm.TritonClient(fake.url).chat_template()
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) \
        == "[user]hi[/user][assistant]"


def test_a_program_runs_over_grpc_with_the_triton_backend(fake):
    backend = radixlm.Triton(fake.url)

    @radixlm.function
    def prog(s):
        s += radixlm.user("alpha beta")
        s += radixlm.assistant(radixlm.gen("echo", max_tokens=8))
        s += "Choice: " + radixlm.select("pick", choices=["long one", "s"])

    state = prog.run(backend=backend)
    assert state["echo"] == "beta[/user][assistant] [user]alpha "
    assert state["pick"] == "s"  # normalized -1.0 beats "long one"'s -8 / 2 = -4.0
    assert state.text().endswith("[/assistant]Choice: s")
    assert json.loads(fake.model.requests[0]["sampling_parameters"]) == {"max_tokens": 8}


def test_the_judge_and_its_raw_tritonclient_version_send_the_same_requests(fake):
    examples = str(Path(__file__).resolve().parents[1] / "clients" / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    judge, judge_raw = importlib.import_module("judge"), importlib.import_module("judge_raw")
    fake.model.preferred = {"yes", "B"}
    topic, essay = judge.ESSAYS[0]

    out = judge_raw.multi_dimensional_judge(fake.url, "llm", topic, essay)
    raw_requests, fake.model.requests = fake.model.requests, []
    state = judge.multi_dimensional_judge.run(topic=topic, essay=essay, temperature=0.0,
                                              backend=radixlm.Triton(fake.url))

    assert out == {name: state[name] for name in out}
    assert (out["related"], out["grade"], len(out["judgment"])) == ("yes", "B", 3)
    assert json.loads(out["verdict"]) == {"grade": "B", "strongest": "clarity", "summary": "fine"}

    def key(r):
        params = json.dumps(json.loads(r.get("sampling_parameters", "{}")), sort_keys=True)
        return r.get("text_input"), r.get("choices"), params

    assert sorted(map(key, fake.model.requests)) == sorted(map(key, raw_requests))
