"""The same essay judge as judge.py, written with raw tritonclient calls (for the line count).

    python clients/examples/judge_raw.py --url localhost:8001
"""
from __future__ import annotations

import argparse
import json
import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.grpc as grpcclient
from jinja2.sandbox import ImmutableSandboxedEnvironment

from judge import DIMENSIONS, ESSAYS, GRADES, VERDICT_SCHEMA

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def load_template(url, model):
    client = grpcclient.InferenceServerClient(url)
    params = client.get_model_config(model, as_json=True)["config"].get("parameters", {})
    client.close()
    source = params.get("chat_template", {}).get("string_value") or CHATML
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)


def render(template, messages, partial=None):
    text = template.render(messages=messages, add_generation_prompt=partial is not None,
                           bos_token="", eos_token="")
    return text + (partial or "")


def request(url, model, prompt, params=None, choices=None):
    # The model is decoupled: even one-shot requests go over a stream, one stream per request.
    client = grpcclient.InferenceServerClient(url)
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = []

    def add(name, datatype, array):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)

    add("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_))
    add("stream", "BOOL", np.array([False]))
    add("sampling_parameters", "BYTES", np.array([json.dumps(params or {}).encode()], dtype=np.object_))
    add("exclude_input_in_output", "BOOL", np.array([True]))
    if choices is not None:
        add("choices", "BYTES", np.array([json.dumps(choices).encode()], dtype=np.object_))
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    results = []
    try:
        while True:
            result, error = responses.get()
            if error is not None:
                raise RuntimeError(f"server error: {error}")
            results.append(result)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return results
    finally:
        client.stop_stream()
        client.close()


def generate(url, model, prompt, **params):
    text = ""
    for result in request(url, model, prompt, params):
        piece = result.as_numpy("text_output")
        if piece is not None:
            text += piece[0].decode()
    return text


def select(url, model, prompt, choices):
    for result in request(url, model, prompt, choices=choices):
        raw = result.as_numpy("choice_scores")
        if raw is not None:
            scores = json.loads(raw[0].decode())
            return max(scores, key=lambda score: score["normalized_logprob"])["choice"]
    raise RuntimeError("the scoring response carried no choice_scores")


def multi_dimensional_judge(url, model, topic, essay):
    template = load_template(url, model)
    messages = [
        {"role": "system", "content": "You are a strict teacher who grades student essays."},
        {"role": "user", "content": f"Essay topic: {topic}\n\nEssay:\n{essay}"},
        {"role": "assistant", "content": "I have read the essay."},
        {"role": "user", "content": "Is the essay about its topic? Answer yes or no."},
    ]
    out = {"related": select(url, model, render(template, messages, ""), ["yes", "no"])}
    messages.append({"role": "assistant", "content": out["related"]})
    if out["related"] == "no":
        return out
    # Prefill the shared prefix once so that the three branches hit the radix cache.
    generate(url, model, render(template, messages), max_tokens=1, temperature=0.0)

    def judge_dimension(dimension):
        ask = f"Judge only the essay's {dimension.lower()}. End your judgment with END."
        branch = messages + [{"role": "user", "content": ask}]
        return generate(url, model, render(template, branch, "Judgment: "), max_tokens=48,
                        stop=["END"], temperature=0.0)

    with ThreadPoolExecutor(len(DIMENSIONS)) as pool:
        out["judgment"] = list(pool.map(judge_dimension, DIMENSIONS))
    judgments = "\n".join(f"{d}: {j.strip()}" for d, j in zip(DIMENSIONS, out["judgment"]))
    messages.append({"role": "user", "content":
                     "Merge the three judgments, summarize them, and give a letter grade."})
    answer = judgments + "\nIn summary, "
    out["summary"] = generate(url, model, render(template, messages, answer), max_tokens=48,
                              stop=["."], temperature=0.0)
    answer += out["summary"] + ".\nGrade: "
    out["grade"] = select(url, model, render(template, messages, answer), GRADES)
    messages.append({"role": "assistant", "content": answer + out["grade"]})
    messages.append({"role": "user", "content": "Return the verdict as JSON."})
    out["verdict"] = generate(url, model, render(template, messages, ""), max_tokens=128,
                              json_schema=VERDICT_SCHEMA, temperature=0.0)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="llm")
    args = parser.parse_args(argv)
    with ThreadPoolExecutor(len(ESSAYS)) as pool:
        outs = list(pool.map(lambda e: multi_dimensional_judge(args.url, args.model, *e), ESSAYS))
    for (topic, essay), out in zip(ESSAYS, outs):
        print(f"=== {essay[:50]}...")
        print("related:", out["related"])
        if out["related"] == "no":
            continue
        for dimension, judgment in zip(DIMENSIONS, out["judgment"]):
            print(f"{dimension}: {judgment.strip()!r}")
        print("summary:", repr(out["summary"]), "| grade:", out["grade"])
        print("verdict:", json.loads(out["verdict"]))


if __name__ == "__main__":
    main()
