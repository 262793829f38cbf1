"""One interface for "an engine", whichever process it steps in.

The serving layer holds an ``EngineHandle`` and nothing else: the in-process ``Engine``
satisfies it, and so does ``backend.engine_process.EngineProcess`` (the same engine in
a child process, reached over a socket). Requests go in as typed submissions; outputs
come back as ``OutputBatch``es. A bad request is never an exception of ``submit``: its
refusal (a finished ``StepOutput`` with ``error``) comes back in a later batch, as it
must from an engine in another process.

``next_outputs`` is the only way outputs come back: an in-process engine runs one step
when it has work (else waits up to the timeout for some); a remote engine steps on its
own and ``next_outputs`` waits for what it sent. An engine with several processes of
its own (tensor-parallel ranks) fits behind the same calls: only rank 0 talks to the
handle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .outputs import StepOutput
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    # False: outputs carry no text until the last one, which carries all of it (the
    # text is decoded once instead of every step)
    stream: bool = True


@dataclass(frozen=True)
class ScoreRequest:
    """Score each continuation of ``prompt``: one output with ``choice_scores``."""

    request_id: str
    prompt: str | list[int]
    choices: list[str]


Submission = GenerateRequest | ScoreRequest


@dataclass
class OutputBatch:
    """What one ``next_outputs`` call returns."""

    outputs: list[StepOutput] = field(default_factory=list)
    # wall clock when these outputs left the engine (the oldest, when several steps'
    # outputs are returned together)
    made_at: float = 0.0
    # the engine's step failed: every request still pending on this handle fails with
    # this message (the outputs before the failure are in ``outputs``)
    step_error: str | None = None
    # when tracing requests: engine wall clock at which each request whose first output
    # is in ``outputs`` arrived at the engine
    arrivals: dict[str, float] | None = None


class EngineDied(RuntimeError):
    """The engine is gone (its process crashed, was killed, or never started)."""


@runtime_checkable
class EngineHandle(Protocol):
    def submit(self, request: Submission) -> None:
        """Queue a request (any thread); a refusal comes back as an output."""

    def abort(self, request_id: str) -> None:
        """End a request early (any thread); its final output says "abort"."""

    def next_outputs(self, timeout_s: float) -> OutputBatch:
        """The next outputs, waiting up to ``timeout_s`` when there are none (one
        thread only). Raises ``EngineDied`` when the engine is gone."""

    def prompt_text(self, token_ids: list[int]) -> str:
        """The text of a prompt given as token ids (for responses that echo it)."""

    def stats(self) -> dict:
        """Counters and gauges of the engine (see ``Engine.stats``)."""

    def check_integrity(self) -> None:
        """Raise AssertionError when KV slot accounting is broken."""

    def flush_cache(self) -> int:
        """Drop the cached prefixes no running request holds; the KV slots freed."""

    def close(self, timeout_s: float = 10.0) -> None:
        """Release the engine (an in-process one stays usable for offline calls)."""
