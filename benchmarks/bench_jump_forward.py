"""JSON-heavy workload through the engine, jump-forward on vs off.

Prints a table and writes JSON:

    .venv/bin/python benchmarks/bench_jump_forward.py [--model models/default] [--device cpu]
        [--dtype float32] [--requests 16] [--repeat 3] [--out benchmarks/results/jump_forward_cpu.json]

The workload: schemas with long fixed keys and enums (most of each output is text the
grammar forces), one request per prompt, all submitted together, greedy. Grammars are
compiled before timing, so every counted engine step is a forward pass. Reported per mode:

- engine steps: ``Engine.step()`` calls (forward passes) until every request finished;
- decode steps per output: the engine steps each request took, submission to finish
  (all requests are admitted in the first step), averaged over requests;
- sampled tokens per output: steps in which a request sampled a token (one StepOutput
  each); the other output tokens are forced text;
- output tokens (per request and in total), output tokens per engine step of a request,
  wall time (median of ``--repeat`` runs, the modes alternating, since a shared machine's
  load drifts; the counts are the same in every run), output tokens/s, and how many
  outputs validate (all must).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

try:  # validation; the GPU image lacks it, and then outputs are only parsed
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

from backend.core import Engine, EngineConfig, SamplingParams  # noqa: E402


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


SCHEMAS = {
    "customer_profile": _obj({
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
        "preferred_notification_channel": {"enum": ["email", "sms", "push_notification"]},
        "subscription_tier_level": {"enum": ["free", "professional", "enterprise"]},
        "is_marketing_consent_granted": {"type": "boolean"},
    }),
    "server_event": _obj({
        "event_source_hostname": {"type": "string", "pattern": "^[a-z]{3,8}-[0-9]{2}$"},
        "event_severity_classification": {"enum": ["informational", "warning", "critical_failure"]},
        "event_occurrence_date": {"type": "string",
                                  "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
        "affected_service_components": {"type": "array", "minItems": 1, "maxItems": 2,
                                        "items": {"enum": ["database", "cache", "frontend"]}},
    }),
    "invoice_line_item": _obj({
        "product_stock_keeping_unit": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "quantity_ordered_in_units": {"type": "integer", "minimum": 1, "maximum": 50},
        "unit_price_in_euro_cents": {"type": "integer", "minimum": 1, "maximum": 99999},
        "applicable_tax_category": {"enum": ["standard_rate", "reduced_rate", "zero_rated"]},
    }),
    "weather_observation": _obj({
        "observation_station_identifier": {"type": "string", "pattern": "^[A-Z]{4}[0-9]{2}$"},
        "ambient_air_temperature_celsius": {"type": "number", "minimum": -40, "maximum": 50},
        "relative_humidity_percentage": {"type": "integer", "minimum": 0, "maximum": 100},
        "precipitation_type_observed": {"enum": ["none", "rain", "snow", "sleet"]},
    }),
}
TOPICS = ["a new customer", "last night's outage", "the office chairs order", "Hanoi this morning",
          "a returning customer", "a disk alert", "printer paper", "Bangkok at noon"]


def workload(num_requests: int) -> list[tuple[str, str]]:
    """(schema name, prompt) pairs, cycling through the schemas."""
    names = list(SCHEMAS)
    return [(names[i % len(names)],
             f"Request {i}: fill in the {names[i % len(names)].replace('_', ' ')} record "
             f"for {TOPICS[i % len(TOPICS)]} as JSON.")
            for i in range(num_requests)]


def conforms(text: str, schema: dict) -> bool:
    try:  # strict=False: xgrammar lets maxLength strings hold raw control characters
        value = json.loads(text, strict=False)
    except ValueError:
        return False
    return jsonschema is None or jsonschema.Draft202012Validator(schema).is_valid(value)


def run(engine: Engine, reqs: list[tuple[str, str]], max_new_tokens: int) -> dict:
    # compile every grammar (and warm the model up) outside the timed part
    engine.generate(["warm-up"] * len(SCHEMAS), [
        SamplingParams(json_schema=s, temperature=0.0, max_new_tokens=2) for s in SCHEMAS.values()])
    engine.cache.reset()

    start = time.perf_counter()
    rids = {engine.add_request(prompt, SamplingParams(json_schema=SCHEMAS[name], temperature=0.0,
                                                      max_new_tokens=max_new_tokens)): i
            for i, (name, prompt) in enumerate(reqs)}
    sampled = [0] * len(reqs)
    decode_steps = [0] * len(reqs)
    texts = [""] * len(reqs)
    tokens = [0] * len(reqs)
    reasons: list[str | None] = [None] * len(reqs)
    steps = 0
    while any(r is None for r in reasons):
        steps += 1
        for out in engine.step():
            i = rids[out.request_id]
            sampled[i] += 1
            texts[i] += out.new_text
            tokens[i] = out.num_output_tokens
            if out.finished:
                reasons[i] = out.finish_reason
                decode_steps[i] = steps
    wall = time.perf_counter() - start
    engine.check_integrity()

    valid = sum(reason == "stop" and conforms(text, SCHEMAS[name])
                for (name, _), text, reason in zip(reqs, texts, reasons))
    total = sum(tokens)
    per_schema = {}
    for name in SCHEMAS:
        idx = [i for i, (n, _) in enumerate(reqs) if n == name]
        if idx:
            per_schema[name] = {
                "decode_steps_per_output": round(statistics.mean(decode_steps[i] for i in idx), 2),
                "sampled_tokens_per_output": round(statistics.mean(sampled[i] for i in idx), 2),
                "output_tokens_per_output": round(statistics.mean(tokens[i] for i in idx), 2)}
    return {
        "engine_steps": steps,
        "decode_steps_per_output": round(statistics.mean(decode_steps), 2),
        "sampled_tokens_per_output": round(statistics.mean(sampled), 2),
        "output_tokens_per_output": round(statistics.mean(tokens), 2),
        "output_tokens": total,
        "output_tokens_per_decode_step": round(total / sum(decode_steps), 3),
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(total / wall, 1),
        "valid_outputs": valid,
        "num_requests": len(reqs),
        "per_schema": per_schema,
        "texts": texts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "default"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per mode (median wall)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "jump_forward_cpu.json"))
    args = ap.parse_args()

    reqs = workload(args.requests)
    load_before = os.getloadavg()[0]  # a shared machine: wall times depend on it
    engines = {mode: Engine(EngineConfig(
        model_path=args.model, device=args.device, dtype=args.dtype,
        enable_jump_forward=mode == "on", max_total_tokens=32768, max_running_requests=64,
        max_prefill_tokens=4096)) for mode in ("on", "off")}
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.repeat):
        for mode, engine in engines.items():
            runs[mode].append(run(engine, reqs, args.max_new_tokens))
    rows = {}
    for mode, results in runs.items():
        row = dict(results[0])
        for other in results[1:]:  # greedy: the same work every time
            assert {k: v for k, v in other.items() if k not in ("wall_s", "output_tok_per_s")} \
                == {k: v for k, v in row.items() if k not in ("wall_s", "output_tok_per_s")}
        row["wall_s_runs"] = [r["wall_s"] for r in results]
        row["wall_s"] = round(statistics.median(row["wall_s_runs"]), 3)
        row["output_tok_per_s"] = round(row["output_tokens"] / row["wall_s"], 1)
        rows[mode] = row

    on, off = rows["on"], rows["off"]
    print(f"{args.requests} requests, {len(SCHEMAS)} schemas, greedy, model {args.model} "
          f"({args.device}, {args.dtype})")
    print(f"{'jump-forward':<14}{'steps':>7}{'decode steps/out':>18}{'sampled/out':>13}"
          f"{'tokens/out':>12}{'out tokens':>12}{'tok/step':>10}{'wall s':>9}{'tok/s':>8}"
          f"{'valid':>8}")
    for name, r in rows.items():
        print(f"{name:<14}{r['engine_steps']:>7}{r['decode_steps_per_output']:>18}"
              f"{r['sampled_tokens_per_output']:>13}{r['output_tokens_per_output']:>12}"
              f"{r['output_tokens']:>12}{r['output_tokens_per_decode_step']:>10}{r['wall_s']:>9}"
              f"{r['output_tok_per_s']:>8}{r['valid_outputs']:>5}/{r['num_requests']}")
    summary = {
        "engine_steps_off_over_on": round(off["engine_steps"] / on["engine_steps"], 2),
        "decode_steps_per_output_off_over_on": round(
            off["decode_steps_per_output"] / on["decode_steps_per_output"], 2),
        "wall_speedup_on_vs_off": round(off["wall_s"] / on["wall_s"], 2),
        "identical_texts": f"{sum(a == b for a, b in zip(on['texts'], off['texts']))}/{len(reqs)}",
    }
    print("summary:", summary)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = Path(args.model).resolve()
    out.write_text(json.dumps({
        "model": str(model.relative_to(REPO)) if model.is_relative_to(REPO) else str(model),
        "device": args.device, "dtype": args.dtype,
        "machine": platform.platform(), "cpu_count": os.cpu_count(),
        "load_average_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "validated_with": "jsonschema" if jsonschema is not None else "json.loads only",
        "num_requests": args.requests, "repeat": args.repeat,
        "max_new_tokens": args.max_new_tokens, "schemas": SCHEMAS,
        "prompts": [p for _, p in reqs], "jump_forward_on": on, "jump_forward_off": off,
        "summary": summary}, indent=2, ensure_ascii=False) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
