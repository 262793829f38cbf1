"""The served ensemble (preprocessing -> llm -> postprocessing) on the session's real
tritonserver: its text equals the engine model's own, streamed and whole, in four
scripts; streamed pieces concatenate to the whole answer; bad chat input is refused by
preprocessing and the ensemble keeps serving."""
from __future__ import annotations

import json
import queue
import time
import urllib.request

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from conftest import ADMIN_PARAMETERS, MODEL_REPOSITORY

pytestmark = [pytest.mark.server, pytest.mark.slow]

ENSEMBLE = "ensemble"
PROMPTS = {
    "en": "The quick brown fox jumps over the lazy dog because",
    "vi": "Hà Nội là thủ đô của Việt Nam, nổi tiếng với phở và",
    "th": "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย และมี",
    "zh": "北京是中国的首都，也是一座历史悠久的城市，",
}
GREEDY = {"temperature": 0, "max_tokens": 16}


def _tensor(name: str, value) -> grpcclient.InferInput:
    if isinstance(value, bool):
        array, dtype = np.array([value]), "BOOL"
    elif isinstance(value, str):
        array, dtype = np.array([value.encode()], dtype=np.object_), "BYTES"
    else:
        array, dtype = np.asarray(value, dtype=np.int32), "INT32"
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def inputs(**values) -> list[grpcclient.InferInput]:
    return [_tensor(name, value) for name, value in values.items()]


def ensemble_inputs(prompt: str, stream: bool, params: dict = GREEDY, **extra):
    """Without the prompt in the answer, unless ``extra`` says otherwise."""
    extra = {"exclude_input_in_output": True, **extra}
    return inputs(text_input=prompt, stream=stream, sampling_parameters=json.dumps(params),
                  **extra)


def llm_inputs(prompt: str, stream: bool, params: dict = GREEDY):
    return inputs(text_input=prompt, stream=stream, sampling_parameters=json.dumps(params),
                  exclude_input_in_output=True, return_finish_reason=True,
                  return_num_input_tokens=True, return_num_output_tokens=True)


class Client:
    """One gRPC stream; requests to any model, responses grouped by request id."""

    def __init__(self, server) -> None:
        self.grpc = grpcclient.InferenceServerClient(server.grpc_url)
        self.events: queue.Queue = queue.Queue()
        self.grpc.start_stream(callback=lambda result=None, error=None:
                               self.events.put((result, error)))

    def send(self, model: str, request_id: str, tensors, parameters=None) -> None:
        self.grpc.async_stream_infer(model, tensors, request_id=request_id,
                                     parameters=parameters)

    def collect(self, request_ids, timeout_s: float = 120.0) -> dict[str, list[dict] | str]:
        """Responses (dicts) of each request until its final one, or its error (str)."""
        pending, got = set(request_ids), {rid: [] for rid in request_ids}
        deadline = time.monotonic() + timeout_s
        while pending:
            result, error = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if error is not None:
                # errors carry no request id on the stream: one request at a time here
                (rid,) = pending
                got[rid] = str(error)
                pending.clear()
                continue
            item = as_dict(result)
            got[item["id"]].append(item)
            if item["final"]:
                pending.discard(item["id"])
        return got

    def close(self) -> None:
        self.grpc.stop_stream()
        self.grpc.close()


def as_dict(result) -> dict:
    response = result.get_response()
    item = {"id": response.id, "final": response.parameters["triton_final_response"].bool_param}
    for output in response.outputs:
        array = result.as_numpy(output.name)
        if array.dtype == np.object_:
            item[output.name] = array.reshape(-1)[0].decode("utf-8")
        elif output.name in ("output_ids", "context_ids"):
            item[output.name] = [int(i) for i in array]
        else:
            item[output.name] = int(array.reshape(-1)[0])
    return item


def text(pieces: list[dict]) -> str:
    return "".join(p["text_output"] for p in pieces)


@pytest.fixture(scope="module")
def client(triton_server):
    deadline = time.monotonic() + 120
    url = f"http://{triton_server.http_url}/v2/models/{ENSEMBLE}/ready"
    while True:  # tritonserver serves once every model loaded; this is a safety net
        try:
            with urllib.request.urlopen(url, timeout=2):
                break
        except OSError:
            assert time.monotonic() < deadline, triton_server.log_tail()
            time.sleep(0.5)
    c = Client(triton_server)
    yield c
    c.close()


def test_the_repository_serves_the_ensemble_models():
    for model in ("preprocessing", "postprocessing"):
        assert (MODEL_REPOSITORY / model / "1" / "model.py").resolve() \
            == (MODEL_REPOSITORY.parent / "ensemble" / f"{model}.py").resolve()
    config = (MODEL_REPOSITORY / ENSEMBLE / "config.pbtxt").read_text()
    assert 'platform: "ensemble"' in config


