"""Run the GPU test suite and record the run: `python -m benchmarks.gpu_tests [-n N]`.

CI runs on a machine without a GPU, where every `@pytest.mark.gpu` test skips; this is how the
GPU suite's last full run is kept. It runs `pytest -m gpu tests` in this process (with `-n N`:
N pytest-xdist workers) and writes benchmarks/results/gpu_tests.json: the usual header (date,
command, commit, device, torch and triton versions), the pytest arguments, counts of passed,
failed, skipped and errored tests, every failure's test id and one-line message, and the
duration. Arguments after `--` replace the default `-m gpu tests` (e.g. one file while fixing
it; then write elsewhere with --out). Without a CUDA device it writes only with --out, so a CPU
run (where everything skips) never replaces the record. The exit code is pytest's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.harness import RESULTS_DIR, run_header, write_results

RECORD = RESULTS_DIR / "gpu_tests.json"
DEFAULT_ARGS = ["-m", "gpu", "tests"]
OUTCOMES = ("passed", "failed", "skipped", "errors")


class Recorder:
    """A pytest plugin that keeps one outcome per test and the failures' short messages.

    A test's outcome is its call's (passed, failed, skipped), or skipped / errors when its setup
    skipped or failed; a teardown failure makes it an error. A file that fails to collect is an
    error too. Under xdist the reports reach this controller-side plugin as they do without it.
    """

    def __init__(self):
        self.outcome: dict[str, str] = {}
        self.failures: list[dict] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            self.outcome[report.nodeid] = "skipped" if report.skipped else report.outcome
        elif report.skipped:  # skipped in setup (a marker, a fixture)
            self.outcome[report.nodeid] = "skipped"
        elif report.failed:  # setup or teardown raised
            self.outcome[report.nodeid] = "errors"
        if report.failed:
            self.failures.append({"test": report.nodeid, "when": report.when, "message": _short(report)})

    def pytest_collectreport(self, report):
        if report.failed:
            self.outcome[report.nodeid or "<collection>"] = "errors"
            self.failures.append({"test": report.nodeid, "when": "collect", "message": _short(report)})

    def counts(self) -> dict[str, int]:
        values = list(self.outcome.values())
        return {name: values.count(name) for name in OUTCOMES}


def _short(report, limit: int = 400) -> str:
    """The crash line pytest's summary shows ("AssertionError: ..."), else the report's last line."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = crash.message if crash is not None else (str(report.longrepr).strip().splitlines() or [""])[-1]
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_tests", description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers (0: run in this process)")
    parser.add_argument("--out", type=Path, default=None, help=f"where to write (default {RECORD}, GPU only)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments (default: -m gpu tests)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    out = args.out
    if out is None:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: every GPU test would skip; pass --out to write such a run elsewhere")
        out = RECORD
    pytest_args = ["-q", "-p", "no:cacheprovider"] + (args.pytest_args or DEFAULT_ARGS)
    if args.workers:
        pytest_args = ["-n", str(args.workers)] + pytest_args
    recorder = Recorder()
    start = time.monotonic()
    code = pytest.main(pytest_args, plugins=[recorder])
    duration = time.monotonic() - start
    result = {"suite": "gpu_tests", "pytest_args": pytest_args, "exit_code": int(code),
              "duration_s": round(duration, 1), "counts": recorder.counts(), "failures": recorder.failures}
    write_results(out, run_header("benchmarks.gpu_tests", argv), result)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
