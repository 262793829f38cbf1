"""The loop of ranks 1..N-1 of a tensor-parallel engine: join the group, build this
rank's shard of the model and KV pool, then run each step rank 0 sends, until ``Stop``
or until rank 0's end of the line closes. Sampling and every decision stay on rank 0;
a rank only takes part in the collectives and keeps the last sampled tokens that later
steps' placeholders stand for."""
from __future__ import annotations

import os
from typing import Any

import torch

from ..config import EngineConfig
from ..loaders import open_checkpoint
from ..model_runner import ModelRunner
from .env import MULTICAST_OFF
from .group import join, rank_device
from .protocol import Stop, decode


def run_rank(rank: int, size: int, store: str, fields: dict[str, Any], line) -> None:
    os.environ.update(MULTICAST_OFF)
    config = EngineConfig(**fields)
    device = rank_device(config.device, rank)
    if device.type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    torch.manual_seed(config.seed)
    tp = join(rank, size, store, device)
    checkpoint = open_checkpoint(config.model_path)
    runner = ModelRunner(config, checkpoint.config, checkpoint.weights, tp)
    last_tokens = None
    while True:
        try:
            msg = decode(line.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if isinstance(msg, Stop):
            return
        runner.run_step(msg, last_tokens)
        if msg.num_sampled and config.overlap:
            last_tokens = runner.share_tokens(
                torch.empty(msg.num_sampled, dtype=torch.int64, device=device))
