"""SGLang's frontend features in the language, run against the in-process FakeBackend:
variables, typed gens, logprob meta info, samples, choices methods, forks, reasoning."""
from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import pytest

try:
    import radixlm as sgl
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm as sgl

from radixlm.testing import FakeBackend


def test_var_scope_captures_the_text_appended_inside_it_including_gens():
    backend = FakeBackend(reply=lambda prompt, params: "42")

    @sgl.function
    def prog(s):
        s += "Data: "
        with s.var_scope("json"):
            s += '{"n": ' + sgl.gen("n") + "}"
        s += " done"
        s["seen_in_program"] = s["json"]

    state = prog.run(backend=backend)
    assert state["json"] == '{"n": 42}'
    assert state["seen_in_program"] == '{"n": 42}'
    assert state.text() == 'Data: {"n": 42} done'


def test_item_assignment_membership_return_value_error_and_repr():
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a")
        s["b"] = int(len(s["a"]))
        return {"answer": s["a"]}

    state = prog.run(backend=FakeBackend())
    assert (state["b"], "a" in state, "zzz" in state) == (2, True, False)
    assert state.ret_value == {"answer": "ok"}
    assert state.error() is None
    assert repr(state) == "ProgramState(xok)"


@pytest.mark.parametrize("make, regex, stop", [
    (lambda: sgl.gen_int("v"), sgl.REGEX_INT, [" ", "\n"]),
    (lambda: sgl.gen("v", dtype=float), sgl.REGEX_FLOAT, [" ", "\n"]),
    (lambda: sgl.gen("v", dtype="int", stop="!"), sgl.REGEX_INT, ["!", " ", "\n"]),
    (lambda: sgl.gen_string("v"), sgl.REGEX_STR, None),
    (lambda: sgl.gen("v", dtype=bool), sgl.REGEX_BOOL, None),
])
def test_typed_gens_send_their_types_regex_and_stops(make, regex, stop):
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += make()

    prog.run(backend=backend)
    sent = backend.calls[0][2]
    assert (sent["regex"], sent.get("stop")) == (regex, stop)


def test_a_gen_dtype_other_than_int_float_bool_str_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("v", dtype=list)


def test_min_tokens_and_stop_regex_go_out_under_their_wire_names():
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("v", min_tokens=4, max_tokens=9, stop_regex=r"\d+")

    prog.run(backend=backend)
    assert backend.calls[0][2] == {"min_tokens": 4, "max_tokens": 9, "stop_regex": [r"\d+"]}


def test_logprob_meta_info_has_sglangs_keys_as_logprob_id_text_tuples():
    backend = FakeBackend(reply=lambda prompt, params: "hi")

    @sgl.function
    def prog(s):
        s += "Q" + sgl.gen("v", return_logprob=True, top_logprobs_num=2,
                           return_text_in_logprobs=True)

    meta = prog.run(backend=backend).get_meta_info("v")
    assert backend.calls[0][2]["logprobs"] == 2
    assert meta["output_token_logprobs"] == [(-1.0, ord("h"), "h"), (-1.0, ord("i"), "i")]
    assert meta["output_top_logprobs"][0] == [(-1.0, ord("h"), "h"), (-2.0, ord("i"), "i")]
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (1, 2, 0)
    assert meta["finish_reason"] == {"type": "stop"}
    assert meta["input_token_logprobs"] == []


def test_logprob_start_len_returns_the_prompts_logprobs_and_their_mean():
    @sgl.function
    def prog(s):
        s += "abc" + sgl.gen("v", return_logprob=True, logprob_start_len=0,
                             return_text_in_logprobs=True)

    backend = FakeBackend()
    meta = prog.run(backend=backend).get_meta_info("v")
    sent = backend.calls[0][2]
    assert (sent["prompt_logprobs"], sent["logprob_start_len"]) == (0, 0)
    assert meta["input_token_logprobs"] == [(None, 97, "a"), (-0.5, 98, "b"), (-0.5, 99, "c")]
    assert meta["normalized_prompt_logprob"] == -0.5


