"""benchmarks/gpu_tests.py: the record of a test run (run here on a tiny synthetic suite)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import check_header

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import pytest

def test_passes():
    pass  # a synthetic test that passes: what is checked is the record, in the parent

@pytest.mark.parametrize("v", [1, 2])
def test_fails_once(v):
    assert v == 1, "two is not one"

@pytest.mark.skip(reason="no GPU here")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_setup_error(broken):
    pass
'''


def test_record_counts_every_outcome_and_names_the_failures(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(SUITE)
    out = tmp_path / "record.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_tests", "--out", str(out), "--",
                           "-p", "no:randomly", str(tmp_path / "test_synthetic.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # pytest's: tests failed
    record = json.loads(out.read_text())
    assert next(iter(record)) == "header"
    check_header(record["header"])
    assert record["header"]["command"].endswith(f"benchmarks.gpu_tests --out {out} -- -p no:randomly "
                                                f"{tmp_path / 'test_synthetic.py'}")
    assert record["counts"] == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1}
    assert record["exit_code"] == 1 and record["duration_s"] >= 0
    failures = {(f["test"].split("::")[-1], f["when"]): f["message"] for f in record["failures"]}
    assert failures == {("test_fails_once[2]", "call"): "AssertionError: two is not one assert 2 == 1",
                        ("test_setup_error", "setup"): "RuntimeError: fixture broke"}


def test_a_run_without_a_gpu_does_not_replace_the_record():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", "import benchmarks.gpu_tests as g; g.main([])"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "pass --out" in proc.stderr
