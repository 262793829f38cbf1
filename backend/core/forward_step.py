"""Launching one step on the device: table writes, batch assembly, forward, sampling, with
no host sync; and reading a launched step's results back.

With overlap scheduling the CPU schedules step N+1 before it has read step N's sampled
tokens. A request whose next input is such a token carries a *placeholder* in its
output ids: ``-(k + 1)`` for row k of step N's sampled-token tensor. The launch of step
N+1 swaps placeholders for the real ids on the device, so the CPU never waits::

    step N:    launch -> tokens_N (device) ---------------------> read on host later
    step N+1:  schedule (CPU) -> input_ids = where(id < 0, tokens_N[-id - 1], id) (device)

Only step N's placeholders can be unresolved when step N+1 is built: the host reads
step N's tokens before it schedules step N+2.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .forward_batch import BatchSpec
from .intake import GrammarProvider
from .model_runner import ModelRunner
from .outputs import TokenLogprob
from .parallel.protocol import RankStep
from .request import Req
from .sampling import SampleResult, SamplingRow, argmax_rows, sample
from .schedule_plan import ScheduledItem, SchedulePlan
from .shared_prefix import SharedPrefixTracker


def placeholder(row: int) -> int:
    return -(row + 1)


# prompt rows scored at once: their logits are copied (and exponentiated) in blocks,
# so a long prompt's logprobs never hold a second [prompt tokens, vocab] tensor
PROMPT_LOGPROB_BLOCK = 256


class PromptRow(NamedTuple):
    """A prompt token whose logprob a step computes."""

    req: Req
    logits_row: int  # the row of the step's logits that scores it
    token_id: int


class SampledLogprobs(NamedTuple):
    """Logprobs of a step's sampled (or prompt) tokens, on the host, row by row."""

    chosen: list[float]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    ranks: list[int] | None = None

    def record(self, row: int, token_id: int, num_top: int) -> TokenLogprob:
        """Row ``row``'s token with its ``num_top`` best alternatives (none for 0)."""
        top = None
        if num_top > 0 and self.top_ids is not None:
            top = dict(zip(self.top_ids[row][:num_top], self.top_logprobs[row][:num_top]))
        rank = self.ranks[row] if self.ranks is not None else None
        return TokenLogprob(token_id, self.chosen[row], top, rank)


@dataclass
class StepResults:
    """A launched step's results, read to the host."""

    token_ids: list[int]  # one per sampled item, in order
    logprobs: SampledLogprobs | None
    prompt_logprobs: SampledLogprobs | None  # one row per prompt row, in order


@dataclass
class InFlight:
    """A launched step whose results the host has not read yet."""

    items: list[ScheduledItem]
    sampled: list[ScheduledItem]  # items that produce a token, in sampled-row order
    result: SampleResult | None
    tokens_host: torch.Tensor | None  # pinned copy of result.token_ids, filled asynchronously
    done: torch.cuda.Event | None
    prompt_rows: list[PromptRow]
    prompt_logprobs: tuple | None  # (chosen, ranks, top values, top ids) on the device

    def read(self) -> StepResults:
        """The host's one wait per step."""
        res = self.result
        tokens: list[int] = []
        logprobs = None
        if res is not None:
            if self.done is not None:
                self.done.synchronize()
                tokens = self.tokens_host.tolist()
            else:
                tokens = res.token_ids.tolist()
            if res.logprobs is not None:
                logprobs = SampledLogprobs(res.logprobs.tolist(), _maybe_list(res.top_ids),
                                           _maybe_list(res.top_logprobs),
                                           _maybe_list(res.ranks))
        prompt = None
        if self.prompt_rows:
            chosen, ranks, top_vals, top_ids = self.prompt_logprobs
            prompt = SampledLogprobs(chosen.tolist(), _maybe_list(top_ids),
                                     _maybe_list(top_vals), ranks.tolist())
        return StepResults(tokens, logprobs, prompt)


