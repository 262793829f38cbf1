"""Request groups: what the caller submitted under one id, as the engine's requests.

A generate request with ``n`` samples is a group of n requests (one per sample); a score
request is a group with one request per choice, and answers with one output carrying
every choice's score once all of them are done; ``Engine.generate`` collects the whole
results of the groups it submitted. The ids the callers use are claimed here at
submission (any thread) and released when the group ends.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from .outputs import ChoiceScore, RequestOutput, StepOutput
from .request import Req


@dataclass(eq=False)
class Group:
    group_id: str
    reqs: list[Req]
    choices: list[str] | None = None  # a score request: the choice each request scores

    def all_finished(self) -> bool:
        return all(r.finished for r in self.reqs)


class RequestGroups:
    def __init__(self) -> None:
        self._groups: dict[str, Group] = {}
        self._claimed: set[str] = set()  # ids submitted and not yet finished
        self._claim_lock = threading.Lock()
        self._collect: set[str] = set()  # groups whose whole results generate() collects
        self._results: dict[str, RequestOutput] = {}

    # ---- any thread
    def claim(self, group_id: str) -> None:
        """Reserve a caller's id; ValueError when a request under it is still running."""
        with self._claim_lock:
            if group_id in self._claimed:
                raise ValueError(f"request id {group_id!r} is already in use")
            self._claimed.add(group_id)

    def release(self, group_id: str) -> None:
        with self._claim_lock:
            self._claimed.discard(group_id)

    # ---- the step loop
    def add(self, group: Group) -> None:
        self._groups[group.group_id] = group

    def members(self, group_id: str) -> list[Req]:
        group = self._groups.get(group_id)
        return group.reqs if group is not None else []

    def on_finished(self, req: Req) -> StepOutput | None:
        """``req`` just finished. For a score request: the group's one answer once every
        choice is done (None before). Ends the group when all its requests are done."""
        group = self._groups.get(req.group_id)
        if group is None or not group.all_finished():
            return None
        self._end(group)
        if group.choices is None:
            if group.group_id in self._collect:
                self._results[group.group_id] = _whole_result(group.reqs)
            return None
        return _score_answer(group)

    def _end(self, group: Group) -> None:
        del self._groups[group.group_id]
        self.release(group.group_id)

    # ---- Engine.generate
    def collect(self, group_ids: list[str]) -> None:
        self._collect.update(group_ids)

    def take_results(self) -> dict[str, RequestOutput]:
        out, self._results = self._results, {}
        self._collect.difference_update(out)
        return out


def _score_answer(group: Group) -> StepOutput:
    reqs = group.reqs
    abort = any(r.finish_reason == "abort" for r in reqs)
    scores = None
    if not abort:
        scores = []
        for choice, r in zip(group.choices, reqs):
            entries = r.prompt_logprobs or []
            lps = [lp.logprob for lp in entries]
            scores.append(ChoiceScore(choice, float(sum(lps)), len(lps), lps,
                                      [lp.token_id for lp in entries]))
    return StepOutput(request_id=group.group_id, finished=True,
                      finish_reason="abort" if abort else "stop",
                      num_prompt_tokens=len(reqs[0].origin_input_ids),
                      num_cached_tokens=sum(r.num_cached_tokens for r in reqs),
                      choice_scores=scores)


def best_of(cumulative_logprobs: list[float | None], n: int) -> list[int]:
    """Indices of the ``n`` samples with the highest cumulative logprob, best first
    (the earlier sample on a tie; a sample without one ranks last)."""
    order = sorted(range(len(cumulative_logprobs)), key=lambda i: (
        cumulative_logprobs[i] is None, -(cumulative_logprobs[i] or 0.0), i))
    return order[:n]


def _whole_result(reqs: list[Req]) -> RequestOutput:
    outs = [RequestOutput(
        request_id=r.group_id, prompt=r.origin_input_ids, token_ids=list(r.output_ids),
        text=r.text_state.text, finish_reason=r.finish_reason,
        num_prompt_tokens=len(r.origin_input_ids), num_cached_tokens=r.num_cached_tokens,
        logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
        prompt_logprobs=reqs[0].prompt_logprobs, error=r.error,
        cumulative_logprob=r.cumulative_logprob if r.params.wants_token_logprobs else None)
        for r in reqs]
    n = reqs[0].params.n
    if len(outs) > n:  # best_of: the n most likely samples
        outs = [outs[i] for i in best_of([o.cumulative_logprob for o in outs], n)]
    head = outs[0]
    if len(outs) > 1:
        head.samples = outs
    return head
