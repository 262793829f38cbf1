"""The frontend language's interpreter, run against the in-process FakeBackend."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

try:
    import radixlm
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
    import radixlm

from radixlm import gen, select
from radixlm.testing import FakeBackend


def echo_length(prompt, params):
    return f"<{len(prompt)}>"


def test_appends_run_in_submission_order_and_gen_sees_the_text_before_it():
    backend = FakeBackend(reply=lambda prompt, params: f"[{prompt}]")

    @radixlm.function
    def prog(s):
        s += "A"
        s += gen("x")
        s += "B"
        s += gen("y")

    state = prog.run(backend=backend)
    assert state["x"] == "[A]"
    assert state["y"] == "[A[A]B]"
    assert state.text() == "A[A]B[A[A]B]"


def test_plus_concatenates_text_and_primitives_in_order():
    backend = FakeBackend(reply=lambda prompt, params: "!")

    @radixlm.function
    def prog(s):
        s += "Q: " + gen("a") + " then " + gen("b") + "."

    assert prog.run(backend=backend).text() == "Q: ! then !."


def test_submission_does_not_wait_for_a_slow_gen_but_reading_its_variable_does():
    backend = FakeBackend(delay=0.5)
    timings = {}

    @radixlm.function
    def prog(s):
        start = time.monotonic()
        s += "question" + gen("x") + "more text"
        timings["submit"] = time.monotonic() - start
        value = s["x"]
        timings["read"] = time.monotonic() - start
        timings["value"] = value

    prog.run(backend=backend)
    assert timings["submit"] < 0.1
    assert timings["read"] >= 0.45
    assert timings["value"] == "ok"


def test_fork_branches_run_in_parallel_and_read_back_their_own_variables():
    backend = FakeBackend(reply=lambda prompt, params: prompt[-1], delay=0.5)

    @radixlm.function
    def prog(s):
        s += "shared prefix;"
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += str(i) + gen("pick")
        prog.picks = [f["pick"] for f in forks]

    start = time.monotonic()
    state = prog.run(backend=backend)
    elapsed = time.monotonic() - start
    assert backend.max_concurrent == 4
    # prefix prefill (0.5 s) + 4 parallel branches (0.5 s), not 0.5 + 4 * 0.5
    assert elapsed < 2.0
    assert prog.picks == ["0", "1", "2", "3"]
    assert state.text() == "shared prefix;"


def test_fork_prefills_the_shared_prefix_once_so_every_branch_hits_the_cache():
    backend = FakeBackend()

    @radixlm.function
    def prog(s):
        s += "a long shared prefix of text; "
        forks = s.fork(3)
        for f, word in zip(forks, ["alpha", "beta", "gamma"]):
            f += word + gen("out", max_tokens=4)
        forks.join()
        s += "done"
        prog.forks = forks

    state = prog.run(backend=backend)
    prefix = "a long shared prefix of text; "
    prefills = [c for c in backend.calls if c[2] == {"max_tokens": 1, "temperature": 0.0}]
    assert [c[1] for c in prefills] == [prefix]
    assert prog.forks.prefix_result.num_input_tokens == len(prefix)
    for branch in prog.forks:
        assert branch.get_meta_info("out")["num_cached_tokens"] >= len(prefix)
    assert state["out"] == ["ok", "ok", "ok"]  # join gathers branch variables
    assert state.text() == prefix + "done"


def test_join_concate_and_append_adds_each_branch_text_to_the_parent():
    backend = FakeBackend(reply=lambda prompt, params: prompt[-1].upper())

    @radixlm.function
    def prog(s):
        s += "P:"
        forks = s.fork(2, cache_prefix=False)
        forks[0] += "a" + gen()
        forks[1] += "b" + gen()
        forks.join(mode="concate_and_append")

    assert prog.run(backend=backend).text() == "P:aAbB"


def test_select_picks_the_highest_length_normalized_logprob_and_keeps_the_scores():
    # "maybe" has the highest total (-2.5) but the lowest per token (-0.5); "no" is -0.3/token.
    table = {"yes": [-0.4, -0.4, -0.4], "no": [-0.3, -0.3], "maybe": [-0.5] * 5}
    backend = FakeBackend(scorer=lambda prompt, choice: table[choice])

    @radixlm.function
    def prog(s):
        s += "Answer: " + select("ans", choices=["yes", "no", "maybe"]) + "."

    state = prog.run(backend=backend)
    assert state["ans"] == "no"
    assert state.text() == "Answer: no."
    meta = state.get_meta_info("ans")
    assert meta["normalized_logprobs"] == pytest.approx([-0.4, -0.3, -0.5])
    assert [s.logprob_sum for s in meta["choice_scores"]] == pytest.approx([-1.2, -0.6, -2.5])
    assert backend.calls == [("score", "Answer: ", {"choices": ["yes", "no", "maybe"]})]


def test_gen_with_choices_is_a_select():
    backend = FakeBackend(scorer=lambda prompt, choice: [-1.0] if choice == "B" else [-2.0])

    @radixlm.function
    def prog(s):
        s += gen("grade", choices=["A", "B", "C"])

    assert prog.run(backend=backend)["grade"] == "B"
    assert [c[0] for c in backend.calls] == ["score"]


def test_run_batch_of_32_programs_returns_each_states_own_variables_in_order():
    backend = FakeBackend(reply=lambda prompt, params: str(int(prompt[2:].split()[0]) * 2),
                          delay=0.05)

    @radixlm.function
    def double(s, x):
        s += f"x={x}"
        s += " -> " + gen("y", max_tokens=8)

    states = double.run_batch([{"x": i} for i in range(32)], backend=backend, num_threads=8)
    assert [s["y"] for s in states] == [str(2 * i) for i in range(32)]
    assert states[5].text() == "x=5 -> 10"
    assert 1 < backend.max_concurrent <= 8


def test_a_server_error_names_the_variable_and_carries_the_server_message():
    def fail(prompt, params):
        return "invalid regex '(': missing )" if params.get("regex") == "(" else None

    backend = FakeBackend(fail=fail)

    @radixlm.function
    def prog(s):
        s += gen("fine")
        s += gen("bad", regex="(")
        s += gen("after")

    with pytest.raises(radixlm.ProgramError) as info:
        prog.run(backend=backend)
    assert info.value.var == "bad"
    assert info.value.message == "invalid regex '(': missing )"
    assert "'bad'" in str(info.value)

    state = prog.run(backend=backend, stream=True)
    assert state["fine"] == "ok"
    with pytest.raises(radixlm.ProgramError, match="bad"):
        state["after"]  # skipped once 'bad' failed
    assert len([c for c in backend.calls if c[2].get("regex")]) == 2


def test_one_failing_program_in_a_batch_does_not_stop_the_others():
    backend = FakeBackend(fail=lambda prompt, params: "boom" if "3" in prompt else None)

    @radixlm.function
    def prog(s, i):
        s += str(i) + gen("out")

    states = prog.run_batch([{"i": i} for i in range(5)], backend=backend)
    assert [s.error().var if s.error() else s["out"] for s in states] == [
        "ok", "ok", "ok", "out", "ok"]
    with pytest.raises(radixlm.ProgramError, match="boom"):
        states[3].text()


def test_streaming_yields_a_variables_pieces_as_they_are_produced():
    backend = FakeBackend(reply=lambda prompt, params: "streamed words", piece_size=3)

    @radixlm.function
    def prog(s):
        s += "Say: " + gen("speech") + " end"

    state = prog.run(backend=backend, stream=True)
    pieces = list(state.text_iter("speech"))
    assert pieces == ["str", "eam", "ed ", "wor", "ds"]
    assert "".join(state.text_iter()) == "Say: streamed words end"


def test_run_level_sampling_defaults_apply_to_every_gen_unless_overridden():
    backend = FakeBackend()

    @radixlm.function
    def prog(s):
        s += gen("a") + gen("b", temperature=0.7, stop="\n")

    prog.run(backend=backend, temperature=0.0, max_new_tokens=16)
    assert [c[2] for c in backend.calls] == [
        {"temperature": 0.0, "max_tokens": 16},
        {"temperature": 0.7, "max_tokens": 16, "stop": ["\n"]},
    ]


def test_reading_a_variable_that_was_never_submitted_is_a_key_error():
    @radixlm.function
    def prog(s):
        s += "text"

    state = prog.run(backend=FakeBackend())
    with pytest.raises(KeyError, match="missing"):
        state["missing"]


def test_default_backend_is_used_when_none_is_passed():
    backend = FakeBackend(reply=lambda prompt, params: "default")
    radixlm.set_default_backend(backend)
    try:
        @radixlm.function
        def prog(s):
            s += gen("v")

        assert prog.run()["v"] == "default"
    finally:
        radixlm.set_default_backend(None)


def test_worker_threads_end_when_their_queue_drains():
    before = threading.active_count()

    @radixlm.function
    def prog(s):
        forks = s.fork(5)
        for f in forks:
            f += gen("x")
        forks.join()

    prog.run_batch([{}] * 10, backend=FakeBackend())
    time.sleep(0.1)
    assert threading.active_count() <= before
