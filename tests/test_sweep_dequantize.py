"""benchmarks/sweep_dequantize.py: every pass and tile it times runs, and gives the dispatched
tile's bits (the kernels under Triton's interpreter, tiny shapes); no GPU, no timing."""
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import sweep_dequantize


def test_every_tile_of_every_pass_gives_the_dispatched_bits(tmp_path):
    out = tmp_path / "dq.json"
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", QMOE_BACKEND="triton",
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "benchmarks.sweep_dequantize", "--tiny", "--out", str(out)],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 4 * len(sweep_dequantize.TILES)  # two formats, four passes
    assert all(r.get("exact") is True and "error" not in r for r in rows), [r for r in rows if not r.get("exact")]
    assert {r["dequantize"] for r in rows} == {"activations rowwise", "weights rowwise", "weights columnwise",
                                               "activations tokens"}


def test_it_says_what_it_needs_without_a_gpu(capsys):
    assert sweep_dequantize.main(["--out", "/tmp/unused.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
