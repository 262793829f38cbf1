"""EngineLoop (backend/serving.py) against a scripted engine: routing, finals, cancel, stop."""
from __future__ import annotations

import json
import threading
import time

import pytest

from backend import wire
from backend.serving import EngineLoop
from loop_helpers import EVERY_OUTPUT, RecordingSink, ScriptedEngine, entries, generate, ids_of


@pytest.fixture
def loop():
    engine = ScriptedEngine()
    loop = EngineLoop(engine, idle_wait_s=0.005, cancel_poll_s=0.0)
    loop.start()
    yield loop
    loop.stop(timeout_s=5)


def test_streaming_sends_every_token_once_and_flags_only_the_last(loop):
    sink = RecordingSink()
    loop.submit(generate(max_new_tokens=3), sink)
    assert sink.closed.wait(5)
    assert "".join(sink.texts()) == "1 2 3 "
    assert ids_of(sink) == [1, 2, 3]
    assert [final for _, final in sink.responses][-1] is True
    assert not any(final for _, final in sink.responses[:-1])
    last = sink.responses[-1][0]
    assert last[wire.FINISH_REASON][0] == b"length"
    assert [o[wire.FINISH_REASON][0] for o, _ in sink.responses[:-1]] == \
        [b"None"] * (len(sink.responses) - 1)  # as the vLLM backend says "still running"
    # streamed: each response counts its own tokens, as the vLLM backend does
    counts = [int(o[wire.NUM_OUTPUT_TOKENS][0]) for o, _ in sink.responses]
    assert sum(counts) == 3 and counts == [len(o[wire.OUTPUT_IDS]) for o, _ in sink.responses]
    for out, _ in sink.responses:  # context: the id just before the response's first id
        assert list(out[wire.CONTEXT_IDS]) == [out[wire.OUTPUT_IDS][0] - 1]
    assert loop.num_active() == 0


