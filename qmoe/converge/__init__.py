"""`qmoe converge`: does a recipe train as well as bf16?

A small decoder-only MoE language model (model.py) is trained on the Python standard library's
source, as bytes (data.py), once per bf16 seed and once per recipe, from the same initial
weights and with the same batches (train.py); report.py turns the held-out loss curves into
gaps against the bf16 mean beside the bf16 seed-to-seed noise floor, a JSON file and plots.

    >>> from qmoe.converge import load_converge_config, run_converge, format_table
    >>> cfg = load_converge_config(preset_name="tiny")
    >>> results = run_converge(cfg, device="cpu", out="convergence.json")
    >>> print(format_table(results))
"""
from qmoe.converge.config import (ABLATIONS, BASELINE, PRESET_NAMES, ConvergeConfig, RunSpec, TrainConfig,
                                  load_converge_config, preset, with_overrides)
from qmoe.converge.model import ModelConfig, MoETransformer
from qmoe.converge.report import format_table, plot_results, results_figure, summarize, write_results
from qmoe.converge.run import load_results, merge_results, run_converge

__all__ = ["ABLATIONS", "BASELINE", "PRESET_NAMES", "ConvergeConfig", "RunSpec", "TrainConfig", "ModelConfig",
           "MoETransformer", "load_converge_config", "preset", "with_overrides", "run_converge", "merge_results",
           "load_results", "format_table", "plot_results", "results_figure", "summarize", "write_results"]
