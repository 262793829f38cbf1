"""GGUF files for tests, made the way real ones are made: llama.cpp's own converter
(``convert_hf_to_gguf.py``, from the llama-cpp-python sdist that tests already fetch for
vocabularies) turns a tiny Hugging Face model into a GGUF, so what our loader undoes (the
Q/K permutation, Gemma's norm offset, Phi-3's rope factor tensors) is what llama.cpp did.

    to_gguf(model_dir, out_file, outtype="f32" | "f16" | "bf16" | "q8_0") -> Path

The converter runs in a child process with the gguf-py it ships with. Its vocabulary step
is pointed at byte-level BPE, which is what the tiny test tokenizer is (llama.cpp would
otherwise look for a sentencepiece model or a known pre-tokenizer hash).

    write_gguf(path, architecture, metadata, tensors)  raw files for the loader's error
                                                       paths and quantization types
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

try:
    import model_factory as mf
except ImportError:  # tests/ importable as a package
    from tests import model_factory as mf

_SDIST_ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

_DRIVER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
import conversion.phi as phi
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
for name in ("_set_vocab_sentencepiece", "_set_vocab_llama_hf"):
    setattr(base.TextModel, name, lambda self, *a, **k: self._set_vocab_gpt2())
phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def converter_dir() -> Path:
    """llama.cpp's converter, extracted once from the cached sdist into build/."""
    assets = mf.model_assets()
    target = assets.default_cache_dir() / "llama.cpp-convert"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    sdist = assets.distribution(assets.VOCAB_SDIST, assets.default_cache_dir())
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            rel = member.name[len(_SDIST_ROOT):] if member.name.startswith(_SDIST_ROOT) else None
            if rel and member.isfile() and rel.startswith(_PARTS):
                member.name = rel
                tar.extract(member, tmp, filter="data")
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    return target


def to_gguf(model_dir: Path, out_file: Path, outtype: str = "f32") -> Path:
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(converter_dir()), str(model_dir),
         "--outfile", str(out_file), "--outtype", outtype],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out_file.is_file(), proc.stderr[-3000:]
    return out_file


def write_gguf(path: Path, architecture: str, metadata: dict, tensors: dict) -> Path:
    """A GGUF with the given metadata and tensors: {name: (raw data, ggml type name)},
    raw data being float32 values for F32 or the quantized bytes (uint8 rows) otherwise."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (data, kind) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, np.ascontiguousarray(data),
                          raw_dtype=None if kind == "F32" else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
