"""Two replicas (tritonserver + radixlm-openai) behind sglang-router, and one of them dying.

The router checks each replica's /health every second; a killed replica's in-flight
requests must end with an error (not hang), and traffic must go on to the other one.
"""
from __future__ import annotations

import sys
import threading
import time

import openai
import pytest

from conftest import REPO, ensure_default_model

sys.path.insert(0, str(REPO / "tools"))
from replicas import Cluster  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = ("Alpine glaciers, a long account.", "Zebra migrations: tell all of it.")
LONG = dict(model="llm", max_tokens=3000, temperature=0, stream=True,
            extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ensure_default_model()
    with Cluster(replicas=2, policy="cache_aware", models=("llm",),
                 log_dir=tmp_path_factory.mktemp("replicas")) as started:
        yield started


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_the_router_serves_completions_and_streams_from_the_replicas(cluster):
    client = _client(cluster)
    answer = client.chat.completions.create(model="llm", max_tokens=4,
                                            messages=[{"role": "user", "content": "Hi"}])
    assert answer.choices[0].finish_reason in ("stop", "length")
    events = list(client.completions.create(model="llm", prompt="Hello", max_tokens=4,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert [e.choices[0].finish_reason for e in events if e.choices[0].finish_reason] == ["length"]


def test_cache_aware_routing_keeps_a_tenant_on_the_replica_that_cached_it(cluster):
    client = _client(cluster)
    system = "Quarterly ledger rules of the tenant Kestrel. " * 30
    cached = []
    for question in range(4):
        answer = client.chat.completions.create(
            model="llm", max_tokens=2, messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": f"Rule {question}?"}])
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    # round-robin would send the second request to the other replica's empty cache
    assert cached[0] < 100 and all(c > 300 for c in cached[1:]), cached


def test_a_killed_replica_fails_its_streams_and_traffic_goes_on_to_the_other(cluster):
    client = _client(cluster)
    outcomes: dict[int, str] = {}
    started = [threading.Event(), threading.Event()]
    stop = threading.Event()

    def stream(i: int) -> None:
        try:
            # prompts with nothing in common: the router sends the second one to the
            # replica with the fewer requests in flight, the other one
            events = client.chat.completions.create(
                messages=[{"role": "user", "content": PROMPTS[i]}], **LONG)
            with events:
                for _ in events:
                    started[i].set()
                    if stop.is_set():
                        outcomes[i] = "left by the client"
                        return
            outcomes[i] = "finished"
        except (openai.APIError, openai.APIConnectionError) as exc:
            outcomes[i] = f"error: {type(exc).__name__}"

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.5)  # in order: the second goes to the replica without a stream
    assert all(event.wait(60) for event in started)
    cluster.members[1].kill()
    deadline = time.monotonic() + 60
    while not any(o.startswith("error") for o in outcomes.values()):
        assert time.monotonic() < deadline, f"no stream ended after the kill: {outcomes}"
        time.sleep(0.1)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    # the stream on the killed replica ended with an error; the other one was unaffected
    assert sorted(o.split(":")[0] for o in outcomes.values()) == ["error", "left by the client"]
    time.sleep(3)  # the router's health check (every second) takes the replica out
    for i in range(6):
        answer = client.chat.completions.create(
            model="llm", max_tokens=3, messages=[{"role": "user", "content": f"After {i}"}])
        assert answer.choices[0].finish_reason in ("stop", "length")
