"""The kernel modules' interpreter children (interpreter_cases.InterpreterWorkers): a
queued file runs in the background and its outcome is collected later; a file asked for
before its turn starts at once; a failing child fails its module with its own output; a
session cut short leaves no child running and no output behind."""
from __future__ import annotations

import json
import time

import pytest

from interpreter_cases import MARK, InterpreterWorkers


def _script(folder, name: str, body: str):
    path = folder / name
    path.write_text(body)
    return path


def _reporting(folder, name: str, results: dict, delay_s: float = 0.0):
    return _script(folder, name, f"import time\ntime.sleep({delay_s})\n"
                                 f"print({MARK + json.dumps(results)!r})\n")


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_queued_files_run_in_the_background_one_at_a_time_and_are_collected_later(tmp_path):
    first = _reporting(tmp_path, "first.py", {"a": "ok"}, delay_s=0.5)
    second = _reporting(tmp_path, "second.py", {"b": "boom"})
    workers = InterpreterWorkers([str(first), str(second)])
    try:
        workers.start()
        _wait_for(lambda: workers.started() == [str(first)])
        assert workers.running() == 1  # the second waits for the first
        # both run without being asked for
        _wait_for(lambda: len(workers.started()) == 2 and workers.running() == 0)
        assert workers.results(str(first)) == {"a": "ok"}
        assert workers.results(str(second)) == {"b": "boom"}
    finally:
        workers.stop()


def test_a_file_asked_for_before_its_turn_starts_at_once(tmp_path):
    slow = _reporting(tmp_path, "slow.py", {"x": "ok"}, delay_s=30)
    quick = _reporting(tmp_path, "quick.py", {"y": "ok"})
    workers = InterpreterWorkers([str(slow), str(quick)])
    try:
        workers.start()
        started = time.monotonic()
        assert workers.results(str(quick)) == {"y": "ok"}
        assert time.monotonic() - started < 20  # did not wait for the slow one
    finally:
        workers.stop()


def test_a_failing_child_fails_with_its_own_output(tmp_path):
    broken = _script(tmp_path, "broken.py", "import sys\nprint('partial')\n"
                                            "sys.exit('the worker could not start')\n")
    workers = InterpreterWorkers([])
    try:
        with pytest.raises(AssertionError, match="(?s)partial.*the worker could not start"):
            workers.results(str(broken))
    finally:
        workers.stop()


def test_stop_kills_a_running_child_and_removes_its_output(tmp_path):
    slow = _reporting(tmp_path, "slow.py", {"x": "ok"}, delay_s=60)
    workers = InterpreterWorkers([str(slow)])
    workers.start()
    _wait_for(lambda: workers.running() == 1, timeout_s=10)
    folder = workers.output_folder
    assert any(folder.iterdir())
    workers.stop()
    assert workers.running() == 0
    assert not folder.exists()
