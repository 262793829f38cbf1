"""What the serving layer keeps per request, and the sink its responses go to."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from backend import wire

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


def safe_call(fn: Callable, *args, default: Any = None, ok: Any = None) -> Any:
    """Call a sink (or metrics) method; a client that went away must not take the loop
    down."""
    try:
        result = fn(*args)
        return ok if ok is not None else result
    except Exception as exc:
        log.warning("%s failed: %s", getattr(fn, "__qualname__", "a sink call"), exc)
        return default
