"""How close a quantized engine's next-token distributions stay to the unquantized one's.

Both engines read the same texts in one prefill each (teacher forcing: every position
sees the true text before it, so one early disagreement does not derail the rest) and
give float32 logits at every position. Measured over all positions of all texts:

* ``agreement``: the share of positions whose argmax (the greedy choice) is the same;
* ``mean_kl``: the mean KL(reference || quantized) of the softmax distributions, in nats;
* ``max_kl``: the largest KL at any one position.

An FP8-weight engine computes two products (layers/fp8_linear.py): W8A8 (activations
quantized per token too) for prefill and larger batches, and weight-only (the
activations as they are) for decode at batch 1 and 2 on the GPU. Prefill logits
measure the first; ``weight_only`` turns a runner's FP8 layers into the second's torch
reference, so the CPU measures both.

Used by tests/test_fp8_quality.py on the CPU and tools/gpu/check_fp8.py on the GPU.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# Texts of several kinds (prose, code, a chat turn, numbers and lists), written here.
TEXTS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the top "
    "he could see the fishing boats returning to the harbour, their lanterns swaying with "
    "the swell, and beyond them the dark line where the sea met the sky.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < "
    "len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]\n",
    "<|im_start|>user\nWhat is the difference between weather and climate?<|im_end|>\n"
    "<|im_start|>assistant\nWeather describes the conditions of the atmosphere over hours "
    "or days, while climate is the average of those conditions over decades.",
    "Shopping list for the week: 2 kg of potatoes, 6 eggs, 1 litre of milk, 500 g of "
    "flour, 3 onions, a loaf of bread and 250 g of butter. Total budget: 18.50 euros.",
)


@dataclass(frozen=True)
class Quality:
    positions: int
    agreement: float
    mean_kl: float
    max_kl: float

    def as_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def text_logits(runner, token_lists: list[list[int]]) -> list[torch.Tensor]:
    """float32 logits [len(tokens), vocab] of each token list, from one prefill of them
    all on ``runner`` (a ``ModelRunner``, which records the slots in its request table):
rows 1.., KV slots 1.."""
    from backend.core.forward_batch import ForwardBatch

    lens = [len(t) for t in token_lists]
    total = sum(lens)
    batch = ForwardBatch.build(input_ids=[i for t in token_lists for i in t],
                               req_pool_indices=list(range(1, len(lens) + 1)),
                               extend_prefix_lens=[0] * len(lens), extend_seq_lens=lens,
                               out_cache_loc=list(range(1, total + 1)),
                               logits_indices=list(range(total)), device=runner.to_device)
    logits = runner.forward(batch).float().cpu()
    return list(logits.split(lens))


def weight_only(runner):
    """``runner`` (a ``ModelRunner`` with FP8 weights) with every FP8 layer replaced by
    its dequantized weight in the model dtype: the numbers the weight-only matrix-vector
    kernels give, up to the order of their float32 sums."""
    from backend.core.layers.fp8_linear import dequantize_linears

    dequantize_linears(runner.model, runner.dtype)
    return runner


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> Quality:
    ref = torch.cat(reference)
    got = torch.cat(other)
    ref_logp = torch.log_softmax(ref.double(), dim=-1)
    got_logp = torch.log_softmax(got.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - got_logp)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean()
    return Quality(int(ref.shape[0]), float(agree), float(kl.mean()), float(kl.max()))
