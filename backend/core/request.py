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

from .outputs import TokenLogprob
from .radix_cache import TreeNode
from .sampling_params import SamplingParams


class ReqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str  # engine-wide unique id of this sample
    group_id: str  # the id the caller knows (shared by n samples and by score choices)
    index: int  # sample index within the group
    origin_input_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING

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
    prompt_logprobs: list[TokenLogprob] | None = None
    partial_prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # across chunks
    grammar: object | None = None  # grammar.GrammarState when constrained
    grammar_future: object | None = None  # compilation in flight; not schedulable until done
    text_state: object | None = None  # text_state.TextState

    def __post_init__(self) -> None:
        # read every step for every request: fixed at creation, as the params are
        p = self.params
        self.penalized = p.has_penalties
        # its token is the argmax of the raw logits, no logprobs (a grammar may still mask)
        self.plain_greedy = p.is_greedy and not self.penalized and not p.logprobs

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
        return self.params.prompt_logprobs_start is not None and self.prompt_logprobs is None

    def max_match_len(self) -> int:
        """How much of fill_ids may come from the cache: at least one token must be
        computed to produce logits, and prompt logprobs need their rows computed."""
        limit = len(self.fill_ids) - 1
        if self.wants_prompt_logprobs:
            limit = min(limit, max(self.params.prompt_logprobs_start - 1, 0))
        return max(limit, 0)
