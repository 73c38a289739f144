"""Run a test file again under Triton's interpreter (kernels on CPU tensors).

`TRITON_INTERPRET` must be set before Triton decorates a kernel, so a test module re-runs
itself in a fresh interpreter with TRITON_INTERPRET=1 and QMOE_BACKEND=triton; there its
`inside`-marked tests run and the launcher test skips.
"""
import os
import re
import subprocess
import sys

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETING, reason="runs inside the TRITON_INTERPRET=1 subprocess")
launcher = pytest.mark.skipif(INTERPRETING, reason="this is the subprocess")


def run_under_interpreter(test_file: str) -> subprocess.CompletedProcess:
    """pytest `test_file` in a subprocess with the interpreter and the kernels forced on."""
    env = dict(os.environ, TRITON_INTERPRET="1", QMOE_BACKEND="triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(test_file)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)


def assert_passed_under_interpreter(test_file: str, summary: str) -> None:
    """run_under_interpreter(test_file) exits 0, and its pytest summary matches the regex `summary`
    (how many tests ran there, so a subprocess that collected nothing does not pass)."""
    proc = run_under_interpreter(test_file)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(summary, proc.stdout), proc.stdout[-2000:]
