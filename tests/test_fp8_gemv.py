"""The weight-only FP8 matrix-vector kernels (backend/core/kernels/fp8_gemv.py) on CPU
via the Triton interpreter: each against the torch modules it replaces followed by
``F.linear`` with the dequantized weight, for per-channel and block scales, every fused
prologue, 1..8 rows, dimensions that fit no tile and K split over programs (the
partial sums added by the last program of a tile); then an FP8 model whose small
batches take them, against its weight-only reference in torch. Cases run in a worker
subprocess (see interpreter_cases.py); half precision is fp16 here, bf16 is checked on
the GPU by tools/gpu/fp8_gemv_checks.py. The tile rule and the compiled tiles:
test_fp8_gemv_tiles.py."""
from __future__ import annotations

import sys

import pytest
import torch

from backend.core.layers.fp8_linear import WEIGHT_ONLY_ROWS
from backend.core.kernels.fp8_gemv_tiles import split_k_tiles
from interpreter_cases import REPO, run_cases

FP8 = torch.float8_e4m3fn


def _bound(ref: torch.Tensor, dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """Float32 sums in another order (the scale applied to the input or to the sum
    instead of to each weight), then one rounding to ``dtype``: a few ulps of the output,
    a sliver of the row's scale, and of the sum of the products' magnitudes
    (``magnitude``: |x| @ |w|^T; reordered float32 sums of K terms drift by about
    sqrt(K) float32 ulps of it)."""
    ulp = {torch.float32: 2.0 ** -22, torch.float16: 2.0 ** -10}[dtype]
    return 2 * ulp * ref.abs() + 4 * ulp * ref.abs().max() + 2.0 ** -18 * magnitude + 1e-6


def _check(got, ref, dtype, act, w):
    """``got`` is ``ref`` = F.linear(act, w) in ``dtype`` within ``_bound``."""
    assert got.dtype == dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
    diff = (got.float() - ref.float()).abs()
    magnitude = act.float().abs() @ w.abs().T
    assert (diff <= _bound(ref.float(), dtype, magnitude)).all(), diff.max().item()


def _weights(n, k, block, seed, bias=False):
    """(float8 weight, scales, dequantized float32 weight, bias): per-channel scales
    (block 0) or one per block x block tile, each its tile's absmax / 448."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    w[:, : k // 3] *= 4  # tiles of different ranges: each block scale matters
    if block:
        nb, kb = -(-n // block), -(-k // block)
        padded = torch.zeros(nb * block, kb * block)
        padded[:n, :k] = w.abs()
        amax = padded.view(nb, block, kb, block).amax((1, 3))
        scale = (amax / 448).clamp(min=1e-12)
        full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    else:
        scale = (w.abs().amax(1) / 448).clamp(min=1e-12)
        full = scale[:, None]
    q = (w / full).clamp(-448, 448).to(FP8)
    b = torch.randn(n, generator=gen) if bias else None
    return q, scale, q.float() * full, b


def _case_linear(n, k, rows, block, dtype=torch.float32, bias=False, config=None):
    from backend.core.kernels.fp8_gemv import fp8_linear_rows
    q, scale, w, b = _weights(n, k, block, 3 * n + k, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    ref = torch.nn.functional.linear(x.float(), w, b).to(dtype)
    got = fp8_linear_rows(x, q, scale, None if b is None else b.to(dtype), block=block,
                          config=config)
    _check(got, ref, dtype, x, w)


def _case_norm_linear(n, k, rows, block, residual, dtype=torch.float32, config=None):
    from backend.core.kernels.fp8_gemv import fp8_rmsnorm_linear_rows
    from backend.core.layers.basic import RMSNorm
    q, scale, w, _ = _weights(n, k, block, n * k)
    gen = torch.Generator().manual_seed(n + k)
    norm = RMSNorm(k, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(k, generator=gen))
    norm = norm.to(dtype)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    res = torch.randn(rows, k, generator=gen).to(dtype) if residual else None
    normed, ref_res = (norm(x), x) if res is None else norm(x, res)
    ref = torch.nn.functional.linear(normed.float(), w).to(dtype)
    got, got_res = fp8_rmsnorm_linear_rows(x, res, norm.weight, norm.eps, q, scale,
                                           block=block, config=config)
    _check(got, ref, dtype, normed, w)
    assert torch.equal(got_res, ref_res)  # each row's new residual, rounded once
    assert (got_res is x) == (res is None)


def _case_silu_linear(n, k, rows, block, dtype=torch.float32, config=None):
    from backend.core.kernels.fp8_gemv import fp8_silu_mul_linear_rows
    from backend.core.layers.basic import GatedMLP
    q, scale, w, _ = _weights(n, k, block, n + 7 * k)
    mlp = GatedMLP(n, k).to(dtype)
    with torch.no_grad():
        mlp.down_proj.weight.copy_(w.to(dtype))
    gate_up = (torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    gate, up = gate_up.split(k, dim=-1)
    act = torch.nn.functional.silu(gate) * up  # the module's rounding points
    ref = torch.nn.functional.linear(act.float(), w).to(dtype)
    _check(fp8_silu_mul_linear_rows(gate_up, q, scale, block=block, config=config), ref, dtype,
           act, w)


def _case_refuses_nine_rows():
    from backend.core.kernels.fp8_gemv import fp8_linear_rows
    q, scale, _, _ = _weights(8, 16, 0, 0)
    with pytest.raises(AssertionError, match="rows"):
        fp8_linear_rows(torch.randn(9, 16), q, scale)


def _case_counters_reused():
    """A layer's counters serve every call: each split-K launch leaves them zero, and the
    slices' sums are added in one order, so a repeated call gives the same bits."""
    from backend.core.kernels.fp8_gemv import fp8_silu_mul_linear_rows, tile_counters
    from backend.core.kernels.fp8_gemv_tiles import GemvTiles
    q, scale, w, _ = _weights(40, 900, 0, 5)
    counters = tile_counters(40, "cpu")
    gate_up = torch.randn(2, 1800, generator=torch.Generator().manual_seed(2))
    tiles = GemvTiles(block_n=8, block_k=128, warps=4, split=4)
    first = fp8_silu_mul_linear_rows(gate_up, q, scale, config=tiles, counters=counters)
    assert torch.equal(counters, torch.zeros(40, dtype=torch.int32))
    again = fp8_silu_mul_linear_rows(gate_up, q, scale, config=tiles, counters=counters)
    assert torch.equal(first, again)
    assert torch.equal(counters, torch.zeros(40, dtype=torch.int32))
    gate, up = gate_up.split(900, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    _check(first, torch.nn.functional.linear(act, w), torch.float32, act, w)


def _case_stream_same_bits():
    """At one row a streaming program sums each tile as the one-program-a-tile kernel does
    with the same tiles: the same bits."""
    from backend.core.kernels.fp8_gemv import fp8_rmsnorm_linear_rows
    q, scale, _, _ = _weights(301, 72, 0, 11)
    gen = torch.Generator().manual_seed(4)
    x, res, nw = (torch.randn(1, 72, generator=gen) for _ in range(3))
    one, _ = fp8_rmsnorm_linear_rows(x, res, nw[0], 1e-5, q, scale, config=(2, 128, 4))
    streamed, _ = fp8_rmsnorm_linear_rows(x, res, nw[0], 1e-5, q, scale,
                                          config=(2, 128, 4, 1, 1, 1))
    assert torch.equal(one, streamed)


def _case_stream_refuses_chunked_k():
    """Streaming tiles take whole rows: tiles that would cut K are refused, not quietly
    run as one-program-a-tile chunks."""
    from backend.core.kernels.fp8_gemv import fp8_linear_rows
    q, scale, _, _ = _weights(40, 300, 0, 1)
    with pytest.raises(AssertionError, match="whole rows"):
        fp8_linear_rows(torch.randn(1, 300), q, scale, config=(2, 128, 4, 1, 1, 1))


def _case_model(arch, prompt_len):
    """An FP8 model's logits with its small batches on the kernels (``fuse_rows``, as the
    runner sets it on CUDA) against the same model with every Fp8Linear swapped for its
    dequantized nn.Linear. Up to WEIGHT_ONLY_ROWS: the same numbers up to float32 sum
    order; more rows: the W8A8 product, bit for bit as with fuse_rows off."""
    import tempfile
    from pathlib import Path

    import model_factory as mf
    from engine_helpers import ARCH_OVERRIDES, make_engine
    from backend.core.layers.fp8_linear import dequantize_linears
    quality = mf._tools_module("fp8_quality")
    folder = mf.build_tiny_model(Path(tempfile.mkdtemp()) / arch, arch=arch,
                                 **ARCH_OVERRIDES[arch])
    prompt = [5 + (7 * i) % 150 for i in range(prompt_len)]
    fused, w8a8, ref = (make_engine(folder, quantization="fp8").runner for _ in range(3))
    for module in fused.model.modules():
        if hasattr(module, "fuse_rows"):
            module.fuse_rows = True
    assert dequantize_linears(ref.model, torch.float32) == 4 * len(ref.model.layers)
    got, plain, want = (quality.text_logits(r, [prompt])[0] for r in (fused, w8a8, ref))
    err = ((got - want).abs().max() / want.abs().max()).item()
    w8a8_err = ((plain - want).abs().max() / want.abs().max()).item()
    if prompt_len <= WEIGHT_ONLY_ROWS:
        assert err < 1e-5, err
        assert w8a8_err > 100 * err, (w8a8_err, err)  # the activations' own rounding
    else:
        assert torch.equal(got, plain)


CASES = {}
_SHAPES = (  # (n, k, rows): one whole-row tile (k <= 4096), or K = 5000 in 2048-wide
    # chunks (a partial one) by the default tiles
    (37, 48, 1), (130, 600, 3), (9, 5000, 2), (200, 300, 5), (38, 5000, 8))
for _block in (0, 128):
    _tag = f"block{_block}" if _block else "channel"
    for _n, _k, _rows in _SHAPES:
        _shape = dict(n=_n, k=_k, rows=_rows, block=_block)
        _id = f"{_tag}-n{_n}-k{_k}-r{_rows}"
        CASES[f"linear-{_id}"] = (_case_linear, _shape)
        CASES[f"norm-linear-{_id}"] = (_case_norm_linear, dict(_shape, residual=False))
        CASES[f"add-norm-linear-{_id}"] = (_case_norm_linear, dict(_shape, residual=True))
        CASES[f"silu-linear-{_id}"] = (_case_silu_linear, _shape)
    CASES[f"linear-bias-{_tag}"] = (_case_linear, dict(n=70, k=96, rows=4, block=_block,
                                                       bias=True))
    CASES[f"linear-fp16-{_tag}"] = (_case_linear, dict(n=130, k=600, rows=2, block=_block,
                                                       dtype=torch.float16))
    CASES[f"add-norm-linear-fp16-{_tag}"] = (_case_norm_linear, dict(
        n=130, k=600, rows=1, block=_block, residual=True, dtype=torch.float16))
    CASES[f"silu-linear-fp16-{_tag}"] = (_case_silu_linear, dict(
        n=9, k=5000, rows=3, block=_block, dtype=torch.float16))
# small scale blocks: several block rows, each spanning programs of 4 rows
CASES["linear-block16-narrow-tiles"] = (_case_linear, dict(n=50, k=72, rows=2, block=16,
                                                           config=(4, 32, 4, 1)))
# each prologue the kernels fuse: (name, case, the case's extra arguments)
_PROLOGUES = (("linear", _case_linear, {}),
              ("norm-linear", _case_norm_linear, dict(residual=False)),
              ("add-norm-linear", _case_norm_linear, dict(residual=True)),
              ("silu-linear", _case_silu_linear, {}))
# split K, explicit tiles: 16-output tiles over N = 70 (the last one partial), K = 600 in
# 64-column chunks cut into 3 slices of 256, 256 and 88 columns, each chunk waited for
# (stages 1); 1 and 2 rows, every prologue, both scale layouts (32-wide blocks: two
# tiles a block row)
for _name, _case, _extra in _PROLOGUES:
    for _block in (0, 32):
        for _rows in (1, 2):
            CASES[f"{_name}-split3-block{_block}-r{_rows}"] = (_case, dict(
                n=70, k=600, rows=_rows, block=_block, config=(16, 64, 4, 3), **_extra))
# the same with two chunks ahead through shared memory (stages 3, the default tiles')
for _rows in (1, 2):
    CASES[f"add-norm-linear-split3-stages3-r{_rows}"] = (_case_norm_linear, dict(
        n=70, k=600, rows=_rows, block=32, residual=True, config=(16, 64, 4, 3, 3)))
# the split-K alternative's own tiles where they split (N small, K = 4100: 1024-column
# chunks, two slices, two ahead), as the sweep of tools/gpu/fp8_gemv_checks.py runs them
for _name, _case, _extra in _PROLOGUES:
    for _rows in (1, 2):
        CASES[f"{_name}-split-k-tiles-r{_rows}"] = (_case, dict(
            n=48, k=4100, rows=_rows, block=0, config=tuple(split_k_tiles(48, 4100, _rows)),
            **_extra))
# whole rows, a few programs an SM streaming tiles (fp8_gemv_stream.py): 301 outputs in
# 151 tiles of 2 (the last one partial) over the interpreter's 132 SMs at one program an
# SM: 76 programs, 75 of 2 tiles and one of 1; every prologue, both scale layouts, 1 and
# 2 rows
for _name, _case, _extra in _PROLOGUES:
    for _block in (0, 32):
        for _rows in (1, 2):
            CASES[f"{_name}-stream-block{_block}-r{_rows}"] = (_case, dict(
                n=301, k=72, rows=_rows, block=_block, config=(2, 128, 4, 1, 1, 1),
                **_extra))
CASES["silu-linear-stream-stages2-r2"] = (_case_silu_linear, dict(
    n=301, k=72, rows=2, block=32, config=(2, 128, 4, 1, 2, 1)))
CASES["add-norm-linear-stream-fp16"] = (_case_norm_linear, dict(
    n=301, k=72, rows=1, block=0, residual=True, dtype=torch.float16,
    config=(2, 128, 4, 1, 1, 1)))
CASES["stream-sums-are-the-one-program-a-tile-sums"] = (_case_stream_same_bits, {})
CASES["stream-refuses-tiles-that-cut-k"] = (_case_stream_refuses_chunked_k, {})
CASES["split-counters-are-zero-again-and-results-repeat"] = (_case_counters_reused, {})
CASES["refuses-nine-rows"] = (_case_refuses_nine_rows, {})
for _arch in ("llama", "qwen2"):  # qwen2: QKV bias, tied head
    CASES[f"model-{_arch}-weight-only-rows"] = (
        _case_model, dict(arch=_arch, prompt_len=WEIGHT_ONLY_ROWS))
    CASES[f"model-{_arch}-one-row-more-w8a8"] = (
        _case_model, dict(arch=_arch, prompt_len=WEIGHT_ONLY_ROWS + 1))


def _layer(bias: bool = False):
    from torch import nn

    from backend.core.layers.fp8_linear import Fp8Linear
    torch.manual_seed(0)
    return Fp8Linear.from_linear(nn.Linear(32, 24, bias=bias))


def test_the_dequantized_weight_is_each_float8_value_times_its_row_scale():
    layer = _layer()
    want = layer.weight.float() * layer.weight_scale.view(24, 1)
    assert torch.equal(layer.dequantized(), want)
    assert torch.equal(layer.dequantized(torch.float16), want.half())


def test_only_batches_of_up_to_weight_only_rows_take_the_kernels_with_fuse_rows():
    layer = _layer()
    x = torch.randn(WEIGHT_ONLY_ROWS, 32)
    assert not layer.rows_fusable(x)  # fuse_rows is off until the runner sets it (CUDA)
    layer.fuse_rows = True
    assert layer.rows_fusable(x) and layer.rows_fusable(x[:1])
    assert layer.rows_fusable(x.half()) and layer.rows_fusable(x.bfloat16())
    assert not layer.rows_fusable(torch.randn(WEIGHT_ONLY_ROWS + 1, 32))  # W8A8 above
    assert not layer.rows_fusable(x[:0])
    assert not layer.rows_fusable(torch.randn(32, 8).t())  # K not contiguous
    assert not layer.rows_fusable(x.view(WEIGHT_ONLY_ROWS, 1, 32))


def test_a_bias_must_share_the_rows_dtype():
    layer = _layer(bias=True)
    layer.fuse_rows = True
    assert layer.rows_fusable(torch.randn(1, 32))  # float32 bias, float32 rows
    assert not layer.rows_fusable(torch.randn(1, 32).half())


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels import fp8_gemv
    assert isinstance(fp8_gemv._fp8_gemv_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_fp8_gemv_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
