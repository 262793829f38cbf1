"""The agent-style programs of SGLang's benchmarks (tree of thought, ReAct, LLM judge,
line retrieval, generative agents, multi-chain reasoning, multi-document QA, tip
suggestion, long JSON), written as its users write them, with inline examples, against a
real tritonserver: nested forks and joins, branch variables, programs inside programs."""
from __future__ import annotations

import re

import pytest

from sglang_ports import capped, http_endpoint, sgl  # noqa: F401

pytestmark = pytest.mark.server


def propose_plan(s, question, num_branches):
    s += sgl.user("Sketch a plan for this question in one sentence. Question: " + question)
    forks = s.fork(num_branches)
    forks += sgl.assistant(sgl.gen("plan", max_tokens=256, temperature=0.3))
    return forks


def execute_plan(s, num_branches):
    s += sgl.user("Good. Now solve it with numbers, briefly.")
    forks = s.fork(num_branches)
    forks += sgl.assistant(sgl.gen("answer", max_tokens=256, temperature=0.3))
    return forks


def reflect_solution(s, num_branches):
    s += sgl.user("Score your solution from 1 to 5.")
    forks = s.fork(num_branches)
    forks += sgl.assistant(sgl.gen("score", max_tokens=256, temperature=0.3))
    return forks


def test_tree_of_thought_joins_nested_forks_into_nested_lists(capped):
    @sgl.function
    def tree_search(s, question, num_branches):
        forks_to_join = []
        plan_forks = propose_plan(s, question, num_branches)
        forks_to_join.append(plan_forks)
        sol_states = []
        for plan in plan_forks:
            forks = execute_plan(plan, num_branches)
            forks_to_join.append(forks)
            sol_states.extend(forks)
        for sol in sol_states:
            forks_to_join.append(reflect_solution(sol, num_branches))
        for f in reversed(forks_to_join):
            f.join()

    states = tree_search.run_batch([{"question": "What is 6 times 7?", "num_branches": 2}],
                                   temperature=0, backend=capped, num_threads=8,
                                   progress_bar=True)
    s = states[0]
    assert len(s["plan"]) == 2
    assert [len(xs) for xs in s["answer"]] == [2, 2]
    assert all(isinstance(x, str) for xs in s["answer"] for x in xs)
    assert [[len(scores) for scores in per_plan] for per_plan in s["score"]] == [[2, 2], [2, 2]]


def test_tree_of_thought_deep_returns_its_leaves_as_the_return_value(capped):
    @sgl.function
    def tree_search(s, question, num_branches):
        plan_forks = propose_plan(s, question, num_branches)
        sol_states = [f for plan in plan_forks for f in execute_plan(plan, num_branches)]
        return [[leaf.text() for leaf in reflect_solution(sol, num_branches)]
                for sol in sol_states]

    s = tree_search.run_batch([{"question": "What is 9 minus 4?", "num_branches": 2}],
                              temperature=0, backend=capped, num_threads=8, progress_bar=True)[0]
    leaves = [x for xs in s.ret_value for x in xs]
    assert len(leaves) == 8 and all(x.startswith(s.text()) for x in leaves)
    assert all("Score your solution from 1 to 5." in x for x in leaves)


def test_react_replay_forks_one_branch_per_step(capped):
    @sgl.function
    def webthink(s, question, triplets):
        s += "Solve the task with Thought, Action, Observation steps.\n" + question
        for i in range(1, len(triplets) + 2):
            s += "Thought " + str(i) + ":"
            ss = s.fork(1)
            ss[0] += sgl.gen(name="thought_action", max_tokens=200, stop="Observation")
            ss.join()
            if i > len(triplets):
                break
            s += (triplets[i - 1]["thought"] + "\nAction " + str(i) + ":" +
                  triplets[i - 1]["action"] + "\nObservation " + str(i) + ":" +
                  triplets[i - 1]["observation"] + "\n")

    triplets = [{"thought": " Look it up.", "action": " Search[Nile]",
                 "observation": " The Nile is in Africa."}]
    state = webthink.run_batch([{"question": "Question: Where is the Nile?\n",
                                 "triplets": triplets}], temperature=0, num_threads=8,
                               progress_bar=True)[0]
    assert state.text().endswith("Thought 1: Look it up.\nAction 1: Search[Nile]\n"
                                 "Observation 1: The Nile is in Africa.\nThought 2:")
    assert isinstance(state["thought_action"], list) and len(state["thought_action"]) == 1


