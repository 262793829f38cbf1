"""The engine in a child process (backend/engine_process.py), alone and under EngineLoop:
same tokens as the engine in-process, bad prompts fail alone, aborts free their KV slots,
a dead child fails what is pending, and the child ends with its stub."""
from __future__ import annotations

import os
import signal
import time

import pytest

from backend import diagnostics, wire
from backend.core import SamplingParams
from backend.core.handle import GenerateRequest
from backend.engine_process import EngineProcess, EngineProcessDied
from backend.serving import EngineLoop
from engine_helpers import make_engine, random_prompts, tiny_model
from loop_helpers import RecordingSink, generate

SETTINGS = dict(device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=32,
                max_prefill_tokens=512)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("engine_process"), "llama")


@pytest.fixture(scope="module")
def remote(model_path):
    from backend.core import EngineConfig

    engine = EngineProcess(EngineConfig(model_path=str(model_path), **SETTINGS))
    yield engine
    engine.close()


def run_until_finished(engine, expected: int, timeout_s: float = 60.0) -> list:
    outputs, finished = [], 0
    deadline = time.monotonic() + timeout_s
    while finished < expected:
        assert time.monotonic() < deadline, f"only {finished} of {expected} finished"
        new = engine.next_outputs(0.5).outputs
        outputs += new
        finished += sum(o.finished for o in new)
    return outputs


def add(engine, prompt, params, request_id: str) -> None:
    engine.submit(GenerateRequest(request_id, prompt, params))


def by_request(outputs) -> dict[str, list[int]]:
    ids: dict[str, list[int]] = {}
    for o in outputs:
        ids.setdefault(o.request_id, []).extend(o.new_token_ids)
    return ids


def test_tokens_match_the_engine_in_process(remote, model_path):
    prompts = random_prompts(6, 200, seed=3, min_len=3, max_len=30)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in make_engine(model_path).generate(prompts, params)]
    for i, p in enumerate(prompts):
        add(remote, p, params, f"r{i}")
    got = by_request(run_until_finished(remote, len(prompts)))
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    remote.check_integrity()
    stats = remote.stats()
    assert stats["generated_tokens"] >= 6 * 12
    assert stats["engine_loop"]["steps"] >= 12


def test_a_bad_prompt_fails_alone_and_the_others_finish(remote):
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    add(remote, [], params, "empty")
    add(remote, [12, 13, 14], params, "good")
    add(remote, [10 + i % 900 for i in range(5000)], params, "too-long")
    outputs = run_until_finished(remote, 3)
    errors = {o.request_id: o.error for o in outputs if o.error}
    assert set(errors) == {"empty", "too-long"}
    assert "empty" in errors["empty"] and "tokens" in errors["too-long"]
    assert len(by_request(outputs)["good"]) == 5
    remote.check_integrity()


def test_abort_frees_the_requests_kv_slots(remote):
    params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    add(remote, [20, 21, 22, 23], params, "long")
    first = []
    while not first:
        first = [o for o in remote.next_outputs(1.0).outputs if o.new_token_ids]
    remote.abort("long")
    outputs = run_until_finished(remote, 1)
    assert outputs[-1].finish_reason == "abort"
    assert len(by_request(first + outputs)["long"]) < 400
    stats = remote.stats()
    assert stats["kv_tokens_in_use_by_requests"] == 0 and stats["num_running"] == 0
    remote.check_integrity()


def test_outputs_carry_when_they_left_the_child(remote):
    before = time.time()
    add(remote, [60, 61], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
        "timed")
    batches = []
    while not any(o.finished for b in batches for o in b.outputs):
        batches.append(remote.next_outputs(1.0))
    made = [b.made_at for b in batches if b.outputs]
    assert made and all(before <= m <= time.time() for m in made)
    transfer = remote.stats()["transfer"]
    assert transfer["messages"] >= 2 and 0 <= transfer["max_lag_s"] < 5
    assert transfer["lag_s"] <= transfer["messages"] * transfer["max_lag_s"] + 1e-6


