"""What the engine hands back: per-step deltas and whole-request results."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing precedes it)
    top: dict[int, float] | None = None  # top alternatives (token id -> logprob), best first
    rank: int | None = None  # the token's rank in the distribution (1: the most likely)
    text: str | None = None  # the token decoded alone (vLLM's decoded_token)
    top_text: dict[int, str] | None = None  # the same for the alternatives


@dataclass(slots=True)
class ChoiceScore:
    choice: str
    logprob_sum: float
    num_tokens: int
    token_logprobs: list[float]
    token_ids: list[int] = field(default_factory=list)  # the scored tokens

    @property
    def normalized_logprob(self) -> float:
        return self.logprob_sum / max(self.num_tokens, 1)


@dataclass(slots=True, kw_only=True)
class StepOutput:
    """New output of one request (or one of its n samples) from one ``Engine.step()``.

    ``new_text`` is exactly the text that became final this step: concatenating the
    ``new_text`` of all steps of a request gives its full ``text``.
    """

    request_id: str
    index: int = 0  # sample index (0..n-1)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, this sample
    logprobs: list[TokenLogprob] | None = None  # for new_token_ids, when asked
    # sum of the logprobs of every token of this sample so far, when they are computed
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # once, with the first output
    # For a stateless detokenizer (the ensemble's postprocessing): ids that precede
    # new_token_ids, enough to decode the new ids' text exactly (see detokenizer.py).
    context_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # set when the request failed (bad input, grammar, engine)
    choice_scores: list[ChoiceScore] | None = None  # answer of a score (select) request
    # On the final output: seconds from arrival to admission ("queue_time"), to the first
    # token ("time_to_first_token") and to the end ("e2e_latency"), and the mean gap
    # between later tokens ("time_per_output_token", absent with fewer than 2 tokens).
    # A sample's first output carries the first two.
    timings: dict[str, float] | None = None

    @classmethod
    def refusal(cls, request_id: str, message: str) -> "StepOutput":
        """The one output of a request refused before it ran (bad prompt, bad grammar)."""
        return cls(request_id=request_id, finished=True, finish_reason="abort", error=message)


@dataclass
class RequestOutput:
    """The whole result of one prompt from ``Engine.generate``."""

    request_id: str
    prompt: str | list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    samples: list["RequestOutput"] = field(default_factory=list)  # all n samples when n > 1
    error: str | None = None
    cumulative_logprob: float | None = None  # when token logprobs were computed


@dataclass
class EngineCounters:
    """Totals over finished requests and steps (``Engine.stats()`` reports them)."""

    prompt_tokens: int = 0
    cache_hit_tokens: int = 0  # from either tier
    cache_hit_tokens_host: int = 0  # of those, loaded from the host tier
    generated_tokens: int = 0
    finished_requests: int = 0
    steps: int = 0
    schedule_seconds: float = 0.0
