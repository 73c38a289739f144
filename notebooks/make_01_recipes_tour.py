"""Writes notebooks/01_recipes_tour.ipynb (kept as code so reviews read a diff, not JSON)."""
import nbclient
import nbformat as nbf

cells = []
md = lambda s: cells.append(nbf.v4.new_markdown_cell(s.strip()))  # noqa: E731
code = lambda s: cells.append(nbf.v4.new_code_cell(s.strip()))  # noqa: E731

md("""
# A tour of qmoe's recipes

Each recipe decides how a tensor becomes low precision: which element format, how many
values share a scale, and how that scale is chosen. This notebook quantizes tensors that look
like what an MoE layer sees (heavy-tailed activations with outlier channels, small weights
with rare spikes, gradients whose size varies by orders of magnitude between tokens) and
shows what each recipe does to them. Everything runs on the CPU through qmoe's reference
quantizers, which are the executable form of `NUMERICS.md`.
""")
code("""
import math
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import qmoe
from qmoe.recipes import (DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                          MXFP8BlockScaling, NVFP4BlockScaling, recipe_to_config)
from qmoe.report import realistic_tensors, sqnr_db
%matplotlib inline

tensors = realistic_tensors(tokens=512, hidden=512, ffn=512, seed=0)
recipes = [Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(), NVFP4BlockScaling()]
{k: (tuple(v.shape), v.dtype, f"amax={v.float().abs().max():.3g}") for k, v in tensors.items()}
""")
md("""
## Accuracy per recipe and role

SQNR (signal to quantization noise, in dB) of the rowwise copy. Per-tensor FP8 loses the most
on gradients, whose per-token magnitudes span orders of magnitude; block scaling recovers it.
NVFP4 has 4-bit elements, so it trades about 10 dB for half the bytes.
""")
code("""
rows = []
for r in recipes:
    for role, x in tensors.items():
        q = r.quantizer(role)
        qt = q.quantize(x, rowwise=True, columnwise=False)
        rows.append((recipe_to_config(r)["name"], role, sqnr_db(x.float(), qt.dequantize())))
for name, role, s in rows:
    print(f"{name:<8} {role:<12} {s:6.2f} dB")
""")
md("## Where the error lands\n\nThe distribution of the relative error per element of the activation.")
code("""
x = tensors["input"].float()
fig, ax = plt.subplots(figsize=(8, 4))
for r in recipes:
    d = r.quantizer("input").quantize(x, columnwise=False).dequantize()
    rel = ((d - x).abs() / x.abs().clamp_min(1e-6)).flatten()
    ax.hist(torch.log10(rel.clamp_min(1e-8)).numpy(), bins=80, histtype="step", label=recipe_to_config(r)["name"])
ax.set_xlabel("log10 relative error per element"); ax.set_ylabel("elements"); ax.legend()
ax.set_title("Per-element error on the activation");
""")
md("""
## The scales each recipe chooses

Block recipes pick one scale per block. FP8 block scaling rounds it down to a power of two;
MXFP8 stores only the exponent (E8M0); NVFP4 stores an E4M3 scale per 16 values under one fp32
tensor scale. Histograms of log2 of the dequantization scale per block:
""")
code("""
fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
for ax, r in zip(axes, recipes[1:]):
    qt = r.quantizer("input").quantize(x, columnwise=False)
    s = qt.rowwise_scale_inv.float()
    if qt.amax is not None:  # NVFP4: block scale times the tensor's decode scale
        s = s * (qt.amax / (448 * 6))
    ax.hist(torch.log2(s[s > 0]).flatten().numpy(), bins=60)
    ax.set_title(recipe_to_config(r)["name"]); ax.set_xlabel("log2 scale_inv")
fig.tight_layout();
""")
md("""
## NVFP4's random Hadamard transform

The wgrad copies of activations and gradients are quantized along the tokens. The random
Hadamard transform mixes each run of 16 values first, which makes blocks look Gaussian (the
FP4 grid's best case) and spreads isolated outliers. Both wgrad operands carry the same
transform, so it cancels in the GEMM. It is not free accuracy: when a few tokens dominate a
block (as with these gradients, whose per-token scale varies by e^2 standard deviations), the
mixing spreads the large token over its 15 neighbours and the measured SQNR can drop. Measure it
on your data; `NVFP4BlockScaling(disable_rht=True)` turns it off.
""")
code("""
g = tensors["grad_output"].float()
for rht in (False, True):
    q = NVFP4BlockScaling(disable_rht=not rht, disable_stochastic_rounding=True).quantizer("grad_output")
    qt = q.quantize(g, rowwise=False, columnwise=True)
    ref = g.t()
    if rht:
        from qmoe.reference.quantize_nvfp4 import random_hadamard_transform
        ref = random_hadamard_transform(g.t())
    print(f"RHT={rht}: columnwise SQNR {sqnr_db(ref, qt.dequantize(columnwise=True)):.2f} dB")
""")
md("""
## Stochastic rounding is unbiased

Round-to-nearest always maps 0.3 (in units of the grid) to the same value; stochastic
rounding picks a neighbour with the right probability, so the average converges to the input.
""")
code("""
v = torch.full((64, 64), 0.3)
v[:, ::16] = 6.0   # one 6 per 16-value block pins the scale to 1, so 0.3 sits between grid points 0 and 0.5
body = torch.ones_like(v, dtype=torch.bool); body[:, ::16] = False
nearest = NVFP4BlockScaling().quantizer("input").quantize(v, columnwise=False).dequantize()[body].mean()
q = NVFP4BlockScaling(disable_rht=True).quantizer("grad_output")
q.generator = torch.Generator().manual_seed(0)
draws = torch.stack([q.quantize(v, columnwise=False).dequantize()[body].mean() for _ in range(64)])
print(f"input 0.3: round-to-nearest mean {nearest:.4f}, stochastic mean {draws.mean():.4f}")
""")
md("""
## Delayed scaling

Delayed scaling uses a scale computed from past amaxes, so a quantize call needs no amax pass.
The scale updates when the outermost `qmoe.autocast` region exits.
""")
code("""
layer = qmoe.nn.Linear(512, 512)
recipe = DelayedScaling(amax_history_len=4)
for step in range(3):
    with qmoe.autocast(recipe=recipe):
        y = layer(tensors["input"].float() * (step + 1))
    q = layer.recipe_state.quantizers["input"]
    print(f"step {step}: input scale {q.scale.item():.4g}, history {q.amax_history.tolist()}")
""")
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                "language": "python"}})
# executed as tests/test_notebooks.py runs it and written with its outputs, so a reader sees the
# plots on the repository's web page without running anything
nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
nbf.write(nb, "notebooks/01_recipes_tour.ipynb")
