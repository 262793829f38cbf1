"""ForwardBatch.build: the index layout the kernels and the CUDA-graph runner rely on."""
from __future__ import annotations

import torch

from backend.core.forward_batch import ForwardBatch


def build(prefix, new, logits):
    total = sum(new)
    return ForwardBatch.build(input_ids=list(range(100, 100 + total)),
                              req_pool_indices=[7 + i for i in range(len(new))],
                              extend_prefix_lens=prefix, extend_seq_lens=new,
                              out_cache_loc=list(range(50, 50 + total)),
                              logits_indices=logits, device="cpu")


def test_a_decode_batch_packs_its_per_request_inputs_as_five_rows():
    b = build([4, 9, 2], [1, 1, 1], [0, 1, 2])
    assert b.is_decode and b.all_rows
    assert b.decode_inputs.shape == (5, 3)
    for row, field in zip(b.decode_inputs, (b.input_ids, b.positions, b.out_cache_loc,
                                            b.req_pool_indices, b.seq_lens)):
        assert torch.equal(row, field)
    assert b.positions.tolist() == [4, 9, 2] and b.seq_lens.tolist() == [5, 10, 3]
    # views of one buffer: the graph runner copies them with a single kernel
    assert b.decode_inputs.data_ptr() == b.input_ids.data_ptr()


def test_any_batch_packs_token_and_request_inputs_as_two_views():
    # 5 tokens of 2 requests: the token rows are 6 apart, the request rows 2 apart
    b = build([0, 3], [3, 2], [2, 4])
    assert b.token_inputs.shape == (3, 5) and b.token_inputs.stride() == (6, 1)
    assert b.token_inputs.tolist() == [[100, 101, 102, 103, 104], [0, 1, 2, 3, 4],
                                       [50, 51, 52, 53, 54]]
    assert b.request_inputs.shape == (4, 2)
    assert b.request_inputs.tolist() == [[7, 8], [3, 5], [0, 3], [3, 2]]
    # the same memory as the fields (the extend graph runner checks this before copying)
    assert b.token_inputs.data_ptr() == b.input_ids.data_ptr()
    assert b.request_inputs.data_ptr() == b.req_pool_indices.data_ptr()
    for rows, fields in ((b.token_inputs, (b.input_ids, b.positions, b.out_cache_loc)),
                         (b.request_inputs, (b.req_pool_indices, b.seq_lens,
                                             b.extend_prefix_lens, b.extend_seq_lens))):
        for row, field in zip(rows, fields):
            assert row.data_ptr() == field.data_ptr() and torch.equal(row, field)


def test_all_rows_only_when_the_logits_rows_are_every_token_in_order():
    assert not build([0, 3], [2, 1], [1, 2]).all_rows  # a prefill's last token only
    assert build([0, 3], [2, 1], [0, 1, 2]).all_rows
    # one new token each, but a prompt-logprob row twice and a row skipped: not all rows,
    # so the model gathers them and the CUDA graphs (which return every row) stay out
    odd = build([0, 5], [1, 1], [0, 0, 1])
    assert odd.is_decode and not odd.all_rows
    assert not build([2, 5], [1, 1], [1]).all_rows
    assert build([0], [3], [0, 1, 2]).decode_inputs is None  # not a decode batch


def test_every_index_array_starts_16_byte_aligned():
    # Triton specialises kernels on pointer alignment: misaligned views of the shared
    # buffer made new kernel variants compile in the middle of serving
    for prefix, new in (([4, 9, 2], [1, 1, 1]), ([0, 3], [5, 2]), ([1], [1]), ([0, 0], [3, 4])):
        total = sum(new)
        b = build(prefix, new, list(range(total)) if len(new) % 2 else [total - 1])
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                     "extend_prefix_lens", "extend_seq_lens", "qo_indptr", "logits_indices"):
            assert getattr(b, name).data_ptr() % 16 == 0, (name, prefix, new)
        assert b.positions.tolist() == [p + j for p, n in zip(prefix, new) for j in range(n)]
        assert b.qo_indptr.tolist()[-1] == total
    odd = build([4, 9, 2], [1, 1, 1], [0, 1, 2])  # 3 rows: padded apart, still one view
    assert odd.decode_inputs.stride() == (4, 1)
    assert odd.decode_inputs.tolist() == [[100, 101, 102], [4, 9, 2], [50, 51, 52],
                                          [7, 8, 9], [5, 10, 3]]


def test_graph_capture_sizes_end_at_the_limit_itself():
    from backend.core.cuda_graph import capture_sizes
    assert capture_sizes(1) == [1]
    assert capture_sizes(160)[-3:] == [128, 144, 160]
    sizes = capture_sizes(300)  # not a listed size: still captured, so 257..300 replay
    assert sizes[-2:] == [256, 300] and sizes == sorted(set(sizes))
    assert capture_sizes(3) == [1, 2, 3]


def test_build_decode_is_build_for_one_token_per_request():
    # odd and even sizes: the padding between parts differs
    for b in (1, 2, 3, 8, 33, 128):
        prefix = [(i * 37) % 500 for i in range(b)]
        ids = [-(i + 1) if i % 3 else 1000 + i for i in range(b)]  # placeholders and ids
        rows = [b - i for i in range(b)]
        locs = [9000 + 2 * i for i in range(b)]
        slow = ForwardBatch.build(input_ids=ids, req_pool_indices=rows, extend_prefix_lens=prefix,
                                  extend_seq_lens=[1] * b, out_cache_loc=locs,
                                  logits_indices=list(range(b)), device="cpu")
        fast = ForwardBatch.build_decode(input_ids=ids, req_pool_indices=rows, positions=prefix,
                                         out_cache_loc=locs, device="cpu")
        assert torch.equal(fast.flat, slow.flat)
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                     "extend_prefix_lens", "extend_seq_lens", "qo_indptr", "logits_indices"):
            f, s = getattr(fast, name), getattr(slow, name)
            assert torch.equal(f, s), name
            assert f.data_ptr() - fast.flat.data_ptr() == s.data_ptr() - slow.flat.data_ptr(), name
        assert fast.seq_lens_cpu == slow.seq_lens_cpu == [p + 1 for p in prefix]
        assert fast.extend_prefix_lens_cpu == prefix and fast.extend_seq_lens_cpu == [1] * b
        assert fast.is_decode and fast.all_rows and slow.all_rows
        assert torch.equal(fast.decode_inputs, slow.decode_inputs)
