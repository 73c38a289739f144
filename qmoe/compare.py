"""`qmoe compare`: one MoE layer, forward and backward, under every recipe and in high precision.

Every run uses the same layer (fp32 master weights, copied per run) and the same input and
upstream gradient, so the only difference between rows is how the expert GEMMs compute. Each
row reports the relative error (Frobenius norm of the difference over the norm of the fp32
run's) of the layer output and of the gradients of the input, the router weight and the FC1 /
FC2 weights, the median time per step after warm-up, and the path the GEMMs took.

Dimension legend: T tokens, H hidden, F ffn, E experts, K top-k.

    >>> rows = run_compare(shape={"tokens": 64, "hidden": 64, "ffn": 64, "experts": 4, "top_k": 2},
    ...                    device="cpu", progress=False)
    >>> print(format_table(rows))

Quantized rows (and the "bf16" row) feed the layer bf16 activations; the fp32 weights are cast
or quantized by the layer, as in mixed-precision training with fp32 master weights. The input
is rounded to bf16 once, up front, so the fp32 reference sees the same values and the fp32
router picks the same experts in every row: the errors are the experts' arithmetic, not
routing flips.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from qmoe.autocast import autocast
from qmoe.backend import use_kernels
from qmoe.capabilities import capabilities
from qmoe.nn.moe import MoELayer
from qmoe.ops.grouped_gemm import select_grouped_path
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling, recipe_to_config)
from qmoe.report import realistic_tensors
from qmoe.run_config import CONFIG_KEYS, check_shape, load_run_config, parse_device  # noqa: F401 (CONFIG_KEYS: public)

# Small enough for a laptop CPU through the pure-torch reference (the NVFP4 reference dominates);
# the CUDA default is a mid-sized layer where the kernels, not launch overheads, set the time.
DEFAULT_SHAPE_CPU = {"tokens": 512, "hidden": 256, "ffn": 512, "experts": 8, "top_k": 2}
DEFAULT_SHAPE_CUDA = {"tokens": 8192, "hidden": 2048, "ffn": 1024, "experts": 32, "top_k": 4}
HIGH_PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRADIENTS = ("input", "router", "fc1", "fc2")  # the gradients compared, besides the output


@dataclass
class CompareRow:
    recipe: str  # "fp32", "bf16", or a recipe's config name
    output_error: float  # relative to the fp32 run (nan when the run failed)
    input_grad_error: float
    router_grad_error: float
    fc1_grad_error: float
    fc2_grad_error: float
    step_ms: float  # median forward + backward time per step, after warm-up
    path: str  # "hardware/backend grouped|split" (capabilities, grouped_path); fp32/bf16 rows: dtype/backend
    config: dict  # recipe_to_config(recipe), or {"name": "bf16"}
    error: str = ""  # why the run failed, if it did
    shape: dict = field(default_factory=dict)  # the problem: tokens, hidden, ffn, experts, top_k
    device: str = ""  # where it ran, e.g. "cpu" or "cuda:0 (<device name>)"

    @property
    def errors(self) -> dict[str, float]:
        return {"output": self.output_error, **{g: getattr(self, f"{g}_grad_error") for g in GRADIENTS}}


def default_recipes() -> list:
    """fp32 (the reference, timed too), bf16, then every recipe with its default fields."""
    return ["fp32", "bf16", DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
            NVFP4BlockScaling()]


def spec_name(spec) -> str:
    return spec if isinstance(spec, str) else recipe_to_config(spec)["name"]


def default_shape(device) -> dict:
    return dict(DEFAULT_SHAPE_CUDA if torch.device(device).type == "cuda" else DEFAULT_SHAPE_CPU)


def make_problem(shape: dict, seed: int = 0, device="cpu"):
    """(layer, x [T, H] fp32 holding bf16 values, dy [T, H] fp32): the same for every row.

    x: `qmoe.report.realistic_tensors`' heavy-tailed activations with outlier channels, scaled
    to unit RMS per token as an MoE layer's input is (it follows a norm), so router logits are
    O(1) and the routing probabilities are not all 0 or 1. dy: gradients whose magnitude varies
    by orders of magnitude between tokens.
    """
    torch.manual_seed(seed)
    layer = MoELayer(shape["hidden"], shape["ffn"], shape["experts"], shape["top_k"], device=device)
    # seed + 1: realistic_tensors seeds its own generator, and the same seed would replay the stream the
    # router weights were drawn from, lining token t up with expert t
    t = realistic_tensors(shape["tokens"], shape["hidden"], shape["hidden"], seed=seed + 1, device=device)
    x = t["input"].float()
    x = x * x.square().mean(-1, keepdim=True).clamp_min(1e-12).rsqrt()
    # rounded to bf16 once: every row (fp32 included) sees the same values, so routes alike
    return layer, x.bfloat16().float(), t["grad_output"].float()


def resolve_path(spec, layer: MoELayer, device) -> str:
    """How the expert GEMMs run: `hardware/backend` from qmoe.capabilities, then grouped or split."""
    device = torch.device(device)
    grouped = select_grouped_path(layer.experts.fc1.grouped_path, device)
    if isinstance(spec, str):
        backend = "triton" if use_kernels(torch.empty(0, device=device)) else "reference"
        return f"{spec}/{backend} {grouped}"
    cap = capabilities(device)[spec_name(spec)]
    return f"{cap.hardware}/{cap.backend} {grouped}"


def _check_device(device) -> torch.device:
    return parse_device(device, "device")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor, spec) -> dict[str, torch.Tensor]:
    """One forward + backward; returns the output and the compared gradients (fp32 copies)."""
    dtype = HIGH_PRECISION.get(spec, torch.bfloat16) if isinstance(spec, str) else torch.bfloat16
    for p in layer.parameters():
        p.grad = None
    xi = x.detach().to(dtype, copy=True).requires_grad_(True)
    with autocast(recipe=None if isinstance(spec, str) else spec, enabled=not isinstance(spec, str)):
        y = layer(xi)
    y.backward(dy.to(y.dtype))
    return {"output": y.detach().float(), "input": xi.grad.float(), "router": layer.router.weight.grad.float(),
            "fc1": layer.experts.fc1.weight.grad.float(), "fc2": layer.experts.fc2.weight.grad.float()}


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float64 (0 when both are zero, inf when only ref is)."""
    num = (a.double() - ref.double()).norm().item()
    den = ref.double().norm().item()
    return 0.0 if num == 0 else (num / den if den > 0 else math.inf)


