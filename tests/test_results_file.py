"""benchmarks/results_file: the run metadata every results file records, and the writer."""
import json

import torch

from benchmarks.results_file import run_environment, write_results


def test_run_environment_on_the_cpu_names_versions_and_no_capability():
    env = run_environment("cpu")
    assert set(env) == {"date", "device", "capability", "torch", "triton", "python"}
    assert env["capability"] is None and env["torch"] == torch.__version__
    assert isinstance(env["device"], str) and env["device"]
    assert env["date"].endswith("+00:00")  # UTC, ISO 8601


def test_write_results_creates_the_folder_and_round_trips(tmp_path, capsys):
    path = tmp_path / "new" / "suite.json"
    result = {"suite": "x", **run_environment("cpu"), "rows": [{"ms": 1.5}]}
    write_results(str(path), result)
    assert json.loads(path.read_text()) == result
    assert f"wrote {path}" in capsys.readouterr().out
