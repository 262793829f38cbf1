"""Cascade decode attention (kernels/decode_prefix.py) on CPU via the Triton interpreter.

Rows that share the pool slots of a prefix: the prefix kernel reads it once for a tile of
query rows, stage 1 covers each row's own suffix, stage 2 merges both. The output must be
attention by definition (a torch reference over each row's slots) and agree with the
non-cascade kernel; CUDA-graph padding rows (seq_len 0, table row 0) give exactly 0
whatever shared length the device holds; every workspace element read was written
(the workspace starts NaN-filled). Also: FP8 pools, softcap, GQA groups of 1 to 6, a
batch spanning two row tiles, the fused rotary path, and an engine whose decode batches
share a cached prompt: the same greedy tokens with and without cascade.

As test_triton_kernels.py: the cases run in a worker subprocess with TRITON_INTERPRET=1.
"""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases

FP32_TOL = 1e-4
FP8 = torch.float8_e4m3fn


class Shared:
    """A decode batch whose real rows share their first ``shared`` slots."""

    def __init__(self, shared, suffix_lens, h, kvh, d, seed, dtype=torch.float32,
                 pads=(), fp8=False):
        gen = torch.Generator().manual_seed(seed)
        rows = len(suffix_lens) + 1  # table row 0 stays the padding rows' dummy row
        slots_needed = shared + sum(suffix_lens)
        self.r2t = torch.zeros(rows, shared + max(suffix_lens) + 4, dtype=torch.int32)
        perm = (torch.randperm(slots_needed + 20, generator=gen) + 1).tolist()  # never slot 0
        prefix, own = perm[:shared], perm[shared:]
        table_rows = (torch.randperm(rows - 1, generator=gen) + 1).tolist()
        req_rows, seq_lens, self.loc = [], [], []
        for n, row in zip(suffix_lens, table_rows):
            slots = prefix + own[:n]
            own = own[n:]
            self.r2t[row, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
            req_rows.append(row)
            seq_lens.append(len(slots))
            self.loc.append(slots[-1])
        for i in sorted(pads):  # graph padding: table row 0, no positions
            req_rows.insert(i, 0)
            seq_lens.insert(i, 0)
            self.loc.insert(i, 0)
        self.rows = torch.tensor(req_rows)
        self.seq_lens = torch.tensor(seq_lens)
        self.positions = (self.seq_lens - 1).clamp(min=0)
        self.loc = torch.tensor(self.loc)
        size = slots_needed + 21
        k = torch.randn(size, kvh, d, generator=gen)
        v = torch.randn(size, kvh, d, generator=gen)
        self.k_scale = self.v_scale = None
        if fp8:  # per-head scales, values well inside e4m3's range
            self.k_scale = torch.tensor([0.02, 0.05][:kvh])
            self.v_scale = torch.tensor([0.03, 0.01][:kvh])
            k = k / self.k_scale[None, :, None]
            v = v / self.v_scale[None, :, None]
        self.k, self.v = k.to(FP8 if fp8 else dtype), v.to(FP8 if fp8 else dtype)
        self.q = torch.randn(len(req_rows), h, d, generator=gen).to(dtype)
        self.shared = shared

    def keys(self):
        """K and V as float32 values (float8 bytes times their head's scale)."""
        k, v = self.k.float(), self.v.float()
        if self.k_scale is not None:
            k, v = k * self.k_scale[None, :, None], v * self.v_scale[None, :, None]
        return k, v

    def reference(self, q, scale, softcap=0.0):
        """Attention by definition, row by row; 0 for padding rows."""
        k, v = self.keys()
        group = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape)
        for b, (row, n) in enumerate(zip(self.rows.tolist(), self.seq_lens.tolist())):
            if n == 0:
                continue
            slots = self.r2t[row, :n].long()
            keys = k[slots].repeat_interleave(group, 1)
            s = torch.einsum("hd,shd->hs", q[b].float(), keys) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            out[b] = torch.einsum("hs,shd->hd", s.softmax(-1), v[slots].repeat_interleave(group, 1))
        return out

    def decode(self, declared=None, prefix_splits=0, splits=4, softcap=0.0, rope=None,
               min_split_len=0, k=None, v=None):
        """decode_attention over a NaN-filled workspace and output; ``declared``: the
        shared length the device buffer holds (the batch's own by default)."""
        from backend.core.kernels import SharedPrefix, decode_attention, decode_workspace_numel
        h, d = self.q.shape[1:]
        shared = None
        if prefix_splits:
            length = torch.tensor([self.shared if declared is None else declared])
            shared = SharedPrefix(length, prefix_splits)
        out = torch.full_like(self.q, float("nan"))
        ws = torch.full((decode_workspace_numel(len(self.rows), h, d, splits, prefix_splits),),
                        float("nan"))
        decode_attention(self.q, out, self.k if k is None else k, self.v if v is None else v,
                         self.r2t, self.rows, self.seq_lens, 0.3, splits, workspace=ws,
                         rope=rope, softcap=softcap, k_scale=self.k_scale,
                         v_scale=self.v_scale, min_split_len=min_split_len,
                         shared_prefix=shared)
        return out


