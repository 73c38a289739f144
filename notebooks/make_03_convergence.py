"""Writes notebooks/03_convergence.ipynb (kept as code so reviews read a diff, not JSON)."""
import nbclient
import nbformat as nbf

cells = []
md = lambda s: cells.append(nbf.v4.new_markdown_cell(s.strip()))  # noqa: E731
code = lambda s: cells.append(nbf.v4.new_code_cell(s.strip()))  # noqa: E731

md("""
# Does it train? Loss gaps against bf16

One step's quantization error (notebooks 01 and 02) does not say whether a recipe *trains* as
well as bf16: errors can average out over steps, or compound. `qmoe converge` answers it
directly. It trains a small decoder-only language model whose every block's feed-forward is a
`qmoe.nn.MoELayer`, on the Python standard library's own source read as bytes (every machine
has it; about one file in ten is held out by a fixed rule), once per bf16 seed and once per
recipe, all from the same initial weights and with the same batches. What differs between
runs is the arithmetic of the experts' GEMMs, and, for the bf16 seeds, the initial weights:
their spread is the **noise floor**, the gap a run can show by its seed alone.

This notebook runs a shortened `tiny` preset on the CPU (through qmoe's pure-torch reference),
then loads the GPU results committed in `benchmarks/results/convergence.json`.
""")
code("""
import json, math
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from qmoe.converge import format_table, load_converge_config, results_figure, run_converge, with_overrides
%matplotlib inline

cfg = load_converge_config(preset_name="tiny")
cfg = with_overrides(cfg, recipes=["bf16", "current"], steps=60)   # the tiny preset, shortened
print(cfg.model)
print(cfg.train)
""")
md("""
## Train: bf16 twice (two seeds), FP8 current scaling once

`run_converge` trains the runs one after another. `out=` would write the results JSON after
every run (and `resume=True` would pick up where a stopped job left off); here the results
stay in memory.
""")
code("""
results = run_converge(cfg, device="cpu", progress=False)
print(format_table(results))
""")
md("""
Reading the table: *final loss* is the mean of a run's last evaluations on the held-out files;
*gap* is relative to the mean of the bf16 seeds (positive: worse than bf16). A gap smaller
than the noise floor cannot be told apart from bf16 at this budget. With a few dozen steps of a
model this small, the noise floor is large; the GPU presets below are where the numbers mean
something.
""")
code("""
fig = results_figure(results)
plt.show()
""")
md("""
## The GPU results

`benchmarks/run_convergence.sh` runs the `small` preset (tens of millions of parameters, 2000
steps) on an H200: bf16 with three seeds, all five recipes and the ablations (NVFP4 without each
of its safeguards, delayed scaling with a short history), and writes
`benchmarks/results/convergence.json`. The goals: every FP8 recipe and MXFP8 within 0.25 % of
bf16 (DeepSeek-V3's bar for FP8 training), NVFP4 within 1.5 % (NVIDIA's NVFP4 pre-training
report), or within the noise floor. Read the gaps against that floor: at this size a change of
numerics moves a run about as much as a change of seed (`docs/convergence.md` discusses it).
""")
code("""
path = Path("..") / "benchmarks" / "results" / "convergence.json"
if path.is_file():
    gpu = json.loads(path.read_text())
    h = gpu["header"]
    print(f"{gpu['config']['preset']} preset on {h['device']}, {h['date']}, commit {h['commit'][:10]}, "
          f"precision {gpu['precision']}, {gpu['parameters']['total'] / 1e6:.1f}M parameters")
    print(format_table(gpu))
    fig = results_figure(gpu)
    plt.show()
else:
    print("No GPU results yet: benchmarks/results/convergence.json is absent. To make them, run "
          "`bash benchmarks/run_convergence.sh small` on a GPU from the repository root.")
""")

nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                "language": "python"}})
# executed as tests/test_notebooks.py runs it and written with its outputs, so a reader sees the
# plots on the repository's web page without running anything
nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
nbf.write(nb, "notebooks/03_convergence.ipynb")
