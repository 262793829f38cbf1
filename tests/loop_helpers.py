"""A scripted engine behind the EngineHandle calls and a recording response sink, for
tests of the serving loop (backend/serving.py) without a model or Triton."""
from __future__ import annotations

import threading
import time

from backend import wire
from backend.core.handle import OutputBatch, ScoreRequest
from backend.core.outputs import ChoiceScore, StepOutput
from backend.core.sampling_params import SamplingParams


class ScriptedEngine:
    """Each step emits one token ``t<k>`` (text ``"<k> "``) per unfinished sample."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reqs: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.streamed: dict[str, bool] = {}  # request id -> the stream flag it was added with
        self.fail_next_step = False
        self.refused: list[StepOutput] = []  # refusals, returned with the next batch

    def add_request(self, prompt, params, request_id, stream=True):
        self.streamed[request_id] = stream
        if prompt == "too long":
            raise ValueError("prompt has 9999 tokens; the context length is 64")
        if prompt == "slow reject":  # tracked by the loop for a moment, then refused
            time.sleep(0.002)
            raise ValueError("rejected")
        with self.lock:
            self.reqs[request_id] = {"params": params, "made": [0] * params.num_samples,
                                     "abort": False, "score": None}
        return request_id

    def add_score_request(self, prompt, choices, request_id):
        with self.lock:
            self.reqs[request_id] = {"params": SamplingParams(max_new_tokens=1), "made": [0],
                                     "abort": False, "score": choices}
        return request_id

    def abort(self, rid):
        with self.lock:
            self.aborted.append(rid)
            if rid in self.reqs:
                self.reqs[rid]["abort"] = True

    def has_work(self):
        return bool(self.reqs)

    def wait_for_work(self, timeout):
        time.sleep(min(timeout, 0.005))
        return self.has_work()

    def step(self):
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("kernel exploded")
        time.sleep(0.002)
        outs = []
        with self.lock:
            for rid, r in list(self.reqs.items()):
                if r["score"] is not None:
                    scores = [ChoiceScore(c, -1.0 * (i + 1), 2, [-0.5, -0.5 * (i + 1)])
                              for i, c in enumerate(r["score"])]
                    outs.append(StepOutput(request_id=rid, finished=True, finish_reason="stop",
                                           num_prompt_tokens=3, choice_scores=scores))
                    del self.reqs[rid]
                    continue
                for i, made in enumerate(r["made"]):
                    if made < 0:
                        continue
                    if r["abort"]:
                        outs.append(StepOutput(request_id=rid, index=i, finished=True,
                                               finish_reason="abort", num_prompt_tokens=3,
                                               num_output_tokens=made))
                        r["made"][i] = -1
                        continue
                    made += 1
                    done = made >= r["params"].max_new_tokens
                    # with best_of, sample i's tokens are 100 i + k, and the later samples
                    # are the likelier: cumulative logprob -k (n - i)
                    token = made + (100 * i if r["params"].best_of else 0)
                    cumulative = -made * (len(r["made"]) - i) \
                        if r["params"].wants_token_logprobs else None
                    outs.append(StepOutput(request_id=rid, index=i, new_token_ids=[token],
                                           new_text=f"{token} ", finished=done,
                                           finish_reason="length" if done else None,
                                           num_prompt_tokens=3, num_cached_tokens=1,
                                           num_output_tokens=made, context_token_ids=[token - 1],
                                           cumulative_logprob=cumulative))
                    r["made"][i] = -1 if done else made
                if all(m < 0 for m in r["made"]):
                    del self.reqs[rid]
        return outs

    def stats(self):
        return {"num_running": len(self.reqs), "num_waiting": 0}

    def check_integrity(self):
        pass

    def flush_cache(self):
        return 7

    # the EngineHandle the loop uses, over the script above
    def submit(self, request):
        try:
            if isinstance(request, ScoreRequest):
                self.add_score_request(request.prompt, request.choices, request.request_id)
            else:
                self.add_request(request.prompt, request.params, request.request_id,
                                 request.stream)
        except ValueError as exc:
            with self.lock:
                self.refused.append(StepOutput.refusal(request.request_id, str(exc)))

    def next_outputs(self, timeout_s):
        with self.lock:
            refused, self.refused = self.refused, []
        if not self.reqs:
            time.sleep(min(timeout_s, 0.005))
            return OutputBatch(refused, time.time())
        try:
            return OutputBatch(refused + self.step(), time.time())
        except RuntimeError as exc:
            return OutputBatch(refused, time.time(), step_error=f"engine error: {exc}")

    def prompt_text(self, token_ids):
        return " ".join(map(str, token_ids))

    def close(self, timeout_s=10.0):
        pass


class RecordingSink:
    wanted = None  # every output

    def __init__(self) -> None:
        self.responses: list[tuple[dict, bool]] = []
        self.errors: list[tuple[str, bool]] = []
        self.cancelled = False
        self.closed = threading.Event()
        self.calls_after_final = 0  # Triton frees a request's sender at its final response

    def send(self, outputs, final):
        self.calls_after_final += self.closed.is_set()
        self.responses.append((outputs, final))
        if final:
            self.closed.set()

    def send_error(self, message, cancelled=False):
        self.calls_after_final += self.closed.is_set()
        self.errors.append((message, cancelled))
        self.closed.set()

    def is_cancelled(self):
        self.calls_after_final += self.closed.is_set()
        time.sleep(0.0002)  # an IPC round trip: the final may be sent meanwhile
        return self.cancelled

    def texts(self):
        return [o[wire.TEXT_OUTPUT][0].decode() for o, _ in self.responses]


EVERY_OUTPUT = frozenset(wire.OPTIONAL_OUTPUTS) - {wire.INPUT_TEXT, wire.CANCEL_TOKEN}


def generate(prompt="hi", stream=True, prepend=False, outputs=EVERY_OUTPUT, **params):
    return wire.GenerateJob(prompt, SamplingParams(**params), stream, prepend, outputs)


def entries(out):
    """(index, ids, finish_reason) of each sample entry of one response."""
    ids, start, found = list(out[wire.OUTPUT_IDS]), 0, []
    for k, count in enumerate(out[wire.NUM_OUTPUT_TOKENS]):
        found.append((int(out[wire.INDEX][k]), ids[start:start + count],
                      out[wire.FINISH_REASON][k].decode()))
        start += count
    return found


def ids_of(sink, index=None):
    return [i for o, _ in sink.responses for k, ids, _ in entries(o)
            if index is None or k == index for i in ids]
