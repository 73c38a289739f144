"""benchmarks/harness: the header every results file starts with, its writer, and the files of
record under benchmarks/results/ (each one has a complete header)."""
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.harness import (
    HEADER_KEYS,
    RESULTS_DIR,
    check_header,
    command_line,
    git_commit,
    run_header,
    write_results,
)


def test_run_header_on_the_cpu_names_when_how_and_what():
    header = run_header("benchmarks.bench_moe", ["--quick", "--shapes", "a b"], "cpu")
    assert set(HEADER_KEYS) <= set(header)
    assert header["capability"] is None and header["torch"] == torch.__version__
    assert isinstance(header["device"], str) and header["device"]
    assert header["date"].endswith("+00:00")  # UTC, ISO 8601
    assert header["command"].endswith("python -m benchmarks.bench_moe --quick --shapes 'a b'")
    check_header(header)


def test_git_commit_is_the_checkouts_head_or_unknown(tmp_path):
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, check=False).stdout.strip()
    except OSError:
        head = ""
    assert git_commit() == (head or "unknown")
    assert git_commit(tmp_path) == "unknown"  # not a repository


def test_command_line_records_the_environment_and_torchrun():
    assert command_line("benchmarks.bench_gemm", [], environ={}) == "python -m benchmarks.bench_gemm"
    env = {"QMOE_BACKEND": "reference", "HOME": "/x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert (command_line("benchmarks.bench_ep", ["--quick"], environ=env)
            == "QMOE_BACKEND=reference torchrun --nproc-per-node=2 -m benchmarks.bench_ep --quick")


def test_write_results_puts_the_header_first_and_round_trips(tmp_path, capsys):
    path = tmp_path / "new" / "suite.json"
    header = run_header("benchmarks.bench_x", [], "cpu")
    write_results(path, header, {"suite": "x", "rows": [{"ms": 1.5}]})
    written = json.loads(path.read_text())
    assert list(written) == ["header", "suite", "rows"]
    assert written == {"header": header, "suite": "x", "rows": [{"ms": 1.5}]}
    assert f"wrote {path}" in capsys.readouterr().out


@pytest.mark.parametrize("key", HEADER_KEYS)
def test_write_results_refuses_an_incomplete_header(tmp_path, key):
    header = run_header("benchmarks.bench_x", [], "cpu")
    header[key] = ""
    with pytest.raises(ValueError, match=key):
        write_results(tmp_path / "x.json", header, {"rows": []})
    assert not (tmp_path / "x.json").exists()


def test_write_results_refuses_a_result_that_repeats_the_header(tmp_path):
    header = run_header("benchmarks.bench_x", [], "cpu")
    with pytest.raises(ValueError, match="device"):
        write_results(tmp_path / "x.json", header, {"device": "H200", "rows": []})


RESULT_FILES = sorted(RESULTS_DIR.rglob("*"))


def test_results_hold_only_json_files():
    assert RESULT_FILES, RESULTS_DIR
    assert [p.name for p in RESULT_FILES if p.is_file() and p.suffix != ".json"] == []


@pytest.mark.parametrize("path", [p for p in RESULT_FILES if p.suffix == ".json"],
                         ids=lambda p: str(p.relative_to(RESULTS_DIR)))
def test_every_results_file_starts_with_one_complete_header(path):
    data = json.loads(path.read_text())
    assert next(iter(data)) == "header"
    check_header(data["header"])
    assert not set(data) & set(HEADER_KEYS), "run facts belong in the header only"
    assert len(data["header"]["commit"]) == 40 or data["header"]["commit"] == "unknown"


REPO = RESULTS_DIR.parents[1]


def _cited_results() -> list[tuple[str, str]]:
    """(citing file, cited name) for every results file the code and the docs cite: in Python,
    the .json names on a line that says benchmarks/results/; in Markdown, `...json` spans."""
    found = []
    for path in sorted(REPO.glob("qmoe/**/*.py")):
        for line in path.read_text().splitlines():
            if "benchmarks/results/" in line:
                found += [(str(path.relative_to(REPO)), m) for m in re.findall(r"[\w/]+\.json", line)]
    for path in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]:
        found += [(str(path.relative_to(REPO)), m) for m in re.findall(r"`([\w/]+\.json)`", path.read_text())]
    return found


def test_every_cited_results_file_exists():
    cited = _cited_results()
    assert any(name.endswith("moe.json") for _, name in cited)  # the scan finds the docs' citations
    missing = [(where, name) for where, name in cited
               if not (REPO / name).is_file() and not (RESULTS_DIR / name).is_file()
               and not (RESULTS_DIR / "sweeps" / name).is_file()]
    assert missing == []


@pytest.mark.gpu
def test_captures_leave_no_memory_behind_for_later_measurements():
    """A capture's warm-up runs on the one warm-up stream: a second capture of a cuBLAS matmul
    leaves no more allocated than the first did (a new stream each would keep a workspace each)."""
    from benchmarks.harness import capture_graph, warmup_stream

    import gc

    a = torch.randn(256, 256, device="cuda")
    allocated = []
    for _ in range(3):
        graph, why = capture_graph(lambda: a @ a)
        assert why is None, why
        graph.replay()
        del graph  # its pool goes with it: what stays is the workspaces
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert warmup_stream() is warmup_stream()
    assert allocated[2] == allocated[1], allocated