def test_greedy_text_equals_the_engine_models_streamed_and_whole(client):
    """All 16 requests in flight together: 4 scripts x {ensemble, llm} x {stream, whole}."""
    cases = {}
    for lang, prompt in PROMPTS.items():
        for stream in (True, False):
            cases[f"ens-{lang}-{stream}"] = (ENSEMBLE, ensemble_inputs(prompt, stream))
            cases[f"llm-{lang}-{stream}"] = ("llm", llm_inputs(prompt, stream))
    for rid, (model, tensors) in cases.items():
        client.send(model, rid, tensors)
    got = client.collect(cases)
    for lang in PROMPTS:
        ens_stream, ens_whole = got[f"ens-{lang}-True"], got[f"ens-{lang}-False"]
        llm_stream, llm_whole = got[f"llm-{lang}-True"], got[f"llm-{lang}-False"]
        assert len(ens_whole) == 1 and ens_whole[0]["final"]
        # piece by piece the engine's own stream, and the same whole text
        assert [p["text_output"] for p in ens_stream] == [p["text_output"] for p in llm_stream]
        assert text(ens_whole) == text(llm_whole) == text(llm_stream) == text(ens_stream)
        assert text(ens_whole).strip(), lang
        last = ens_stream[-1]
        assert last["final"] and last["finish_reason"] == "length"
        assert [p["final"] for p in ens_stream].count(True) == 1
        assert all(p["finish_reason"] == "None" for p in ens_stream[:-1])  # as the engine's
        # streamed counts are per response, as the engine's (and the vLLM backend's)
        assert sum(p["num_output_tokens"] for p in ens_stream) \
            == ens_whole[0]["num_output_tokens"] == 16
        assert last["num_input_tokens"] == ens_whole[0]["num_input_tokens"] \
            == llm_whole[0]["num_input_tokens"]


def test_http_generate_and_generate_stream_through_the_ensemble(triton_server):
    body = {"text_input": PROMPTS["zh"], "sampling_parameters": json.dumps(GREEDY)}
    url = f"http://{triton_server.http_url}/v2/models/{ENSEMBLE}"
    whole = requests.post(f"{url}/generate", json=body, timeout=120).json()
    direct = requests.post(f"http://{triton_server.http_url}/v2/models/llm/generate",
                           json=body, timeout=120).json()
    # as the engine model does by default, a whole answer starts with its prompt
    assert whole["text_output"] == direct["text_output"] and whole["finish_reason"] == "length"
    assert whole["text_output"].startswith(PROMPTS["zh"])
    with requests.post(f"{url}/generate_stream", json={**body, "stream": True}, timeout=120,
                       stream=True) as response:
        events = [json.loads(line[len(b"data: "):]) for line in response.iter_lines()
                  if line.startswith(b"data: ")]
    assert PROMPTS["zh"] + "".join(e["text_output"] for e in events) == whole["text_output"]
    assert len(events) > 1 and events[-1]["finish_reason"] == "length"


def test_chat_messages_are_rendered_by_preprocessing(client, triton_server):
    messages = [{"role": "user", "content": "Xin chào, bạn khỏe không?"}]
    rendered = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\n"
                "Xin chào, bạn khỏe không?<|im_end|>\n<|im_start|>assistant\n")
    client.send(ENSEMBLE, "chat", inputs(messages=json.dumps(messages), stream=False,
                                         sampling_parameters=json.dumps(GREEDY),
                                         exclude_input_in_output=True))
    client.send(ENSEMBLE, "flag", inputs(text_input=messages[0]["content"],
                                         apply_chat_template=True, stream=False,
                                         sampling_parameters=json.dumps(GREEDY),
                                         exclude_input_in_output=True))
    client.send("llm", "direct", llm_inputs(rendered, stream=False))
    got = client.collect(["chat", "flag", "direct"])
    assert text(got["chat"]) == text(got["flag"]) == text(got["direct"])
    assert got["chat"][0]["num_input_tokens"] == got["direct"][0]["num_input_tokens"]