def _case_cascade(shared, suffix_lens, h=4, kvh=2, d=32, seed=0, pads=(), declared=None,
                  prefix_splits=4, splits=4, softcap=0.0, min_split_len=0,
                  dtype=torch.float32, tol=FP32_TOL, fp8=False):
    batch = Shared(shared, suffix_lens, h, kvh, d, seed, dtype=dtype, pads=pads, fp8=fp8)
    want = batch.reference(batch.q, 0.3, softcap)
    got = batch.decode(declared, prefix_splits, splits, softcap, min_split_len=min_split_len)
    plain = batch.decode(None, 0, splits, softcap, min_split_len=min_split_len)
    assert torch.isfinite(got).all()
    assert (got.float() - want).abs().max().item() < tol
    assert (got.float() - plain.float()).abs().max().item() < tol
    for i in pads:
        assert torch.equal(got[i], torch.zeros_like(got[i]))


def _case_padding_only(stale):
    """A CUDA graph's capture (or a replay's tail tile): rows all padding, the shared
    length buffer holding anything: outputs exactly 0, nothing read past the rows."""
    batch = Shared(40, [3, 5], 4, 2, 32, seed=1)
    batch.seq_lens.zero_()
    batch.rows.zero_()
    got = batch.decode(declared=stale, prefix_splits=4)
    assert torch.equal(got, torch.zeros_like(got))


def _case_rope(shared, suffix_lens, h, kvh, d, fp8=False, pads=(), tol=FP32_TOL):
    """The fused rotary path: q and the new K arrive unrotated; the prefix kernel rotates
    q itself. Same output as the rotation + store + the reference, and the pool written
    exactly as the non-cascade kernel writes it."""
    from types import SimpleNamespace
    from backend.core.kernels import DecodeRope
    from backend.core.layers.rotary import RotaryEmbedding
    batch = Shared(shared, suffix_lens, h, kvh, d, seed=d + h, pads=pads, fp8=fp8)
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), d, max_positions=512)
    gen = torch.Generator().manual_seed(5)
    new_k, new_v = (torch.randn(len(batch.rows), kvh, d, generator=gen) for _ in range(2))
    if fp8:
        new_k, new_v = new_k * 0.5, new_v * 0.2
    rope = DecodeRope(new_k, new_v, batch.positions, rot.cos, rot.sin, batch.loc)
    pools = []
    outs = []
    for prefix_splits in (0, 3):
        k, v = batch.k.clone(), batch.v.clone()
        outs.append(batch.decode(None, prefix_splits, rope=rope, k=k, v=v))
        pools.append((k, v))
    assert torch.equal(pools[0][0].float(), pools[1][0].float())
    assert torch.equal(pools[0][1].float(), pools[1][1].float())
    # the reference over the pool as the kernels wrote it, with q rotated in torch
    batch.k, batch.v = pools[1]
    q_rot, _ = rot(batch.positions, batch.q.clone(), new_k.clone())
    want = batch.reference(q_rot, 0.3)
    real = batch.seq_lens > 0
    assert (outs[1][real] - want[real]).abs().max().item() < tol
    assert (outs[1] - outs[0]).abs().max().item() < tol
    for i in pads:
        assert torch.equal(outs[1][i], torch.zeros_like(outs[1][i]))


# The engine case lowers the cascade thresholds (256 shared tokens, 16 rows): under the
# interpreter a 16-row batch over 270 cached tokens cost 44 s of the CI machine's CPU, and
# the path it checks (the scheduler's shared prefix reaching the kernel) is the same.
ENGINE_MIN_PREFIX, ENGINE_MIN_BATCH = 64, 4


def _case_engine():
    """A served decode batch after a cached few-shot prompt goes through the cascade path
    and samples the same greedy tokens as without it."""
    import tempfile
    from pathlib import Path

    import backend.core.layers.triton_attention as triton_attention
    from engine_helpers import tiny_model
    model = tiny_model(Path(tempfile.mkdtemp()), "llama")
    calls = []
    launch = triton_attention.decode_attention
    thresholds = triton_attention.CASCADE_MIN_PREFIX, triton_attention.CASCADE_MIN_BATCH

    def spy(*args, shared_prefix=None, **kwargs):
        calls.append(None if shared_prefix is None else int(shared_prefix.length))
        return launch(*args, shared_prefix=shared_prefix, **kwargs)

    triton_attention.decode_attention = spy
    triton_attention.CASCADE_MIN_PREFIX = ENGINE_MIN_PREFIX
    triton_attention.CASCADE_MIN_BATCH = ENGINE_MIN_BATCH
    try:
        tokens = {cascade: _engine_tokens(model, cascade, calls) for cascade in (True, False)}
    finally:
        triton_attention.decode_attention = launch
        triton_attention.CASCADE_MIN_PREFIX, triton_attention.CASCADE_MIN_BATCH = thresholds
    assert tokens[True] == tokens[False]


