"""Port of the vLLM backend's ci/L0_backend_vllm/metrics_test/vllm_metrics_test.py.

Upstream reads the vllm:* series of a fresh server after two rounds of three greedy
requests and checks exact counts (OPT's prompts are 6 tokens, its answers 16). Here the
counts are our tokenizer's and our engine's (computed with the in-process reference
engine), and each check is on the change across the rounds. The series are off by
default, as upstream; the vLLM backend's own model parameter, REPORT_CUSTOM_METRICS,
turns them on, as upstream's test does. A server started with --allow-metrics=false
refuses the scrape, as upstream's last two tests check. Each case runs on a small server
of its own.
"""
from __future__ import annotations

import re
import shutil
from functools import partial

import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import MODEL_REPOSITORY, _stop, start_server
from vllm_ci_util import UserData, callback, create_vllm_request

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]
SAMPLING_PARAMETERS = {"temperature": "0", "top_p": "1"}
INFERENCE_COUNT = 2


def parse_vllm_metrics(metrics_url: str) -> dict:
    """The vllm:* samples, as upstream reads them (the last sample of each name wins:
    a histogram's _bucket is its +Inf bucket)."""
    r = requests.get(f"http://{metrics_url}/metrics", timeout=10)
    r.raise_for_status()
    pattern = r"^(vllm:[^ {]+)(?:{.*})? ([0-9.-]+)$"
    return {key: float(value) if "." in value else int(value)
            for key, value in re.findall(pattern, r.text, re.MULTILINE)}


def vllm_infer(server, prompts, sampling_parameters, model_name="llm"):
    """Upstream's helper: INFERENCE_COUNT rounds of non-streamed requests."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    user_data = UserData()
    for _ in range(INFERENCE_COUNT):
        client.start_stream(callback=partial(callback, user_data))
        for i, prompt in enumerate(prompts):
            request_data = create_vllm_request(prompt, i, False, sampling_parameters,
                                               model_name, True)
            client.async_stream_infer(model_name=model_name, inputs=request_data["inputs"],
                                      request_id=request_data["request_id"],
                                      outputs=request_data["outputs"],
                                      parameters=sampling_parameters)
        for _ in prompts:
            result = user_data._completed_requests.get(timeout=120)
            assert type(result) is not InferenceServerException, str(result)
            assert result.as_numpy("text_output") is not None
        client.stop_stream()
    client.close()


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory):
    """The llm model with the vllm:* series turned on, as upstream's test configures it
    (they are off by default, as in the vLLM backend)."""
    server = _llm_only_server(tmp_path_factory, "metrics_on", metrics_parameter="true")
    try:
        yield server
    finally:
        _stop(server.process)


def test_vllm_metrics(metrics_server, reference_engine):
    before = parse_vllm_metrics(metrics_server.metrics_url)
    vllm_infer(metrics_server, PROMPTS, SAMPLING_PARAMETERS)
    after = parse_vllm_metrics(metrics_server.metrics_url)  # read right after the last answer

    def delta(name):
        return after[name] - before.get(name, 0)

    prompt_tokens = sum(len(reference_engine.tokenizer.encode(p)) for p in PROMPTS)
    outs = reference_engine.generate(PROMPTS, {"temperature": 0, "top_p": 1})
    generated = sum(len(o.token_ids) for o in outs)  # 16 each unless the model stops
    total_prompts = len(PROMPTS)
    assert delta("vllm:prompt_tokens_total") == prompt_tokens * INFERENCE_COUNT
    assert delta("vllm:generation_tokens_total") == generated * INFERENCE_COUNT
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert delta(f"{name}_count") == total_prompts * INFERENCE_COUNT, name
        assert delta(f"{name}_sum") > 0, name
        assert delta(f"{name}_bucket") == total_prompts * INFERENCE_COUNT, name
    # one observation per generated token after each request's first
    per_token = (generated - total_prompts) * INFERENCE_COUNT
    assert delta("vllm:time_per_output_token_seconds_count") == per_token
    assert delta("vllm:time_per_output_token_seconds_sum") > 0
    assert delta("vllm:time_per_output_token_seconds_bucket") == per_token
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens * INFERENCE_COUNT
    assert delta("vllm:request_generation_tokens_sum") == generated * INFERENCE_COUNT


def test_custom_sampling_params(metrics_server):
    n, temperature = 2, 1
    custom_sampling_parameters = SAMPLING_PARAMETERS.copy()
    custom_sampling_parameters.update({"n": str(n), "temperature": str(temperature)})
    vllm_infer(metrics_server, PROMPTS, custom_sampling_parameters)
    metrics_dict = parse_vllm_metrics(metrics_server.metrics_url)
    assert "vllm:request_params_n_count" in metrics_dict
    assert "vllm:request_params_n_sum" in metrics_dict
    assert "vllm:request_params_n_bucket" in metrics_dict


def _llm_only_server(tmp_path_factory, name, extra_args=(), metrics_parameter=None):
    repo = tmp_path_factory.mktemp(name)
    shutil.copytree(MODEL_REPOSITORY / "llm", repo / "llm")
    if metrics_parameter is not None:
        config = repo / "llm" / "config.pbtxt"
        config.write_text(config.read_text() + '\nparameters: { key: "REPORT_CUSTOM_METRICS" '
                          f'value: {{ string_value: "{metrics_parameter}" }} }}\n')
    return start_server(tmp_path_factory.mktemp(f"{name}_log") / "server.log",
                        (f"--model-repository={repo}", *extra_args))


def test_vllm_metrics_are_off_by_default(tmp_path_factory):
    server = _llm_only_server(tmp_path_factory, "metrics_off")
    try:
        vllm_infer(server, PROMPTS, SAMPLING_PARAMETERS)
        metrics_dict = parse_vllm_metrics(server.metrics_url)
        assert len(metrics_dict) == 0  # no vllm:* series at all
        text = requests.get(f"http://{server.metrics_url}/metrics", timeout=10).text
        assert "radixlm_generation_tokens_total" in text  # ours stay
    finally:
        _stop(server.process)


def test_vllm_metrics_refused(tmp_path_factory):
    server = _llm_only_server(tmp_path_factory, "metrics_refused", ("--allow-metrics=false",))
    try:
        vllm_infer(server, PROMPTS, SAMPLING_PARAMETERS)
        with pytest.raises(requests.exceptions.ConnectionError):
            parse_vllm_metrics(server.metrics_url)
    finally:
        _stop(server.process)
