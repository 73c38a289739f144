"""`qmoe report`: what every recipe does to realistic tensors (SQNR, error, bits, path).

The tensors imitate what a transformer's MoE layer sees: heavy-tailed activations with a few
outlier channels, small-variance weights with rare large entries, and gradients whose
magnitude varies by orders of magnitude from token to token.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from qmoe.capabilities import capabilities
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling, recipe_to_config)
from qmoe.recipes.recipe import ROLES
from qmoe.run_config import load_run_config, parse_device

DEFAULT_SHAPES = {"tokens": 2048, "hidden": 1024, "ffn": 1024}


@dataclass
class ReportRow:
    recipe: str
    role: str
    copy: str  # "rowwise" or "columnwise" (the wgrad copy, compared in its own domain)
    sqnr_db: float
    rel_error: float
    bits_per_element: float
    path: str


def default_recipes():
    return [DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(), NVFP4BlockScaling()]


def realistic_tensors(tokens: int, hidden: int, ffn: int, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Activation [T, H], weight [F, H] and gradient [T, F] with the tails real training shows."""
    g = torch.Generator().manual_seed(seed)
    # a Gaussian scale mixture: heavy tails like real activations, from our own generator
    act = torch.randn(tokens, hidden, generator=g) * torch.exp(0.75 * torch.randn(tokens, hidden, generator=g)) * 0.5
    outlier_channels = torch.randperm(hidden, generator=g)[: max(1, hidden // 100)]
    act[:, outlier_channels] *= 20.0
    weight = torch.randn(ffn, hidden, generator=g) * 0.02
    spikes = torch.rand(ffn, hidden, generator=g) < 1e-3
    weight = torch.where(spikes, torch.randn(ffn, hidden, generator=g) * 0.3, weight)
    token_scale = torch.exp(torch.randn(tokens, 1, generator=g) * 2.0) * 1e-5
    u = torch.rand(tokens, ffn, generator=g).clamp_min(1e-12)
    sign = torch.where(torch.rand(tokens, ffn, generator=g) < 0.5, -1.0, 1.0)
    grad = sign * -torch.log(u) * token_scale  # Laplace noise, scaled per token
    return {r: v.to(device=device, dtype=torch.bfloat16) for r, v in
            zip(ROLES, (act, weight, grad))}


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    noise = (x.double() - y.double()).pow(2).sum().item()
    signal = x.double().pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * math.log10(signal / noise)


def bits_per_element(qt, columnwise: bool = False) -> float:
    m, k = qt.shape_2d
    parts = ((qt.columnwise_data, qt.columnwise_scale_inv, qt.columnwise_amax) if columnwise
             else (qt.rowwise_data, qt.rowwise_scale_inv, qt.amax))
    nbytes = sum(t.numel() * t.element_size() for t in parts if t is not None)
    return 8.0 * nbytes / (m * k)


def _reference_copy(q, x: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """What the stored copy approximates: x, x^T, or the Hadamard-domain x^T for NVFP4's RHT copies."""
    if not columnwise:
        return x.float()
    if getattr(q, "rht", False):
        from qmoe.reference.quantize_nvfp4 import random_hadamard_transform

        return random_hadamard_transform(x.float().t())
    return x.float().t()


def run_report(recipes=None, shapes=None, seed: int = 0, device=None, progress: bool = True) -> list[ReportRow]:
    """Quantize the realistic set with every recipe and role; one row per (recipe, role, copy)."""
    recipes = recipes or default_recipes()
    shapes = {**DEFAULT_SHAPES, **(shapes or {})}
    device = parse_device(device, "device")
    tensors = realistic_tensors(shapes["tokens"], shapes["hidden"], shapes["ffn"], seed, device)
    caps = capabilities(device)
    jobs = [(r, role) for r in recipes for role in ROLES]
    from tqdm.auto import tqdm

    rows = []
    for recipe, role in tqdm(jobs, desc="qmoe report", disable=not progress, unit="tensor"):
        name = recipe_to_config(recipe)["name"]
        q = recipe.quantizer(role)
        if getattr(q, "generator", "absent") is None:
            q.generator = torch.Generator(device=device).manual_seed(seed)
        x = tensors[role]
        if hasattr(q, "update_scale"):  # delayed scaling: report the steady state, not the fresh scale 1
            q.quantize(x, rowwise=True, columnwise=False)
            q.update_scale()
        qt = q.quantize(x, rowwise=True, columnwise=True)
        cap = caps[name]
        path = f"{cap.hardware}/{cap.backend}"
        for columnwise in (False, True):
            ref = _reference_copy(q, x, columnwise)
            deq = qt.dequantize(torch.float32, columnwise=columnwise).reshape(ref.shape)
            rel = ((deq.double() - ref.double()).norm() / ref.double().norm()).item()
            rows.append(ReportRow(name, role, "columnwise" if columnwise else "rowwise", sqnr_db(ref, deq), rel,
                                  bits_per_element(qt, columnwise), path))
    return rows


def format_table(rows: list[ReportRow]) -> str:
    head = f"{'recipe':<8} {'role':<12} {'copy':<10} {'SQNR dB':>8} {'rel err':>9} {'bits/el':>8}  path"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.recipe:<8} {r.role:<12} {r.copy:<10} {r.sqnr_db:>8.2f} {r.rel_error:>9.2e} "
                     f"{r.bits_per_element:>8.3f}  {r.path}")
    return "\n".join(lines)


def load_report_config(path) -> tuple[list, dict, int]:
    """`--config FILE` -> (recipes or None, shape {tokens, hidden, ffn}, seed): the schema shared with
    `qmoe compare` (`qmoe.run_config`); report skips its fp32/bf16 entries and its other keys."""
    cfg = load_run_config(path, default_recipes(), dims_quantized=("tokens", "hidden", "ffn"))
    recipes = None
    if "recipes" in cfg:
        recipes = [r for r in cfg["recipes"] if not isinstance(r, str)]
        if not recipes:
            raise ValueError("config key 'recipes' names no quantization recipe (report has nothing to do for "
                             "fp32 or bf16)")
    shape = {k: v for k, v in cfg.get("shape", {}).items() if k in DEFAULT_SHAPES}
    return recipes, shape, cfg.get("seed", 0)


def plot_report(rows: list[ReportRow], path) -> None:
    """Bar chart of SQNR per recipe and role, and SQNR against bits per element."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or pip install 'qmoe[test]')") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = list(dict.fromkeys(r.recipe for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(ROLES)
    for i, role in enumerate(ROLES):
        vals = [next((r.sqnr_db for r in rows if r.recipe == rec and r.role == role and r.copy == "rowwise"),
                     float("nan")) for rec in recipes]
        ax1.bar([j + i * width for j in range(len(recipes))], vals, width, label=role)
    ax1.set_xticks([j + width for j in range(len(recipes))], recipes)
    ax1.set_ylabel("SQNR (dB, higher is better)")
    ax1.set_title("Rowwise quantization SQNR by recipe and role")
    ax1.legend()
    for rec in recipes:
        pts = [(r.bits_per_element, r.sqnr_db) for r in rows if r.recipe == rec and r.copy == "rowwise"]
        ax2.scatter([p[0] for p in pts], [p[1] for p in pts], label=rec, s=40)
    ax2.set_xlabel("bits per element (data + scales)")
    ax2.set_ylabel("SQNR (dB)")
    ax2.set_title("Accuracy against storage")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rows_as_dicts(rows):
    return [asdict(r) for r in rows]