def test_under_the_engine_loop_streams_and_scores(remote):
    loop = EngineLoop(remote, idle_wait_s=0.01, cancel_poll_s=0.01)
    loop.start()
    try:
        stream, score, bad = RecordingSink(), RecordingSink(), RecordingSink()
        loop.submit(generate([30, 31, 32], max_new_tokens=6, temperature=0.0, ignore_eos=True), stream)
        loop.submit(wire.ScoreJob([30, 31, 32], ["a", "b c"]), score)
        loop.submit(generate([]), bad)
        for sink in (stream, score, bad):
            assert sink.closed.wait(60)
        assert sum(len(o[wire.OUTPUT_IDS]) for o, _ in stream.responses) == 6
        assert [final for _, final in stream.responses][-1] is True
        assert len(score.responses) == 1 and score.responses[0][1] is True
        assert bad.errors and "empty" in bad.errors[0][0]
        assert loop.num_active() == 0
    finally:
        loop.stop(timeout_s=10)
    remote.check_integrity()


def test_traced_requests_say_when_the_child_got_them(model_path, monkeypatch):
    from backend.core import EngineConfig
    monkeypatch.setenv(diagnostics.TRACE_ENV, "16")  # the child inherits it
    engine = EngineProcess(EngineConfig(model_path=str(model_path), **SETTINGS))
    loop = EngineLoop(engine, idle_wait_s=0.01, cancel_poll_s=0.01)
    loop.start()
    try:
        sink, bad = RecordingSink(), RecordingSink()
        loop.submit(generate([30, 31, 32], max_new_tokens=3, temperature=0.0, ignore_eos=True),
                    sink, "traced")
        loop.submit(generate([10**9]), bad, "refused")
        assert sink.closed.wait(60) and bad.closed.wait(60)
        deadline = time.monotonic() + 5
        while loop.pending_responses() and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = RecordingSink()
        loop.submit(wire.StatsJob(), stats)
        assert stats.closed.wait(60)
    finally:
        loop.stop(timeout_s=10)
        engine.close()
    import json
    traces = {t["id"]: t for t in json.loads(stats.responses[0][0][wire.STATS][0])["trace"]}
    t = traces["traced"]
    assert t["intake"] < t["received"] <= t["made"] <= t["routed"] <= t["first_sent"]
    assert traces["refused"]["intake"] < traces["refused"]["received"]  # its error came back


def test_sigterm_to_the_child_is_ignored(remote):
    os.kill(remote.pid, signal.SIGTERM)  # what a signal to the server's process group does
    time.sleep(0.3)
    add(remote, [40, 41], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
        "after-sigterm")
    assert len(by_request(run_until_finished(remote, 1))["after-sigterm"]) == 3


def test_a_dead_child_fails_pending_requests_through_the_loop(model_path):
    from backend.core import EngineConfig

    engine = EngineProcess(EngineConfig(model_path=str(model_path), **SETTINGS))
    deaths = []
    loop = EngineLoop(engine, idle_wait_s=0.01, cancel_poll_s=0.01, on_death=deaths.append,
                      on_error=lambda message: None)
    loop.start()
    try:
        sink = RecordingSink()
        loop.submit(generate([50, 51], max_new_tokens=4000, temperature=0.0, ignore_eos=True), sink)
        deadline = time.monotonic() + 60
        while not sink.responses:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(engine.pid, signal.SIGKILL)
        assert sink.closed.wait(30)
        assert sink.errors and "engine" in sink.errors[-1][0]
        while not deaths:  # reported after every pending request got its error
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "exited" in deaths[0]
        later = RecordingSink()
        loop.submit(generate([1]), later)
        assert later.errors and "not running" in later.errors[0][0]
    finally:
        loop.stop(timeout_s=10)
        engine.close(timeout_s=1)


