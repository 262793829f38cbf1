"""Kernel test cases run under TRITON_INTERPRET=1 in a child process.

Triton decides at its first import whether it interprets kernels, and other test modules
(xgrammar, the engine) import it earlier in the pytest process, so each kernel test
module re-runs itself as a script in a child with the variable set and reports every
case's outcome on one line of JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
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


def results_of(test_file: str) -> dict:
    """In pytest: run ``test_file`` as a script under the interpreter; its case results."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, test_file], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len(MARK):])