def test_todays_logprobs_shape_without_token_text_parses_with_text_none():
    @sgl.function
    def prog(s):
        s += sgl.gen("v", return_logprob=True, top_logprobs_num=1)

    meta = prog.run(backend=FakeBackend(token_text=False)).get_meta_info("v")
    assert meta["output_token_logprobs"] == [(-1.0, ord("o"), None), (-1.0, ord("k"), None)]
    assert meta["output_top_logprobs"][1] == [(-1.0, ord("k"), None)]


def test_asking_for_token_text_the_server_does_not_send_fails_naming_the_variable():
    @sgl.function
    def prog(s):
        s += sgl.gen("v", return_logprob=True, return_text_in_logprobs=True)

    with pytest.raises(sgl.ProgramError) as info:
        prog.run(backend=FakeBackend(token_text=False))
    assert info.value.var == "v" and "return_text_in_logprobs" in info.value.message


def test_max_tokens_zero_appends_nothing_and_gives_the_next_positions_top_logprobs():
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("step0", max_tokens=0, return_logprob=True, top_logprobs_num=3,
                            return_text_in_logprobs=True)

    backend = FakeBackend(reply=lambda prompt, params: "xyz")
    state = prog.run(backend=backend)
    meta = state.get_meta_info("step0")
    assert (state.text(), state["step0"], meta["completion_tokens"]) == ("Q:", "", 0)
    assert backend.calls[0][2]["max_tokens"] == 1
    assert [t[2] for t in meta["output_top_logprobs"][0]] == ["x", "y", "z"]
    assert meta["output_token_logprobs"] == []


def test_n_samples_make_a_list_and_the_state_continues_with_the_first():
    counter = itertools.count()
    backend = FakeBackend(reply=lambda prompt, params: f"s{next(counter)}")

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("v", n=3) + "."

    state = prog.run(backend=backend)
    assert state["v"] == ["s0", "s1", "s2"]
    assert state.text() == "Q:s0."
    assert [m["index"] for m in state.get_meta_info("v")["samples"]] == [0, 1, 2]


def scorer(prompt: str, choice: str) -> list[float]:
    conditional = {"x": [-1.0], "yz": [-3.0, -0.5], "ab": [-0.1, -5.0], "c": [-1.0]}
    alone = {"x": [-1.0], "yz": [-9.0, -4.0]}
    return (alone if prompt == "" else conditional)[choice]


@pytest.mark.parametrize("choices, method, decision", [
    (["x", "yz"], sgl.token_length_normalized, "x"),
    (["x", "yz"], sgl.unconditional_likelihood_normalized, "yz"),
    (["ab", "c"], sgl.token_length_normalized, "c"),
    (["ab", "c"], sgl.greedy_token_selection, "ab"),
])
def test_select_decides_by_the_choices_method(choices, method, decision):
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.select("v", choices=choices, choices_method=method)

    meta = prog.run(backend=FakeBackend(scorer=scorer)).get_meta_info("v")
    assert prog.run(backend=FakeBackend(scorer=scorer))["v"] == decision
    assert [[t[0] for t in row] for row in meta["input_token_logprobs"]] == [
        scorer("Q:", c) for c in choices]
    assert meta["normalized_prompt_logprobs"] == [sum(scorer("Q:", c)) / len(c) for c in choices]


def test_greedy_selection_pads_a_shorter_choice_with_its_own_mean():
    decision = sgl.greedy_token_selection(
        choices=["a", "ab"], normalized_prompt_logprobs=[0, 0],
        input_token_logprobs=[[(-1.0, 1, None)], [(-1.0, 1, None), (-0.5, 2, None)]],
        output_token_logprobs=[[], []])
    assert decision.decision == "ab"  # -1.0 pads "a"; -0.5 beats it
    assert decision.meta_info["greedy_logprob_matrix"] == [[-1.0, -1.0], [-1.0, -0.5]]


