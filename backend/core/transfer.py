"""Host lists to device tensors without stalling on the device queue."""
from __future__ import annotations

import torch


def to_device(values: list, device: str | torch.device, dtype=torch.int64) -> torch.Tensor:
    """A host list as a device tensor without making the host wait for the device."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
