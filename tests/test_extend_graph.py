"""Extend-step CUDA graphs: the padded static batch gives the eager step's results.

CUDA graphs need a GPU, but what can go wrong in them is the padding: the static
buffers carry the real batch followed by padding tokens, padding requests and padding
logits rows, and stale values from a larger earlier batch must not leak into a smaller
one. ``ExtendGraphRunner(use_graphs=False)`` replays by running that padded static batch
eagerly, so these cases check it on CPU with the Triton kernels under the interpreter
(a worker subprocess, as in test_triton_kernels.py): logits, KV pool and request table
equal to an eager run of the same steps, step after step. The GPU check (graph vs eager
tokens) is benchmarks/gpu/smoke.py.
"""
from __future__ import annotations

import sys

import pytest
import torch

from interpreter_cases import REPO, run_cases

POOL_SLOTS = 400
TABLE_ROWS = 8
MAX_CTX = 128


def _tiny_model():
    from transformers import LlamaConfig

    from backend.core.model_runner import _init_dummy
    from backend.core.models.llama import LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=97,
                         max_position_embeddings=MAX_CTX, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config, MAX_CTX)
    _init_dummy(model, seed=3)
    model.float().eval()
    return model


class _Side:
    """One KV pool, request table and attention backend: the eager side or the runner's."""

    def __init__(self, model):
        from backend.core.layers.triton_attention import TritonAttention
        from backend.core.memory_pool import KVPool, ReqToTokenPool
        self.pool = KVPool(POOL_SLOTS, 2, 2, 16, torch.float32, "cpu")
        self.table = ReqToTokenPool(TABLE_ROWS, MAX_CTX, "cpu").req_to_token
        self.attn = TritonAttention(self.pool, self.table, num_heads=4)
        self.model = model

    def eager(self, batch):
        from backend.core.model_runner import record_slots
        record_slots(self.table, batch)
        self.attn.prepare(batch)
        return self.model.compute_logits(self.model(batch, self.attn))


class _Requests:
    """Host bookkeeping for a few requests: their table rows, lengths and KV slots."""

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.free_slots = (torch.randperm(POOL_SLOTS - 1, generator=gen) + 1).tolist()
        self.gen = gen
        self.lens: dict[int, int] = {}

    def batch(self, items, prompt_logprob_rows=()):
        """items: (table row, new tokens); every request's last token gets a logits row,
        and requests in ``prompt_logprob_rows`` get one for every new token."""
        from backend.core.forward_batch import ForwardBatch
        ids, rows, prefix, new, locs, logits = [], [], [], [], [], []
        for row, n in items:
            a = self.lens.get(row, 0)
            start = len(ids)
            ids += torch.randint(1, 97, (n,), generator=self.gen).tolist()
            rows.append(row)
            prefix.append(a)
            new.append(n)
            locs += [self.free_slots.pop() for _ in range(n)]
            if row in prompt_logprob_rows:
                logits += list(range(start, start + n))
            else:
                logits.append(start + n - 1)
            self.lens[row] = a + n
        return ForwardBatch.build(input_ids=ids, req_pool_indices=rows, extend_prefix_lens=prefix,
                                  extend_seq_lens=new, out_cache_loc=locs,
                                  logits_indices=logits, device="cpu")


def _steps_match(steps, max_tokens=16, max_requests=6):
    """Every step through the runner (padded, no graphs) == the same step run eagerly:
    logits, every KV slot but the dummy slot 0, and the request table."""
    from backend.core.cuda_graph import ExtendGraphRunner
    from backend.core.model_runner import record_slots
    model = _tiny_model()
    ref, side = _Side(model), _Side(model)
    runner = ExtendGraphRunner(model, side.attn, max_tokens, max_requests, torch.device("cpu"),
                               use_graphs=False)
    reqs = _Requests(seed=5)
    for i, (items, lp_rows) in enumerate(steps):
        batch = reqs.batch(items, lp_rows)
        assert runner.can_run(batch), f"step {i}: runner refused the batch"
        want = ref.eager(batch)
        record_slots(side.table, batch)
        got = model.compute_logits(runner.replay(batch))
        assert got.shape == want.shape, f"step {i}: {tuple(got.shape)} vs {tuple(want.shape)}"
        err = (got - want).abs().max().item()
        assert err < 1e-5, f"step {i}: logits differ by {err}"
        for layer in range(2):
            for name in ("k_buffer", "v_buffer"):
                a, b = getattr(ref.pool, name)[layer], getattr(side.pool, name)[layer]
                # (not bit-equal: CPU matmuls round differently for 11 rows and for 16)
                diff = (a[1:] - b[1:]).abs().max().item()
                assert diff < 1e-5, f"step {i}: {name}[{layer}] differs by {diff}"
        assert torch.equal(ref.table, side.table), f"step {i}: request table differs"
    return runner


