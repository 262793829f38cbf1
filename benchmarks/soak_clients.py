"""The soak's requests (benchmarks/soak.py): what each is, and one client per transport.

Each request has a transport (gRPC streamed or not, HTTP ``generate`` or
``generate_stream``), a constraint (none, regex, JSON schema, or a ``choices`` scoring
request) and a fate: it runs to its end, its client leaves mid-way (gRPC cancel, an HTTP
stream closed, an HTTP ``generate`` client that times out), or it is malformed. Each
client reports how the request ended; a request with no end within ``HANG_S`` is a hang.
"""
from __future__ import annotations

import json
import queue
import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import requests
import tritonclient.grpc as grpcclient

# A streamed response's finish_reason while its request runs (backend/wire_outputs.py)
NOT_FINISHED = "None"
# Optional outputs are sent only when asked: the soak checks reasons and token counts
RETURNED = ("return_finish_reason", "return_num_output_tokens")

MODEL = "llm"
HANG_S = 300.0
TRANSPORTS = ("grpc_stream", "grpc_whole", "http_whole", "http_stream")
CONSTRAINTS = ("none", "regex", "json_schema", "choices")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
# Rejected at intake, each for a reason of its own: (sampling parameters, prompt)
MALFORMED = (("{not json", "hi"), ('{"max_tokens": 0}', "hi"), ('{"temperature": "hot"}', "hi"),
             ('{"no_such_key": 1}', "hi"), ('{"seed": "abc"}', "hi"), ('{"n": -1}', "hi"),
             ('{"max_tokens": 4}', ""), ('{"top_p": 7}', "hi"))


@dataclass(frozen=True)
class Spec:
    index: int
    transport: str
    constraint: str
    fate: str  # "finish", "cancel" or "malformed"
    prompt: str
    params: str  # the sampling_parameters JSON text
    choices: str | None = None  # JSON list: a scoring request


@dataclass
class Result:
    spec: Spec
    outcome: str  # "final", "error", "left" (the client went away), "hang"
    detail: str = ""  # the finish reason, or the error
    num_output_tokens: int = 0
    seconds: float = 0.0