@pytest.mark.parametrize("messages, message", [
    ('[{"role": "user", "content": "hi"', "'messages' is not valid JSON"),
    ('[{"role": "user"}]', "'messages'[0] needs a string 'content'"),
    ('{"role": "user", "content": "hi"}', "'messages' must be a non-empty JSON list"),
])
def test_bad_chat_input_gets_a_clear_error_and_the_ensemble_keeps_serving(client, messages,
                                                                         message):
    client.send(ENSEMBLE, "bad", inputs(messages=messages, stream=True,
                                        sampling_parameters=json.dumps(GREEDY)))
    error = client.collect(["bad"], timeout_s=60)["bad"]
    assert isinstance(error, str) and message in error, error
    client.send(ENSEMBLE, "good", ensemble_inputs(PROMPTS["en"], stream=True))
    pieces = client.collect(["good"])["good"]
    assert pieces[-1]["final"] and sum(p["num_output_tokens"] for p in pieces) == 16
    assert text(pieces)


def test_bad_chat_input_over_http_is_a_400_with_the_reason(triton_server):
    response = requests.post(f"http://{triton_server.http_url}/v2/models/{ENSEMBLE}/generate",
                             json={"messages": "not json"}, timeout=60)
    assert response.status_code == 400
    assert "'messages' is not valid JSON" in response.json()["error"]


def test_stop_strings_given_as_request_parameters_cut_the_text_as_the_engine_does(client):
    params = {"temperature": 0, "max_tokens": 12}
    client.send("llm", "free", llm_inputs(PROMPTS["en"], stream=False, params=params))
    free = text(client.collect(["free"])["free"])
    stop = free[len(free) // 2:len(free) // 2 + 3]
    for stream in (True, False):
        client.send(ENSEMBLE, f"ens-{stream}", ensemble_inputs(PROMPTS["en"], stream, params),
                    parameters={"stop": stop})
        client.send("llm", f"llm-{stream}", llm_inputs(PROMPTS["en"], stream, params),
                    parameters={"stop": stop})
    got = client.collect(["ens-True", "ens-False", "llm-True", "llm-False"])
    cut = free[:free.index(stop)]
    assert text(got["ens-True"]) == text(got["ens-False"]) == text(got["llm-False"]) == cut
    assert got["ens-True"][-1]["finish_reason"] == "stop"


def test_n_samples_without_streaming_decode_each_sample(client, reference_engine):
    """A non-streamed n > 1 answer is one engine response with the samples' ids back to
    back: postprocessing splits them and decodes each, as the engine does."""
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 6, "n": 3, "ignore_eos": True}
    client.send(ENSEMBLE, "n3", ensemble_inputs("Xin chào", False, params))
    result, error = client.events.get(timeout=120)
    assert error is None
    texts = [t.decode("utf-8") for t in result.as_numpy("text_output")]
    want = reference_engine.generate(["Xin chào"], params)[0].samples
    assert texts == [s.text for s in want]
    assert [f.decode() for f in result.as_numpy("finish_reason")] == ["length"] * 3


def test_exclude_input_in_output_false_returns_the_prompt_as_the_engine_model_does(client):
    prompt = PROMPTS["vi"]
    client.send(ENSEMBLE, "kept", ensemble_inputs(prompt, False, exclude_input_in_output=False))
    client.send("llm", "alone", llm_inputs(prompt, stream=False))
    got = client.collect(["kept", "alone"])
    assert text(got["kept"]) == prompt + text(got["alone"])
    client.send(ENSEMBLE, "streamed", ensemble_inputs(prompt, True, exclude_input_in_output=False))
    error = client.collect(["streamed"], timeout_s=60)["streamed"]
    assert "when streaming, exclude_input_in_output = false is not allowed" in error


def engine_stats(triton_server) -> dict:
    body = requests.post(f"http://{triton_server.http_url}/v2/models/llm/generate",
                         json={"parameters": {"debug": "stats", **ADMIN_PARAMETERS}},
                         timeout=60).json()
    return json.loads(body["stats"])


@pytest.mark.parametrize("stream", [True, False])
def test_cancelling_an_ensemble_request_aborts_it_in_the_engine(triton_server, stream):
    """Triton hands the cancellation of an ensemble request to its later steps only; the
    postprocessing step relays it to the engine (a streamed request at its next token, a
    whole one at the engine's next heartbeat, within about a second)."""
    grpc = grpcclient.InferenceServerClient(triton_server.grpc_url)
    events: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result=None, error=None: events.put((result, error)))
    params = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    grpc.async_stream_infer(ENSEMBLE, ensemble_inputs(PROMPTS["en"], stream, params),
                            request_id="long")
    deadline = time.monotonic() + 60
    while engine_stats(triton_server)["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    if stream:
        assert events.get(timeout=60)[1] is None  # it is generating
    grpc.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 10
    while (stats := engine_stats(triton_server))["num_running"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["kv_tokens_in_use_by_requests"] == 0 and stats["integrity_ok"]
    grpc.close()
