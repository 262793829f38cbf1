"""Two instances of the model behind a real tritonserver (``instance_group count: 2``): one
engine process serves both stubs, every stream gets the in-process engine's tokens, the
counters add up across instances while the engine-wide gauges come from one, and SIGTERM
to the process group stops both stubs and the engine process."""
from __future__ import annotations

import re
import shutil
import time

import pytest

from conftest import (MODEL_REPOSITORY, Stream, _stop, ensure_default_model, grpc_inputs,
                      joined, server_stats, sigterm_mid_stream, start_server)
from test_engine_process import wait_gone
from test_metrics_server import Scrape

pytestmark = [pytest.mark.server, pytest.mark.slow]

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}  # all 8 from a real model


def test_two_instances_share_one_engine(tmp_path, reference_engine):
    from backend.core import SamplingParams

    ensure_default_model()
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "llm", repo / "llm")
    config = repo / "llm" / "config.pbtxt"
    text = re.sub(r"instance_group \[[^\]]*\]", "instance_group [ { count: 2, kind: KIND_CPU } ]",
                  config.read_text())
    assert "count: 2" in text
    config.write_text(text)
    server = start_server(tmp_path / "server.log", (f"--model-repository={repo}",))
    try:
        log = server.log_path.read_text()
        started = re.findall(r"the engine runs in process (\d+)", log)
        attached = re.findall(r"attached to the engine process (\d+)", log)
        assert len(started) == 1 and attached == started, log[-3000:]
        child = int(started[0])

        prompts = [f"Question {i}: what comes after {i}?" for i in range(12)]
        s = Stream(server)
        for i, p in enumerate(prompts):
            s.send(f"q{i}", grpc_inputs(p, GREEDY))
        got = s.collect([f"q{i}" for i in range(len(prompts))])
        want = reference_engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                 ignore_eos=True))
        for i, w in enumerate(want):
            assert joined(got[f"q{i}"])[1] == w.token_ids
            assert got[f"q{i}"][-1]["finish_reason"] == "length"

        stats = server_stats(server)
        assert stats["engine_peers"] == 2 and stats["integrity_ok"] is True

        deadline = time.monotonic() + 15
        while True:  # metrics are published a fraction of a second after the fact
            metrics = Scrape(server)
            done = [v for (n, ls), v in metrics.samples.items()
                    if n == "radixlm_requests_total" and ("finish_reason", "length") in ls]
            if sum(done) == len(prompts) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # one series per instance; how Triton split the requests between them is its own
        # business (3 and 9 in one run here), so only their sum is asserted
        assert sum(done) == len(prompts) and len(done) == 2, done
        assert metrics("radixlm_generation_tokens_total") == 8 * len(prompts)
        running = [ls for (n, ls), _ in metrics.samples.items()
                   if n == "radixlm_num_requests_running"]
        assert len(running) == 1  # the engine's gauges come from one instance

        assert sigterm_mid_stream(server, s)["finish_reason"] == "abort"
        s.close()
        server.process.wait(timeout=30)
        wait_gone(child, "the server", timeout_s=10)
    finally:
        _stop(server.process)
