"""Writes notebooks/02_moe_layer.ipynb (kept as code so reviews read a diff, not JSON)."""
import nbclient
import nbformat as nbf

cells = []
md = lambda s: cells.append(nbf.v4.new_markdown_cell(s.strip()))  # noqa: E731
code = lambda s: cells.append(nbf.v4.new_code_cell(s.strip()))  # noqa: E731

md("""
# Inside `qmoe.nn.MoELayer`

An MoE layer routes every token to `top_k` of `num_experts` expert MLPs, groups the token
copies by expert, runs every expert's GEMMs over its group, and adds the results back per
token, weighted by the routing probabilities. This notebook opens each stage on a small layer
on the CPU (qmoe's pure-torch reference, the same arithmetic the GPU kernels follow):

1. routing: the top-k choice, the probabilities, how many tokens each expert gets;
2. padding: each expert's group is padded to the recipe's `align_size` with rows of zeros;
3. the grouped path (one quantize and one GEMM for all experts) against the split path (one per expert);
4. what each recipe costs in accuracy and time, with `qmoe.compare` (the `qmoe compare` job).

Dimensions: T tokens, H hidden, F ffn, E experts, K top-k.
""")
code("""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import qmoe
from qmoe import ops
from qmoe.recipes import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling
from qmoe.compare import make_problem
%matplotlib inline

T, H, F, E, K = 128, 128, 128, 8, 2
# the layer, an input and an upstream gradient exactly as `qmoe compare` makes them: heavy-tailed
# activations with outlier channels at unit RMS per token, and gradients whose scale varies by token
layer, x, dy = make_problem({"tokens": T, "hidden": H, "ffn": F, "experts": E, "top_k": K}, seed=0)
{name: tuple(p.shape) for name, p in layer.named_parameters()}
""")
md("""
## 1. Routing

The router is a linear layer kept in fp32 (`router.weight [E, H]`), so which experts a token
picks does not flip with the activation precision. By default (`score_function="softmax"`,
`pre_softmax=False`) it ranks the logits, keeps the top K, and takes a softmax over those K:
each token's probabilities sum to 1. `probs [T, E]` is zero outside the chosen experts and
`routing_map [T, E]` marks them.
""")
code("""
with torch.no_grad():
    probs, routing_map = layer.router(x)
top_p, top_e = probs.topk(K, dim=-1)
for t in range(4):
    print(f"token {t}: experts {top_e[t].tolist()}  probs {[round(p, 3) for p in top_p[t].tolist()]}")
print("every token picks", routing_map.sum(1).unique().tolist(), "experts; probs sum to",
      probs.sum(1).min().item(), "..", probs.sum(1).max().item())
""")
code("""
counts = routing_map.sum(0)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.5))
ax1.bar(range(E), counts.tolist())
ax1.axhline(T * K / E, color="gray", ls="--", label="perfect balance")
ax1.set_xlabel("expert"); ax1.set_ylabel("tokens routed"); ax1.set_title("Tokens per expert"); ax1.legend()
ax2.hist(top_p[:, 0].numpy(), bins=30, label="first choice")
ax2.hist(top_p[:, 1].numpy(), bins=30, alpha=0.7, label="second choice")
ax2.set_xlabel("routing probability"); ax2.set_title("Probabilities of the chosen experts"); ax2.legend()
fig.tight_layout()
""")
md("""
## 2. Permutation and padding to the recipe's `align_size`

`ops.moe_permute` copies each token once per chosen expert and groups the copies by expert.
Quantized GEMMs want each group to be a whole number of blocks along the tokens (the
columnwise copies used by the weight gradient are quantized in blocks of rows), so every group
is padded with zero rows to the recipe's `align_size`: 16 for FP8 delayed/current/block
scaling, 32 for MXFP8, 128 for NVFP4 (none without a recipe). The row count
`R = T*K + E*(align_size - 1)` depends only on the shapes, never on the routing, so the buffers
are static and a CUDA graph can hold them.
""")
code("""
print(f"{'recipe':<8} {'align':>5}  {'R':>5}  split sizes (real tokens per expert: {counts.tolist()})")
permuted = {}
for recipe in (None, Float8BlockScaling(), MXFP8BlockScaling(), NVFP4BlockScaling()):
    align = recipe.align_size if recipe is not None else 1
    out, row_probs, row_id_map, split_sizes = ops.moe_permute(x, routing_map, probs, align_size=align, top_k=K)
    permuted[align] = (out, row_probs, split_sizes)
    name = type(recipe).__name__ if recipe is not None else "none"
    print(f"{name[:8]:<8} {align:>5}  {out.shape[0]:>5}  {split_sizes.tolist()}")
""")
md("""
Inside each expert's group the real token copies come first, then its padding rows. Padding
rows and the unused tail after the last group are exactly zero, and so are their routing
probabilities, so they add nothing to any amax, scale, product or gradient.
""")
code("""
out, row_probs, split_sizes = permuted[32]   # MXFP8
starts = torch.cat((torch.zeros(1, dtype=torch.int64), split_sizes.cumsum(0).long()))
is_pad = torch.ones(out.shape[0], dtype=torch.bool)
for g in range(E):
    is_pad[starts[g]: starts[g] + counts[g]] = False
print("padding rows:", int(is_pad.sum()), " all zero:", bool((out[is_pad] == 0).all()),
      " probs zero:", bool((row_probs[is_pad] == 0).all()),
      " real rows nonzero:", bool((out[~is_pad].abs().sum(1) > 0).all()))

fig, ax = plt.subplots(figsize=(11, 1.8))
ax.imshow(out.abs().amax(1, keepdim=True).T.clamp_min(1e-3).log10().numpy(), aspect="auto", cmap="viridis")
for s in starts.tolist():
    ax.axvline(s - 0.5, color="white", lw=0.8)
ax.set_yticks([]); ax.set_xlabel("permuted row (white lines: expert group starts)")
ax.set_title("log10 max|row| of the permuted MXFP8 buffer: dark bands are the zero padding");
""")
md("""
## 3. The grouped path and the split path

`grouped_path="grouped"` (what `"auto"` picks wherever it can) quantizes all groups in one
launch into a `GroupedTensor` and runs one grouped GEMM, with the split sizes left on the
device: no host synchronisation, so it can be captured in a CUDA graph. `grouped_path="split"`
reads the split sizes on the host and quantizes and multiplies each expert on its own: slow and
simple, the cross-check. Same weights, same input, same recipe: the outputs and every gradient
agree bit for bit.
""")
code("""
split_layer = qmoe.nn.MoELayer(H, F, E, K, grouped_path="split")
split_layer.load_state_dict(layer.state_dict())

def run(m, recipe):
    xi = x.clone().requires_grad_(True)
    m.zero_grad()
    with qmoe.autocast(recipe=recipe):
        y = m(xi)
    y.backward(dy)
    return [y.detach(), xi.grad, m.router.weight.grad, m.experts.fc1.weight.grad, m.experts.fc2.weight.grad]

for recipe in (MXFP8BlockScaling(), NVFP4BlockScaling(disable_stochastic_rounding=True)):
    same = [torch.equal(a, b) for a, b in zip(run(layer, recipe), run(split_layer, recipe))]
    print(f"{type(recipe).__name__:<20} output, d input, d router, d fc1, d fc2 bit-identical: {same}")
""")
md("""
(NVFP4 is run without stochastic rounding here: the two paths draw their random numbers in a
different order, so with it the gradients agree only in distribution.)

## 4. Accuracy against speed, per recipe

`qmoe.compare.run_compare` is what `qmoe compare` runs: the same layer, input and upstream
gradient under every recipe, with the relative error of the output and of each gradient
against an fp32 run, and the median step time after a warm-up step (delayed scaling's first
step uses the fresh scale 1). On a CPU every recipe runs qmoe's reference, which spends its
time on quantization (NVFP4's most), so CPU times rank the reference, not the GPU kernels; run
`qmoe compare --device cuda` or `qmoe bench moe` on a GPU for speed.
""")
code("""
from qmoe.compare import compare_figure, format_table, run_compare

rows = run_compare(shape={"tokens": 128, "hidden": 64, "ffn": 128, "experts": 8, "top_k": 2},
                   device="cpu", steps=1, progress=False)
print(format_table(rows))
""")
code("""
compare_figure(rows)
""")
md("""
What the numbers say: bf16 activations cost about 0.5% relative error. The four FP8 recipes
land near 5-10%; block scaling and MXFP8 produce identical numbers because both store E4M3
values with power-of-two scales, and scaling by a power of two does not change which mantissa
a value rounds to (only block size would matter, through saturation or underflow, and neither
happens here). NVFP4's 4-bit elements cost three to four times more error, and its stochastic
rounding of gradients adds noise that averages out over steps rather than within one.
""")

nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                "language": "python"}})
# executed as tests/test_notebooks.py runs it and written with its outputs, so a reader sees the
# plots on the repository's web page without running anything
nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
nbf.write(nb, "notebooks/02_moe_layer.ipynb")
