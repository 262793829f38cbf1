"""SGLang's frontend examples (``examples/frontend_language``: quick start, choices with
logprobs, CoT decoding, README examples, parallel samples, streaming, non-ASCII regexes,
multi-stage forks, n samples), written as its users write them, against a real
tritonserver."""
from __future__ import annotations

import asyncio
import re

import pytest

from sglang_ports import capped, http_endpoint, sgl  # noqa: F401

pytestmark = pytest.mark.server


def test_quick_start_completion_single_stream_and_batch(capped):
    @sgl.function
    def few_shot_qa(s, question):
        s += "Questions with answers.\nQ: Largest ocean?\nA: Pacific\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n", temperature=0)

    state = few_shot_qa.run(question="Smallest planet?")
    assert state.text().endswith("Q: Smallest planet?\nA:" + state["answer"])
    streamed = few_shot_qa.run(question="Smallest planet?", stream=True)
    assert "".join(streamed.text_iter("answer")) == streamed["answer"] == state["answer"]
    states = few_shot_qa.run_batch([{"question": "Tallest animal?"}, {"question": "Hot or cold?"}])
    assert [s.text().count("Q: ") for s in states] == [2, 2]


def test_quick_start_chat_messages_stream_and_batch(capped):
    @sgl.function
    def multi_turn_question(s, question_1, question_2):
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1", max_tokens=256))
        s += sgl.user(question_2)
        s += sgl.assistant(sgl.gen("answer_2", max_tokens=256))

    args = {"question_1": "Name a fruit.", "question_2": "Name a color."}
    state = multi_turn_question.run(**args)
    assert [m["role"] for m in state.messages()] == ["user", "assistant"] * 2
    assert state.messages()[1]["content"] == state["answer_1"]
    streamed = multi_turn_question.run(**args, stream=True)
    assert "".join(streamed.text_iter()) == streamed.text()
    states = multi_turn_question.run_batch([args, {"question_1": "Hi.", "question_2": "Bye."}])
    assert [len(s.messages()) for s in states] == [4, 4]


def test_choices_expose_each_choices_token_logprobs(capped):
    @sgl.function
    def tool_use(s, question):
        s += "To answer this question: " + question + ", "
        s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"])

    state = tool_use.run("What is 5 + 5?")
    meta = state.get_meta_info("tool")
    assert state["tool"] in ("calculator", "search engine")
    assert len(meta["input_token_logprobs"]) == 2
    for tokens, mean in zip(meta["input_token_logprobs"], meta["normalized_prompt_logprobs"]):
        assert tokens and sum(t[0] for t in tokens) / len(tokens) == pytest.approx(mean)
    states = tool_use.run_batch([{"question": "Who is Ada Lovelace?"}, {"question": "2*3?"}])
    assert all(len(s.get_meta_info("tool")["input_token_logprobs"]) == 2 for s in states)


@sgl.function
def cot_decoding(s, question, get_top_k, with_text):
    s += sgl.user("Question: " + question + "\nAnswer:")
    s += sgl.assistant_begin()
    step_0 = s.fork(1)[0]
    forks = s.fork(get_top_k)
    step_0 += sgl.gen("get_top_k", max_tokens=0, return_logprob=True,
                      top_logprobs_num=get_top_k, return_text_in_logprobs=with_text)
    logprobs = step_0.get_meta_info("get_top_k")["output_top_logprobs"][0]
    for f, (logprob, token_id, text) in zip(forks, logprobs):
        f += text if with_text else ""
        f += sgl.gen("answer", temperature=0, max_tokens=1024, return_logprob=True,
                     top_logprobs_num=2, return_text_in_logprobs=with_text)
    return logprobs, forks


def test_cot_decoding_branches_on_the_first_tokens_top_logprobs(capped):
    state = cot_decoding.run(question="How many legs do 3 cats have?", get_top_k=3,
                             with_text=False)
    first, forks = state.ret_value
    assert len(first) == 3 and [t[0] for t in first] == sorted((t[0] for t in first),
                                                              reverse=True)
    assert all(isinstance(t[1], int) for t in first)
    for f in forks:
        top = f.get_meta_info("answer")["output_top_logprobs"]
        assert top and all(len(pair) == 2 and pair[0][0] >= pair[1][0] for pair in top)


def test_cot_decoding_with_token_text_branches_on_each_tokens_text(capped):
    state = cot_decoding.run(question="How many legs do 3 cats have?", get_top_k=3,
                             with_text=True)
    first, forks = state.ret_value
    assert len(first) == 3 and all(isinstance(t[2], str) for t in first)
    for (_, _, text), f in zip(first, forks):  # each branch continues with its token's text
        assert f.text().endswith(text + f["answer"])


