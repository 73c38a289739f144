"""The results of `qmoe converge`: loss gaps against bf16 with their noise floor, the JSON file, plots.

Definitions (every number below is about held-out loss):
- a run's final loss is the mean of its last `train.final_evals` evaluations (one evaluation is
  noisy; the mean of a few is what a user would compare);
- the baseline is the mean final loss of the bf16 seeds;
- a run's gap is (final - baseline) / baseline: positive is worse than bf16;
- the noise floor is the largest |final_s - baseline| / baseline over the bf16 seeds: how far a
  run can land from the baseline by its seed alone. A recipe whose gap is below the noise floor
  cannot be told apart from bf16 at this budget;
- a recipe meets its goal when its gap is at most max(goal, noise floor): 0.25 % for the FP8
  recipes and MXFP8 (DeepSeek-V3's bar for FP8 block scaling), 1.5 % for NVFP4 (NVIDIA's NVFP4
  pre-training report).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

GOALS = {"delayed": 0.0025, "current": 0.0025, "block": 0.0025, "mxfp8": 0.0025, "nvfp4": 0.015}
BASELINE = "bf16"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def final_loss(record: dict, final_evals: int) -> float:
    """Mean of the run's last `final_evals` held-out losses; nan unless the run completed."""
    losses = record["held_out"]["loss"]
    if record.get("status") != "done" or not losses:
        return math.nan
    return _mean(losses[-final_evals:])


def baseline_labels(results: dict) -> list[str]:
    return [label for label, r in results["runs"].items() if r["recipe"]["name"] == BASELINE]


def summarize(results: dict) -> dict:
    """{"baseline": {labels, final, noise_floor}, "runs": {label: {final, gap, goal, within_noise, meets_goal}}}."""
    n = results["config"]["train"]["final_evals"]
    runs = results["runs"]
    base = baseline_labels(results)
    finals = {label: final_loss(r, n) for label, r in runs.items()}
    base_finals = [finals[b] for b in base if math.isfinite(finals[b])]
    mean = _mean(base_finals)
    noise = max((abs(f - mean) / mean for f in base_finals), default=math.nan) if len(base_finals) > 1 else math.nan
    out = {}
    for label, r in runs.items():
        gap = (finals[label] - mean) / mean if math.isfinite(mean) else math.nan
        goal = GOALS.get(r["recipe"]["name"])
        bar = max(goal, noise) if goal is not None and math.isfinite(noise) else goal
        out[label] = {"final": finals[label], "gap": gap, "goal": goal,
                      "within_noise": bool(math.isfinite(gap) and math.isfinite(noise) and abs(gap) <= noise),
                      "meets_goal": None if goal is None or not math.isfinite(gap) else bool(gap <= bar)}
    return {"baseline": {"labels": base, "final": mean, "noise_floor": noise}, "runs": out}


def gap_curves(results: dict) -> dict:
    """Per eval step: the bf16 mean, each run's relative gap to it, and the bf16 noise band (±)."""
    runs = results["runs"]
    base = [runs[b]["held_out"] for b in baseline_labels(results)]
    if not base:
        return {"step": [], "noise": [], "gap": {}}
    steps = sorted(set.intersection(*(set(b["step"]) for b in base)))
    at = {s: _mean(b["loss"][b["step"].index(s)] for b in base) for s in steps}
    noise = [max(abs(b["loss"][b["step"].index(s)] - at[s]) / at[s] for b in base) if len(base) > 1 else 0.0
             for s in steps]
    gaps = {}
    for label, r in runs.items():
        h = dict(zip(r["held_out"]["step"], r["held_out"]["loss"]))
        gaps[label] = [(h[s] - at[s]) / at[s] if s in h else math.nan for s in steps]
    return {"step": steps, "noise": noise, "gap": gaps}


def format_table(results: dict) -> str:
    s = summarize(results)
    b = s["baseline"]
    lines = [f"{'run':<16} {'status':<9} {'final loss':>10} {'gap vs bf16':>12} {'goal':>7} {'tokens/s':>10} "
             f"{'peak GiB':>9}"]
    for label, r in results["runs"].items():
        row = s["runs"][label]
        goal = f"{row['goal'] * 100:.2f}%" if row["goal"] is not None else ""
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
        mem = f"{r['peak_memory_gib']:.2f}" if r.get("peak_memory_gib") else "-"
        mark = "" if row["meets_goal"] is None else (" ok" if row["meets_goal"] else " MISS")
        lines.append(f"{label:<16} {r['status']:<9} {row['final']:>10.4f} {row['gap'] * 100:>+11.3f}% {goal:>7} "
                     f"{tps:>10} {mem:>9}{mark}")
    lines.append(f"bf16 baseline {b['final']:.4f} (mean of {len(b['labels'])} seeds), noise floor "
                 f"{b['noise_floor'] * 100:.3f}%" if math.isfinite(b["noise_floor"]) else
                 f"bf16 baseline {b['final']:.4f}; noise floor needs 2 or more bf16 seeds")
    failed = [f"{label}: {r['error']}" for label, r in results["runs"].items() if r.get("error")]
    return "\n".join(lines + failed)


RECORDED_ENV = ("QMOE_BACKEND", "TRITON_INTERPRET")  # variables that change what a run computes


