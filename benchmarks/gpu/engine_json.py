"""bench_engine's ``json`` mode: JSON-schema-constrained decoding of three schemas, tok/s and
the fraction of outputs that parse and conform."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from engine_driver import drive, reset_cache  # noqa: E402


JSON_SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"}},
        "required": ["name", "age", "active"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "priority": {"enum": ["low", "normal", "high"]}},
        "required": ["id", "items", "priority"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "day": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["work", "home", "travel", "misc"]}},
        "confirmed": {"type": "boolean"}},
        "required": ["title", "day", "tags", "confirmed"], "additionalProperties": False},
}


def conforms(value, schema) -> bool:
    """Enough of JSON Schema for JSON_SCHEMAS (jsonschema is not on the GPU machine)."""
    if "enum" in schema:
        return value in schema["enum"]
    t = schema.get("type")
    if t == "object":
        if not isinstance(value, dict):
            return False
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(conforms(value[k], props[k]) for k in value if k in props)
    if t == "array":
        return isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30) \
            and all(conforms(v, schema.get("items", {})) for v in value)
    if t == "string":
        import re
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30) \
            and (("pattern" not in schema) or re.search(schema["pattern"], value) is not None)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool) \
            and schema.get("minimum", -1 << 62) <= value <= schema.get("maximum", 1 << 62)
    if t == "boolean":
        return isinstance(value, bool)
    return True


def mode_json(ctx):
    eng, rec, args, budget, SP = ctx["eng"], ctx["rec"], ctx["args"], ctx["budget"], ctx["SP"]
    name = "3schemas"
    if rec.is_done("json", name):
        return
    if not budget.allows(ctx["min_item_s"]):
        rec.write("json", name, status="skipped", error="time budget")
        return
    try:
        per = 2 if args.quick else 32
        n_out = 192
        names = list(JSON_SCHEMAS)
        texts = {k: json.dumps(v) for k, v in JSON_SCHEMAS.items()}
        # compile once, untimed (and warm the constrained path)
        t = time.perf_counter()
        warm = C.random_prompts(len(names), 16, C.hash_seed("json-warm"))
        drive(eng, [0.0] * len(names), warm,
              [SP(max_new_tokens=n_out, temperature=0.0, json_schema=texts[k]) for k in names])
        compile_and_warm_s = time.perf_counter() - t
        kinds = [names[i % len(names)] for i in range(per * len(names))]
        prompts = C.random_prompts(len(kinds), 32, C.hash_seed("json"))
        params = [SP(max_new_tokens=n_out, temperature=0.0, json_schema=texts[k]) for k in kinds]
        reset_cache(eng)
        reqs, wall = drive(eng, [0.0] * len(kinds), prompts, params, keep_text=True)
        m = C.summarize(reqs)
        valid, per_schema = 0, {}
        for k, r in zip(kinds, reqs):
            ok = False
            try:
                ok = conforms(json.loads(r.get("text", "")), JSON_SCHEMAS[k])
            except (ValueError, TypeError):
                ok = False
            valid += ok
            s = per_schema.setdefault(k, {"n": 0, "valid": 0, "out_tokens": 0})
            s["n"] += 1
            s["valid"] += ok
            s["out_tokens"] += r["n_out"]
        reasons: dict = {}
        for r in reqs:
            reasons[r.get("finish_reason")] = reasons.get(r.get("finish_reason"), 0) + 1
        m.update(valid_fraction=round(valid / len(reqs), 4), per_schema=per_schema,
                 finish_reasons=reasons, compile_and_warm_s=round(compile_and_warm_s, 3),
                 jump_forward=getattr(eng.config, "enable_jump_forward", None),
                 mean_output_tokens=round(m["output_tokens"] / max(m["n_completed"], 1), 2),
                 sample_text=(reqs[0].get("text") or "")[:200])
        rec.write("json", name, m, status="ok" if m["n_completed"] == len(reqs) else "truncated")
    except Exception as exc:  # noqa: BLE001
        rec.write("json", name, status="error", error=C.error_text(exc))
