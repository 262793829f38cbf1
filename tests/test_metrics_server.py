"""The engine's metrics on Triton's metrics port of the session's real tritonserver:
after a known set of requests, exact token counts, the cached tokens of a shared-prefix
pair, requests by finish reason, latency histograms, and gauges back at rest."""
from __future__ import annotations

import json
import queue
import re
import time
import uuid

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from conftest import SERVED_MODEL, ensure_default_model

pytestmark = [pytest.mark.server, pytest.mark.slow]

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
COUNTERS = ("radixlm_prompt_tokens_total", "radixlm_generation_tokens_total",
            "radixlm_cached_prompt_tokens_total", "radixlm_requests_total",
            "radixlm_cached_prompt_tokens_by_tier_total", "radixlm_kv_transfer_bytes_total",
            "radixlm_host_cache_loads_total", "radixlm_host_cache_load_seconds_total")
GAUGES = ("radixlm_num_requests_running", "radixlm_num_requests_waiting",
          "radixlm_kv_cache_usage_ratio", "radixlm_radix_cache_tokens",
          "radixlm_host_cache_tokens")
HISTOGRAMS = ("radixlm_time_to_first_token_seconds", "radixlm_time_per_output_token_seconds",
              "radixlm_e2e_request_latency_seconds", "radixlm_queue_time_seconds")


class Scrape:
    """One read of /metrics."""

    def __init__(self, server) -> None:
        self.text = requests.get(f"http://{server.metrics_url}/metrics", timeout=10).text
        self.samples: dict[tuple[str, frozenset], float] = {}
        for line in self.text.splitlines():
            match = SAMPLE.match(line)
            if match and not line.startswith("#"):
                labels = frozenset(LABEL.findall(match.group(2) or ""))
                self.samples[(match.group(1), labels)] = float(match.group(3))

    def __call__(self, name: str, **labels: str) -> float:
        """The served model's value of ``name`` (summed over its engine instances)."""
        want = {("model", SERVED_MODEL), *labels.items()}
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= ls]
        assert found, f"no {name}{labels} series in /metrics"
        return sum(found)

    def types(self) -> dict[str, str]:
        return dict(re.findall(r"^# TYPE (radixlm_\S+) (\S+)$", self.text, re.M))


def settled(server, check=lambda m: None, timeout_s: float = 15.0) -> Scrape:
    """Poll until ``check`` passes with the engine at rest (metrics are published a
    fraction of a second after the fact)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = Scrape(server)
        try:
            assert metrics("radixlm_num_requests_running") == 0
            assert metrics("radixlm_num_requests_waiting") == 0
            check(metrics)
            return metrics
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def generate(server, prompt: str, params: dict) -> dict:
    body = {"text_input": prompt, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params), "return_finish_reason": True,
            **{f"return_num_{kind}_tokens": True for kind in ("input", "output", "cached")}}
    response = requests.post(f"http://{server.http_url}/v2/models/{SERVED_MODEL}/generate",
                             json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_metric_names_types_and_labels(triton_server):
    metrics = settled(triton_server)
    assert metrics.types() == {**{n: "counter" for n in COUNTERS}, **{n: "gauge" for n in GAUGES},
                               **{n: "histogram" for n in HISTOGRAMS}}
    labels = {dict(ls).get("model_instance") for (n, ls) in metrics.samples
              if n.startswith("radixlm_")}
    assert labels == {f"{SERVED_MODEL}_0_0"}  # one engine instance, named by Triton
    reasons = {dict(ls)["finish_reason"] for (n, ls) in metrics.samples
               if n == "radixlm_requests_total"}
    assert {"stop", "length", "abort", "error"} <= reasons


def test_known_requests_show_up_exactly(triton_server):
    before = settled(triton_server)
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    # A shared-prefix pair with a prefix no earlier request has put in the radix cache.
    prefix = f"Session {uuid.uuid4().hex}: radix caches share prompt prefixes. " * 3
    pair = [prefix + "The first question", prefix + "Another question"]
    first = generate(triton_server, pair[0], {"temperature": 0, "max_tokens": 5})
    second = generate(triton_server, pair[1], {"temperature": 0, "max_tokens": 7})
    ids = [tokenizer.encode(p) for p in pair]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == common > 30
    # two more "length" finishes and one stop at a stop string
    free = generate(triton_server, "Count with me:", {"temperature": 0, "max_tokens": 8})
    stop = free["text_output"][len(free["text_output"]) // 2:][:2]
    stopped = generate(triton_server, "Count with me:",
                       {"temperature": 0, "max_tokens": 8, "stop": [stop]})
    assert [r["finish_reason"] for r in (first, second, free, stopped)] \
        == ["length", "length", "length", "stop"]
    done = [first, second, free, stopped]

    def check(after: Scrape) -> None:
        def delta(name, **labels):
            return after(name, **labels) - before(name, **labels)

        assert delta("radixlm_prompt_tokens_total") == sum(r["num_input_tokens"] for r in done)
        assert delta("radixlm_generation_tokens_total") \
            == sum(r["num_output_tokens"] for r in done) == 5 + 7 + 8 + stopped["num_output_tokens"]
        assert delta("radixlm_cached_prompt_tokens_total") \
            == common + free["num_cached_tokens"] + stopped["num_cached_tokens"]
        assert delta("radixlm_requests_total", finish_reason="length") == 3
        assert delta("radixlm_requests_total", finish_reason="stop") == 1
        assert delta("radixlm_requests_total", finish_reason="abort") == 0
        assert delta("radixlm_requests_total", finish_reason="error") == 0
        for name in HISTOGRAMS:  # every request here made more than one token
            assert delta(f"{name}_count") == 4, name
            assert delta(f"{name}_bucket", le="+Inf") == 4, name
        assert 0 < delta("radixlm_e2e_request_latency_seconds_sum") < 120
        assert delta("radixlm_time_to_first_token_seconds_sum") \
            <= delta("radixlm_e2e_request_latency_seconds_sum")
        # at rest: no KV held by requests; the pair and the rest stay in the radix cache
        assert after("radixlm_kv_cache_usage_ratio") == 0
        assert after("radixlm_radix_cache_tokens") >= first["num_input_tokens"]

    settled(triton_server, check)


def test_gauges_follow_a_request_in_flight_and_return_to_rest(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result=None, error=None: events.put((result, error)))

    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    before = settled(triton_server)
    params = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}
    client.async_stream_infer(SERVED_MODEL, [
        tensor("text_input", np.array([b"Tell me a long story."], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_),
               "BYTES")], request_id="long")
    try:
        assert events.get(timeout=60)[1] is None
        deadline = time.monotonic() + 15
        while True:
            busy = Scrape(triton_server)
            if busy("radixlm_num_requests_running") == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert busy("radixlm_num_requests_running") == 1
        assert 0 < busy("radixlm_kv_cache_usage_ratio") < 1
    finally:
        client.stop_stream(cancel_requests=True)  # the client goes away: the engine aborts
        client.close()
    settled(triton_server, lambda after: (
        _true(after("radixlm_kv_cache_usage_ratio") == 0),
        _true(after("radixlm_requests_total", finish_reason="abort")
              == before("radixlm_requests_total", finish_reason="abort") + 1)))


def _true(condition: bool) -> None:
    assert condition