def run_header(device, command: str | None = None) -> dict:
    """When, how and on what: the `header` every results file under benchmarks/results/ starts
    with (date, command, commit, device, torch, triton, ...), as the benchmark suites write it."""
    device = torch.device(device)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import qmoe
    on_gpu = device.type == "cuda"
    if command is None:
        command = "python " + shlex.join(sys.argv)
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in RECORDED_ENV if os.environ.get(k))
    commit, dirty = _git_commit()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": f"{env} {command}" if env else command, "commit": commit, "uncommitted_changes": dirty,
            "device": torch.cuda.get_device_name(device) if on_gpu else (platform.processor() or "cpu"),
            "capability": list(torch.cuda.get_device_capability(device)) if on_gpu else None,
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "qmoe": qmoe.__version__, "cpu_threads": torch.get_num_threads()}


def _git_commit() -> tuple[str, bool | None]:
    """(HEAD of the checkout qmoe runs from, whether tracked files differ from it), or ("unknown", None)."""
    if os.environ.get("QMOE_COMMIT"):  # an exported tree: the enclosing checkout is not what ran
        return os.environ["QMOE_COMMIT"], False
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        if len(head) != 40:
            return "unknown", None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        return head, bool(status)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def write_results(results: dict, path) -> None:
    """JSON (header first) with the summary refreshed; written to a temporary file, then renamed."""
    results["summary"] = summarize(results)
    results = {"header": results["header"], **results}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    os.replace(tmp, path)


def results_figure(results: dict):
    """One matplotlib figure, three panels: loss curves, gap vs steps with the noise band, final gaps."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    for draw, ax in zip(_PANELS, axes):
        draw(results, ax)
    fig.suptitle(_title(results))
    fig.tight_layout()
    return fig


def plot_results(results: dict, target) -> list[Path]:
    """The three panels of results_figure as one PNG when `target` ends in .png, else as three PNGs
    in the directory `target`. Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(target)
    names = ("loss_curves.png", "gap_vs_steps.png", "final_gaps.png")
    if target.suffix.lower() == ".png":
        fig = results_figure(results)
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110)
        plt.close(fig)
        return [target]
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for draw, name in zip(_PANELS, names):
        fig, ax = plt.subplots(figsize=(7, 4.8))
        draw(results, ax)
        ax.set_title(f"{ax.get_title()}\n{_title(results)}", fontsize=9)
        fig.tight_layout()
        fig.savefig(target / name, dpi=110)
        plt.close(fig)
        written.append(target / name)
    return written


def _title(results: dict) -> str:
    c, h = results["config"], results["header"]
    m = c["model"]
    return (f"preset {c['preset']}: {m['layers']} layers, hidden {m['hidden']}, {m['experts']} experts "
            f"top-{m['top_k']}, {c['train']['steps']} steps, precision {results.get('precision', '?')} "
            f"on {h['device']}")


def _colors(results: dict) -> dict:
    import matplotlib.pyplot as plt
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = [label for label in results["runs"] if results["runs"][label]["recipe"]["name"] != BASELINE]
    return {label: cycle[(i + 1) % len(cycle)] for i, label in enumerate(labels)}


def _plot_losses(results, ax):
    colors = _colors(results)
    for label, r in results["runs"].items():
        base = r["recipe"]["name"] == BASELINE
        color = "black" if base else colors[label]
        ax.plot(r["train"]["step"], r["train"]["loss"], color=color, alpha=0.25, lw=0.8)
        ax.plot(r["held_out"]["step"], r["held_out"]["loss"], color=color, lw=1.5, ls="--" if base else "-",
                marker="o", ms=2.5, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte): held-out lines, train faint")
    ax.set_title("loss curves")
    _legend(ax)


def _plot_gap_curves(results, ax):
    g = gap_curves(results)
    colors = _colors(results)
    steps = g["step"]
    if steps:
        band = [100 * v for v in g["noise"]]
        ax.fill_between(steps, [-v for v in band], band, color="gray", alpha=0.3, label="bf16 seed spread")
    for label, gaps in g["gap"].items():
        if results["runs"][label]["recipe"]["name"] == BASELINE:
            continue
        ax.plot(steps, [100 * v for v in gaps], color=colors[label], marker="o", ms=2.5, label=label)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss gap vs bf16 mean (%)")
    ax.set_title("relative gap to bf16")
    _legend(ax)


def _plot_final_gaps(results, ax):
    s = summarize(results)
    colors = _colors(results)
    labels = [label for label in results["runs"] if results["runs"][label]["recipe"]["name"] != BASELINE]
    gaps = [100 * s["runs"][label]["gap"] for label in labels]
    ax.bar(range(len(labels)), [v if math.isfinite(v) else 0 for v in gaps], color=[colors[lb] for lb in labels])
    for i, label in enumerate(labels):
        goal = s["runs"][label]["goal"]
        if goal is not None:
            ax.plot([i - 0.4, i + 0.4], [100 * goal] * 2, color="red", lw=1.2)
        if not math.isfinite(gaps[i]):
            ax.text(i, 0, results["runs"][label]["status"], ha="center", va="bottom", fontsize=8)
    noise = s["baseline"]["noise_floor"]
    if math.isfinite(noise):
        ax.axhspan(-100 * noise, 100 * noise, color="gray", alpha=0.3, label="bf16 noise floor")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("final held-out loss gap (%)")
    ax.set_title("final gap (red: goal)")
    _legend(ax)


def _legend(ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


_PANELS = (_plot_losses, _plot_gap_curves, _plot_final_gaps)
