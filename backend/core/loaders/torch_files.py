"""Weights of a Hugging Face model folder: safetensors first, else PyTorch files loaded
without running pickled code."""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Iterator

import torch

TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def weight_files(folder: Path) -> list[Path]:
    """The folder's weight files: every ``*.safetensors`` when there is one, else every
    PyTorch file; a clear error when there is neither."""
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        return safetensors
    pickled = sorted(p for p in folder.iterdir() if p.suffix in TORCH_SUFFIXES)
    if pickled:
        return pickled
    raise ValueError(f"no weights in {folder}: expected *.safetensors (or PyTorch *.bin) files")


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        if path.suffix == ".safetensors":
            yield from _safetensors(path)
        else:
            yield from load_torch_file(path).items()


def _safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except Exception as exc:  # safetensors raises its own error types for broken headers
        if isinstance(exc, (ValueError, OSError)) or type(exc).__name__ == "SafetensorError":
            raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None
        raise


def load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint's state dict, through ``torch.load(weights_only=True)``: tensors
    and plain containers only. A file that needs arbitrary classes to unpickle is refused,
    since unpickling it would run code the file names."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError) as exc:
        raise ValueError(
            f"{path} cannot be loaded as plain tensors (torch.load with weights_only=True "
            f"refused it: {_reason(exc)}). Pickled checkpoints are never fully unpickled, "
            "as that runs code from the file; convert it to safetensors.") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path} holds no state dict (a mapping of names to tensors)")
    return state


def _reason(exc: Exception) -> str:
    """The informative line of torch's refusal (it leads with general advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "Unsupported global" in line or "WeightsUnpickler error" in line:
            return line
    return lines[0] if lines else type(exc).__name__
