"""HostToDevice's pinned staging ring, run on the CPU with a stand-in for CUDA events (the
GPU check is tools/check_kernels_gpu.py)."""
from __future__ import annotations

import random

import torch

from backend.core.transfer import HostToDevice, PinnedRing


class FakeEvent:
    """Records whether the ring waited on it before writing its buffer again."""

    log: list[str] = []

    def __init__(self) -> None:
        self.recorded = self.waited = False

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "waited on an event that was never recorded"
        self.waited = True
        FakeEvent.log.append("wait")


def test_every_copy_holds_its_own_values_while_buffers_are_reused_and_grow():
    ring = PinnedRing(torch.device("cpu"), slots=3, min_bytes=16, pin=False, new_event=FakeEvent)
    rng = random.Random(3)
    sent, got = [], []
    for _ in range(40):
        n = rng.choice([0, 1, 5, 300, 2000])
        dtype = rng.choice([torch.int64, torch.int32, torch.float32, torch.bool])
        if dtype is torch.bool:
            values = [rng.random() < 0.5 for _ in range(n)]
        elif dtype is torch.float32:
            values = [rng.randint(-999, 999) / 4 for _ in range(n)]
        else:
            values = [rng.randint(-2**30, 2**30) for _ in range(n)]
        out = ring.copy(values, dtype)
        assert out.dtype == dtype and out.shape == (n,)
        sent.append(values)
        got.append(out)
    assert all(t.tolist() == v for t, v in zip(got, sent))
    assert max(b.numel() for b in ring.buffers) >= 2000 * 8  # grew past min_bytes


def test_a_buffer_is_written_again_only_after_its_last_copy_is_waited_for():
    FakeEvent.log = []
    ring = PinnedRing(torch.device("cpu"), slots=2, pin=False, new_event=FakeEvent)
    ring.copy([1, 2], torch.int64)
    ring.copy([3], torch.int64)
    first = ring.events[0]
    assert FakeEvent.log == [] and not first.waited  # two slots: no reuse yet
    ring.copy([4], torch.int64)  # slot 0 again
    assert first.waited and FakeEvent.log == ["wait"]


def test_host_to_device_on_the_cpu_is_a_plain_tensor():
    t = HostToDevice("cpu")([[1, 2], [3, 4]], torch.float32)
    assert t.tolist() == [[1.0, 2.0], [3.0, 4.0]] and t.dtype == torch.float32
    assert HostToDevice(torch.device("cpu"))([5, 6]).tolist() == [5, 6]