DIMENSIONS = ["Content: is it accurate and on topic?", "Structure: does it flow?",
              "Grammar: is it written correctly?"]


def test_llm_judge_merges_parallel_judgements(capped):
    @sgl.function
    def multi_dimension_judge(s, article):
        s += "Judge the quality of this article strictly."
        s += "\n```\n" + article + "\n```\n\n"
        forks = s.fork(len(DIMENSIONS))
        for i in range(len(DIMENSIONS)):
            forks[i] += ("USER: Judge the article on this metric only. " + DIMENSIONS[i]
                         + ' End with "END".\nJUDGE:')
            forks[i] += sgl.gen("judgement", max_tokens=256, stop="END")
        forks.join()
        s += "My judgements by metric:\n"
        for i in range(len(DIMENSIONS)):
            s += DIMENSIONS[i].split(":")[0] + ": " + forks[i]["judgement"].strip() + "\n"
        s += "On a scale of 1 to 10, I score the article" + sgl.gen("score", max_tokens=2)

    state = multi_dimension_judge.run_batch([{"article": "Cats sleep a lot. They purr."}],
                                            temperature=0, num_threads=8, progress_bar=True)[0]
    assert len(state["judgement"]) == 3 and all("END" not in j for j in state["judgement"])
    for dimension, judgement in zip(DIMENSIONS, state["judgement"]):
        assert f"{dimension.split(':')[0]}: {judgement.strip()}\n" in state.text()
    assert state.get_meta_info("score")["completion_tokens"] <= 2


def test_line_retrieval_appends_parallel_encoded_bodies_in_order(capped):
    @sgl.function
    def line_retrieval(s, prefix, suffix, body_0, body_1, body_2, body_3):
        s += prefix + "\n"
        contexts = [body_0, body_1, body_2, body_3]
        position_ids_offset = [i * 1000 for i in range(len(contexts))]
        forks = s.fork(len(contexts), position_ids_offset)
        forks += lambda i: contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "\n" + suffix
        s += sgl.gen("answer", max_tokens=16)

    lines = [f"line {i}: REGISTER_CONTENT is <{100 + i}>" for i in range(8)]
    bodies = {f"body_{k}": "\n".join(lines[2 * k:2 * k + 2]) for k in range(4)}
    states = line_retrieval.run_batch(
        [{"prefix": "Remember these lines.", "suffix": "What is in line 5?", **bodies}],
        temperature=0, num_threads=8, progress_bar=True)
    text = states[0].text()
    assert "Remember these lines.\n" + "\n".join(lines) + "\n\nWhat is in line 5?" in text
    assert states[0].get_meta_info("answer").get("prompt_length", -1) == -1
    assert isinstance(re.findall(r"\d+", states[0]["answer"]), list)


@sgl.function
def poignancy_event(s, persona_name, persona_iss, event):
    s += "Here is " + persona_name + ".\n" + persona_iss + "\n"
    s += "Rate from 1 to 10 how poignant this event is for " + persona_name + ".\n\n"
    s += "Event: " + event + "Rate (return a number between 1 to 10):"
    s += sgl.gen(name="Rate", max_tokens=2)


@sgl.function
def generate_event_triple(s, persona_name, action):
    s += "Turn the input into (subject, predicate, object).\n"
    s += "Input: Ann is baking bread.\nOutput: (Ann, bake, bread)\n---\n"
    s += persona_name + " is " + action + ".\n(" + persona_name + ","
    s += sgl.gen(name="Triple", max_tokens=20, stop=")")


def test_generative_agents_run_one_program_after_another(capped):
    calls = [{poignancy_event: {"persona_name": "Ann", "persona_iss": "Ann is a baker.",
                                "event": "Ann won a prize. "}},
             {generate_event_triple: {"persona_name": "Bo", "action": "reading a map"}}]
    states = []
    for a in calls:
        for func, arg in a.items():
            result = func.run(**arg)
        result.sync()
        states.append(result)
    assert states[0].get_meta_info("Rate")["completion_tokens"] <= 2
    assert ")" not in states[1]["Triple"]
    assert states[1].text().endswith("(Bo," + states[1]["Triple"])


