"""The cases of SGLang's frontend test programs (``sglang/test/test_programs.py``), written
as its users write them, against a real tritonserver. Text is gibberish with random
weights, so the tests check what must hold whatever the model says: structure, types,
constraints, choices, variables and meta info."""
from __future__ import annotations

import ast
import operator

import pytest

from sglang_ports import CappedBackend, capped, grpc_endpoint, http_endpoint, sgl  # noqa: F401

pytestmark = pytest.mark.server


def test_few_shot_qa_runs_alone_and_in_a_batch(capped):
    @sgl.function
    def few_shot_qa(s, question):
        s += "Answer each question with one word.\n\n"
        s += "Q: Which planet is called the red planet?\nA: Mars\n"
        s += "Q: What is frozen water called?\nA: Ice\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n", temperature=0)

    state = few_shot_qa.run(question="What color is a clear sky?")
    assert "\n" not in state["answer"]
    assert state.text().endswith("Q: What color is a clear sky?\nA:" + state["answer"])
    questions = ["What do bees make?", "What is the opposite of hot?", "Which animal barks?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0.1)
    for q, s in zip(questions, states):
        assert s.text().endswith(f"Q: {q}\nA:" + s["answer"]) and "\n" not in s["answer"]


def test_multi_turn_chat_builds_five_messages(capped):
    @sgl.function
    def two_questions(s, first, second):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(first)
        s += sgl.assistant(sgl.gen("answer_1"))
        with s.user():
            s += second
        with s.assistant():
            s += sgl.gen("answer_2")

    state = two_questions.run(first="Plan a day in Rome.", second="Now make it shorter.",
                              temperature=0.7, max_new_tokens=64)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [messages[2]["content"], messages[4]["content"]] == [state["answer_1"],
                                                                 state["answer_2"]]
    assert capped.asked == [64, 64]


def test_select_answers_with_the_choice_it_scores_best(capped):
    @sgl.function
    def true_or_false(s, statement):
        s += "Say whether the statement is True, False, or Unknown.\n"
        s += "Statement: Ice is cold.\nAnswer: True\n"
        s += "Statement: " + statement + "\n"
        s += "Answer:" + sgl.select("answer", ["True", "False", "Unknown"])

    for statement in ("Fire is wet.", "Cats can fly.", "Blue is nicer than red."):
        state = true_or_false.run(statement=statement)
        scores = state.get_meta_info("answer")["normalized_prompt_logprobs"]
        assert state["answer"] == ["True", "False", "Unknown"][scores.index(max(scores))]
        assert state.text().endswith("Answer:" + state["answer"])


def test_a_variable_feeds_the_next_prompt(capped):
    @sgl.function
    def expert_answer(s, question):
        s += "Question: " + question + "\n"
        s += "The best person to ask is" + sgl.gen("expert", stop=[".", "\n"]) + ".\n"
        s += "For example," + s["expert"] + " would say that " + sgl.gen("answer", stop=".") + "."

    state = expert_answer.run(question="How do tides work?", temperature=0.1)
    assert state.text().endswith(
        f"is{state['expert']}.\nFor example,{state['expert']} would say that {state['answer']}.")


def calculate(expression: str) -> str:
    """Arithmetic on integers only; anything else (a random model's gibberish) is 'invalid'."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(node)

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError):
        return "invalid"


def test_tool_use_puts_python_results_in_a_var_scope(capped):
    @sgl.function
    def tool_use(s, lhs, rhs):
        s += "Use calculate(expression) for arithmetic.\ncalculate(2+3)=5\n"
        s += f"Question: what is {lhs} times {rhs}?\n"
        s += "Answer: calculate(" + sgl.gen("expression", stop=")") + ") = "
        with s.var_scope("answer"):
            s += calculate(s["expression"])

    state = tool_use(lhs=12, rhs=34, temperature=0)
    assert ")" not in state["expression"]
    assert state["answer"] == calculate(state["expression"])
    assert state.text().endswith(f"calculate({state['expression']}) = {state['answer']}")


def test_react_loop_branches_on_selected_actions(capped):
    @sgl.function
    def react(s, question):
        s += "Question: Where was the inventor of the telephone born?\n"
        s += "Thought 1: Find the inventor.\nAction 1: Search [telephone inventor].\n"
        s += "Observation 1: Alexander Graham Bell.\nThought 2: Done.\nAction 2: Finish [Scotland].\n\n"
        s += "Question: " + question + "\n"
        for i in range(1, 4):
            s += f"Thought {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
            s += f"Action {i}: " + sgl.select(f"action_{i}", ["Search", "Finish"])
            if s[f"action_{i}"] == "Search":
                s += " [" + sgl.gen(stop="]") + "].\n"
                s += f"Observation {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
            else:
                s += " [" + sgl.gen("answer", stop="]") + "].\n"
                break

    state = react.run(question="Which river flows through Paris?", temperature=0.1)
    actions = [state[f"action_{i}"] for i in range(1, 4) if f"action_{i}" in state]
    assert actions and set(actions) <= {"Search", "Finish"}
    assert ("Finish" in actions) == ("answer" in state)
    assert actions.count("Finish") <= 1 and (actions[-1] == "Finish" or len(actions) == 3)


def test_parallel_decoding_forks_and_joins_variables(capped):
    @sgl.function
    def parallel_decoding(s, topic):
        s += "USER: Give three short tips for " + topic + ".\nASSISTANT: Here they are:\n"
        for i in range(1, 4):
            s += f"{i}." + sgl.gen(max_tokens=16, stop=[".", "\n"]) + ".\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"Expanding tip {i + 1} into a paragraph:\nTip {i + 1}:"
            forks[i] += sgl.gen("detailed_tip", 64, stop=["\n\n"])
        forks.join()
        s += "The tips, explained:\n"
        for i in range(3):
            s += f"Tip {i + 1}:" + forks[i]["detailed_tip"] + "\n"
        s += "\nIn summary," + sgl.gen("summary", max_tokens=512)

    state = parallel_decoding.run(topic="sleeping well", temperature=0.3)
    tips = state["detailed_tip"]
    assert isinstance(tips, list) and len(tips) == 3
    assert "".join(f"Tip {i + 1}:{t}\n" for i, t in enumerate(tips)) in state.text()
    assert state.text().endswith("In summary," + state["summary"])
    assert sorted(set(capped.asked)) == [16, 64, 512]


def test_parallel_encoding_appends_every_branchs_text(capped):
    @sgl.function
    def parallel_encoding(s, question, context_0, context_1, context_2):
        s += "USER: Remember these statements.\n"
        contexts = [context_0, context_1, context_2]
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Question: " + question + "\nASSISTANT:" + sgl.gen("answer", max_tokens=64)

    state = parallel_encoding.run(question="Who owns the red car?", context_0="Ann owns a bike.",
                                  context_1="Bo owns the red car.", context_2="Cy owns a boat.",
                                  temperature=0)
    assert ("Statement 0: Ann owns a bike.\nStatement 1: Bo owns the red car.\n"
            "Statement 2: Cy owns a boat.\nQuestion: ") in state.text()


def test_image_questions_are_refused_clearly(capped):
    @sgl.function
    def image_qa(s, question):
        s += sgl.user(sgl.image("example_image.png") + question)
        s += sgl.assistant(sgl.gen("answer"))

    with pytest.raises(NotImplementedError, match="text-only"):
        image_qa.run(question="What is in the picture?")


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_streamed_text_and_variable_pieces_add_up(request, transport):
    endpoint = request.getfixturevalue(f"{transport}_endpoint")
    sgl.set_default_backend(CappedBackend(endpoint))

    @sgl.function
    def qa(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer"))

    try:
        state = qa(question="Describe a beach.", stream=True)
        assert "".join(state.text_iter()) == state.text()
        state = qa(question="Describe a beach.", stream=True)
        assert "".join(state.text_iter("answer")) == state["answer"]
        assert state["answer"] and state.messages()[-1]["content"] == state["answer"]
    finally:
        sgl.set_default_backend(None)


def test_speculative_programs_run_as_ordinary_ones(capped):
    @sgl.function(num_api_spec_tokens=64)
    def character(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("Make up a character in this format:")
        s += sgl.assistant("Name: Ada.\nBirthday: May 1.\nJob: Baker.\n")
        s += sgl.user("Now a new one.")
        s += sgl.assistant("Name:" + sgl.gen("name", stop="\n") + "\nBirthday:"
                           + sgl.gen("birthday", stop="\n") + "\nJob:" + sgl.gen("job", stop="\n"))

    state = character()
    state.sync()
    assert all("\n" not in state[k] for k in ("name", "birthday", "job"))


def test_hellaswag_style_batch_of_selects(capped):
    lines = [
        {"ctx": "She picks up the kettle and", "endings": [" pours tea.", " flies away.",
                                                           " sings loudly.", " melts."]},
        {"ctx": "The dog runs to the door and", "endings": [" barks.", " reads.", " swims.",
                                                            " paints."]},
        {"ctx": "He opens the umbrella because", "endings": [" it rains.", " it is blue.",
                                                             " he is hungry.", " of cats."]},
    ]
    few_shot = "A man sits down and reads a book.\n\n"

    @sgl.function
    def few_shot_hellaswag(s, question, choices):
        s += few_shot + question
        s += sgl.select("answer", choices=choices)

    rets = few_shot_hellaswag.run_batch(
        [{"question": l["ctx"], "choices": l["endings"]} for l in lines],
        temperature=0, num_threads=64, progress_bar=True)
    preds = [lines[i]["endings"].index(rets[i]["answer"]) for i in range(len(rets))]
    assert all(0 <= p < 4 for p in preds)


