"""What the serving layer keeps per request, and the sink its responses go to."""
from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

import numpy as np

from backend import wire
from backend.core.handle import GenerateRequest, ScoreRequest

log = logging.getLogger("radixlm.serving")


class ResponseSink(Protocol):
    """Where one request's responses go (a Triton response sender, or a test double)."""

    # the outputs the client asked for (None: all); a sink may leave it out
    wanted: frozenset[str] | None

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...
    def send_error(self, message: str, cancelled: bool = False) -> None: ...  # always final
    def is_cancelled(self) -> bool: ...


@dataclass
class SampleText:
    """One sample's output collected for its one response (not streamed)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    context_ids: list[int] | None = None  # of the first output: what precedes it
    prompt_logprobs: list | None = None
    final: object = None  # the sample's last StepOutput (finish reason, counts)


@dataclass
class SentState:
    """What a streamed sample's responses have said so far (kept by the sender): a
    response without new output for the sample repeats it."""

    finish_reason: str | None = None
    num_cached_tokens: int = 0
    cumulative_logprob: float | None = None


@dataclass
class Tracked:
    job: wire.GenerateJob | wire.ScoreJob
    sink: ResponseSink
    prompt_text: str
    num_samples: int  # the engine's samples (best_of of them when larger than n)
    wanted: frozenset[str] | None = None  # the sink's, read once
    samples: dict[int, SampleText] = field(default_factory=dict)
    sent: dict[int, SentState] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    num_input_tokens: int = 0
    cancel_token: str | None = None  # when the request asked for one
    last_sent: float = 0.0  # monotonic time of its latest response (heartbeats)
    last_polled: float = 0.0  # monotonic time it was last asked about cancellation
    cancelled: bool = False  # by the client: its final response is a CANCELLED error
    cancel_message: str = "request cancelled"  # that error's text
    deadline: float | None = None  # time.monotonic() past which the request is cancelled
    aborted: bool = False  # by the server shutting down: a final with finish_reason "abort"
    # Once the final response is sent, Triton frees the request's response factory and
    # any later call on the sink (an is_cancelled poll included) would touch freed
    # memory: the final send and each poll hold io_lock, and ``closed`` ends the sink.
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    trace: dict | None = None  # the request's timeline, when tracing (diagnostics)

    def close_with(self, send: Callable[[], None]) -> None:
        """Send the final response (or error), unless one was already sent."""
        with self.io_lock:
            if self.closed:
                return
            self.closed = True
            safe_call(send)


class NewRequest(NamedTuple):
    """A request on its way in: what the loop keeps of it and what the engine gets."""
    tracked: Tracked
    request: GenerateRequest | ScoreRequest


def track(job: wire.GenerateJob | wire.ScoreJob, sink: ResponseSink, rid: str,
          prompt_text: Callable[[list[int]], str], timeout_s: float | None) -> NewRequest:
    """What the loop keeps of a new request, and what the engine gets. ``prompt_text``:
    the engine's detokenizer, for a prompt of ids that leads its output. ``timeout_s``:
    the request is cancelled (its final response an error) after that long."""
    now = time.monotonic()
    n = job.params.num_samples if isinstance(job, wire.GenerateJob) else 1
    tracked = Tracked(job=job, sink=sink, prompt_text=job.prompt if isinstance(job.prompt, str)
                      else "", num_samples=n, wanted=sink.wanted, last_sent=now,
                      last_polled=now)
    if timeout_s is not None and timeout_s > 0:
        tracked.deadline = now + timeout_s
        tracked.cancel_message = f"request timed out (its limit: {timeout_s:g} s)"
    if isinstance(job, wire.ScoreJob):
        return NewRequest(tracked, ScoreRequest(rid, job.prompt, job.choices))
    if job.prepend_input and not isinstance(job.prompt, str):
        try:
            tracked.prompt_text = prompt_text(job.prompt)
        except (OverflowError, ValueError, TypeError):
            pass  # ids outside the vocabulary: the engine refuses them by name
    if wire.CANCEL_TOKEN in job.outputs:
        tracked.cancel_token = secrets.token_hex(16)
    return NewRequest(tracked, GenerateRequest(rid, job.prompt, job.params,
                                               _text_per_step(job, sink)))


def _text_per_step(job: wire.GenerateJob, sink: ResponseSink) -> bool:
    """Whether the engine should detokenize every step (its ``stream`` flag): only for a
    streamed request whose client reads text_output. Otherwise the text is decoded once,
    when the request finishes (stop strings still see every step's text: the engine
    keeps decoding incrementally for them)."""
    wanted = sink.wanted
    return job.stream and (wanted is None or wire.TEXT_OUTPUT in wanted)


def safe_call(fn: Callable, *args, default: Any = None, ok: Any = None) -> Any:
    """Call a sink (or metrics) method; a client that went away must not take the loop
    down."""
    try:
        result = fn(*args)
        return ok if ok is not None else result
    except Exception as exc:
        log.warning("%s failed: %s", getattr(fn, "__qualname__", "a sink call"), exc)
        return default


class PendingRequests:
    """The requests the engine still works on, by request id and by cancel token. The
    execute thread adds, the loop thread looks up and retires, a cancel request looks up
    by token: every access takes the one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Tracked] = {}
        self._by_token: dict[str, str] = {}  # cancel_token -> request id

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def add(self, rid: str, tracked: Tracked) -> None:
        with self._lock:
            self._by_id[rid] = tracked
            if tracked.cancel_token is not None:
                self._by_token[tracked.cancel_token] = rid

    def find(self, outputs: list) -> list[tuple[Any, Tracked | None]]:
        """(output, its request or None) for each output: one look-up pass for a batch."""
        with self._lock:
            return [(out, self._by_id.get(out.request_id)) for out in outputs]

    def by_token(self, token: str) -> tuple[str, Tracked] | None:
        with self._lock:
            rid = self._by_token.get(token)
            tracked = self._by_id.get(rid) if rid is not None else None
        return (rid, tracked) if tracked is not None else None

    def items(self) -> list[tuple[str, Tracked]]:
        """A snapshot of (request id, tracked)."""
        with self._lock:
            return list(self._by_id.items())

    def retire(self, rid: str) -> Tracked | None:
        """The engine is done with ``rid``: stop tracking it (its final may still be queued)."""
        with self._lock:
            tracked = self._by_id.pop(rid, None)
            if tracked is not None and tracked.cancel_token is not None:
                self._by_token.pop(tracked.cancel_token, None)
            return tracked

    def take_all(self) -> dict[str, Tracked]:
        with self._lock:
            taken, self._by_id = self._by_id, {}
            self._by_token.clear()
            return taken