def time_steps(layer, x, dy, spec, steps: int, warmup: int):
    """Warm-up steps (delayed scaling's first step runs on the fresh scale 1; later steps use the
    scales its amax history gives), then `steps` timed steps: (median ms, last step's tensors)."""
    device = x.device
    for _ in range(warmup):
        run_step(layer, x, dy, spec)
    times, result = [], None
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        result = run_step(layer, x, dy, spec)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), result


def run_compare(recipes=None, shape=None, seed: int = 0, device=None, steps: int | None = None,
                warmup: int = 1, progress: bool = True) -> list[CompareRow]:
    """Run the layer under each entry of `recipes` ("fp32", "bf16" or Recipe objects; default
    `default_recipes()`) and compare it with the fp32 run. One row per entry, in order; a run
    that raises gives a row with `error` set and nan errors instead of stopping the others."""
    device = _check_device(device)
    recipes = list(recipes) if recipes else default_recipes()
    shape = check_shape({**default_shape(device), **(shape or {})}, [r for r in recipes if not isinstance(r, str)])
    where = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    steps = steps if steps is not None else (10 if device.type == "cuda" else 2)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    base, x, dy = make_problem(shape, seed, device)
    from tqdm import tqdm

    bar = tqdm(total=len(recipes) + 1, desc="qmoe compare", disable=not progress, unit="run")
    bar.set_postfix_str("fp32 reference")
    ref_ms, ref = time_steps(copy.deepcopy(base), x, dy, "fp32", steps, warmup)
    bar.update()
    rows = []
    for spec in recipes:
        name = spec_name(spec)
        bar.set_postfix_str(name)
        layer = copy.deepcopy(base)  # fresh recipe state (delayed-scaling histories) per row
        config = {"name": spec} if isinstance(spec, str) else recipe_to_config(spec)
        path = resolve_path(spec, layer, device)
        try:
            ms, out = (ref_ms, ref) if spec == "fp32" else time_steps(layer, x, dy, spec, steps, warmup)
            errs = {k: relative_error(out[k], ref[k]) for k in ("output", *GRADIENTS)}
            rows.append(CompareRow(name, errs["output"], *(errs[g] for g in GRADIENTS), ms, path, config,
                                   shape=dict(shape), device=where))
        except Exception as e:  # noqa: BLE001 - one recipe failing must not hide the others
            nan = math.nan
            rows.append(CompareRow(name, nan, nan, nan, nan, nan, nan, path, config,
                                   error=f"{type(e).__name__}: {e}", shape=dict(shape), device=where))
        bar.update()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return rows