def test_readme_examples(capped):
    @sgl.function
    def tool_use(s, question):
        s += "To answer this question: " + question + ". "
        s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
        if s["tool"] == "calculator":
            s += "The math expression is" + sgl.gen("expression")
        elif s["tool"] == "search engine":
            s += "The key word to search is" + sgl.gen("word")

    @sgl.function
    def tip_suggestion(s):
        s += "Two tips for staying healthy: 1. Sleep. 2. Walk.\n\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Now, expand tip {i + 1} into a paragraph:\n"
            f += sgl.gen("detailed_tip", max_tokens=256, stop="\n\n")
        s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
        s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
        s += "In summary" + sgl.gen("summary")

    state = tool_use.run(question="What is the capital of Chile?")
    assert ("expression" in state) == (state["tool"] == "calculator") != ("word" in state)
    state = tip_suggestion.run()
    assert "detailed_tip" not in state  # the forks were read, never joined
    assert state.text().endswith("In summary" + state["summary"])

    @sgl.function
    def text_qa(s, question):
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n")

    states = text_qa.run_batch([{"question": "Capital of Spain?"}, {"question": "Of Peru?"}],
                               progress_bar=True)
    assert all("\n" not in s["answer"] for s in states)
    state = text_qa.run(question="Capital of Italy?", temperature=0.1, stream=True)
    assert "".join(state.text_iter()) == state.text()


def test_parallel_sample_gathers_each_branchs_variables(capped):
    @sgl.function
    def parallel_sample(s, question, n):
        s += "Question: Compute 1 + 2\nReasoning: Use a calculator.\nTool: calculator\nAnswer: 3\n"
        s += "Question: " + question + "\n"
        forks = s.fork(n)
        forks += "Reasoning:" + sgl.gen("reasoning", stop="\n") + "\n"
        forks += "Tool:" + sgl.gen("tool", choices=["calculator", "browser"]) + "\n"
        forks += "Answer:" + sgl.gen("answer", stop="\n") + "\n"
        forks.join()

    state = parallel_sample.run(question="Compute 5 + 2 + 4.", n=3, temperature=1.0)
    for i in range(3):
        assert state["tool"][i] in ("calculator", "browser")
        assert "\n" not in state["reasoning"][i] + state["answer"][i]


def test_streaming_a_variable_with_and_without_asyncio(capped):
    @sgl.function
    def multi_turn_question(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1", max_tokens=256))
        s += sgl.user(question_2)
        s += sgl.assistant(sgl.gen("answer_2", max_tokens=256))

    args = {"question_1": "Name a city.", "question_2": "Name a river.", "stream": True}
    state = multi_turn_question.run(**args)
    assert "".join(state.text_iter(var_name="answer_2")) == state["answer_2"]

    async def async_stream():
        state = multi_turn_question.run(**args)
        pieces = [out async for out in state.text_async_iter(var_name="answer_2")]
        return pieces, state["answer_2"]

    pieces, answer = asyncio.run(async_stream())
    assert "".join(pieces) == answer


def test_a_non_ascii_regex_constrains_the_whole_output(http_endpoint):
    character_regex = (r"""\{\n    "姓名": "[^"]{1,8}",\n"""
                       r"""    "学院": "(格兰芬多|赫奇帕奇|拉文克劳|斯莱特林)",\n"""
                       r"""    "存活": "(存活|死亡)"\n\}""")

    @sgl.function
    def character_gen(s, name):
        s += name + " 是一名小说中的角色。请填写这个角色的信息。\n"
        s += sgl.gen("json_output", max_tokens=256, regex=character_regex)

    state = character_gen.run(name="赫敏", temperature=0, backend=http_endpoint)
    assert re.fullmatch(character_regex, state["json_output"]), state["json_output"]


def test_multi_stage_fork_synthesizes_unjoined_branch_variables(capped):
    companies = {"AAA": "Makes chips.", "BBB": "Makes boats.", "CCC": "Makes bread."}

    @sgl.function
    def industry_sweep(s, sector_context, companies, research_question):
        s += sector_context + "\n" + "Research question: " + research_question + "\n\n"
        tickers = list(companies.keys())
        forks = s.fork(len(tickers))
        for i, ticker in enumerate(tickers):
            forks[i] += f"--- Company: {ticker} ---\n{companies[ticker]}\n\n"
            forks[i] += sgl.gen(f"analysis_{ticker}", max_tokens=400, stop="\n\n",
                                temperature=0.3)
        s += "Per-company analyses gathered:\n"
        for i, ticker in enumerate(tickers):
            s += f"\n[{ticker}] " + forks[i][f"analysis_{ticker}"]
        s += "\n\nFinal ranking:\n" + sgl.gen("sector_pick", max_tokens=400, temperature=0.2)

    state = industry_sweep.run(sector_context="Small manufacturers.", companies=companies,
                               research_question="Which grows fastest?")
    text = state.text()
    positions = [text.index(f"\n[{t}] ") for t in companies]
    assert positions == sorted(positions) and text.endswith(state["sector_pick"])


def test_n_samples_make_a_list_variable(capped):
    @sgl.function
    def multi_turn_question(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1", max_tokens=1024, n=2))
        s += sgl.user(question_2)
        s += sgl.assistant(sgl.gen("answer_2", max_tokens=1024))

    for state in multi_turn_question.run_batch(
            [{"question_1": "Name a tree.", "question_2": "Name a bird."}] * 2,
            temperature=1.0):
        assert isinstance(state["answer_1"], list) and len(state["answer_1"]) == 2
        assert isinstance(state["answer_2"], str)
        assert state.messages()[2]["content"] == state["answer_1"][0]
