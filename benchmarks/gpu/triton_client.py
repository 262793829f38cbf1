"""bench_triton's client side: what one request sends and how its streamed responses are
tallied (the wire contract), and the client processes that run a batch of requests over
gRPC streaming from one shared start time."""
from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_server import MODEL  # noqa: E402  (the model its repository holds)

# The wire type of the prompt's token ids: the llm model declares input_ids TYPE_INT64
# (backend/wire.py), and Triton rejects a request of any other type before the model
# sees it; tests/test_bench_triton_wire.py checks the two agree.
INPUT_IDS_DATATYPE = "INT64"


def input_ids_array(prompt: list[int]):
    """The prompt as the ``input_ids`` tensor's data (numpy of INPUT_IDS_DATATYPE)."""
    import numpy as np

    return np.asarray(prompt, dtype=np.int64)


# What a streamed response says (backend/wire_outputs.py): finish_reason is the string
# "None" while the request runs, and num_output_tokens and output_ids count this
# response's tokens only. The final response is the one with a real finish reason.
NOT_FINISHED = "None"


def tally_response(rec: dict, as_numpy, t: float) -> bool:
    """Add one response (``as_numpy(name)`` reads a tensor) received at ``t`` to the
    request's record; True when it was the request's last."""
    ids = as_numpy("output_ids")
    k = 0 if ids is None else int(ids.size)
    if k:
        rec["n_out"] += k
        if rec["first"] is None:
            rec["first"] = t
    cached = as_numpy("num_cached_tokens")
    if cached is not None and cached.size:
        rec["cached"] = int(cached.reshape(-1)[0])
    fr = as_numpy("finish_reason")
    reason = fr.reshape(-1)[0] if fr is not None and fr.size else b""
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    if not reason or reason == NOT_FINISHED:
        return False
    rec["end"] = t
    rec["finish_reason"] = reason
    return True


def _client_worker(url, items, t0, n_out, timeout_s, id_prefix):
    """One process: run its requests (index, arrival, prompt) over one aio channel."""
    return asyncio.run(_client_async(url, items, t0, n_out, timeout_s, id_prefix))


async def _client_async(url, items, t0, n_out, timeout_s, id_prefix):
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    started = time.time()
    await client.is_server_live()  # the channel connects on its first call
    connect_ms = (time.time() - started) * 1e3
    wanted = [grpcclient.InferRequestedOutput(n) for n in
              ("output_ids", "finish_reason", "num_cached_tokens")]

    async def one(idx, arrival, prompt):
        rec = {"idx": idx, "arrival": arrival, "first": None, "end": None, "n_out": 0,
               "n_in": len(prompt), "cached": 0, "origin": t0, "connect_ms": connect_ms}
        delay = t0 + arrival - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        inp = grpcclient.InferInput("input_ids", [len(prompt)], INPUT_IDS_DATATYPE)
        inp.set_data_from_numpy(input_ids_array(prompt))
        params = {"stream": True, "max_tokens": int(n_out), "temperature": 0.0,
                  "ignore_eos": True, "exclude_input_in_output": True}

        async def requests():
            yield {"model_name": MODEL, "inputs": [inp], "outputs": wanted,
                   "request_id": f"{id_prefix}{idx}", "parameters": params}

        call = None
        try:
            rec["sent"] = time.time() - t0  # how late the client itself was
            call = client.stream_infer(requests(), stream_timeout=timeout_s)
            async for result, error in call:
                t = time.time() - t0
                if error is not None:
                    rec["error"] = str(error)[:300]
                    break
                if tally_response(rec, result.as_numpy, t):
                    break
            if rec["end"] is None and "error" not in rec:
                rec["error"] = "stream ended without a final response"
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if call is not None:
                try:
                    call.cancel()
                except Exception:  # noqa: BLE001
                    pass
        return rec

    try:
        return await asyncio.gather(*(one(i, a, p) for i, a, p in items))
    finally:
        await client.close()


def run_requests(url, arrivals, prompts, n_out, procs, timeout_s, id_prefix=""):
    """Spread requests round-robin over client processes sharing one start time. Request
    ids are ``id_prefix`` + index (a prefix per run keeps timelines of one run, which a
    stub may report in a later run's stats with several instances, from joining another)."""
    import tritonclient.grpc.aio  # noqa: F401 - imported once here, not in every forked worker
    items = [(i, a, p) for i, (a, p) in enumerate(zip(arrivals, prompts))]
    procs = max(1, min(procs, len(items)))
    shares = [items[k::procs] for k in range(procs)]
    t0 = time.time() + 0.3 + 0.05 * procs  # let the workers start
    with ProcessPoolExecutor(max_workers=procs, mp_context=get_context("fork")) as pool:
        futs = [pool.submit(_client_worker, url, s, t0, n_out, timeout_s, id_prefix)
                for s in shares]
        out = []
        for f in futs:
            out += f.result()
    out.sort(key=lambda r: r["idx"])
    for r in out:
        r.pop("idx", None)
    return out
