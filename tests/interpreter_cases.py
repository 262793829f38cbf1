"""Kernel test cases run under TRITON_INTERPRET=1 in a child process.

Triton decides at its first import whether it interprets kernels, and other test modules
(xgrammar, the engine) import it earlier in the pytest process, so each kernel test
module re-runs itself as a script in a child with the variable set and reports every
case's outcome on one line of JSON.

The interpreter is slow (about five minutes of the suite's CPU time on the 2-core CI
machine) and the rest of the suite spends much of its time waiting on servers, so
``InterpreterWorkers`` starts the children in the background when collection ends, one at
a time in the order their modules will run, and a module's fixture then only collects
its child's outcome (conftest.py's ``interpreter_results``), or starts it at once when
its turn has not come. On that machine the suite went from 1,335 to 1,131 s (1,265 s in
a run beside other work). Running the kernel modules last instead, so that no test
waits for its child, was slower (1,252 s): the children then share the CPU with the
engine and server tests."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MARK = "RESULTS "


def run_cases(cases: dict) -> None:
    """In the child: run every case (each a (function, kwargs) pair) and print results."""
    results = {}
    for case_id, (fn, kwargs) in cases.items():
        try:
            with torch.no_grad():
                fn(**kwargs)
            results[case_id] = "ok"
        except Exception:  # report every case, not just the first failure
            results[case_id] = traceback.format_exc()
    print(MARK + json.dumps(results))


WORKER_TIMEOUT_S = 300


@dataclass
class _Child:
    """One test file's worker: the process and the files its output goes to (files, not
    pipes, so that any thread may wait for it without draining anything)."""
    process: subprocess.Popen
    stdout: Path
    stderr: Path


class InterpreterWorkers:
    """The interpreter children of one pytest session (conftest.py keeps one)."""

    def __init__(self, test_files: list[str]) -> None:
        self._queue = [str(Path(f).resolve()) for f in test_files]
        self.output_folder = Path(tempfile.mkdtemp(prefix="radixlm-interpreter-"))
        self._children: dict[str, _Child] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run_queue, name="interpreter-workers",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def results(self, test_file: str) -> dict:
        """``test_file``'s case results: its child's, started now if not started yet."""
        child = self._child(str(Path(test_file).resolve()))
        try:
            code = child.process.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.process.kill()
            raise AssertionError(f"{test_file}: interpreter worker still running after "
                                 f"{WORKER_TIMEOUT_S} s") from None
        out, err = child.stdout.read_text(), child.stderr.read_text()
        lines = [ln for ln in out.splitlines() if ln.startswith(MARK)]
        assert code == 0 and lines, f"worker failed:\n{out}\n{err}"
        return json.loads(lines[-1][len(MARK):])

    def started(self) -> list[str]:
        """The files whose child has started, in the order they started."""
        with self._lock:
            return list(self._children)

    def running(self) -> int:
        """How many children have not exited yet."""
        with self._lock:
            return sum(c.process.poll() is None for c in self._children.values())

    def stop(self) -> None:
        """Kill the children still running (a session cut short); remove their output."""
        with self._lock:
            self._stopped = True
            children = list(self._children.values())
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        shutil.rmtree(self.output_folder, ignore_errors=True)

    def _child(self, test_file: str, background: bool = False) -> _Child:
        with self._lock:
            if test_file not in self._children:
                if test_file in self._queue:
                    self._queue.remove(test_file)
                self._children[test_file] = self._spawn(test_file, background)
            return self._children[test_file]

    def _run_queue(self) -> None:
        while True:
            with self._lock:
                if self._stopped or not self._queue:
                    return
                test_file = self._queue[0]
            child = self._child(test_file, background=True)
            try:
                child.process.wait(timeout=WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass  # results() reports it; the queue goes on

    def _spawn(self, test_file: str, background: bool) -> _Child:
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        if background:  # leave the other core to the tests running meanwhile
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        stem = Path(test_file).stem
        stdout, stderr = self.output_folder / f"{stem}.out", self.output_folder / f"{stem}.err"
        with stdout.open("w") as out, stderr.open("w") as err:
            process = subprocess.Popen([sys.executable, test_file], cwd=REPO, env=env,
                                       stdout=out, stderr=err, text=True)
        return _Child(process, stdout, stderr)
