"""Token sampling for a batch of rows of logits: a few pure functions over tensors.

Order per row (as in common serving engines): penalties -> logit rules (bias, allowed
tokens, bad words, minimum length) -> grammar mask -> greedy, or temperature -> top-k ->
top-p -> min-p -> draw. Logprobs (and ranks) are reported from the raw model distribution
(before penalties and temperature) so they score the model, not the sampler.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .request import LogitRules
from .sampling_params import SamplingParams
from .transfer import HostToDevice


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    rules: LogitRules | None = None


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] chosen-token logprobs (raw distribution)
    top_ids: torch.Tensor | None  # [B, K]
    top_logprobs: torch.Tensor | None  # [B, K]
    ranks: torch.Tensor | None = None  # [B] the chosen token's rank (1: the most likely)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place. Repetition penalty covers prompt and output tokens (divide positive
    logits, multiply negative ones); frequency and presence penalties cover output only."""
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)),
                                dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                          vals * p.repetition_penalty)
        if row.output_ids and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_logit_rules(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: each row's logit bias, allowed tokens, bad words and minimum length."""
    neg_inf = float("-inf")
    for i, row in enumerate(rows):
        rules = row.rules
        if rules is None:
            continue
        if rules.bias_ids:
            ids = torch.tensor(rules.bias_ids, dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(rules.bias_values, dtype=logits.dtype,
                                           device=logits.device)
        if rules.allowed_ids is not None:
            keep = torch.tensor(rules.allowed_ids, dtype=torch.long, device=logits.device)
            allowed = logits[i, keep]
            logits[i].fill_(neg_inf)
            logits[i, keep] = allowed
        banned = rules.banned_next(row.output_ids)
        if banned:
            logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = neg_inf


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, truncate: bool = True) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (all per row, [B] tensors).
    top_k <= 0 means no limit. ``truncate=False`` says no row uses top-k or top-p (known
    on the host), which skips the vocabulary sort."""
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    if not truncate:
        floor = (min_p * probs.max(dim=-1).values).unsqueeze(1)
        return probs.masked_fill(probs < floor, 0.0)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[1]
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = rank >= k
    # top-p: keep the smallest prefix whose mass reaches p (the token crossing p stays)
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= cum_before >= top_p.unsqueeze(1)
    drop |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [B, V], the same indices (the first maximum of a row;
    a NaN counts as the maximum), in two rounds: the largest of each of ``C`` equal
    chunks of a row, then the first chunk holding the row's largest. One row's argmax
    over a large vocabulary runs on a single block of the GPU (38 µs for 128,256 float32
    logits on an H100, 1% of an 8B decode step at batch 1); B x C chunks spread over every
    SM. Falls back to the plain argmax where V has no divisor to cut it by."""
    b, v = logits.shape
    chunks = vocab_chunks(v)
    if chunks == 1 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    width = v // chunks
    best, within = logits.view(b, chunks, width).max(dim=-1)  # first maximum of a chunk
    chunk = best.argmax(dim=-1, keepdim=True)  # the first chunk with the row's maximum
    return (chunk * width + within.gather(1, chunk)).squeeze(1)


@functools.lru_cache(maxsize=64)
def vocab_chunks(v: int) -> int:
    """How many equal chunks ``argmax_rows`` cuts a row of ``v`` into: the largest divisor
    of v from 16 to 256 whose chunks hold at least 256 logits, else 1 (no cut)."""
    for chunks in range(min(256, v // 256), 15, -1):
        if v % chunks == 0:
            return chunks
    return 1


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row via the exponential race (argmax p / E, E ~ Exp(1)), which needs
    no host sync; rows with their own generator draw their noise from it (seeded runs
    repeat exactly)."""
    noise = torch.empty_like(probs)
    if all(g is None for g in generators):
        noise.exponential_()
    else:
        for i, g in enumerate(generators):
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow], to_device: HostToDevice,
           num_top_logprobs: int, want_logprobs: bool,
           vocab_mask: torch.Tensor | None = None) -> SampleResult:
    """Pick one token per row of ``logits`` ([B, V] float32). ``vocab_mask`` ([B, V] bool,
    True = allowed) comes from grammars; ``to_device`` copies the per-row knobs."""
    raw = logits
    edits = any(r.params.has_penalties or r.rules is not None for r in rows)
    logits = logits.clone() if edits or vocab_mask is not None else logits
    apply_penalties(logits, rows)
    apply_logit_rules(logits, rows)
    if vocab_mask is not None:
        logits.masked_fill_(~vocab_mask, float("-inf"))

    greedy = [r.params.is_greedy for r in rows]
    if all(greedy):
        token_ids = argmax_rows(logits)
    else:
        knobs = to_device([[max(r.params.temperature, 1e-5), r.params.top_k, r.params.top_p,
                            r.params.min_p] for r in rows], torch.float32)
        temperature, top_k, top_p, min_p = knobs.unbind(dim=1)
        top_k = top_k.long()
        truncate = any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows)
        probs = filter_logits(logits, temperature, top_k, top_p, min_p, truncate)
        token_ids = draw(probs, [r.generator for r in rows])
        if any(greedy):
            is_greedy = to_device(greedy, torch.bool)
            token_ids = torch.where(is_greedy, argmax_rows(logits), token_ids)

    if not want_logprobs:
        return SampleResult(token_ids, None, None, None)
    logp = torch.log_softmax(raw, dim=-1)
    chosen = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top_ids = top_vals = None
    if num_top_logprobs > 0:
        top_vals, top_ids = logp.topk(num_top_logprobs, dim=-1)
    return SampleResult(token_ids, chosen, top_ids, top_vals, ranks)
