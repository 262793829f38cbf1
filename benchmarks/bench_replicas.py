"""Replicas behind sglang-router: cache-aware routing against round-robin, and a replica killed.

    .venv/bin/python benchmarks/bench_replicas.py --replicas 2 --out docs/benchmarks

Workload: tenants, each with a long system prompt of its own, ask short questions,
interleaved (a seeded shuffle), a few at a time, through the router's OpenAI endpoint.
The tenants' prompts together hold more tokens than one replica's KV pool but fewer than
all replicas': round-robin sends every tenant to every replica, so each replica's LRU
radix cache churns; cache-aware routing keeps each tenant on one replica. Hit rate is
the usage's ``cached_tokens`` over ``prompt_tokens``, summed over the run. Each policy
gets fresh replicas (empty caches). The fault run kills one replica (SIGKILL) halfway and
checks that every request ends (answer or error) and the rest of the run completes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
import urllib.request
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from replicas import Cluster  # noqa: E402

WORDS = ("ledger invoice shipment pallet warranty refund courier customs tariff quota "
         "bakery sourdough oven flour yeast crust proofing rye spelt batch "
         "clinic triage nurse dosage referral ward intake chart consent rota").split()


def tenant_prompt(tenant: int, words: int) -> str:
    rng = random.Random(tenant)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Tenant {tenant} policy handbook. Answer from it only. {body}"


def workload(tenants: int, questions: int, words: int, seed: int) -> list[tuple[int, list]]:
    prompts = [tenant_prompt(t, words) for t in range(tenants)]
    requests = [(t, [{"role": "system", "content": prompts[t]},
                     {"role": "user", "content": f"Question {q} of tenant {t}?"}])
                for t in range(tenants) for q in range(questions)]
    random.Random(seed).shuffle(requests)
    return requests


async def run(url: str, requests: list, concurrency: int, max_tokens: int,
              on_half=None, timeout_s: float = 300) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=timeout_s)
    queue = list(enumerate(requests))
    done = {"ok": 0, "errors": 0, "prompt": 0, "cached": 0, "completion": 0}
    errors: list[str] = []
    half = asyncio.Event()

    async def one(messages) -> None:
        stream = await client.chat.completions.create(
            model="llm", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for event in stream:
            if event.usage:
                done["prompt"] += event.usage.prompt_tokens
                done["cached"] += event.usage.prompt_tokens_details.cached_tokens
                done["completion"] += event.usage.completion_tokens

    async def worker() -> None:
        while queue:
            index, (_, messages) = queue.pop(0)
            if index >= len(requests) // 2:
                half.set()
            try:
                await one(messages)
                done["ok"] += 1
            except (openai.APIError, openai.APIConnectionError) as exc:
                done["errors"] += 1
                errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")

    async def fault() -> None:
        await half.wait()
        on_half()

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    if on_half is not None:
        tasks.append(asyncio.create_task(fault()))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s * 4)
    seconds = time.perf_counter() - start
    await client.close()
    return {"requests": len(requests), "ok": done["ok"], "errors": done["errors"],
            "seconds": round(seconds, 2),
            "requests_per_s": round(done["ok"] / seconds, 3),
            "prompt_tokens": done["prompt"], "cached_tokens": done["cached"],
            "completion_tokens": done["completion"],
            "hit_rate": round(done["cached"] / max(done["prompt"], 1), 4),
            "prompt_tokens_per_s": round(done["prompt"] / seconds, 1),
            "error_samples": sorted(set(errors))[:3]}


def measure(policy: str, args, requests, fault: bool = False) -> dict:
    with Cluster(replicas=args.replicas, policy=policy, models=("llm",)) as cluster:
        on_half = (lambda: cluster.members[-1].kill()) if fault else None
        result = asyncio.run(run(cluster.url, requests, args.concurrency, args.max_tokens,
                                 on_half))
        if fault:  # traffic goes on to the others: a fresh request after the run
            result["after_fault_ok"] = _one_more(cluster.url)
        else:  # where the work went: each replica's engine counters
            result["per_replica"] = [_engine_counts(r.http_url) for r in cluster.members]
    print(policy, "fault" if fault else "", json.dumps(result), flush=True)
    return {"policy": policy, "fault": fault, **result}


def _engine_counts(http_url: str) -> dict:
    request = urllib.request.Request(f"http://{http_url}/v2/models/llm/generate",
                                     data=json.dumps({"parameters": {"debug": "stats"}}).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        stats = json.loads(json.loads(response.read())["stats"])
    return {"requests": stats["finished_requests"], "prompt_tokens": stats["prompt_tokens"],
            "cached_tokens": stats["cache_hit_tokens"]}


def _one_more(url: str) -> bool:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="llm", max_tokens=2,
                                            messages=[{"role": "user", "content": "still there?"}])
    return answer.choices[0].finish_reason in ("stop", "length")


def table(results: list[dict]) -> str:
    lines = ["| policy | requests ok / errors | hit rate | requests/s | prompt tokens/s | seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        name = r["policy"] + (", one replica killed halfway" if r["fault"] else "")
        lines.append(f"| {name} | {r['ok']} / {r['errors']} | {r['hit_rate']:.1%} | "
                     f"{r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:.0f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    w, results = report["workload"], report["results"]
    name = f"replicas_{w['replicas']}_cpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    requests = w["tenants"] * w["questions"]
    prompt_len = results[0]["prompt_tokens"] // requests
    text = [f"# {w['replicas']} replicas behind {report['router']} ({report['machine']})", "",
            f"{w['tenants']} tenants x {w['questions']} questions, system prompts of {w['words']} "
            f"words (prompts of ~{prompt_len:,} tokens), interleaved, {w['concurrency']} at a "
            f"time, {w['max_tokens']} output tokens; a KV pool of 16,384 tokens per replica (the "
            f"tenants' prompts need ~{w['tenants'] * prompt_len:,}). Fresh replicas for each row.",
            "", table(results), "",
            f"Best possible hit rate: about {1 - w['tenants'] / requests:.1%} (each tenant's first "
            "request misses). Round-robin sends every tenant to every replica, whose LRU caches "
            "then churn; cache-aware routing kept each tenant on one replica."]
    fault = next((r for r in results if r["fault"]), None)
    if fault is not None:
        text += ["", "Fault row: one replica's servers were SIGKILLed when the second half of the "
                 f"requests began; {fault['ok']} requests were answered and {fault['errors']} ended "
                 "with an error (the router retries a request that fails before any answer on "
                 "another replica), none hung, and a new request after the run was "
                 f"{'answered' if fault.get('after_fault_ok') else 'NOT answered'}."]
    (out / f"{name}.md").write_text("\n".join(text) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--words", type=int, default=1000, help="system prompt length in words")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-fault", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--from-json", type=Path, help="only rewrite the report from this JSON")
    args = parser.parse_args()
    if args.from_json:
        write_report(json.loads(args.from_json.read_text()), args.out)
        return
    requests = workload(args.tenants, args.questions, args.words, args.seed)
    results = [measure(policy, args, requests) for policy in ("round_robin", "cache_aware")]
    if not args.skip_fault:
        results.append(measure("cache_aware", args, requests, fault=True))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs (shared), CPU-only, default model"
    report = {"workload": {k: v for k, v in vars(args).items() if k not in ("out", "from_json")},
              "machine": machine, "router": "sglang-router 0.3.2", "results": results}
    write_report(report, args.out)
    print(table(results))

if __name__ == "__main__":
    main()
