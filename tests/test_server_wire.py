"""The server's wire contract (backend/wire.py): request parsing and response encoding
(backend/wire_outputs.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend import model_config, wire, wire_outputs
from backend.core.outputs import TokenLogprob
from backend.wire_outputs import SampleOutput


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=np.bool_)


def parse(parameters=None, **inputs):
    return wire.parse_request(inputs, parameters or {})


def test_text_request_with_sampling_parameters_tensor():
    job = parse(text_input=text("xin chào"), stream=flag(True),
                sampling_parameters=text('{"max_tokens": 5, "temperature": 0, "stop": ["\\n"]}'))
    assert isinstance(job, wire.GenerateJob)
    assert job.prompt == "xin chào" and job.stream is True
    assert job.params.max_new_tokens == 5 and job.params.temperature == 0
    assert job.params.stop == ["\n"]
    assert job.prepend_input is False  # streamed answers leave the prompt out by default


def test_plain_request_parameters_work_like_the_json_and_the_tensor_wins():
    job = parse({"max_tokens": 7, "top_k": 3, "exclude_input_in_output": True},
                text_input=text("hi"), sampling_parameters=text('{"top_k": 5}'))
    assert job.params.max_new_tokens == 7 and job.params.top_k == 5
    assert job.stream is False and job.prepend_input is False


def test_non_streamed_answers_include_the_prompt_unless_excluded():
    assert parse(text_input=text("hi")).prepend_input is True
    assert parse(text_input=text("hi"), exclude_input_in_output=flag(True)).prepend_input is False


def test_input_ids_prompt():
    job = parse(input_ids=np.array([5, 6, 7], dtype=np.int64))
    assert job.prompt == [5, 6, 7]
    # plain Python ints: the engine refuses anything that is not an int (numpy's included)
    assert all(type(t) is int for t in job.prompt)


def test_choices_make_a_score_job():
    job = parse(text_input=text("Capital of France?"), choices=text('["Paris", "Rome"]'))
    assert job == wire.ScoreJob("Capital of France?", ["Paris", "Rome"])


def test_debug_parameter_asks_for_stats_or_a_cache_flush_and_cancel_names_a_token():
    assert parse({"debug": "stats"}) == wire.StatsJob()
    assert parse({"debug": "flush_cache"}) == wire.StatsJob(flush_cache=True)
    assert parse({"cancel": "5e1f"}) == wire.CancelJob("5e1f")


def test_optional_outputs_are_asked_by_return_flags_or_by_name():
    assert parse(text_input=text("a")).outputs == frozenset()
    asked = parse({"return_num_input_tokens": True}, text_input=text("a"),
                  return_finish_reason=flag(True), return_logprobs=flag(False))
    assert asked.outputs == {wire.FINISH_REASON, wire.NUM_INPUT_TOKENS}
    named = wire.parse_request({"text_input": text("a")}, {},
                               requested=frozenset({wire.TEXT_OUTPUT, wire.OUTPUT_IDS}))
    assert named.outputs == {wire.OUTPUT_IDS}
    # Triton reports every output as requested when a request names none
    unnamed = wire.parse_request({"text_input": text("a")}, {}, requested=wire.OUTPUT_NAMES)
    assert unnamed.outputs == frozenset()
    cumulative = parse(text_input=text("a"), return_cumulative_logprob=flag(True))
    assert cumulative.params.cumulative_logprob is True  # the engine computes them then


def test_streaming_refuses_the_prompt_in_the_output_and_best_of_above_n():
    with pytest.raises(wire.InputError, match="when streaming, exclude_input_in_output = "
                                              "false is not allowed"):
        parse(text_input=text("a"), stream=flag(True), exclude_input_in_output=flag(False))
    # ...unless the prompt is to come in input_text, which a stream's text never holds
    echo = parse(text_input=text("a"), stream=flag(True), exclude_input_in_output=flag(False),
                 return_input_text=flag(True))
    assert echo.prepend_input and wire.INPUT_TEXT in echo.outputs
    with pytest.raises(wire.InputError, match=r"best_of \(3\) > n \(1\) is not supported "
                                              "when streaming"):
        parse({"best_of": 3}, text_input=text("a"), stream=flag(True))


@pytest.mark.parametrize("parameters, inputs, message", [
    ({}, {}, "missing input 'text_input'"),
    ({}, {"text_input": text("")}, "'text_input' is empty"),
    ({}, {"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one element"),
    ({}, {"text_input": np.array([b"\xff"], dtype=np.object_)}, "not valid UTF-8"),
    ({}, {"text_input": text("a"), "sampling_parameters": text("{max_tokens: 1")}, "not valid JSON"),
    ({}, {"text_input": text("a"), "sampling_parameters": text("[1]")}, "must be a JSON object"),
    ({}, {"text_input": text("a"), "sampling_parameters": text('{"beam_width": 2}')},
     "unknown sampling parameter(s): beam_width"),
    ({"max_tokens": 0}, {"text_input": text("a")}, "max_tokens must be >= 1"),
    ({"temperature": "hot"}, {"text_input": text("a")}, "temperature must be a number"),
    ({}, {"text_input": np.array([5], dtype=np.int64)}, "'text_input' must be a string"),
    ({"prompt_logprobs_start": 0}, {"text_input": text("a")},
     "unknown sampling parameter(s): prompt_logprobs_start"),
    ({"stream": "yes"}, {"text_input": text("a")}, "parameter 'stream' must be a boolean"),
    ({}, {"input_ids": np.array([], dtype=np.int64)}, "non-empty 1-D"),
    ({}, {"input_ids": np.array([1, -2], dtype=np.int64)}, "negative token id"),
    ({}, {"input_ids": np.array([1.5], dtype=np.float32)}, "must be INT64"),
    ({}, {"text_input": text("a"), "input_ids": np.array([1], dtype=np.int64)}, "not both"),
    ({}, {"text_input": text("a"), "choices": text('["ok", ""]')}, "non-empty strings"),
    ({"debug": "everything"}, {}, "parameter 'debug' must be 'stats' or 'flush_cache'"),
    ({"cancel": 5}, {}, "parameter 'cancel' must be a cancel_token string"),
])
def test_bad_requests_raise_input_error_with_a_clear_message(parameters, inputs, message):
    with pytest.raises(wire.InputError) as info:
        wire.parse_request(inputs, parameters)
    assert message in str(info.value)


def test_generation_outputs_encode_every_tensor():
    entries = [TokenLogprob(9, -0.25, {9: -0.25, 4: -1.5}, 1, "Sài", {9: "Sài", 4: "x"}),
               TokenLogprob(10, -0.5, None, 3, " Gòn")]
    out = wire_outputs.generation_outputs(
        [SampleOutput(1, "Sài Gòn", [9, 10], "stop", 2, 3, entries, -0.75)],
        outputs=frozenset(wire.OPTIONAL_OUTPUTS), num_input_tokens=4, context_ids=[8],
        input_text="prompt", cancel_token="t0k")
    assert out[wire.TEXT_OUTPUT].dtype == np.object_
    assert out[wire.TEXT_OUTPUT][0].decode("utf-8") == "Sài Gòn"
    assert out[wire.OUTPUT_IDS].dtype == np.int32 and list(out[wire.OUTPUT_IDS]) == [9, 10]
    assert out[wire.FINISH_REASON][0] == b"stop"
    for name in (wire.NUM_INPUT_TOKENS, wire.NUM_OUTPUT_TOKENS, wire.NUM_CACHED_TOKENS):
        assert out[name].dtype == np.uint32  # as the vLLM backend (and OpenAI frontend) has them
    assert [int(out[k][0]) for k in (wire.NUM_INPUT_TOKENS, wire.NUM_OUTPUT_TOKENS,
                                      wire.NUM_CACHED_TOKENS, wire.INDEX)] == [4, 2, 3, 1]
    assert out[wire.CUMULATIVE_LOGPROB].dtype == np.float32
    assert out[wire.CUMULATIVE_LOGPROB][0] == pytest.approx(-0.75)
    assert list(out[wire.CONTEXT_IDS]) == [8]
    assert (out[wire.INPUT_TEXT][0], out[wire.CANCEL_TOKEN][0]) == (b"prompt", b"t0k")
    assert json.loads(out[wire.LOGPROBS][0]) == [
        {"9": {"logprob": -0.25, "rank": 1, "decoded_token": "Sài"},
         "4": {"logprob": -1.5, "rank": 2, "decoded_token": "x"}},
        {"10": {"logprob": -0.5, "rank": 3, "decoded_token": " Gòn"}},
    ]


def test_unasked_outputs_are_left_out_and_running_samples_say_none():
    running = [SampleOutput(0, "", [], None, 0)]
    assert set(wire_outputs.generation_outputs(running, outputs=frozenset(),
                                               num_input_tokens=1, context_ids=[])) == \
        {wire.TEXT_OUTPUT}
    out = wire_outputs.generation_outputs(running, outputs=frozenset({wire.FINISH_REASON,
                                                                      wire.LOGPROBS}),
                                          num_input_tokens=1, context_ids=[])
    assert out[wire.FINISH_REASON][0] == b"None"  # the vLLM backend's str(None)
    assert out[wire.LOGPROBS][0] == b"null"  # the request asked for no logprobs


def test_every_encoded_tensor_is_declared_with_its_type():
    declared = {spec["name"]: spec["data_type"] for spec in wire.OUTPUT_SPECS}
    out = wire_outputs.generation_outputs(
        [SampleOutput(0, "a", [1], None, 1, 0, [], 0.0)], outputs=frozenset(wire.OPTIONAL_OUTPUTS),
        num_input_tokens=1, context_ids=[], prompt_logprobs=[])
    numpy_types = {np.object_: "TYPE_STRING", np.int32: "TYPE_INT32", np.uint32: "TYPE_UINT32",
                   np.float32: "TYPE_FP32"}
    every = {**out, **wire_outputs.stats_outputs({}), **wire_outputs.score_outputs([], 1, 0)}
    for name, array in every.items():
        assert declared[name] == numpy_types[array.dtype.type], name


def test_config_parameters_become_an_engine_config(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)
    config = model_config.engine_config_from_parameters({
        "model_path": "models/m", "max_total_tokens": "4096", "enable_radix_cache": "false",
        "schedule_policy": "fcfs", "context_length": "", "EXECUTION_ENV_PATH": "/x.tar.gz",
        "chat_template": "{{ messages }}",
    }, [tmp_path / "nowhere", tmp_path])
    assert config.model_path == str(tmp_path / "models" / "m")
    assert config.max_total_tokens == 4096 and config.enable_radix_cache is False
    assert config.schedule_policy == "fcfs" and config.context_length is None


def test_cuda_graphs_cover_every_running_batch_unless_capped(tmp_path):
    (tmp_path / "m").mkdir()
    base = {"model_path": str(tmp_path / "m"), "max_running_requests": "300"}
    default = model_config.engine_config_from_parameters(base, [])
    assert default.cuda_graph_max_batch is None and default.cuda_graph_batch == 300
    none = model_config.engine_config_from_parameters(dict(base, cuda_graph_max_batch="none"), [])
    assert none.cuda_graph_batch == 300
    capped = model_config.engine_config_from_parameters(dict(base, cuda_graph_max_batch="96"), [])
    assert capped.cuda_graph_batch == 96
    many = model_config.engine_config_from_parameters(dict(base, max_running_requests="2048"), [])
    assert many.cuda_graph_batch == 512  # the default's start-up bound
    with pytest.raises(ValueError, match="cuda_graph_max_batch must be at least 1"):
        model_config.engine_config_from_parameters(dict(base, cuda_graph_max_batch="0"), [])
    # extend steps: graphs up to 2048 tokens by default, any other bound, 0 for none
    assert default.cuda_graph_max_tokens == 2048
    assert model_config.engine_config_from_parameters(
        dict(base, cuda_graph_max_tokens="0"), []).cuda_graph_max_tokens == 0
    with pytest.raises(ValueError, match="cuda_graph_max_tokens must be >= 0"):
        model_config.engine_config_from_parameters(dict(base, cuda_graph_max_tokens="-1"), [])


@pytest.mark.parametrize("parameters, message", [
    ({"model_path": "/m", "max_totl_tokens": "1"}, "unknown model parameter 'max_totl_tokens'"),
    ({"model_path": "/m", "max_total_tokens": "lots"}, "max_total_tokens='lots' is not a valid"),
    ({"model_path": "/m", "enable_radix_cache": "maybe"}, "enable_radix_cache='maybe'"),
    ({"dtype": "float32"}, "must set the parameter 'model_path'"),
    ({"model_path": "missing/dir"}, "'missing/dir' not found"),
])
def test_bad_config_parameters_fail_the_load_clearly(parameters, message):
    with pytest.raises(ValueError) as info:
        model_config.engine_config_from_parameters(parameters, [])
    assert message in str(info.value)


def test_model_info_comes_from_the_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "</s>"}, "bos_token": "<s>", "chat_template": "old"}))
    (tmp_path / "chat_template.jinja").write_text("{{ new }}")
    info = model_config.read_model_info({"model_path": str(tmp_path)}, [])
    assert info == {"chat_template": "{{ new }}", "eos_token": "</s>", "bos_token": "<s>"}
    assert model_config.read_model_info({"model_path": str(tmp_path / "gone")}, []) == {}


def test_limits_bound_the_request_at_parse_time():
    from backend.core.limits import RequestLimits

    limits = RequestLimits(max_tokens=50, max_choices=2)
    with pytest.raises(wire.InputError, match="max_tokens is 51; this server allows at most 50"):
        wire.parse_request({"text_input": text("a")}, {"max_tokens": 51}, limits=limits)
    with pytest.raises(wire.InputError, match="the number of choices is 3"):
        wire.parse_request({"text_input": text("a"), "choices": text('["a", "b", "c"]')}, {},
                           limits=limits)


def test_the_stubs_parser_remembers_sampling_parameters_only_where_that_changes_nothing():
    from backend.core.limits import RequestLimits

    parser = wire.RequestParser(RequestLimits(max_tokens=50))
    prompt = {"input_ids": np.array([1, 2], dtype=np.int64)}
    first = parser.parse(prompt, {"max_tokens": 8, "temperature": 0})
    again = parser.parse(prompt, {"max_tokens": 8, "temperature": 0})
    assert again.params is first.params  # a burst's repeated keys are parsed once
    # equal values of another type are another request: False is no temperature
    with pytest.raises(wire.InputError, match="temperature must be a number"):
        parser.parse(prompt, {"max_tokens": 8, "temperature": False})
    for _ in range(2):  # a refused request is refused every time
        with pytest.raises(wire.InputError, match="max_tokens is 51"):
            parser.parse(prompt, {"max_tokens": 51})
    # the cumulative_logprob output asks the engine for logprobs: not the same parameters
    asked = parser.parse(prompt, {"max_tokens": 8, "temperature": 0,
                                  "return_cumulative_logprob": True})
    assert asked.params.cumulative_logprob and not first.params.cumulative_logprob
    stops = parser.parse(prompt, {"max_tokens": 8, "stop": ["x"]})  # lists: parsed each time
    assert stops.params.stop == ["x"]
    assert parser.parse(prompt, {"max_tokens": 8, "stop": ["x"]}).params is not stops.params


def test_a_scoring_request_may_have_an_empty_prompt_and_the_generate_id_is_not_a_key():
    assert parse(choices=text('["a", "b"]')) == wire.ScoreJob("", ["a", "b"])
    assert parse({"id": "42", "max_tokens": 3}, text_input=text("a")).params.max_new_tokens == 3


def test_the_vllm_series_are_off_unless_report_custom_metrics_asks_for_them():
    assert model_config.vllm_metrics_wanted({}) is False
    assert model_config.vllm_metrics_wanted({"REPORT_CUSTOM_METRICS": "true"}) is True
    assert model_config.vllm_metrics_wanted({"REPORT_CUSTOM_METRICS": "false"}) is False


def test_request_timeout_parameter_defaults_to_ten_minutes_and_zero_means_none():
    assert model_config.request_timeout_s({}) == 600.0
    assert model_config.request_timeout_s({"request_timeout_s": "2.5"}) == 2.5
    assert model_config.request_timeout_s({"request_timeout_s": "0"}) is None
    for bad in ("-1", "inf", "nan", "soon"):
        with pytest.raises(ValueError, match="request_timeout_s"):
            model_config.request_timeout_s({"request_timeout_s": bad})
    config = model_config.engine_config_from_parameters(
        {"model_path": "/m", "request_timeout_s": "5"}, [])  # not an engine setting
    assert config.model_path == "/m"


def test_a_requests_time_limit_is_the_shorter_of_the_models_and_the_clients():
    assert model_config.time_limit_s(False, 600.0, 0) == 600.0
    assert model_config.time_limit_s(False, 600.0, 2_500_000) == 2.5
    assert model_config.time_limit_s(False, 1.0, 2_500_000) == 1.0
    assert model_config.time_limit_s(True, 600.0, 0) is None  # a stream's client is seen
    assert model_config.time_limit_s(True, 600.0, 3_000_000) == 3.0
    assert model_config.time_limit_s(False, None, 0) is None


def test_engine_process_parameter_defaults_to_the_device_and_rejects_nonsense():
    assert model_config.engine_process_wanted({}, "cuda:1") is True
    assert model_config.engine_process_wanted({}, "cpu") is False
    assert model_config.engine_process_wanted({"engine_process": " Auto "}, "cpu") is False
    assert model_config.engine_process_wanted({"engine_process": "true"}, "cpu") is True
    assert model_config.engine_process_wanted({"engine_process": "0"}, "cuda") is False
    with pytest.raises(ValueError, match="engine_process"):
        model_config.engine_process_wanted({"engine_process": "sometimes"}, "cuda")
    # a serving parameter, not an EngineConfig field: the engine config ignores it
    config = model_config.engine_config_from_parameters({"model_path": "/m", "engine_process": "true"}, [])
    assert config.model_path == "/m"
    # several instances on one device share an engine process, CPU included
    assert model_config.engine_process_wanted({}, "cpu", instances=2) is True
    assert model_config.engine_process_wanted({"engine_process": "false"}, "cpu", instances=2) is False


def test_instances_on_device_counts_the_groups_that_place_instances_there():
    def config(*groups):
        return {"instance_group": list(groups)}

    assert model_config.instances_on_device({}, "CPU", 0) == 1
    assert model_config.instances_on_device(config({"count": 3, "kind": "KIND_CPU"}), "CPU", 0) == 3
    two_gpus = config({"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]})
    assert model_config.instances_on_device(two_gpus, "GPU", 1) == 2  # 2 on each listed GPU
    split = config({"count": 1, "kind": "KIND_GPU", "gpus": [0]},
                   {"count": 2, "kind": "KIND_GPU", "gpus": [1]})
    assert model_config.instances_on_device(split, "GPU", 0) == 1
    assert model_config.instances_on_device(split, "GPU", 1) == 2
    every_gpu = config({"count": 2, "kind": "KIND_GPU"})
    assert model_config.instances_on_device(every_gpu, "GPU", 3) == 2
    mixed = config({"count": 2, "kind": "KIND_GPU"}, {"count": 1, "kind": "KIND_CPU"})
    assert model_config.instances_on_device(mixed, "CPU", 0) == 1