def test_select_refuses_sampling_and_unknown_methods():
    with pytest.raises(ValueError, match="temperature"):
        sgl.select("v", ["a", "b"], temperature=0.7)
    with pytest.raises(TypeError, match="choices_method"):
        sgl.select("v", ["a", "b"], choices_method=max)


def test_forks_take_one_expression_per_branch_from_a_lambda_or_a_list():
    @sgl.function
    def prog(s):
        forks = s.fork(3, [0, 1000, 2000])  # SGLang's position offsets, not used
        forks += lambda i: f"<{i}>"
        forks += ["a", "b", "c"]
        forks += sgl.gen("out")
        forks.join()

    state = prog.run(backend=FakeBackend(reply=lambda prompt, params: prompt[-4:]))
    assert state["out"] == ["<0>a", "<1>b", "<2>c"]


def test_concate_and_append_inside_an_open_user_turn_keeps_the_turn_whole():
    @sgl.function
    def prog(s, docs):
        s += sgl.user_begin()
        s += "Docs:"
        forks = s.fork(len(docs))
        forks += lambda i: docs[i]
        forks.join("concate_and_append")
        s += " end"
        s += sgl.user_end()
        s += sgl.assistant(sgl.gen("answer"))

    state = prog.run(docs=["[1]", "[2]"], backend=FakeBackend())
    assert state.messages() == [{"role": "user", "content": "Docs:[1][2] end"},
                                {"role": "assistant", "content": "ok"}]


def test_text_async_iter_streams_a_variable_inside_an_event_loop():
    backend = FakeBackend(reply=lambda prompt, params: "abcdef", piece_size=2)

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("v")

    async def collect():
        state = prog.run(backend=backend, stream=True)
        return [piece async for piece in state.text_async_iter(var_name="v")]

    assert asyncio.run(collect()) == ["ab", "cd", "ef"]


@pytest.mark.parametrize("model_type, output, reasoning, answer", [
    ("qwen3", "<think>plan it</think>\n\nParis", "plan it", "Paris"),
    ("qwen3", "Paris", "", "Paris"),
    ("deepseek-r1", "plan it</think>Paris", "plan it", "Paris"),
    ("deepseek-r1", "still thinking", "still thinking", ""),
])
def test_separate_reasoning_splits_the_reasoning_from_the_answer(model_type, output,
                                                                  reasoning, answer):
    @sgl.function
    def prog(s):
        s += sgl.user("Capital of France?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("a"), model_type=model_type))

    state = prog.run(backend=FakeBackend(reply=lambda prompt, params: output))
    assert (state["a"], state["a_reasoning_content"]) == (answer, reasoning)
    assert state.messages()[-1] == {"role": "assistant", "content": answer}


def test_separate_reasoning_needs_a_known_model_type_and_a_named_gen():
    with pytest.raises(ValueError, match="model_type"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="nope")
    with pytest.raises(ValueError, match="named"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")


def test_run_batch_takes_positional_lists_a_progress_bar_and_generator_style(capsys):
    @sgl.function
    def prog(s, a, b="B"):
        s += a + b

    backend = FakeBackend()
    states = prog.run_batch([["x"], ("y", "z")], backend=backend, progress_bar=True)
    assert [s.text() for s in states] == ["xB", "yz"]
    assert "2/2" in capsys.readouterr().err
    lazy = prog.run_batch([{"a": str(i)} for i in range(4)], backend=backend,
                          generator_style=True, num_threads=2)
    assert [s.text() for s in lazy] == ["0B", "1B", "2B", "3B"]
    with pytest.raises(TypeError, match="arguments"):
        prog.run_batch([["x", "y", "z"]], backend=backend)


def test_bind_fixes_arguments_and_run_keywords_set_sampling_defaults():
    backend = FakeBackend()

    @sgl.function
    def prog(s, topic):
        s += topic + sgl.gen("v")

    prog.bind(topic="T").run(backend=backend, max_new_tokens=5, stop=(), temperature=0.2,
                             top_k=3)
    assert backend.calls[0][1] == "T"
    assert backend.calls[0][2] == {"max_tokens": 5, "temperature": 0.2, "top_k": 3}
