"""What radixlm-openai costs: 32 concurrent streams straight over gRPC against the same
streams through the OpenAI server (/v1/completions, SSE), on one tritonserver.

    python benchmarks/gpu/bench_openai_overhead.py --model /tmp/shapes/llama-8b \
        --server-python /tmp/v/bin/python3 --openai-python /tmp/v/bin/python3
    python benchmarks/gpu/bench_openai_overhead.py --model /tmp/shapes/default --device cpu --quick

Both paths send token-id prompts (no tokenization) with ``ignore_eos`` and the same
``max_tokens``; the direct path is ``radixlm.AsyncTritonClient`` (what the OpenAI server
uses inside), the OpenAI path a plain asyncio HTTP/1.1 client reading the SSE events, so
the difference is the HTTP layer, FastAPI and the event encoding. Rounds alternate
between the paths; each row is the median of the rounds' output tokens per second.
Target: the OpenAI path within 5% of the direct one at 32 streams on the 8B shape.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "clients"))
import bench_triton as T  # noqa: E402
import common as C  # noqa: E402
from common import log  # noqa: E402


async def direct_round(url: str, prompts: list[list[int]], n_out: int) -> int:
    from radixlm import AsyncTritonClient

    client = AsyncTritonClient(url)

    async def one(prompt) -> int:
        count = 0
        async for chunk in client.generate_stream(prompt, max_tokens=n_out, temperature=0.0,
                                                  ignore_eos=True):
            count += len(chunk.output_ids)
        return count

    try:
        return sum(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


async def openai_round(port: int, prompts: list[list[int]], n_out: int) -> int:
    async def one(prompt) -> int:
        body = json.dumps({"model": "llm", "prompt": prompt, "max_tokens": n_out,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        tokens = 0
        async for line in reader:  # chunked framing lines are skipped: only events count
            if line.startswith(b"data: {") and b'"usage": {' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        writer.close()
        return tokens

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


def start_openai(python: str, grpc_url: str, log_path: Path) -> tuple[subprocess.Popen, int]:
    (port,) = T.free_ports(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parents[1] / "clients")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.Popen([python, "-m", "radixlm.openai", f"--grpc-url={grpc_url}",
                             "--host=127.0.0.1", f"--port={port}", "--log-level=warning"],
                            env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"radixlm-openai did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(ap)
    ap.add_argument("--server-python", default=os.environ.get("RADIXLM_SERVER_PYTHON", sys.executable))
    ap.add_argument("--openai-python", default=sys.executable,
                    help="Python with fastapi, uvicorn, pydantic and tritonclient[grpc]")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--server-pidfile", default=None,
                    help="write the server's process group id here while it runs")
    args = ap.parse_args(argv)
    # `timeout` sends SIGTERM: unwind through `finally` so that both servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.streams, args.output_len, args.rounds = 4, 16, 2
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="radixlm-openai-bench-"))
    repo = T.make_repository(tmp / "repo", args.model, device,
                             "bfloat16" if device == "cuda" else "float32", {})
    server = T.Server(args.server_python, repo, tmp / "server.log")
    if args.server_pidfile:
        Path(args.server_pidfile).write_text(str(server.proc.pid))
    openai_proc = None
    try:
        server.wait_ready(600)
        openai_proc, port = start_openai(args.openai_python, server.grpc_url, tmp / "openai.log")
        prompts = C.random_prompts(args.streams, args.input_len, C.hash_seed("openai", args.streams))
        asyncio.run(direct_round(server.grpc_url, prompts, 8))  # warm-up: graphs, caches
        asyncio.run(openai_round(port, prompts, 8))
        rates: dict[str, list[float]] = {"direct_grpc": [], "openai_sse": []}
        for r in range(args.rounds):
            for name in (("direct_grpc", "openai_sse") if r % 2 == 0 else ("openai_sse", "direct_grpc")):
                fresh = C.random_prompts(args.streams, args.input_len, C.hash_seed(name, r))
                start = time.perf_counter()
                tokens = asyncio.run(direct_round(server.grpc_url, fresh, args.output_len)
                                     if name == "direct_grpc" else openai_round(port, fresh, args.output_len))
                rates[name].append(tokens / (time.perf_counter() - start))
                assert tokens == args.streams * args.output_len, (name, tokens)
        row = {name: round(statistics.median(v), 1) for name, v in rates.items()}
        row["openai_over_direct"] = round(row["openai_sse"] / row["direct_grpc"], 4)
        row.update(model=C.model_label(args.model), streams=args.streams, input_len=args.input_len,
                   output_len=args.output_len, rounds=args.rounds, all=rates)
        log(f"openai overhead: {json.dumps(row)}")
        with open(args.out, "a") as out:
            out.write(json.dumps({"bench": "openai_overhead", **row}) + "\n")
    finally:
        if openai_proc is not None:
            openai_proc.terminate()
            openai_proc.wait(timeout=30)
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