def plan(count: int, seed: int) -> list[Spec]:
    """``count`` requests: 10% cancelled, 5% malformed, a quarter of the rest constrained."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        transport = TRANSPORTS[i % len(TRANSPORTS)]
        roll = rng.random()
        fate = "malformed" if roll < 0.05 else "cancel" if roll < 0.15 else "finish"
        prompt = f"Request {i}: {rng.choice(['Tell me', 'Explain', 'List'])} " \
                 f"{rng.choice(['a fact', 'three colors', 'the plan', 'why'])}."
        constraint, choices = "none", None
        if fate == "malformed":
            params, prompt = MALFORMED[i % len(MALFORMED)]
        elif fate == "cancel":  # runs until its client leaves
            params = json.dumps({"max_tokens": 2000, "ignore_eos": True, "temperature": 0})
        else:
            constraint = rng.choice(CONSTRAINTS) if rng.random() < 0.25 else "none"
            body = {"max_tokens": rng.randint(2, 12), "temperature": rng.choice([0, 0.7]),
                    "seed": i}
            if constraint == "regex":
                body["regex"] = "[a-z]{1,6}"
            elif constraint == "json_schema":
                body["json_schema"] = SCHEMA
                body["max_tokens"] = 24
            elif constraint == "choices":
                choices = json.dumps(["yes", "no", "maybe"])
            params = json.dumps(body)
        specs.append(Spec(i, transport, constraint, fate, prompt, params, choices))
    return specs


def _grpc_inputs(spec: Spec) -> list:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    stream = spec.transport == "grpc_stream"
    inputs = [tensor("text_input", np.array([spec.prompt.encode()], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([stream]), "BOOL"),
              tensor("sampling_parameters", np.array([spec.params.encode()], dtype=np.object_),
                     "BYTES")]
    inputs += [tensor(name, np.array([True]), "BOOL") for name in RETURNED]
    if spec.choices is not None:
        inputs.append(tensor("choices", np.array([spec.choices.encode()], dtype=np.object_),
                             "BYTES"))
    return inputs


class Clients:
    """One per worker thread: a gRPC client and an HTTP session."""

    def __init__(self, http_url: str, grpc_url: str) -> None:
        self.http_url, self.grpc_url = http_url, grpc_url
        self.session = requests.Session()
        self.grpc = grpcclient.InferenceServerClient(grpc_url)

    def run(self, spec: Spec) -> Result:
        started = time.monotonic()
        runner = self._grpc if spec.transport.startswith("grpc") else \
            self._http_stream if spec.transport == "http_stream" else self._http_whole
        result = runner(spec)
        result.seconds = time.monotonic() - started
        return result

    def _grpc(self, spec: Spec) -> Result:
        events: queue.Queue = queue.Queue()
        self.grpc.start_stream(callback=lambda result=None, error=None: events.put((result, error)))
        leave_at = time.monotonic() + 0.3 if spec.fate == "cancel" else None
        try:
            self.grpc.async_stream_infer(MODEL, _grpc_inputs(spec), request_id=str(spec.index),
                                         enable_empty_final_response=True)
            deadline = time.monotonic() + HANG_S
            tokens = 0
            while True:
                wait = (leave_at or deadline) - time.monotonic()
                try:
                    result, error = events.get(timeout=max(wait, 0.0))
                except queue.Empty:
                    if leave_at is not None:  # after its first responses, or 0.3 s
                        return Result(spec, "left")
                    return Result(spec, "hang")
                if error is not None:
                    return Result(spec, "error", str(error))
                response = result.get_response()
                names = {o.name for o in response.outputs}
                if "num_output_tokens" in names:  # this response's tokens when streamed
                    tokens += int(result.as_numpy("num_output_tokens")[0])
                if response.parameters["triton_final_response"].bool_param:
                    reason = result.as_numpy("finish_reason")[0].decode() \
                        if "finish_reason" in names else ""
                    return Result(spec, "final", reason, tokens)
        finally:
            self.grpc.stop_stream(cancel_requests=True)

    def _body(self, spec: Spec, stream: bool) -> dict:
        body = {"text_input": spec.prompt, "sampling_parameters": spec.params,
                **{name: True for name in RETURNED}}
        if spec.choices is not None:
            body["choices"] = spec.choices
        if stream:
            body["stream"] = True
        return body

    def _http_whole(self, spec: Spec) -> Result:
        timeout = 0.5 if spec.fate == "cancel" else HANG_S
        try:
            r = self.session.post(f"http://{self.http_url}/v2/models/{MODEL}/generate",
                                  json=self._body(spec, False), timeout=timeout)
        except requests.Timeout:
            return Result(spec, "left" if spec.fate == "cancel" else "hang")
        answer = r.json()
        if r.status_code != 200:
            return Result(spec, "error", answer.get("error", r.text))
        tokens = answer.get("num_output_tokens", 0)
        return Result(spec, "final", answer.get("finish_reason", ""),
                      tokens if isinstance(tokens, int) else sum(tokens))

    def _http_stream(self, spec: Spec) -> Result:
        tokens = 0
        try:
            with self.session.post(f"http://{self.http_url}/v2/models/{MODEL}/generate_stream",
                                   json=self._body(spec, True), stream=True,
                                   timeout=HANG_S) as r:
                for line in r.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        return Result(spec, "error", event["error"])
                    if spec.fate == "cancel":
                        return Result(spec, "left")  # closes the connection
                    tokens += int(event.get("num_output_tokens", 0))  # this event's
                    if event.get("finish_reason", NOT_FINISHED) != NOT_FINISHED:
                        return Result(spec, "final", event["finish_reason"], tokens)
            return Result(spec, "error", "the stream ended without a final response")
        except requests.Timeout:
            return Result(spec, "hang")
        except requests.RequestException as exc:
            return Result(spec, "error", repr(exc))


def run_all(specs: list[Spec], http_url: str, grpc_url: str, workers: int,
            progress=None) -> list[Result]:
    """Every spec, ``workers`` at a time."""
    todo: queue.Queue = queue.Queue()
    for spec in specs:
        todo.put(spec)
    results: list[Result] = []
    lock = threading.Lock()

    def work() -> None:
        clients = Clients(http_url, grpc_url)
        while True:
            try:
                spec = todo.get_nowait()
            except queue.Empty:
                return
            try:
                result = clients.run(spec)
            except Exception as exc:  # noqa: BLE001 - a client failure is a finding too
                result = Result(spec, "error", f"client: {exc!r}")
            with lock:
                results.append(result)
                if progress is not None:
                    progress(len(results))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results, key=lambda r: r.spec.index)
