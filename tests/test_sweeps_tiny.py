"""The GPU sweeps that have a --tiny mode still run end to end (tiny shapes, the Triton kernels
under the interpreter, no timing), so a change elsewhere that breaks one shows here rather than
on the GPU: every row that needs no GPU runs and gives the reference variant's bits, and the
Gluon variants, which need one, are recorded as errors instead of stopping the sweep."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sweep(module: str, out: Path, *args: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", QMOE_BACKEND="triton",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", module, "--tiny", "--out", str(out), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())["rows"]


def test_block_cast_sweep(tmp_path):
    rows = _sweep("benchmarks.sweep_block_cast", tmp_path / "cast.json")
    plain = [r for r in rows if r["variant"] in ("triton", "dispatched")]
    assert len(plain) == 2 * 3 * 2 * 2  # shapes x blocks x orientations x (triton, dispatched)
    assert all(r.get("mismatches") == 0 and "error" not in r for r in plain), plain
    assert all("error" in r for r in rows if r["variant"].startswith("gluon"))  # no GPU here


@pytest.mark.parametrize("cases", [["wgrad"], ["fprop", "dgrad"]], ids=["wgrad", "fprop-dgrad"])
def test_block_gemm_sweep(tmp_path, cases):
    rows = _sweep("benchmarks.sweep_block_gemm", tmp_path / "gemm.json", "--variants", "dispatched",
                  "--cases", *cases)
    assert rows and all(r["status"] == "ok" and r.get("exact", True) for r in rows), rows
    assert {r["variant"] for r in rows} == {"current", "dispatched"}
    assert any(r["shape"] == "qwen3-fc1" for r in rows) == (cases == ["wgrad"])


def test_scale_transpose_sweep(tmp_path):
    rows = _sweep("benchmarks.sweep_scale_transpose", tmp_path / "transpose.json")
    assert len(rows) == 2 and all(r["same_bits"] for r in rows), rows
