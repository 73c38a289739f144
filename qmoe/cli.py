"""The `qmoe` command: `info`, `compare` (the main job), `report`, `converge` and `bench <suite>`."""
from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from pathlib import Path

BENCH_SUITES = ("quantize", "gemm", "linear", "routing", "moe", "ep", "activation", "fused_activation", "bias")


def _cmd_info(args) -> int:
    import torch

    import qmoe
    from qmoe.capabilities import capabilities

    from qmoe.run_config import parse_device

    device = parse_device(args.device) if args.device else None
    caps = capabilities(device)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    dev = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"qmoe {qmoe.__version__}  torch {torch.__version__}  triton {triton_version}")
    print(f"device: {dev} ({name})")
    print(f"{'recipe':<8} {'hardware':<10} {'backend':<10} why")
    for c in caps.values():
        print(f"{c.recipe:<8} {c.hardware:<10} {c.backend:<10} {c.why}")
    return 0


def _print_and_save(args, rows, format_table, rows_as_dicts, plot) -> None:
    """The table on stdout, and the rows as `--json` and a figure as `--plot` when asked."""
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows_as_dicts(rows), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


def _check_run_args(args) -> None:
    """Everything a compare/report run is told, checked before it starts (exit 2, one line)."""
    from qmoe.run_config import check_output_path, parse_device

    args.device = str(parse_device(args.device))
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install matplotlib (or pip install 'qmoe[test]')") \
                from None


def _cmd_report(args) -> int:
    from qmoe.report import format_table, load_report_config, plot_report, rows_as_dicts, run_report

    _check_run_args(args)
    recipes, shapes, seed = load_report_config(args.config) if args.config else (None, None, 0)
    if args.seed is not None:
        seed = args.seed
    rows = run_report(recipes, shapes, seed=seed, device=args.device, progress=not args.no_progress)
    _print_and_save(args, rows, format_table, rows_as_dicts, plot_report)
    return 0


def _cmd_compare(args) -> int:
    from qmoe.compare import format_table, load_compare_config, plot_compare, rows_as_dicts, run_compare

    _check_run_args(args)
    kwargs = load_compare_config(args.config) if args.config else {}
    if args.seed is not None:
        kwargs["seed"] = args.seed
    if args.steps is not None:
        kwargs["steps"] = args.steps
    rows = run_compare(**kwargs, device=args.device, progress=not args.no_progress)
    _print_and_save(args, rows, format_table, rows_as_dicts, plot_compare)
    failed = [r.recipe for r in rows if r.error]
    if failed:
        print(f"qmoe compare: {', '.join(failed)} failed (see the table)", file=sys.stderr)
    return 1 if failed else 0


def _cmd_converge(args) -> int:
    from qmoe.converge import (format_table, load_converge_config, merge_results, plot_results, run_converge,
                               with_overrides, write_results)

    if args.merge:
        results = merge_results(args.merge)
        write_results(results, args.out)
    else:
        cfg = load_converge_config(args.config, preset_name=args.preset)
        cfg = with_overrides(cfg, recipes=args.recipes, seeds=args.seeds, steps=args.steps, ablations=args.ablations,
                             precision=args.precision)
        results = run_converge(cfg, device=args.device, out=args.out, resume=args.resume,
                               checkpoints=args.checkpoint_dir, time_budget=args.time_budget,
                               command="qmoe " + shlex.join(args.argv), progress=not args.no_progress,
                               only=args.only, concurrent_jobs=args.concurrent_jobs)
    print(format_table(results))
    print(f"wrote {args.out}")
    if args.plot:
        for path in plot_results(results, args.plot):
            print(f"wrote {path}")
    failed = [label for label, r in results["runs"].items() if r["status"] == "failed"]
    if failed:
        print(f"qmoe converge: {', '.join(failed)} failed (see the table)", file=sys.stderr)
    return 1 if failed else 0