def _engine_tokens(model, cascade, calls):
    """Greedy tokens of ENGINE_MIN_BATCH questions after a cached 70-token prompt."""
    from backend.core import SamplingParams
    from engine_helpers import make_engine, random_prompts
    engine = make_engine(model, attention_backend="triton", enable_cascade_attention=cascade,
                         max_prefill_tokens=1024)
    shots, *questions = random_prompts(ENGINE_MIN_BATCH + 1, engine.runner.vocab_size,
                                       seed=3, min_len=6, max_len=12)
    shots = (shots * 40)[:ENGINE_MIN_PREFIX + 6]  # a few-shot prompt past the threshold
    for i, q in enumerate(questions):
        q[0] = 10 + i  # each question differs from its first token
    # two tokens: the second comes from one cascaded decode step (under the interpreter
    # each step costs seconds; the kernel cases above cover the rest)
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    engine.generate([shots + [9]], params)  # the examples are cached now
    calls.clear()
    outs = engine.generate([shots + q for q in questions], params)
    cascaded = [c for c in calls if c is not None]
    if cascade:  # every decode layer of the batch's step, over the cached prompt
        assert cascaded and set(cascaded) == {len(shots)}, calls
    else:
        assert not cascaded and calls
    return [o.token_ids for o in outs]


CASES = {
    # the prefix of several 32-position KV tiles over 4 prefix splits (one left empty at
    # 70), rows of 1 to 40 own positions, a padding row in the middle and at the end
    "shared70": (_case_cascade, dict(shared=70, suffix_lens=[1, 9, 40, 3], pads=(2, 5))),
    "shared33-one-split": (_case_cascade, dict(shared=33, suffix_lens=[2, 2, 70], splits=1)),
    "shared100-one-pass-layout": (_case_cascade, dict(shared=100, suffix_lens=[1, 5, 64],
                                                      min_split_len=64, splits=8)),
    "prefix-splits1": (_case_cascade, dict(shared=50, suffix_lens=[4, 1], prefix_splits=1)),
    # the device holding less than the rows share (0 too): still exact
    "declared0": (_case_cascade, dict(shared=40, suffix_lens=[3, 6], declared=0, pads=(1,))),
    "declared-part": (_case_cascade, dict(shared=80, suffix_lens=[3, 6, 1], declared=37)),
    # GQA: groups 1, 3 (63 of 64 tile rows used), 4, 6; head_dim 80 padded to 128
    "group1": (_case_cascade, dict(shared=45, suffix_lens=[2, 7, 1], h=2, kvh=2)),
    "group3": (_case_cascade, dict(shared=45, suffix_lens=[2, 7, 1], h=6, kvh=2)),
    "group6-d80": (_case_cascade, dict(shared=45, suffix_lens=[2, 7], h=6, kvh=1, d=80)),
    # 20 requests at GROUP 4: two row tiles of 16, the second mostly empty
    "two-row-tiles": (_case_cascade, dict(shared=40, suffix_lens=[1 + i % 5 for i in range(20)],
                                          h=8, kvh=2, d=16, pads=(20, 21))),
    "softcap": (_case_cascade, dict(shared=60, suffix_lens=[3, 12, 1], softcap=2.0, seed=4)),
    "fp8": (_case_cascade, dict(shared=60, suffix_lens=[3, 12, 1], fp8=True, seed=5,
                                pads=(3,))),
    "fp16": (_case_cascade, dict(shared=70, suffix_lens=[2, 30], d=64, dtype=torch.float16,
                                 tol=2e-3, seed=6)),
    "padding-only-stale0": (_case_padding_only, dict(stale=0)),
    "padding-only-stale1000": (_case_padding_only, dict(stale=1000)),
    "rope": (_case_rope, dict(shared=70, suffix_lens=[1, 9, 33], h=4, kvh=2, d=32, pads=(3,))),
    "rope-gqa4": (_case_rope, dict(shared=40, suffix_lens=[2, 5], h=8, kvh=2, d=64)),
    "rope-fp8": (_case_rope, dict(shared=50, suffix_lens=[2, 5], h=4, kvh=2, d=32, fp8=True)),
    "engine": (_case_engine, {}),
}


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    import backend.core.kernels.decode_prefix as decode_prefix
    assert isinstance(decode_prefix._decode_prefix, InterpretedFunction), "interpreter not active"
    sys.path.insert(0, str(REPO / "tests"))
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_cascade_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