class SlowSink(RecordingSink):
    """A response sender that takes ``delay_s`` per send (an IPC round trip, slowed down)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def send(self, outputs, final):
        time.sleep(self.delay_s)
        super().send(outputs, final)


def test_a_slow_sender_gets_the_tokens_of_several_steps_per_response():
    engine = ScriptedEngine()
    loop = EngineLoop(engine, idle_wait_s=0.005, cancel_poll_s=0.0)
    loop.start()
    try:
        sink = SlowSink(0.03)
        loop.submit(generate(max_new_tokens=40), sink)  # 40 steps of 2 ms: about 80 ms
        assert sink.closed.wait(10)
        assert ids_of(sink) == list(range(1, 41))
        assert "".join(sink.texts()) == "".join(f"{k} " for k in range(1, 41))
        assert len(sink.responses) < 20  # one send per step would take 40 x 30 ms
        assert [final for _, final in sink.responses].count(True) == 1 and sink.responses[-1][1]
        assert sum(int(o[wire.NUM_OUTPUT_TOKENS][0]) for o, _ in sink.responses) == 40
    finally:
        loop.stop(timeout_s=5)


def test_a_slow_sender_merges_each_samples_tokens_apart():
    """Two samples' step outputs queue interleaved (0, 1, 0, 1, ...) behind a slow send:
    each joins its own sample's queued response, never the other's."""
    loop = EngineLoop(ScriptedEngine(), idle_wait_s=0.005, cancel_poll_s=0.0)
    loop.start()
    try:
        sink = SlowSink(0.03)
        loop.submit(generate(max_new_tokens=30, n=2), sink)
        assert sink.closed.wait(10)
    finally:
        loop.stop(timeout_s=5)
    assert ids_of(sink, 0) == list(range(1, 31)) and ids_of(sink, 1) == list(range(1, 31))
    assert len(sink.responses) < 30  # 60 step outputs
    assert any(len(ids) > 1 for o, _ in sink.responses for _, ids, _ in entries(o))
    for out, _ in sink.responses:  # context: the id before each response's first id
        assert list(out[wire.CONTEXT_IDS]) == [out[wire.OUTPUT_IDS][0] - 1]
    assert [final for _, final in sink.responses].count(True) == 1 and sink.responses[-1][1]


def test_a_blocked_sender_does_not_hold_up_the_engine_or_other_requests(loop):
    release = threading.Event()

    class BlockedSink(RecordingSink):
        def send(self, outputs, final):
            release.wait(10)
            super().send(outputs, final)

    blocked, other = BlockedSink(), RecordingSink()
    loop.submit(generate(max_new_tokens=5), blocked)
    loop.submit(generate(max_new_tokens=5), other)
    try:
        assert other.closed.wait(5) and ids_of(other) == [1, 2, 3, 4, 5]
        deadline = time.monotonic() + 5
        while loop.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not loop.engine.has_work()  # the engine finished both while one send hung
        assert not blocked.closed.is_set()
    finally:
        release.set()
    assert blocked.closed.wait(5) and ids_of(blocked) == [1, 2, 3, 4, 5]


def test_no_sink_is_touched_after_its_final_response_while_cancellation_is_polled(loop):
    sinks = [RecordingSink() for _ in range(300)]
    for i, sink in enumerate(sinks):
        loop.submit(generate(max_new_tokens=1 + i % 3, stream=i % 2 == 0), sink)
    rejected = [RecordingSink() for _ in range(100)]  # refused while the loop polls them
    for sink in rejected:
        loop.submit(generate("slow reject", max_new_tokens=500), sink)
    sinks += rejected
    assert all(sink.closed.wait(10) for sink in sinks)
    time.sleep(0.05)  # let the cancellation watcher make a few more rounds
    assert sum(sink.calls_after_final for sink in sinks) == 0
    assert all(len([1 for _, final in sink.responses if final]) + len(sink.errors) == 1
               for sink in sinks)
    assert all(sink.errors == [("rejected", False)] for sink in rejected)


def test_non_streaming_sends_one_response_with_everything_and_the_prompt(loop):
    sink = RecordingSink()
    loop.submit(generate("Q: ", stream=False, prepend=True, max_new_tokens=3), sink)
    assert sink.closed.wait(5)
    assert len(sink.responses) == 1 and sink.responses[0][1] is True
    out = sink.responses[0][0]
    assert out[wire.TEXT_OUTPUT][0].decode() == "Q: 1 2 3 "
    assert list(out[wire.OUTPUT_IDS]) == [1, 2, 3]
    assert list(out[wire.CONTEXT_IDS]) == [0]  # what precedes the first output id


@pytest.mark.parametrize("stream, wanted, per_step", [
    (True, None, True),  # every output: text too
    (True, frozenset({wire.TEXT_OUTPUT, wire.FINISH_REASON}), True),
    (True, frozenset({wire.OUTPUT_IDS, wire.FINISH_REASON}), False),  # ids only
    (False, None, False),  # one response at the end: the text is decoded once
])
def test_the_engine_detokenizes_every_step_only_for_streamed_text(loop, stream, wanted, per_step):
    sink = RecordingSink()
    sink.wanted = wanted
    outputs = EVERY_OUTPUT if wanted is None else wanted - {wire.TEXT_OUTPUT}
    loop.submit(generate(stream=stream, max_new_tokens=2, outputs=outputs), sink)
    assert sink.closed.wait(5)
    assert list(loop.engine.streamed.values()) == [per_step]
    if wanted is None or wire.OUTPUT_IDS in wanted:  # the tokens arrive either way
        assert [i for o, _ in sink.responses for i in o[wire.OUTPUT_IDS]] == [1, 2]
    if wanted is not None:  # only what the client asked for is built (and the text)
        assert all(set(o) == wanted | {wire.TEXT_OUTPUT} for o, _ in sink.responses)


def test_rejected_prompt_gets_an_error_and_is_not_tracked(loop):
    sink = RecordingSink()
    loop.submit(generate("too long"), sink)
    assert sink.closed.wait(5)
    assert sink.errors == [("prompt has 9999 tokens; the context length is 64", False)]
    assert loop.num_active() == 0 and not sink.responses


def test_cancelled_request_is_aborted_and_gets_a_cancelled_final(loop):
    sink = RecordingSink()
    loop.submit(generate(max_new_tokens=10_000), sink)
    while len(sink.responses) < 2:
        time.sleep(0.001)
    sink.cancelled = True
    assert sink.closed.wait(5)
    assert sink.errors == [("request cancelled", True)]
    assert len(loop.engine.aborted) == 1 and loop.num_active() == 0
    assert len(sink.responses) < 10_000


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_time_limit_is_aborted_with_an_error(loop, stream):
    """What bounds the work of a non-streamed HTTP client that left: Triton never says."""
    sink, other = RecordingSink(), RecordingSink()
    started = time.monotonic()
    loop.submit(generate(max_new_tokens=100_000, stream=stream), sink, timeout_s=0.2)
    loop.submit(generate(max_new_tokens=100_000, stream=stream), other)
    assert sink.closed.wait(5)
    assert 0.2 <= time.monotonic() - started < 2
    assert sink.errors == [("request timed out (its limit: 0.2 s)", True)]
    assert not other.closed.is_set()  # no limit: runs on
    assert loop.engine.aborted == [next(iter(r for r in loop.engine.streamed))]
    assert loop.num_active() == 1


def test_n_samples_stream_with_their_index_and_one_final(loop):
    sink = RecordingSink()
    loop.submit(generate(max_new_tokens=2, n=2), sink)
    assert sink.closed.wait(5)
    assert ids_of(sink, 0) == [1, 2] and ids_of(sink, 1) == [1, 2]
    assert [final for _, final in sink.responses].count(True) == 1 and sink.responses[-1][1]
    # as the vLLM backend streams n samples: every response has an entry for each
    for out, _ in sink.responses:
        assert [k for k, _, _ in entries(out)] == [0, 1] and len(out[wire.TEXT_OUTPUT]) == 2
    assert [reason for _, _, reason in entries(sink.responses[-1][0])] == ["length", "length"]


def test_score_request_gets_one_response_with_choice_scores(loop):
    sink = RecordingSink()
    loop.submit(wire.ScoreJob("Is it?", ["yes", "no"]), sink)
    assert sink.closed.wait(5)
    (out, final), = sink.responses
    scores = json.loads(out[wire.CHOICE_SCORES][0])
    assert final and [s["choice"] for s in scores] == ["yes", "no"]
    assert scores[1]["logprob_sum"] == -2.0 and scores[1]["normalized_logprob"] == -1.0


def test_stats_job_reports_engine_stats_and_integrity(loop):
    sink = RecordingSink()
    loop.submit(wire.StatsJob(), sink)
    assert sink.closed.wait(5)
    stats = json.loads(sink.responses[0][0][wire.STATS][0])
    loop_timings = stats.pop("loop")
    assert stats == {"num_running": 0, "num_waiting": 0, "integrity_ok": True,
                     "integrity_error": None, "num_pending_requests": 0}
    assert set(loop_timings) == {"step_s", "route_s", "idle_s", "steps", "queued_responses",
                                 "intake_requests", "intake_s", "intake_burst_gaps",
                                 "intake_burst_gap_s", "cancel_poll_passes", "ipc"}
    assert loop_timings["steps"] == 0 and loop_timings["idle_s"] > 0
    # the Triton adapter counts its round trips there; this sink is no Triton sink
    assert loop_timings["ipc"] == {"response_sends": 0, "error_sends": 0, "cancel_polls": 0,
                                   "metric_increments": 0, "metric_sets": 0,
                                   "metric_observes": 0}


def test_intake_timings_count_requests_and_gaps_within_bursts_only(loop):
    loop.note_intake(10.0, 10.0002, 1)
    loop.note_intake(10.0005, 10.0007, 2)  # 0.3 ms after the previous hand-over: a burst
    loop.note_intake(11.0, 11.0001, 1)  # a second later: not part of it
    t = loop.diagnostics.intake
    assert t["intake_requests"] == 4
    assert t["intake_s"] == pytest.approx(0.0005)
    assert t["intake_burst_gaps"] == 1 and t["intake_burst_gap_s"] == pytest.approx(0.0003)


def test_loop_timings_count_the_steps_and_the_profile_is_written(tmp_path, monkeypatch):
    from backend import diagnostics
    monkeypatch.setenv(diagnostics.PROFILE_ENV, str(tmp_path))
    loop = EngineLoop(ScriptedEngine(), idle_wait_s=0.005, cancel_poll_s=0.0)
    loop.start()
    sink = RecordingSink()
    loop.submit(generate(max_new_tokens=5), sink)
    assert sink.closed.wait(5)
    loop.stop(timeout_s=5)
    timings = loop.diagnostics.timer.report()
    assert timings["steps"] == 5 and timings["step_s"] >= 5 * 0.002
    (profile,) = tmp_path.glob("engine_loop_*.txt")
    assert "_take_batch" in profile.read_text()


def stats_of(loop) -> dict:
    sink = RecordingSink()
    loop.submit(wire.StatsJob(), sink)
    assert sink.closed.wait(5)
    return json.loads(sink.responses[0][0][wire.STATS][0])


def test_request_timelines_are_reported_once_and_in_order_when_tracing(monkeypatch):
    from backend import diagnostics
    monkeypatch.setenv(diagnostics.TRACE_ENV, "8")
    loop = EngineLoop(ScriptedEngine(), idle_wait_s=0.005, cancel_poll_s=0.0)
    loop.start()
    try:
        streamed, whole = RecordingSink(), RecordingSink()
        loop.submit(generate(max_new_tokens=3), streamed, "client-7")
        loop.submit(generate(stream=False, max_new_tokens=2), whole)
        assert streamed.closed.wait(5) and whole.closed.wait(5)
        wait_for(lambda: loop.pending_responses() == 0)  # the senders noted their last send
        first, again = stats_of(loop)["trace"], stats_of(loop)["trace"]
    finally:
        loop.stop(timeout_s=5)
    assert again == []
    (s,) = [t for t in first if t["id"] == "client-7"]
    assert s["intake"] <= s["made"] <= s["routed"] <= s["first_sent"] <= s["final_sent"]
    assert s["received"] == s["intake"]  # an in-process engine has it at submit
    assert s["responses"] == len(streamed.responses) >= 2
    (w,) = [t for t in first if t["id"] != "client-7"]
    assert w["id"].endswith("-1")  # no label: the loop's own request id
    assert w["responses"] == 1 and w["first_sent"] == w["final_sent"] >= w["routed"]


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_engine_failure_fails_pending_requests_and_the_loop_keeps_serving(loop):
    loop.engine.fail_next_step = True
    sink = RecordingSink()
    loop.submit(generate(max_new_tokens=50), sink)
    assert sink.closed.wait(5)
    assert sink.errors == [("engine error: kernel exploded", False)]
    after = RecordingSink()
    loop.submit(generate(max_new_tokens=1), after)
    assert after.closed.wait(5) and after.texts() == ["1 "]


def test_a_stuck_stop_logs_where_the_loop_thread_is():
    engine = ScriptedEngine()
    release = threading.Event()
    engine.step = lambda: release.wait(10) and []  # a step that does not return
    errors: list[str] = []
    loop = EngineLoop(engine, idle_wait_s=0.005, cancel_poll_s=0.0, on_error=errors.append)
    loop.start()
    loop.submit(generate(max_new_tokens=2), RecordingSink())
    time.sleep(0.05)
    loop.stop(timeout_s=0.3, report_after_s=0.1)
    release.set()
    assert len(errors) == 1 and "still stopping after 0.1 s" in errors[0]
    assert "in <lambda>" in errors[0]  # the frame it is stuck in


def test_stop_drains_pending_requests_with_final_responses():
    engine = ScriptedEngine()
    loop = EngineLoop(engine, idle_wait_s=0.005)
    loop.start()
    sinks = [RecordingSink() for _ in range(3)]
    for sink in sinks:
        loop.submit(generate(max_new_tokens=100_000), sink)
    time.sleep(0.05)
    started = time.monotonic()
    loop.stop(timeout_s=5)
    assert time.monotonic() - started < 5
    for sink in sinks:
        assert sink.closed.is_set()
        assert sink.responses[-1][1] is True
        assert sink.responses[-1][0][wire.FINISH_REASON][0] == b"abort"
    late = RecordingSink()
    loop.submit(generate(), late)
    assert late.errors == [("the model is shutting down", False)]


def test_server_shutdown_aborts_pending_requests_with_final_responses():
    stopping = threading.Event()
    loop = EngineLoop(ScriptedEngine(), idle_wait_s=0.005, cancel_poll_s=0.0,
                      server_stopping=stopping.is_set)
    loop.start()
    try:
        streamed, whole = RecordingSink(), RecordingSink()
        loop.submit(generate(max_new_tokens=100_000), streamed)
        loop.submit(generate("Q: ", stream=False, prepend=True, max_new_tokens=100_000), whole)
        while len(streamed.responses) < 3:
            time.sleep(0.001)
        stopping.set()
        assert streamed.closed.wait(5) and whole.closed.wait(5)
        last, final = streamed.responses[-1]
        assert final and last[wire.FINISH_REASON][0] == b"abort"
        (out, final), = whole.responses
        assert final and out[wire.FINISH_REASON][0] == b"abort"
        assert out[wire.TEXT_OUTPUT][0].decode().startswith("Q: 1 2 3 ")
        assert loop.num_active() == 0 and not streamed.errors
    finally:
        loop.stop(timeout_s=5)