def _cmd_bench(args) -> int:
    root = Path(__file__).resolve().parents[1]
    if (root / "benchmarks").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        mod = importlib.import_module(f"benchmarks.bench_{args.suite}")
    except ModuleNotFoundError as e:
        print(f"qmoe bench {args.suite}: benchmark suite not available ({e}); run from a source checkout "
              f"(pip install -e .)", file=sys.stderr)
        return 2
    return int(mod.main(args.rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qmoe", description="quantized Mixture-of-Experts toolkit")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="how each recipe runs on this machine, and why")
    info.add_argument("--device", default=None)
    info.set_defaults(func=_cmd_info)
    cmp = sub.add_parser("compare", help="an MoE layer's forward and backward under every recipe: error, time, path")
    cmp.add_argument("--config", help="YAML/JSON file: recipes, shape {tokens, hidden, ffn, experts, top_k}, "
                                      "seed, steps (the schema qmoe report reads too)")
    cmp.add_argument("--plot", help="save a figure (PNG) of error and time per recipe")
    cmp.add_argument("--json", help="save the rows as JSON")
    cmp.add_argument("--seed", type=int, default=None, help="overrides the config's seed (default 0)")
    cmp.add_argument("--steps", type=int, default=None, help="timed steps per recipe (default 2 on CPU, 10 on CUDA)")
    cmp.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    cmp.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmp.set_defaults(func=_cmd_compare)
    rep = sub.add_parser("report", help="quantize realistic tensors with every recipe and compare")
    rep.add_argument("--config", help="YAML/JSON file: recipes, shape {tokens, hidden, ffn}, seed (compare's "
                                      "schema: its fp32/bf16 entries, experts, top_k and steps are skipped)")
    rep.add_argument("--plot", help="save a figure (PNG) of the results")
    rep.add_argument("--json", help="save the rows as JSON")
    rep.add_argument("--seed", type=int, default=None, help="overrides the config's seed (default 0)")
    rep.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    rep.add_argument("--no-progress", action="store_true", help="no progress bar")
    rep.set_defaults(func=_cmd_report)
    from qmoe.converge.config import ALL_RECIPES, PRECISIONS, PRESET_NAMES

    conv = sub.add_parser("converge", help="train a small MoE language model under each recipe and bf16; "
                                           "loss gaps against bf16 with its seed-to-seed noise floor")
    conv.add_argument("--preset", choices=PRESET_NAMES, default=None,
                      help="tiny (CPU, about a minute), small (GPU), dsv3-like (GPU); default: the config's, "
                           "else tiny")
    conv.add_argument("--config", help="YAML/JSON file overlaying the preset: preset, model {...}, train {...}, "
                                       "recipes [...], seeds")
    conv.add_argument("--recipes", nargs="+", choices=ALL_RECIPES, default=None,
                      help="runs to train (bf16 is the baseline and is required); default: the preset's")
    conv.add_argument("--seeds", type=int, default=None, help="bf16 seeds, whose spread is the noise floor "
                                                             "(default 2)")
    conv.add_argument("--steps", type=int, default=None, help="training steps per run (default: the preset's)")
    conv.add_argument("--precision", choices=PRECISIONS, default=None,
                      help="bf16: torch.autocast(bf16) with fp32 weights; fp32: no torch.autocast; "
                           "auto (default): bf16 on CUDA, fp32 on CPU")
    conv.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    conv.add_argument("--out", default="convergence.json", help="results JSON (default convergence.json); "
                                                                "rewritten after every run")
    conv.add_argument("--plot", help="PNG file (three panels) or a directory (three PNGs)")
    conv.add_argument("--resume", action="store_true", help="keep --out's finished runs, continue interrupted "
                                                            "runs from their checkpoints (<out>.ckpt/)")
    conv.add_argument("--checkpoint-dir", default=None, help="where interrupted runs keep their state "
                                                             "(default <out>.ckpt)")
    conv.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                      help="stop cleanly (results and plots written) once this many seconds are spent; "
                           "--resume continues")
    conv.add_argument("--ablations", action="store_true", help="add NVFP4 without RHT / stochastic rounding / "
                                                               "2-D weight scaling, and delayed with history 16")
    conv.add_argument("--only", nargs="+", metavar="LABEL", help="train only these runs (labels as in the table: "
                                                                 "bf16-s0, delayed, nvfp4-no-rht, ...)")
    conv.add_argument("--concurrent-jobs", type=int, default=1, metavar="N",
                      help="how many converge jobs share this device (recorded beside tokens/s)")
    conv.add_argument("--merge", nargs="+", metavar="FILE", help="join results files of the same config into "
                                                                "--out (trains nothing)")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.set_defaults(func=_cmd_converge)
    bench = sub.add_parser("bench", help="run a benchmark suite and write benchmarks/results/<suite>.json")
    bench.add_argument("suite", choices=BENCH_SUITES)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the suite")
    bench.set_defaults(func=_cmd_bench)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"qmoe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
