"""Host time per decode step on the CPU, the model's forward pass replaced by a ready
logits tensor: scheduling, batch assembly, argmax, token bookkeeping, streamed
detokenization and step outputs, everything of a step but the model.

    python benchmarks/bench_decode_host.py [--batch 128] [--model models/default]

B greedy requests with 32-token prompts decode without end; after a warm-up, 5 rounds of
100 steps each are timed. Prints the median round's microseconds per step, and all five
(the machine is shared: compare runs of two commits interleaved, by their low values).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend.core import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--model", default="models/default")
    args = ap.parse_args()
    b = args.batch
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model_path=args.model, device="cpu", max_total_tokens=65536,
                                 max_running_requests=256, max_prefill_tokens=16384,
                                 enable_overlap=False))
    runner = engine.runner
    logits = torch.randn(b, 64, generator=torch.Generator().manual_seed(0))  # token ids < 64
    real_forward = runner.forward

    def forward(batch):  # decode steps only; the prefill runs the model
        n = batch.logits_indices.shape[0]
        return logits[:n] if batch.is_decode and n <= b else real_forward(batch)

    runner.forward = forward
    params = SamplingParams(max_new_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(b):
        engine.add_request([100 + (i * 7 + j) % 1000 for j in range(32)], params, stream=True)
    for _ in range(5):
        engine.step()
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(100):
            engine.step()
        rounds.append((time.perf_counter() - started) / 100 * 1e6)
    print(f"batch {b}: {statistics.median(rounds):.0f} us per decode step "
          f"(rounds: {', '.join(f'{r:.0f}' for r in rounds)})")


if __name__ == "__main__":
    main()