def format_table(rows: list[CompareRow]) -> str:
    head = (f"{'recipe':<8} {'output':>9} {'d input':>9} {'d router':>9} {'d fc1':>9} {'d fc2':>9} "
            f"{'ms/step':>9}  path")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.recipe:<8} failed: {r.error}")
            continue
        errs = " ".join(f"{v:>9.2e}" for v in r.errors.values())
        lines.append(f"{r.recipe:<8} {errs} {r.step_ms:>9.1f}  {r.path}")
    return "\n".join(lines)


def load_compare_config(path) -> dict:
    """`--config FILE` (YAML or JSON) -> keyword arguments of `run_compare`: the schema shared with
    `qmoe report` (`qmoe.run_config`), e.g.

    {"recipes": ["bf16", "mxfp8", {"name": "nvfp4", "disable_rht": true}],
     "shape": {"tokens", "hidden", "ffn", "experts", "top_k"}, "seed": 0, "steps": 3}
    """
    return load_run_config(path, default_recipes())


def _log_ms_axis(axis) -> None:
    """A log axis of milliseconds labelled 1, 2, 5, 10, 20, 50 (not 2x10^1)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def figure_title(rows: list[CompareRow]) -> str:
    """The problem and the device the rows ran on, as the figure's title."""
    r = rows[0] if rows else None
    if r is None or not r.shape:
        return "qmoe compare"
    s = r.shape
    return (f"qmoe compare: MoE layer, {s['tokens']} tokens, hidden {s['hidden']}, ffn {s['ffn']}, "
            f"{s['experts']} experts, top-{s['top_k']}, on {r.device}")


def compare_figure(rows: list[CompareRow]):
    """A matplotlib Figure: relative error per recipe (output and each gradient), time per step
    per recipe (log axis: NVFP4's reference can be 10x the others), and output error against
    time, titled with the shape and the device. Built without pyplot: no global backend changes."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ValueError("plots need matplotlib: pip install matplotlib (or pip install 'qmoe[test]')") from e
    done = [r for r in rows if not r.error]
    ok = [r for r in done if r.recipe != "fp32"]  # fp32 is the reference: its errors are 0
    fig = Figure(figsize=(16, 5), layout="constrained")
    fig.suptitle(figure_title(rows))
    ax1, ax2, ax3 = fig.subplots(1, 3, width_ratios=[1.4, 1, 1])
    keys = ("output", *GRADIENTS)
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        vals = [max(r.errors[key], 1e-12) for r in ok]  # log axis: an exact 0 would vanish
        ax1.bar([j + i * width for j in range(len(ok))], vals, width, label=key if key == "output" else f"d {key}")
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(ok))], [r.recipe for r in ok])
    ax1.set_yscale("log")
    ax1.set_ylabel("relative error vs fp32 (lower is better)")
    ax1.set_title("MoE layer output and gradients")
    ax1.legend(fontsize=8)

    ax2.barh([r.recipe for r in done][::-1], [r.step_ms for r in done][::-1], color="tab:gray")
    ax2.set_xscale("log")
    _log_ms_axis(ax2.xaxis)
    for y, r in enumerate(done[::-1]):
        ax2.annotate(f"{r.step_ms:.3g}", (r.step_ms, y), textcoords="offset points", xytext=(3, 0), va="center",
                     fontsize=8)
    ax2.margins(x=0.25)
    ax2.set_xlabel("ms per forward + backward step (log)")
    ax2.set_title("Time per step (median after warm-up)")

    markers = "osD^vP*X"
    for i, r in enumerate(ok):  # a legend, not labels by the points: close points' labels would collide
        ax3.scatter(r.step_ms, max(r.output_error, 1e-12), s=50, marker=markers[i % len(markers)], label=r.recipe)
    if ok:
        ax3.legend(fontsize=8)
    ax3.set_xscale("log")
    ax3.set_yscale("log")
    ax3.margins(x=0.15, y=0.25)
    _log_ms_axis(ax3.xaxis)
    ax3.set_xlabel("ms per step (log)")
    ax3.set_ylabel("output relative error")
    ax3.set_title("Accuracy against speed")
    return fig


def plot_compare(rows: list[CompareRow], path) -> None:
    """`--plot FILE.png`: save `compare_figure(rows)`."""
    compare_figure(rows).savefig(path, dpi=110)


def rows_as_dicts(rows: list[CompareRow]) -> list[dict]:
    return [asdict(r) for r in rows]
