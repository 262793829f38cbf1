"""The header of a GGUF file (metadata and tensor table) and its tensors, dequantized.

A direct walk over a memory map: gguf-py's ``GGUFReader`` builds a Python object for every
entry of every metadata array, which takes 7-30 s on files with a 50k-260k vocabulary;
here the vocabulary arrays are decoded in one pass and tensor data is only read when a
tensor is asked for. Dequantization is gguf-py's (``gguf.quants.dequantize``).

Layout (little-endian, versions 2 and 3):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] (fastest first), u32 type, u64 offset)
    padding to ``general.alignment`` (32) | tensor data (offsets relative to here)
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
            10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that is not a readable GGUF (wrong magic, version, or cut short)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: slowest dimension first
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    metadata: dict
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default=None):
        """``<architecture>.<key>`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_header(path: str | Path) -> GGUFHeader:
    """Parse ``path``'s metadata and tensor table; raises GGUFError on a broken file."""
    path = str(path)
    with open(path, "rb") as fh:
        if not Path(path).stat().st_size:
            raise GGUFError(f"{path} is empty")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse(blob, path)


def _parse(blob: mmap.mmap, path: str) -> GGUFHeader:
    reader = _Reader(blob, path)
    try:
        if blob[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        version, n_tensors, n_kv = reader.unpack("<IQQ", 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        metadata = {}
        for _ in range(n_kv):
            key = reader.string()
            (vtype,) = reader.unpack("<I")
            metadata[key] = reader.value(vtype)
        entries = []
        for _ in range(n_tensors):
            name = reader.string()
            (ndims,) = reader.unpack("<I")
            dims = reader.unpack(f"<{ndims}Q")
            ggml_type, offset = reader.unpack("<IQ")
            entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    except struct.error:
        raise GGUFError(f"{path} is truncated: its header ends early") from None
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in entries:
        nbytes = tensor_nbytes(shape, ggml_type)
        start = data_start + offset
        if start + nbytes > len(blob):
            raise GGUFError(f"{path} is truncated: tensor {name!r} ends at byte {start + nbytes}, "
                            f"the file has {len(blob)}")
        tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
    return GGUFHeader(path, metadata, tensors)


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except ValueError:
        raise GGUFError(f"unknown ggml tensor type {ggml_type}") from None
    count = int(np.prod(shape)) if shape else 1
    return count // block * type_size


def read_tensor(header: GGUFHeader, name: str) -> np.ndarray:
    """The tensor ``name`` as float32 (dequantized), in torch order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    info = header.tensors[name]
    raw = np.memmap(header.path, mode="r", dtype=np.uint8, offset=info.offset, shape=(info.nbytes,))
    qtype = GGMLQuantizationType(info.ggml_type)
    if qtype == GGMLQuantizationType.F32:
        values = np.array(raw.view(np.float32))
    else:
        rows = raw.reshape(-1, info.nbytes // max(1, _num_rows(info.shape)))
        values = dequantize(rows, qtype).astype(np.float32, copy=False)
    return values.reshape(info.shape)


def _num_rows(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1


class _Reader:
    """A cursor over the mapped bytes."""

    def __init__(self, blob: mmap.mmap, path: str) -> None:
        self.blob, self.path, self.pos = blob, path, 0

    def unpack(self, fmt: str, pos: int | None = None) -> tuple:
        if pos is not None:
            self.pos = pos
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        end = self.pos + n
        if end > len(self.blob):
            raise struct.error("string past the end")
        text = self.blob[self.pos:end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if etype in _SCALARS:  # fixed width: one read for the whole array
                return list(self.unpack(f"<{count}{_SCALARS[etype]}"))
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        return self.unpack("<" + _SCALARS[vtype])[0]
