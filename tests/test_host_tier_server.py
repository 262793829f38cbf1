"""The two-tier radix cache behind a real tritonserver, with a GPU cache (here the CPU KV
pool) too small for the traffic: a cycle of tenants larger than the pool keeps reporting
cached tokens (served back from host memory), the tier's metrics show it, and cancelled
streams give back every KV slot and leave the host blocks accounted for."""
from __future__ import annotations

import re
import shutil
import time

import pytest

from conftest import (MODEL_REPOSITORY, Stream, _stop, ensure_default_model, grpc_inputs,
                      server_stats, start_server)
from test_metrics_server import Scrape

pytestmark = [pytest.mark.server, pytest.mark.slow]

POOL = 256  # KV tokens on the "device": about three of the five tenants' prompts
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu").split()
TENANTS = [f"Tenant {k} system prompt: " + " ".join(WORDS[(k * 7 + i) % 26] for i in range(40))
           for k in range(5)]  # ~75 tokens each


def _wait_until(server, ready, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server_stats(server)
        if ready(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_a_cycle_of_tenants_larger_than_the_kv_pool_keeps_hitting_and_nothing_leaks(tmp_path):
    ensure_default_model()
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "llm", repo / "llm")
    config = repo / "llm" / "config.pbtxt"
    text = re.sub(r'(key: "max_total_tokens" value: \{ string_value: )"\d+"', rf'\1"{POOL}"',
                  config.read_text())
    assert f'string_value: "{POOL}"' in text
    # prompts of ~75 tokens: load every host match, however short
    text += 'parameters: { key: "host_load_min_tokens" value: { string_value: "0" } }\n'
    config.write_text(text)
    server = start_server(tmp_path / "server.log", (f"--model-repository={repo}",))
    try:
        s = Stream(server)
        cached = []
        for rnd in range(3):
            for k, tenant in enumerate(TENANTS):
                rid = f"r{rnd}-t{k}"
                s.send(rid, grpc_inputs(f"{tenant} Question {rnd}?",
                                        {"temperature": 0, "max_tokens": 4}))
                cached.append(s.collect([rid])[rid][-1]["num_cached_tokens"])
        assert all(c <= 3 for c in cached[:5]), cached  # only the shared "Tenant " start
        # every later request finds its tenant's prompt in one tier or the other
        assert all(c >= 40 for c in cached[5:]), cached
        stats = server_stats(server)
        assert stats["kv_tokens_total"] == POOL and stats["host_cache_tokens_total"] == 2 * POOL
        assert stats["cache_hit_tokens_host"] > 0 and stats["kv_bytes_to_device"] > 0

        # cancel streams mid-way: slots go back, loads finish, the accounting holds
        for i in range(4):
            s.send(f"long{i}", grpc_inputs(f"{TENANTS[i]} Tell me more.",
                                           {"temperature": 0, "max_tokens": 400,
                                            "ignore_eos": True}))
        result, error = s.events.get(timeout=60)
        assert error is None, error
        s.close(cancel=True)
        stats = _wait_until(server, lambda st: st["num_running"] == 0 and st["num_waiting"] == 0)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["kv_tokens_in_use_by_requests"] == 0
        assert stats["host_loads_in_flight"] == 0
        assert stats["integrity_ok"] is True, stats["integrity_error"]
        assert 0 < stats["host_cache_tokens"] <= stats["host_cache_tokens_total"]

        deadline = time.monotonic() + 15
        while True:  # published a fraction of a second after the fact, stats sampled apart
            metrics = Scrape(server)
            total = metrics("radixlm_cached_prompt_tokens_total")
            host = metrics("radixlm_cached_prompt_tokens_by_tier_total", tier="host")
            device = metrics("radixlm_cached_prompt_tokens_by_tier_total", tier="device")
            if (host > 0 and host + device == total) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert host > 0 and host + device == total, (host, device, total)
        assert metrics("radixlm_kv_transfer_bytes_total", direction="to_host") > 0
    finally:
        _stop(server.process)