class ForwardStep:
    """The device side of a step. Holds what only the device side needs: the last
    step's sampled tokens (placeholders resolve against them) and each seeded request's
    generator."""

    def __init__(self, runner: ModelRunner, grammar: GrammarProvider) -> None:
        self.runner = runner
        self.grammar = grammar
        self.to_device = runner.to_device
        self.last_tokens: torch.Tensor | None = None  # device tokens of the last launch
        self.shared_prefix = SharedPrefixTracker()
        self._generators: weakref.WeakKeyDictionary[Req, torch.Generator] = \
            weakref.WeakKeyDictionary()

    def launch(self, plan: SchedulePlan) -> InFlight:
        runner, items = self.runner, plan.items
        spec, prompt_rows, sample_rows = self._build(items)
        sampled = [it for it in items if it.samples]
        logits = runner.run_step(RankStep(plan.table_writes, spec, len(sampled)),
                                 self.last_tokens)
        prompt_lp = self._prompt_logprobs(logits, prompt_rows) if prompt_rows else None
        result = tokens_host = done = None
        if sampled:
            result = self._sample(self._rows(logits, sample_rows), [it.req for it in sampled])
            runner.share_tokens(result.token_ids)
            if result.token_ids.is_cuda:
                tokens_host = torch.empty(result.token_ids.shape, dtype=torch.int64, pin_memory=True)
                tokens_host.copy_(result.token_ids, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self.last_tokens = result.token_ids
            for row, it in enumerate(sampled):  # the token exists on the device only, so far
                it.out_index = len(it.req.output_ids)
                it.req.output_ids.append(placeholder(row))
        return InFlight(items, sampled, result, tokens_host, done, prompt_rows, prompt_lp)

    def _build(self, items: list[ScheduledItem]):
        spec = self._build_decode(items)
        if spec is not None:
            return spec, [], list(range(len(items)))
        input_ids, rows, starts, new_lens, locs, logits_idx = [], [], [], [], [], []
        prompt_rows: list[PromptRow] = []
        sample_rows: list[int] = []
        offset = 0
        for it in items:
            r, a, n = it.req, it.start_pos, it.num_new
            input_ids += r.tokens(a, a + n)
            rows.append(r.req_pool_idx)
            starts.append(a)
            new_lens.append(n)
            locs += it.new_slots
            if r.wants_prompt_logprobs:
                # the logit at position p scores prompt token p + 1
                first = max(r.prompt_logprobs_start, 1) - 1
                for p in range(max(a, first), min(a + n, len(r.origin_input_ids) - 1)):
                    prompt_rows.append(PromptRow(r, len(logits_idx), r.origin_input_ids[p + 1]))
                    logits_idx.append(offset + p - a)
            if it.samples:
                sample_rows.append(len(logits_idx))
                logits_idx.append(offset + n - 1)
            offset += n
        spec = BatchSpec(decode=False, input_ids=input_ids, req_pool_indices=rows,
                         out_cache_loc=locs, extend_prefix_lens=starts,
                         extend_seq_lens=new_lens, logits_indices=logits_idx,
                         num_placeholders=sum(1 for t in input_ids if t < 0))
        return spec, prompt_rows, sample_rows

    def _build_decode(self, items: list[ScheduledItem]) -> BatchSpec | None:
        """The batch of a step in which every request computes one token and samples the
        next (decode): one pass, no per-request slicing. None for any other step."""
        last = items[-1]
        if last.num_new != 1 or not last.samples:
            # the scheduler lists decodes first: a step with a prefill chunk in it (a mixed
            # step) ends with one, and goes to the general build without a wasted pass
            return None
        input_ids, rows, positions, locs = [], [], [], []
        placeholders = 0
        for it in items:
            r = it.req
            if it.num_new != 1 or not it.samples or r.wants_prompt_logprobs:
                return None
            a = it.start_pos
            n_in = len(r.origin_input_ids)
            t = r.output_ids[a - n_in] if a >= n_in else r.origin_input_ids[a]
            if t < 0:
                placeholders += 1
            input_ids.append(t)
            rows.append(r.req_pool_idx)
            positions.append(a)
            locs.append(it.new_slots[0])
        return BatchSpec(decode=True, input_ids=input_ids, req_pool_indices=rows,
                         out_cache_loc=locs, positions=positions,
                         num_placeholders=placeholders,
                         shared_prefix_len=self.shared_prefix.shared_len(
                             [it.req for it in items], positions))

    def _prompt_logprobs(self, logits: torch.Tensor, rows: list[PromptRow]) -> tuple:
        """Each prompt row's token logprob and rank, and the best alternatives when a
        request asks for them, computed PROMPT_LOGPROB_BLOCK rows at a time."""
        num_top = max(row.req.params.prompt_logprobs or 0 for row in rows)
        parts: list[tuple] = []
        for a in range(0, len(rows), PROMPT_LOGPROB_BLOCK):
            block = rows[a:a + PROMPT_LOGPROB_BLOCK]
            x = logits.index_select(0, self.to_device([r.logits_row for r in block])).float()
            tok = self.to_device([r.token_id for r in block]).unsqueeze(1)
            norm = torch.logsumexp(x, dim=-1, keepdim=True)
            chosen = x.gather(1, tok)
            ranks = (x > chosen).sum(dim=-1) + 1
            top = x.topk(num_top, dim=-1) if num_top else None
            parts.append(((chosen - norm).squeeze(1), ranks,
                          top.values - norm if top else None, top.indices if top else None))
        chosen, ranks, top_vals, top_ids = zip(*parts)
        return (torch.cat(chosen), torch.cat(ranks),
                torch.cat(top_vals) if num_top else None, torch.cat(top_ids) if num_top else None)

    def _rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``logits[rows]`` without a host sync. Indexing a CUDA tensor with a Python list
        copies the list from pageable memory, which waits for the stream to drain: the
        host would wait for this step's forward before building the next one."""
        if len(rows) == logits.shape[0]:  # increasing and distinct: every row, in order
            return logits
        return logits.index_select(0, self.to_device(rows))

    def _generator(self, req: Req) -> torch.Generator | None:
        seed = req.params.seed
        if seed is None:
            return None
        gen = self._generators.get(req)
        if gen is None:  # seeded per sample: sample i of a request draws its own stream
            gen = torch.Generator(device=self.runner.device).manual_seed(
                (seed + req.index) % (1 << 64))
            self._generators[req] = gen
        return gen

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampleResult:
        if all(r.plain_greedy and r.grammar is None for r in reqs):
            return SampleResult(argmax_rows(logits), None, None, None)
        rows = [SamplingRow(r.params, r.origin_input_ids, r.output_ids, self._generator(r),
                            r.rules) for r in reqs]
        top = max(r.params.logprobs or 0 for r in reqs)
        want = any(r.params.wants_token_logprobs for r in reqs)
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            grammar = self.grammar.get()
            bitmask = grammar.allocate_bitmask(len(reqs))
            grammar.fill_bitmasks(bitmask, [(reqs[i].grammar, i) for i in constrained])
            grammar.apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), constrained)
        return sample(logits, rows, self.to_device, num_top_logprobs=top, want_logprobs=want)


def _maybe_list(t):
    return t.tolist() if t is not None else None
