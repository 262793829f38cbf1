"""A request's state as the scheduler sees it.

Token bookkeeping of one request::

    fill_ids   = origin_input_ids + output_ids
    kv_indices = slots of fill_ids[:num_computed]     (KV that exists in the pool)
                 [ tree_owned_len slots owned by the radix tree | the rest owned by this request ]

Each step extends ``num_computed`` towards ``len(fill_ids)``: a prefill chunk, or one
decode token. The last sampled token never has KV until it is fed back next step.

Plain Python: a request's device-side state (its table row's contents, its seeded
generator) lives with the forward step, keyed by the request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from .outputs import TokenLogprob
from .radix_node import TreeNode
from .sampling_params import SamplingParams


class ReqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class LogitRules(NamedTuple):
    """A request's edits to its logits before each draw, worked out once at intake."""

    bias_ids: list[int]  # logit_bias, as two aligned lists
    bias_values: list[float]
    allowed_ids: list[int] | None  # allowed_token_ids
    bad_word_ids: list[list[int]]  # each bad word's tokens (every tokenization of it)
    min_tokens: int  # the stop ids are masked while the output is shorter
    stop_ids: list[int]  # EOS (unless ignore_eos) and stop_token_ids

    @property
    def reads_output(self) -> bool:
        """A bad word of several tokens is matched against the output's last tokens,
        which must be on the host (no overlapped step)."""
        return any(len(seq) > 1 for seq in self.bad_word_ids)

    def banned_next(self, output_ids: list[int]) -> list[int]:
        """Token ids the next draw must not pick, given the output so far."""
        banned = list(self.stop_ids) if len(output_ids) < self.min_tokens else []
        for seq in self.bad_word_ids:
            prefix = len(seq) - 1
            if prefix == 0 or (len(output_ids) >= prefix and output_ids[-prefix:] == seq[:-1]):
                banned.append(seq[-1])
        return banned


@dataclass(eq=False)
class Req:
    rid: str  # engine-wide unique id of this sample
    group_id: str  # the id the caller knows (shared by n samples and by score choices)
    index: int  # sample index within the group
    origin_input_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    rules: LogitRules | None = None
    # prompt positions from here on get logprobs (sample 0 of a request computes them
    # for all its samples)
    prompt_logprobs_start: int | None = None

    # KV state
    kv_indices: list[int] = field(default_factory=list)
    tree_owned_len: int = 0  # leading kv_indices owned by the radix tree (locked via last_node)
    last_node: TreeNode | None = None
    req_pool_idx: int | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the cache (either tier) at first admission
    num_host_cached_tokens: int = 0  # of those, the ones loaded from the host tier
    waiting_load: bool = False  # admitted, its cached prefix still loading from the host
    admitted_once: bool = False

    # scheduling
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    admit_time: float | None = None  # latest admission (retraction re-admits)
    first_admit_time: float | None = None
    times_passed_over: int = 0  # waiting steps in which a later arrival was admitted first
    blocked_by: "Req | None" = None  # wait until this request's prompt is cached
    cached_match_len: int = 0  # last radix match length (for lpm ordering)

    # results
    is_choice: bool = False  # scores one choice of a score request: no outputs of its own
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # of the sampled tokens (when their logprobs are computed)
    prompt_logprobs: list[TokenLogprob] | None = None
    partial_prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # across chunks
    grammar: object | None = None  # grammar.GrammarState when constrained
    grammar_future: object | None = None  # compilation in flight; not schedulable until done
    text_state: object | None = None  # text_state.TextState

    def __post_init__(self) -> None:
        # read every step for every request: fixed at creation, as the params are
        p = self.params
        # the next draw reads this request's latest tokens on the host
        self.penalized = p.has_penalties or (self.rules is not None and self.rules.reads_output)
        # its token is the argmax of the raw logits, no logprobs (a grammar may still mask)
        self.plain_greedy = (p.is_greedy and not p.has_penalties and self.rules is None
                             and not p.wants_token_logprobs)

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids (hot path: one decode token)."""
        n = len(self.origin_input_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.origin_input_ids[start:end]
        return self.origin_input_ids[start:] + self.output_ids[:end - n]

    @property
    def num_computed(self) -> int:
        return len(self.kv_indices)

    @property
    def num_uncomputed(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids) - len(self.kv_indices)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs_start is not None and self.prompt_logprobs is None

    def max_match_len(self) -> int:
        """How much of fill_ids may come from the cache: at least one token must be
        computed to produce logits, and prompt logprobs need their rows computed."""
        limit = self.seq_len - 1  # not len(fill_ids): that copies the prompt
        if self.wants_prompt_logprobs:
            limit = min(limit, max(self.prompt_logprobs_start - 1, 0))
        return max(limit, 0)
