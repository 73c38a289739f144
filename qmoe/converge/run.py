"""`qmoe converge`'s job: every run of a config, one after the other, into one results file.

The results file is rewritten after every run, so a job cut short (a device call's time limit)
keeps the runs it finished; `resume=True` skips those and continues an interrupted run from its
checkpoint (beside the results file, in `<out>.ckpt/`). `merge_results` joins files that ran
different subsets of the same config (one device call per subset).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from qmoe.converge.config import ConvergeConfig
from qmoe.converge.data import load_corpus
from qmoe.converge.model import MoETransformer
from qmoe.converge.report import run_header, summarize, write_results
from qmoe.converge.train import resolve_precision, train_run


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def checkpoint_dir(out) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".ckpt")


def _comparable(config: dict) -> dict:
    """The parts of a config that must agree for runs to be compared (not the list of runs)."""
    return {k: config[k] for k in ("model", "train")}


def new_results(cfg: ConvergeConfig, device, command: str | None = None) -> dict:
    corpus = load_corpus()
    with torch.device("meta"):
        params = MoETransformer(cfg.model).num_parameters()
    return {"header": run_header(device, command), "kind": "qmoe converge", "config": cfg.to_dict(),
            "parameters": params, "data": corpus.describe(),
            "precision": resolve_precision(cfg.train.precision, torch.device(device)), "runs": {}}


def load_results(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"results file {str(path)!r} does not exist")
    results = json.loads(path.read_text())
    if not isinstance(results, dict) or results.get("kind") != "qmoe converge":
        raise ValueError(f"{str(path)!r} is not a qmoe converge results file")
    return results


def run_converge(cfg: ConvergeConfig, *, device=None, out=None, resume: bool = False, progress: bool = True,
                 checkpoints=None, time_budget: float | None = None, stop_after: int | None = None,
                 command: str | None = None, only=None, concurrent_jobs: int = 1, log=print) -> dict:
    """Train every run of `cfg` (bf16 seeds first); returns the results dict, also written to `out`.

    resume: reuse `out`'s finished runs and continue interrupted ones from their checkpoints.
    checkpoints: directory of the runs' checkpoints (default `<out>.ckpt`; none without `out`).
    time_budget: seconds; once spent, the run in progress stops at a checkpoint and no other
    starts, so results and plots are written before an outside time limit kills the job.
    stop_after: stop every run after this many steps, leaving a checkpoint (for testing resume).
    command: the command line recorded in the results' header (default: this process's).
    only: labels of the runs to train (default all): jobs that share one device each take some
    and `merge_results` joins their files.
    concurrent_jobs: how many such jobs share the device, recorded beside tokens/s (which it lowers).
    """
    deadline = time.monotonic() + time_budget if time_budget is not None else None
    device = device or default_device()
    specs = select_runs(cfg, only)
    if isinstance(concurrent_jobs, bool) or not isinstance(concurrent_jobs, int) or concurrent_jobs < 1:
        raise ValueError(f"concurrent_jobs must be a positive integer, got {concurrent_jobs!r}")
    results = new_results(cfg, device, command)
    results["header"]["concurrent_jobs"] = concurrent_jobs
    if resume and out is not None and Path(out).is_file():
        old = load_results(out)
        if _comparable(old["config"]) != _comparable(results["config"]):
            raise ValueError(f"--resume: {str(out)!r} was written for another model or training config; "
                             f"use another --out")
        if old.get("data", {}).get("fingerprint") != results["data"]["fingerprint"]:
            raise ValueError(f"--resume: {str(out)!r} was trained on other data (another Python's stdlib)")
        results["runs"] = {k: v for k, v in old["runs"].items() if v.get("status") == "done"}
    corpus = load_corpus()
    ckpt_dir = Path(checkpoints) if checkpoints is not None else checkpoint_dir(out) if out is not None else None
    for spec in specs:
        if spec.label in results["runs"] and results["runs"][spec.label]["status"] == "done":
            log(f"{spec.label}: done in {out}, skipped")
            continue
        if deadline is not None and time.monotonic() > deadline:
            log(f"{spec.label}: not started, the time budget is spent (rerun with --resume to continue)")
            continue
        record = train_run(cfg, spec, corpus, device, progress=progress, resume=resume, stop_after=stop_after,
                           deadline=deadline,
                           checkpoint=ckpt_dir / f"{spec.label}.pt" if ckpt_dir is not None else None)
        record["concurrent_jobs"] = concurrent_jobs
        results["runs"][spec.label] = record
        last = record["held_out"]["loss"][-1] if record["held_out"]["loss"] else float("nan")
        tps = f", {record['tokens_per_s']:.0f} tokens/s" if record["tokens_per_s"] else ""
        log(f"{spec.label}: {record['status']} after {record['steps_done']} steps, held-out loss {last:.4f}{tps}"
            + (f" ({record['error']})" if record["error"] else ""))
        if out is not None:
            write_results(results, out)
    # runs of the file that this config does not list stay (a --resume with fewer recipes keeps them)
    if out is not None:
        write_results(results, out)
    if checkpoints is None and ckpt_dir is not None and ckpt_dir.is_dir() and not any(ckpt_dir.iterdir()):
        ckpt_dir.rmdir()
    return results


def select_runs(cfg: ConvergeConfig, only=None) -> list:
    """The runs of `cfg` whose labels `only` lists (all when None); an unknown label is an error."""
    specs = cfg.runs()
    if only is None:
        return specs
    labels = [s.label for s in specs]
    unknown = [label for label in only if label not in labels]
    if unknown or not only:
        raise ValueError(f"--only: unknown run label(s) {unknown or only!r}; this config's runs are "
                         f"{', '.join(labels)}")
    return [s for s in specs if s.label in only]


def merge_results(paths) -> dict:
    """One results dict from files that ran subsets of the same model and training config."""
    if not paths:
        raise ValueError("--merge needs one or more results files")
    merged = None
    for path in paths:
        r = load_results(path)
        if merged is None:
            merged = r
            continue
        if _comparable(r["config"]) != _comparable(merged["config"]) or r["data"] != merged["data"] \
                or r["precision"] != merged["precision"]:
            raise ValueError(f"--merge: {str(path)!r} ran another config, data or precision than {str(paths[0])!r}")
        for label, run in r["runs"].items():
            if label in merged["runs"] and merged["runs"][label]["status"] == "done" and run["status"] != "done":
                continue
            merged["runs"][label] = run
        merged["config"]["recipes"] += [e for e in r["config"]["recipes"] if e not in merged["config"]["recipes"]]
        merged.setdefault("merged_headers", []).append(r["header"])
    merged["summary"] = summarize(merged)
    return merged
