"""Host lists to device tensors without stalling on the device queue.

A copy from pageable memory makes the host wait until the device has drained its queue,
which would defeat overlap scheduling: the values go through pinned memory. Pinning a
fresh buffer per call (``tensor.pin_memory()``) costs more host time than the whole rest
of a small copy, and ``torch.tensor(list)`` is slower than numpy at reading a list, so
each ``HostToDevice`` keeps a ring of pinned buffers that numpy fills in place. A buffer
is written again only after the copy that last read it has run (an event per buffer);
with several buffers in the ring that wait is nearly always already over.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
          torch.bool: np.bool_}


class PinnedRing:
    """Round-robin pinned staging buffers for host-to-device copies on one device."""

    def __init__(self, device: torch.device, slots: int = 8, min_bytes: int = 1 << 16,
                 pin: bool = True, new_event=None) -> None:
        """``pin`` and ``new_event`` exist for tests on machines without CUDA."""
        self.device = device
        self.min_bytes = min_bytes
        self.pin = pin
        self.new_event = new_event or torch.cuda.Event
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0
        self.lock = threading.Lock()

    def copy(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        n = len(values)
        np_dtype = _NUMPY[dtype]
        itemsize = np_dtype().itemsize
        nbytes = max(n * itemsize, 1)
        with self.lock:
            k = self.next
            self.next = (k + 1) % len(self.buffers)
            event = self.events[k]
            if event is not None:
                event.synchronize()  # the copy that read this buffer last has run
            buf = self.buffers[k]
            if buf is None or buf.numel() < nbytes:
                size = max(self.min_bytes, 1 << (nbytes - 1).bit_length())
                buf = self.buffers[k] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            host = buf[:n * itemsize]
            host.numpy().view(np_dtype)[:] = values
            out = torch.empty(n, dtype=dtype, device=self.device)
            out.copy_(host.view(dtype), non_blocking=True)
            event = self.events[k] = self.new_event()
            event.record()
        return out


class HostToDevice:
    """``copy(values, dtype)``: a host list as a tensor on ``device``, never making the
    host wait for the device. One per model runner (its ring is reused every step)."""

    def __init__(self, device: str | torch.device) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._ring = PinnedRing(device) if device.type == "cuda" else None

    def __call__(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        if self._ring is None:
            return torch.tensor(values, dtype=dtype)
        if dtype in _NUMPY and (not values or not isinstance(values[0], (list, tuple))):
            return self._ring.copy(values, dtype)
        host = torch.tensor(values, dtype=dtype)  # nested lists: shape from torch
        return host.pin_memory().to(self.device, non_blocking=True)
