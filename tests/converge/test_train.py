"""Training runs: resuming from a checkpoint continues exactly; results files resume and merge; the CLI
runs the tiny preset end to end."""
import json
import math
import time

import pytest
import torch

from qmoe.cli import main
from qmoe.converge import format_table, load_converge_config, merge_results, run_converge
from qmoe.converge.data import load_corpus
from qmoe.converge.report import summarize
from qmoe.converge.run import checkpoint_dir
from qmoe.converge.train import train_run

MICRO = {"model": {"layers": 1, "hidden": 32, "heads": 2, "experts": 4, "top_k": 2, "ffn": 32},
         "train": {"steps": 12, "batch": 4, "seq_len": 16, "warmup_steps": 3, "eval_every": 4, "eval_batches": 2,
                   "log_every": 2, "checkpoint_every": 0}}


def _curves(results):
    return {label: (r["status"], r["train"], r["held_out"]) for label, r in results["runs"].items()}


def _micro(**kw):
    return load_converge_config({**MICRO, **kw})


@pytest.mark.parametrize("label", ["bf16-s0", "current"])
def test_resume_continues_exactly(tmp_path, label):
    cfg = _micro(recipes=["bf16", "current"], seeds=1)
    spec = next(s for s in cfg.runs() if s.label == label)
    corpus = load_corpus()
    whole = train_run(cfg, spec, corpus, "cpu", progress=False)
    ckpt = tmp_path / "run.pt"
    part = train_run(cfg, spec, corpus, "cpu", checkpoint=ckpt, stop_after=5, progress=False)
    assert part["status"] == "stopped" and part["steps_done"] == 5 and ckpt.is_file()
    torch.manual_seed(1234)  # the resumed run must not depend on the generators' state before it
    rest = train_run(cfg, spec, corpus, "cpu", checkpoint=ckpt, resume=True, progress=False)
    assert rest["status"] == whole["status"] == "done"
    assert rest["train"] == whole["train"] and rest["held_out"] == whole["held_out"]
    assert not ckpt.exists()  # a finished run leaves no checkpoint behind


def test_a_spent_time_budget_stops_cleanly_and_resumes(tmp_path):
    cfg = _micro(recipes=["bf16"], seeds=2)
    out, ckpts, logs = tmp_path / "r.json", tmp_path / "ckpts", []
    # a run past its deadline stops at the next step boundary, leaving a checkpoint
    part = train_run(cfg, cfg.runs()[0], load_corpus(), "cpu", checkpoint=ckpts / "bf16-s0.pt",
                     deadline=time.monotonic(), progress=False)
    assert (part["status"], part["steps_done"]) == ("stopped", 1) and (ckpts / "bf16-s0.pt").is_file()
    # a job whose budget is spent starts no run, and still writes its (empty) results
    empty = run_converge(cfg, device="cpu", out=out, checkpoints=ckpts, time_budget=0.0, progress=False,
                         log=logs.append)
    assert empty["runs"] == {} and out.is_file() and "noise floor" in format_table(empty)
    assert sum("not started, the time budget is spent" in line for line in logs) == 2
    again = run_converge(cfg, device="cpu", out=out, checkpoints=ckpts, resume=True, progress=False,
                         log=logs.append)
    whole = run_converge(cfg, device="cpu", progress=False, log=logs.append)
    assert _curves(again) == _curves(whole)


def test_checkpoint_of_another_run_is_refused(tmp_path):
    cfg = _micro(recipes=["bf16", "current"], seeds=1)
    base, cur = cfg.runs()
    ckpt = tmp_path / "run.pt"
    train_run(cfg, base, load_corpus(), "cpu", checkpoint=ckpt, stop_after=2, progress=False)
    with pytest.raises(ValueError, match="different run or config"):
        train_run(cfg, cur, load_corpus(), "cpu", checkpoint=ckpt, resume=True, progress=False)


