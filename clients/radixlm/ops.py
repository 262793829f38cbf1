"""The primitives that call the model: gen, select, separate_reasoning.

Each runs on its state's worker thread (interpreter.py) and changes the state only through
the executor's ``begin_var`` / ``stream_piece`` / ``finish_var`` / ``rewrite``.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .choices import token_length_normalized
from .ir import Gen, Select, SeparateReasoning, reasoning_name
from .logprobs import TokenLogprob
from .meta import gen_meta
from .reasoning import split
from .results import ScoreResult
from .sampling import to_wire

if TYPE_CHECKING:
    from .interpreter import StreamExecutor


def run_gen(ex: "StreamExecutor", prim: Gen) -> None:
    wire = to_wire(prim.params.over(ex.defaults))
    start = ex.begin_var(prim.name)
    stream = ex.stream and not wire.prefill_only

    def on_text(piece: str) -> None:
        ex.stream_piece(prim.name, piece)

    began = time.monotonic()
    result = ex.backend.generate(ex.text_, wire.params, on_text if stream else None)
    meta = gen_meta(result, wire, time.monotonic() - began)
    text = "" if wire.prefill_only else result.text
    # n > 1: the variable lists every sample; the state continues with the first.
    value = [s.text for s in (result.samples or (result,))] if wire.n > 1 else text
    ex.finish_var(prim.name, start, text, value, meta)


def _token_rows(scores: ScoreResult, first_unknown: bool = False) -> list[list[TokenLogprob]]:
    """Per choice, its tokens as ``(logprob, token_id, text)``. The server sends token ids
    only in newer versions (``token_ids``); text is not sent."""
    rows = []
    for score in scores.scores:
        ids = list(score.token_ids) or [None] * len(score.token_logprobs)
        rows.append([TokenLogprob(None if (i == 0 and first_unknown) else lp, tid, None)
                     for i, (lp, tid) in enumerate(zip(score.token_logprobs, ids))])
    return rows


def run_select(ex: "StreamExecutor", prim: Select) -> None:
    method = prim.method or token_length_normalized
    choices = list(prim.choices)
    scores = ex.backend.score(ex.text_, choices)
    unconditional = None
    if method.requires_unconditional_logprobs:
        # The choices scored after only the model's end-of-text token: no context-free
        # logprob exists for a choice's first token (None, as the method expects).
        alone = ex.backend.score(ex.backend.unconditional_prompt(), choices)
        unconditional = _token_rows(alone, first_unknown=True)
    normalized = [s.normalized_logprob for s in scores.scores]
    decision = method(choices=choices, normalized_prompt_logprobs=normalized,
                      input_token_logprobs=_token_rows(scores),
                      output_token_logprobs=[[] for _ in choices],
                      unconditional_token_logprobs=unconditional)
    if decision.decision not in prim.choices:
        raise ValueError(f"the choices method picked {decision.decision!r}, not a choice")
    meta = {**decision.meta_info,
            "choice_scores": list(scores.scores), "normalized_logprobs": normalized,
            "prompt_tokens": scores.num_input_tokens, "cached_tokens": scores.num_cached_tokens,
            "num_input_tokens": scores.num_input_tokens,
            "num_cached_tokens": scores.num_cached_tokens}
    start = ex.begin_var(prim.name)
    ex.finish_var(prim.name, start, decision.decision, decision.decision, meta)


def run_separate_reasoning(ex: "StreamExecutor", prim: SeparateReasoning) -> None:
    # Last first: rewriting a later span leaves the earlier spans where they are.
    for name in reversed(prim.names):
        value = ex.vars[name]
        if not isinstance(value, str):
            raise ValueError("separate_reasoning needs one sample (n=1)")
        reasoning, answer = split(value, prim.model_type)
        start, end = ex.spans[name]
        ex.rewrite(start, end, answer)
        ex.spans[name] = (start, start + len(answer))
        ex.set_var(name, answer)
        ex.set_var(reasoning_name(name), reasoning)