def test_multi_chain_reasoning_votes_over_parallel_chains(capped):
    num_chains = 3
    prompts = ["Think step by step.", "Break it into parts.", "Check each step."]

    @sgl.function
    def multi_chain(s, question):
        s += "Question: " + question + "\n"
        forks = s.fork(num_chains)
        for i in range(num_chains):
            forks[i] += ("Answer: " + prompts[i % num_chains] +
                         sgl.gen("chain", max_tokens=256, temperature=0.3, stop="Question"))
        forks.join()
        s += "Answer: here are some solutions; I take a majority vote.\n\n"
        for i in range(num_chains):
            s += f"Solution {i + 1}: " + forks[i]["chain"].strip() + "\n\n"
        s += "\nBy majority vote, the final answer (a single integer) is "
        s += sgl.gen("answer", max_tokens=16)

    state = multi_chain.run_batch([{"question": "What is 5 plus 8?"}], temperature=0,
                                  backend=capped, num_threads=8)[0]
    assert len(state["chain"]) == 3
    assert all(f"Solution {i + 1}: {c.strip()}\n\n" in state.text()
               for i, c in enumerate(state["chain"]))


def test_multi_document_qa_encodes_documents_inside_an_open_user_turn(capped):
    @sgl.function
    def multi_document_qa(s, docs, question):
        s += sgl.user_begin()
        s += "Answer a question from the documents.\n"
        s += "Question:" + question + "Documents begin.\n"
        forks = s.fork(len(docs))
        forks += lambda i: docs[i]
        forks.join("concate_and_append")
        s += "\nDocuments end."
        s += "\n\nAnswer this question:\n" + question + "\nAnswer in three words or fewer."
        s += sgl.user_end()
        s += sgl.assistant(sgl.gen("answer", max_tokens=16))

    docs = ["[Doc 1] The bridge opened in 1932. ", "[Doc 2] It is painted red. "]
    state = multi_document_qa.run_batch([{"docs": docs, "question": "When did it open?"}],
                                        temperature=0, num_threads=8, progress_bar=True)[0]
    user, assistant = state.messages()
    assert "Documents begin.\n" + "".join(docs) + "\nDocuments end." in user["content"]
    assert assistant == {"role": "assistant", "content": state["answer"]}


def test_tip_suggestion_runs_a_program_from_inside_a_program(capped):
    @sgl.function
    def expand_tip(s, topic, tip):
        s += "Expand a tip into a paragraph.\n\nTopic: " + topic + "\nTip: " + tip + "\nParagraph:"
        s += sgl.gen("paragraph", max_tokens=128, stop=["\n\n"], temperature=0)

    @sgl.function
    def suggest_tips(s, topic):
        s += "USER: Give tips for " + topic + ".\nASSISTANT: Here are 2 short tips:\n"
        paragraphs = []
        for i in range(1, 3):
            s += f"{i}." + sgl.gen(f"tip_{i}", max_tokens=24, stop=[".", "\n"]) + ".\n"
            paragraphs.append(expand_tip(topic=topic, tip=s[f"tip_{i}"]))
        for i in range(1, 3):
            s += f"Tip {i}:" + paragraphs[i - 1]["paragraph"] + "\n"
        return paragraphs

    state = suggest_tips.run_batch([{"topic": "saving money"}], temperature=0, num_threads=8,
                                   progress_bar=True)[0]
    for i, paragraph in enumerate(state.ret_value, start=1):
        assert paragraph.text().startswith("Expand a tip") and f"Tip: {state[f'tip_{i}']}\n" in \
            paragraph.text()
        assert f"Tip {i}:{paragraph['paragraph']}\n" in state.text()


def test_long_json_decode_fields_stop_at_the_closing_quote(capped):
    @sgl.function
    def json_decode(s, document):
        s += "Extract the city from this page.\nPage begin.\n" + document + "Page end.\n{\n"
        s += '  "name": "' + sgl.gen("name", max_tokens=8, stop='"') + '",\n'
        s += '  "air port code": "' + sgl.gen("air port code", max_tokens=8, stop='"') + '",\n'
        s += "}\n"

    state = json_decode.run_batch([{"document": "Lima is the capital of Peru."}],
                                  temperature=0, num_threads=8, progress_bar=True)[0]
    assert '"' not in state["name"] + state["air port code"]
    assert state.text().endswith(f'  "name": "{state["name"]}",\n  "air port code": '
                                 f'"{state["air port code"]}",\n}}\n')