def test_results_file_resumes_and_merges(tmp_path):
    out_a, out_b = tmp_path / "a.json", tmp_path / "b.json"
    logs = []
    cfg = _micro(recipes=["bf16"], seeds=2)
    first = run_converge(cfg, device="cpu", out=out_a, progress=False, log=logs.append)
    assert set(first["runs"]) == {"bf16-s0", "bf16-s1"}
    # an interrupted job: its runs stop early and leave checkpoints; --resume finishes them
    cfg2 = _micro(recipes=["bf16", "current"], seeds=2)
    run_converge(cfg2, device="cpu", out=out_a, resume=True, progress=False, stop_after=6, log=logs.append)
    assert (checkpoint_dir(out_a) / "current.pt").is_file()
    assert json.loads(out_a.read_text())["runs"]["current"]["status"] == "stopped"
    done = run_converge(cfg2, device="cpu", out=out_a, resume=True, progress=False, log=logs.append)
    assert sum("bf16-s0: done in" in line for line in logs) == 2  # finished runs are skipped, not retrained
    assert done["runs"]["bf16-s0"] == first["runs"]["bf16-s0"] and done["runs"]["current"]["status"] == "done"
    assert not checkpoint_dir(out_a).exists()
    # another subset of the same config, run elsewhere, merges into one file
    run_converge(_micro(recipes=["bf16", "delayed"], seeds=1), device="cpu", out=out_b, progress=False,
                 log=logs.append)
    merged = merge_results([out_a, out_b])
    assert set(merged["runs"]) == {"bf16-s0", "bf16-s1", "current", "delayed"}
    assert math.isfinite(merged["summary"]["runs"]["delayed"]["gap"])
    other = tmp_path / "c.json"
    run_converge(_micro(recipes=["bf16"], seeds=1, train={**MICRO["train"], "steps": 8}), device="cpu", out=other,
                 progress=False, log=logs.append)
    with pytest.raises(ValueError, match="another config"):
        merge_results([out_a, other])
    with pytest.raises(ValueError, match="another model or training config"):
        run_converge(_micro(recipes=["bf16"], seeds=1, train={**MICRO["train"], "steps": 8}), device="cpu",
                     out=out_a, resume=True, progress=False, log=logs.append)


def test_jobs_split_by_label_merge_into_the_whole_run(tmp_path):
    """Concurrent jobs each train some labels (--only); merged, they equal one job training all."""
    cfg = _micro(recipes=["bf16", "current"], seeds=2)
    whole = run_converge(cfg, device="cpu", progress=False, log=lambda _: None)
    parts = [tmp_path / "j0.json", tmp_path / "j1.json"]
    for out, only in zip(parts, (["bf16-s0", "current"], ["bf16-s1"])):
        part = run_converge(cfg, device="cpu", out=out, only=only, concurrent_jobs=2, progress=False,
                            log=lambda _: None)
        assert set(part["runs"]) == set(only)
    merged = merge_results(parts)
    assert _curves(merged) == _curves(whole)
    assert merged["summary"] == summarize(whole)
    assert all(r["concurrent_jobs"] == 2 for r in merged["runs"].values())
    with pytest.raises(ValueError, match="unknown run label.*'nvfp4'.*bf16-s0, bf16-s1, current"):
        run_converge(cfg, device="cpu", only=["nvfp4"], progress=False)


def test_tiny_preset_end_to_end(tmp_path, capsys):
    out, plots = tmp_path / "convergence.json", tmp_path / "plots"
    rc = main(["converge", "--preset", "tiny", "--recipes", "bf16", "current", "--device", "cpu", "--out", str(out),
               "--plot", str(plots), "--no-progress"])
    assert rc == 0
    assert sorted(p.name for p in plots.iterdir()) == ["final_gaps.png", "gap_vs_steps.png", "loss_curves.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in plots.iterdir())
    results = json.loads(out.read_text())
    assert next(iter(results)) == "header"  # as every file under benchmarks/results/ starts
    for key in ("config", "data", "parameters", "summary"):
        assert key in results
    header = results["header"]
    for key in ("date", "device", "torch", "commit", "command"):
        assert isinstance(header[key], str) and header[key]
    assert header["command"].startswith("qmoe converge --preset tiny")
    assert len(header["commit"]) == 40 or header["commit"] == "unknown"
    assert list(results["runs"]) == ["bf16-s0", "bf16-s1", "current"]
    steps = results["config"]["train"]["steps"]
    for run in results["runs"].values():
        assert run["status"] == "done" and run["steps_done"] == steps
        train, held = run["train"]["loss"], run["held_out"]["loss"]
        assert all(math.isfinite(v) for v in train + held)
        assert train[-1] < train[0] - 1.0 and held[-1] < held[0]  # it learns: ln 256 = 5.5 at the start
        assert run["held_out"]["step"][-1] == steps
        assert run["tokens_per_s"] > 0
    s = results["summary"]
    assert math.isfinite(s["baseline"]["noise_floor"]) and math.isfinite(s["runs"]["current"]["gap"])
    table = capsys.readouterr().out
    assert "noise floor" in table and "current" in table