def test_the_child_exits_when_its_stub_goes_away(model_path, tmp_path):
    """A stub killed outright (SIGKILL) cannot say "close": its engine process notices
    the closed socket and exits instead of holding the GPU."""
    import subprocess
    import sys

    script = tmp_path / "stub.py"
    script.write_text(
        "import sys, time\n"
        "from backend.core import EngineConfig\n"
        "from backend.engine_process import EngineProcess\n"
        f"e = EngineProcess(EngineConfig(model_path={str(model_path)!r}, **{SETTINGS!r}))\n"
        "print(e.pid, flush=True)\n"
        "time.sleep(600)\n")
    stub = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        child = int(stub.stdout.readline())
        stub.kill()
        stub.wait(10)
        wait_gone(child, "its stub")
    finally:
        stub.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pid: int, what: str, timeout_s: float = 30.0) -> None:
    """Wait for process ``pid`` to exit; fail with ``what`` outlived ... after the timeout."""
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        assert time.monotonic() < deadline, f"the engine process outlived {what}"
        time.sleep(0.05)


def test_a_model_that_cannot_load_fails_the_start_with_the_reason(tmp_path):
    from backend.core import EngineConfig

    with pytest.raises(EngineProcessDied, match="building the engine failed"):
        EngineProcess(EngineConfig(model_path=str(tmp_path / "missing"), **SETTINGS))


def test_the_childs_step_loop_is_profiled_on_request(model_path, monkeypatch, tmp_path):
    """RADIXLM_PROFILE_DIR (passed on to the child): its step loop's cProfile text is
    written at every stats request."""
    from backend.core import EngineConfig
    monkeypatch.setenv(diagnostics.PROFILE_ENV, str(tmp_path))
    engine = EngineProcess(EngineConfig(model_path=str(model_path), **SETTINGS))
    try:
        add(engine, [5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.0,
                                              ignore_eos=True), "profiled")
        run_until_finished(engine, 1)
        engine.stats()
        profile = tmp_path / f"engine_process_{engine.pid}.txt"
        text = profile.read_text()
        assert "engine.py" in text and "(step)" in text
    finally:
        engine.close()


def test_engine_cpus_setting_parses_lists_and_ranges_and_rejects_the_rest():
    from backend.cpu_pinning import parse_cpus

    assert parse_cpus("8") == {8}
    assert parse_cpus("8,10-12, 3") == {3, 8, 10, 11, 12}
    for bad in ("a", "3-", "5-2", "1;2"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_engine_cpus_auto_gives_each_gpu_its_own_cpu_and_leaves_cpu_runs_alone():
    from backend.cpu_pinning import HostCpus, loop_cpus

    machine = HostCpus(online=16, shared=False)
    allowed = set(range(16))
    assert loop_cpus("", allowed, "cuda", machine) == {15}
    assert loop_cpus("auto", allowed, "cuda:0", machine) == {15}
    assert loop_cpus("auto", allowed, "cuda:3", machine) == {12}
    assert loop_cpus("auto", allowed, "cpu", machine) is None  # nothing to overlap with
    assert loop_cpus("auto", {0, 1}, "cuda", HostCpus(2, False)) is None  # too few CPUs
    assert loop_cpus("none", allowed, "cuda", machine) is None
    assert loop_cpus("3-4", allowed, "cpu", machine) == {3, 4}
    # a container that sees only GPU 2 of the machine as cuda:0 counts from that GPU
    assert loop_cpus("auto", allowed, "cuda:0", HostCpus(16, False, (2,))) == {13}
    # CPUs shared with other tenants: every pod's cuda:0 would pick the same CPU
    assert loop_cpus("auto", allowed, "cuda", HostCpus(16, True)) is None
    # ... unless a cpuset of its own was given: then the device index within it
    assert loop_cpus("auto", {2, 5, 9, 11}, "cuda:1", HostCpus(16, True, (6, 7))) == {9}


def test_engine_cpus_setting_pins_the_loop_and_keeps_later_threads_off_it():
    import threading

    from backend.cpu_pinning import LoopPinning

    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs")  # the CI machine has 2
    one = max(before)
    pinning = LoopPinning()
    try:
        assert pinning.pin_loop("cpu", setting=str(one)) == {one}
        assert os.sched_getaffinity(0) == {one}
        seen = []

        def other():
            pinning.keep_off_loop()
            seen.append(os.sched_getaffinity(0))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen == [before - {one}]
        # no such CPU: left as it is
        assert LoopPinning().pin_loop("cpu", setting="100000") is None
        assert os.sched_getaffinity(0) == {one}
    finally:
        os.sched_setaffinity(0, before)