def _case_prefill_then_mixed():
    _steps_match([
        ([(1, 5), (2, 9)], ()),  # two prompts: 14 tokens in the 16-token graph
        # a continued prompt (prefix 5), a decode row, a new prompt with prompt logprobs:
        # 11 tokens, 3 requests, 5 logits rows
        ([(1, 7), (2, 1), (3, 3)], (3,)),
        ([(4, 8)], ()),  # exactly a captured size: no padding tokens
        # fewer tokens and requests than two steps ago in the same graph: stale padding
        # (tokens, slots, request offsets) from that step must not be read or written
        ([(3, 9)], ()),
        ([(1, 1), (2, 1), (3, 1), (4, 1)], ()),  # a decode-only batch (logprobs case)
    ])


def _case_full_rows():
    # as many requests and logits rows as the graph has room for (no request padding)
    _steps_match([([(1, 2), (2, 1), (3, 1), (4, 2)], ()),
                  ([(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2)], ())],
                 max_tokens=8, max_requests=6)


def _case_limits():
    from backend.core.cuda_graph import ExtendGraphRunner, extend_capture_sizes, extend_classes
    assert extend_capture_sizes(0) == []
    assert extend_capture_sizes(8) == [8]
    assert extend_capture_sizes(100) == [8, 16, 32, 48, 64, 96, 100]
    model = _tiny_model()
    runner = ExtendGraphRunner(model, _Side(model).attn, 16, 6, torch.device("cpu"),
                               use_graphs=False)
    assert runner.sizes == [8, 16] and runner.rows_for(8) == 6 and runner.rows_for(16) == 6
    assert extend_classes(8) == [8] and extend_classes(48) == [16, 32, 48]
    assert extend_classes(512) == [16, 32, 64, 512]
    # the graph for a batch runs the tile an eager step would: by its longest extend
    assert [runner.class_for(n, 512) for n in (1, 16, 17, 33, 64, 65, 512)] == \
        [16, 16, 32, 64, 64, 512, 512]
    reqs = _Requests(seed=1)
    assert runner.can_run(reqs.batch([(1, 16)]))
    assert not runner.can_run(reqs.batch([(2, 17)]))  # more tokens than the largest graph
    assert not runner.can_run(reqs.batch([(r, 1) for r in range(1, 8)]))  # 7 requests > 6
    assert not runner.can_run(reqs.batch([(3, 7)], prompt_logprob_rows=(3,)))  # 7 logits rows
    small = ExtendGraphRunner(model, _Side(model).attn, 16, 2, torch.device("cpu"),
                              use_graphs=False)
    assert small.rows_for(8) == 2 and not small.can_run(reqs.batch([(4, 1), (5, 1), (6, 1)]))


CASES = {
    "prefill-then-mixed": (_case_prefill_then_mixed, {}),
    "full-rows": (_case_full_rows, {}),
    "limits": (_case_limits, {}),
}


def _worker() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from backend.core.kernels.extend_attention import _extend_attn_kernel
    assert isinstance(_extend_attn_kernel, InterpretedFunction), "interpreter not active"
    run_cases(CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_extend_graph_case(interpreter_results, case_id):
    outcome = interpreter_results.get(case_id, "case did not run")
    assert outcome == "ok", outcome


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker()
