"""Port of the vLLM backend's ci/L0_additional_outputs_vllm/additional_outputs_test.py.

Upstream sends one request per combination of stream, the five return_* inputs and the
``logprobs`` sampling key to vllm_opt, and checks each optional output: absent unless
asked, ``finish_reason`` "None" until the last response, ``cumulative_logprob`` moving
with every response, ``logprobs`` in vLLM's shape (rank-1 tokens spelling the text),
``num_input_tokens``, and ``num_output_tokens`` counting each response's own tokens.

Here the model is `llm` on the session's server. The combinations' requests are sent
together (one module fixture, one request id each) so that the engine batches them;
each parametrized test then checks its own request's responses, as upstream does one
by one. Engine-specific expectations: upstream's "the text is a sentence" (OPT writes
English) becomes "the text is our engine's greedy answer", and the last finish reason
is our engine's (16 tokens, vLLM's default length, unless the model stops first).

Upstream's full product is 1,458 requests, over five minutes of a two-core CPU. By
default the parameters run over a pairwise covering set of it (every value of each
parameter meets every value of every other in some test, plus all flags unset and all
set); RADIXLM_VLLM_CI_FULL=1 runs the full product.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

pytestmark = [pytest.mark.server, pytest.mark.slow]

FLAGS = [None, True, False]
PARAMETERS = ("stream", "return_finish_reason", "return_cumulative_logprob", "logprobs",
              "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")
VALUES = ([True, False], FLAGS, FLAGS, [None, 0, 2], FLAGS, FLAGS, FLAGS)
STREAMS = 8  # gRPC streams the combinations are spread over


def pairwise(values: tuple[list, ...]) -> list[tuple]:
    """Combinations in which every pair of values of two parameters occurs (greedy: take
    the candidate of the full product that covers the most uncovered pairs)."""
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(values)), 2)
                 for a in range(len(values[i])) for b in range(len(values[j]))}
    chosen = []
    product = list(itertools.product(*(range(len(v)) for v in values)))
    while uncovered:
        best = max(product, key=lambda c: sum((i, c[i], j, c[j]) in uncovered for i, j in
                                              itertools.combinations(range(len(c)), 2)))
        uncovered -= {(i, best[i], j, best[j]) for i, j in
                      itertools.combinations(range(len(best)), 2)}
        chosen.append(best)
    return [tuple(values[i][k] for i, k in enumerate(c)) for c in chosen]


if os.environ.get("RADIXLM_VLLM_CI_FULL") == "1":
    COMBINATIONS = list(itertools.product(*VALUES))
else:
    extremes = [(s, *[f] * 2, lp, *[f] * 3) for s in (True, False) for f in (None, True)
                for lp in (None, 2)]
    COMBINATIONS = list(dict.fromkeys(pairwise(VALUES) + extremes))


class TestAdditionalOutputs:
    _model_name = "llm"
    _sampling_parameters = {"temperature": "0", "top_p": "1"}
    _prompt = "In this example,"

    def _get_sampling_parameters(self, logprobs=None):
        sampling_parameters = self._sampling_parameters.copy()
        if logprobs is not None:
            sampling_parameters["logprobs"] = logprobs
        return sampling_parameters

    def _get_inputs(self, prompt, stream=True, sampling_parameters=None, **return_flags):
        def tensor(name, array, dtype):
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(array)
            return t

        inputs = [tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_),
                         "BYTES"),
                  tensor("stream", np.array([stream], dtype=bool), "BOOL")]
        if sampling_parameters is not None:
            inputs.append(tensor("sampling_parameters", np.array(
                [json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_), "BYTES"))
        for name, value in return_flags.items():
            if value is not None:
                inputs.append(tensor(name, np.array([value], dtype=bool), "BOOL"))
        return inputs

    def _assert_text_output_valid(self, expected_text):
        text_output = ""
        for response in self._responses:
            result, error = response["result"], response["error"]
            assert error is None
            text_output += result.as_numpy(name="text_output")[0].decode("utf-8")
        assert len(text_output) > 0, "output is empty"
        assert text_output == expected_text

    def _assert_finish_reason(self, return_finish_reason, expected_reason):
        for i in range(len(self._responses)):
            result, error = self._responses[i]["result"], self._responses[i]["error"]
            assert error is None
            finish_reason_np = result.as_numpy(name="finish_reason")
            if return_finish_reason is None or return_finish_reason is False:
                assert finish_reason_np is None
                continue
            finish_reason = finish_reason_np[0].decode("utf-8")
            if i < len(self._responses) - 1:
                assert finish_reason == "None"
            else:
                assert finish_reason == expected_reason

    def _assert_cumulative_logprob(self, return_cumulative_logprob):
        prev_cumulative_logprob = 0.0
        for response in self._responses:
            result, error = response["result"], response["error"]
            assert error is None
            cumulative_logprob_np = result.as_numpy(name="cumulative_logprob")
            if return_cumulative_logprob is None or return_cumulative_logprob is False:
                assert cumulative_logprob_np is None
                continue
            cumulative_logprob = cumulative_logprob_np[0].astype(float)
            assert cumulative_logprob != prev_cumulative_logprob
            prev_cumulative_logprob = cumulative_logprob

    def _assert_logprobs(self, stream, sampling_parameters, return_logprobs,
                         return_num_output_tokens):
        for response in self._responses:
            result, error = response["result"], response["error"]
            assert error is None
            logprobs_np = result.as_numpy(name="logprobs")
            if return_logprobs is None or return_logprobs is False:
                assert logprobs_np is None
                continue
            logprobs = json.loads(logprobs_np[0].decode("utf-8"))
            if "logprobs" not in sampling_parameters:
                assert logprobs is None
                continue
            assert isinstance(logprobs, list)
            assert len(logprobs) >= 1
            if return_num_output_tokens is True:
                num_output_tokens = result.as_numpy(name="num_output_tokens")[0].astype(int)
                assert len(logprobs) == num_output_tokens
            text_output_logprobs = ""
            for logprobs_d in logprobs:
                assert isinstance(logprobs_d, dict)
                assert 1 <= len(logprobs_d) <= sampling_parameters["logprobs"] + 1
                rank_one_found = False
                for token_id, logprob_d in logprobs_d.items():
                    assert isinstance(token_id, str)
                    assert len(logprob_d) == 3
                    assert isinstance(logprob_d["logprob"], float)
                    assert isinstance(logprob_d["rank"], int)
                    assert isinstance(logprob_d["decoded_token"], str)
                    if logprob_d["rank"] == 1:
                        assert not rank_one_found
                        rank_one_found = True
                        text_output_logprobs += logprob_d["decoded_token"]
                assert rank_one_found
            text_output = result.as_numpy(name="text_output")[0].decode("utf-8")
            if not stream:
                # exclude_input_in_output unset: the prompt leads a whole answer
                text_output_logprobs = self._prompt + text_output_logprobs
            assert text_output_logprobs == text_output

    def _assert_num_input_tokens(self, return_num_input_tokens):
        for response in self._responses:
            result, error = response["result"], response["error"]
            assert error is None
            num_input_tokens_np = result.as_numpy(name="num_input_tokens")
            if return_num_input_tokens is None or return_num_input_tokens is False:
                assert num_input_tokens_np is None
                continue
            num_input_tokens = num_input_tokens_np.astype(int)
            assert num_input_tokens > 0
            assert num_input_tokens <= len(self._prompt)

    def _assert_num_output_tokens(self, return_num_output_tokens):
        for response in self._responses:
            result, error = response["result"], response["error"]
            assert error is None
            num_output_tokens_np = result.as_numpy(name="num_output_tokens")
            if return_num_output_tokens is None or return_num_output_tokens is False:
                assert num_output_tokens_np is None
                continue
            num_output_tokens = num_output_tokens_np[0].astype(int)
            assert num_output_tokens > 0

    @pytest.mark.parametrize(", ".join(PARAMETERS), COMBINATIONS)
    def test_additional_outputs(self, all_responses, greedy_answer, stream, return_finish_reason,
                                return_cumulative_logprob, logprobs, return_logprobs,
                                return_num_input_tokens, return_num_output_tokens):
        key = (stream, return_finish_reason, return_cumulative_logprob, logprobs,
               return_logprobs, return_num_input_tokens, return_num_output_tokens)
        sampling_parameters = self._get_sampling_parameters(logprobs=logprobs)
        self._responses = all_responses[key]
        assert len(self._responses) > 0
        text, reason = greedy_answer
        self._assert_text_output_valid(text if stream else self._prompt + text)
        self._assert_finish_reason(return_finish_reason, reason)
        self._assert_cumulative_logprob(return_cumulative_logprob)
        self._assert_logprobs(stream, sampling_parameters, return_logprobs,
                              return_num_output_tokens)
        self._assert_num_input_tokens(return_num_input_tokens)
        self._assert_num_output_tokens(return_num_output_tokens)


@pytest.fixture(scope="module")
def greedy_answer(reference_engine):
    out = reference_engine.generate([TestAdditionalOutputs._prompt],
                                    {"temperature": 0, "top_p": 1})[0]
    return out.text, out.finish_reason


@pytest.fixture(scope="module")
def all_responses(triton_server) -> dict[tuple, list[dict]]:
    """Every combination's responses, keyed as the test's parameters."""
    shape = TestAdditionalOutputs()
    clients, events = [], queue.Queue()
    for _ in range(STREAMS):
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)
        client.start_stream(lambda result=None, error=None: events.put((result, error)))
        clients.append(client)
    for i, key in enumerate(COMBINATIONS):
        stream, finish, cumulative, logprobs, lp_flag, n_in, n_out = key
        sampling_parameters = shape._get_sampling_parameters(logprobs=logprobs)
        inputs = shape._get_inputs(
            shape._prompt, stream=stream, sampling_parameters=sampling_parameters,
            return_finish_reason=finish, return_cumulative_logprob=cumulative,
            return_logprobs=lp_flag, return_num_input_tokens=n_in,
            return_num_output_tokens=n_out)
        clients[i % STREAMS].async_stream_infer(shape._model_name, inputs=inputs,
                                                request_id=str(i),
                                                parameters=sampling_parameters)
    got: dict[int, list[dict]] = {i: [] for i in range(len(COMBINATIONS))}
    pending, deadline = set(got), time.monotonic() + 1200
    while pending:
        result, error = events.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert error is None, error  # every request here is valid
        rid = int(result.get_response().id)
        got[rid].append({"result": result, "error": None})
        if result.get_response().parameters["triton_final_response"].bool_param:
            pending.discard(rid)
    for client in clients:
        client.stop_stream()
        client.close()
    return {key: got[i] for i, key in enumerate(COMBINATIONS)}
