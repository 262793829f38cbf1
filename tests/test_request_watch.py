"""RequestWatch (backend/request_watch.py): the cancellation polls' budget per pass, their
round robin, and time limits checked for every request whatever the budget."""
from __future__ import annotations

from backend.request_watch import RequestWatch
from backend.serving_types import Tracked
from loop_helpers import generate


class PolledSink:
    wanted = None

    def __init__(self) -> None:
        self.polls = 0
        self.cancelled = False

    def is_cancelled(self):
        self.polls += 1
        return self.cancelled


def pending(count: int, **fields) -> list[tuple[str, Tracked]]:
    return [(f"r{i}", Tracked(job=generate(), sink=PolledSink(), prompt_text="", num_samples=1,
                              **fields)) for i in range(count)]


def watch(aborted: list, max_polls: int) -> RequestWatch:
    return RequestWatch(aborted.append, lambda rid, item: None, poll_s=0.1, heartbeat_s=1.0,
                        max_polls=max_polls)


def polls(requests) -> list[int]:
    return [t.sink.polls for _, t in requests]


def test_a_pass_polls_at_most_its_budget_and_every_request_in_turn():
    aborted, requests = [], pending(40)
    w = watch(aborted, max_polls=8)
    for k in range(5):
        w.check(requests, now=1.0 + k)
        assert sum(polls(requests)) == 8 * (k + 1)  # the budget, whatever the batch
    assert polls(requests) == [1] * 40  # five passes asked each of the 40 once
    w.check(requests, now=6.0)
    assert polls(requests) == [2] * 8 + [1] * 32  # and the round starts over
    assert aborted == []


def test_a_client_that_left_is_noticed_within_its_share_of_passes():
    aborted, requests = [], pending(40)
    requests[37][1].sink.cancelled = True
    w = watch(aborted, max_polls=8)
    for k in range(5):  # ceil(40 / 8) passes
        w.check(requests, now=1.0 + k)
    assert aborted == ["r37"] and requests[37][1].cancelled


def test_up_to_the_budget_every_request_is_polled_every_pass():
    aborted, requests = [], pending(8)
    w = watch(aborted, max_polls=8)
    w.check(requests, now=1.0)
    w.check(requests, now=2.0)
    assert polls(requests) == [2] * 8


def test_time_limits_are_checked_for_every_request_without_a_round_trip():
    aborted, requests = [], pending(40, deadline=5.0)
    w = watch(aborted, max_polls=8)
    w.check(requests, now=4.0)
    assert aborted == [] and sum(polls(requests)) == 8
    w.check(requests, now=5.0)
    assert aborted == [f"r{i}" for i in range(40)]
    assert sum(polls(requests)) == 8  # no poll for a request whose time is up
    assert all(t.cancelled for _, t in requests)


def test_a_request_busy_in_a_sender_or_closed_is_skipped_without_spending_the_budget():
    aborted, requests = [], pending(10)
    busy, closed = requests[0][1], requests[1][1]
    closed.closed = True
    w = watch(aborted, max_polls=4)
    with busy.io_lock:
        w.check(requests, now=1.0)
    assert polls(requests) == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    w.check(requests, now=2.0)  # the busy one waited longest: asked first now
    assert polls(requests) == [1, 0, 1, 1, 1, 1, 1, 1, 1, 0]
