"""`qmoe bench quantize`: achieved bandwidth of every recipe's quantizer, against the device copy.

For each recipe and role, on bf16 inputs of 65536x7168, 16384x2048 and 32 groups x 2048 rows x
7168 (grouped, one `GroupedTensor.quantize`), rowwise + columnwise and rowwise only:

- gbps: minimum bytes (the input read once, every output tensor written once) over the median
  time of the whole quantizer call (`triton.testing.do_bench`), amax launches included;
- copy_gbps: a device-to-device copy measured in the same run (bytes read + written);
- frac_copy = gbps / copy_gbps;
- graphed_gbps, graphed_frac_copy: the same call captured in a CUDA graph and replayed, as a
  graphed training step runs it: device time only. The eager call's time also holds whatever of
  the host's work the device waits for, which varies from run to run on the grouped calls
  (graph_error says why a call could not be captured);
- torch_compile_gbps: `torch.compile` of the reference (`qmoe.reference`) doing the same work
  (grouped rows: the compiled per-tensor reference called once per group: the split path).

"current-amax" is current scaling as the MoE layer runs it where the kernel that produced the
rows reduced their amax (`qmoe.contracts.carriers.RowsWithAmax`): the quantizer only casts.
The amax is computed before timing, and a dense shape is quantized as one group.

Quantizers whose computation is identical (e.g. delayed-scaling input and weight) are measured
once. Writes benchmarks/results/quantize.json and prints a table.

    python -m benchmarks.bench_quantize [--quick] [--no-peer] [--warm-jobs 12]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import capture_graph, copy_gbps, median_ms, run_header, write_results

SHAPES = {"65536x7168": (65536, 7168, None), "16384x2048": (16384, 2048, None), "32x2048x7168": (65536, 7168, 32)}
RECIPES = ("delayed", "current", "current-amax", "block", "mxfp8", "nvfp4")
ROLES = ("input", "weight", "grad_output")
RESULT = Path(__file__).resolve().parent / "results" / "quantize.json"


def make_recipe(name):
    from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                              NVFP4BlockScaling)
    return {"delayed": DelayedScaling, "current": Float8CurrentScaling, "current-amax": Float8CurrentScaling,
            "block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}[name]()


def signature(q, recipe: str) -> tuple:
    """What a quantizer computes (two quantizers with one signature run the same kernels)."""
    keys = ("fmt", "block", "power_2_scale", "amax_epsilon", "scale_mode", "block_2d", "rht", "stochastic")
    return (type(q).__name__, recipe == "current-amax") + tuple(str(getattr(q, k, None)) for k in keys)


def plan(args):
    """[(shape name, recipe, role, both)] in measurement order."""
    return [(s, r, role, both) for s in args.shapes for r in args.recipes for role in args.roles
            for both in (True, False)]


# ---------------------------------------------------------------- what is timed

def inputs(shape_name, device="cuda"):
    m, k, groups = SHAPES[shape_name]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    splits = torch.full((groups,), m // groups, device=device, dtype=torch.int64) if groups else None
    return x, splits


def qmoe_call(q, x, splits, both, recipe: str = ""):
    from qmoe import GroupedTensor
    if recipe == "current-amax":  # the producer's amax handed over: the call only casts
        from qmoe.contracts.carriers import RowsWithAmax
        from qmoe.reference.quantize import group_amax

        if splits is None:
            splits = torch.tensor([x.shape[0]], device=x.device)
        offsets = torch.cat([splits.new_zeros(1), splits.cumsum(0)])
        rows = RowsWithAmax(x, group_amax(x, offsets))
        return lambda: GroupedTensor.quantize(rows, splits, q, rowwise=True, columnwise=both, validate=False)
    if splits is None:
        return lambda: q.quantize(x, rowwise=True, columnwise=both)
    return lambda: GroupedTensor.quantize(x, splits, q, rowwise=True, columnwise=both, validate=False)


def output_bytes(out) -> int:
    seen, total = set(), 0
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax",
                 "columnwise_amax"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def reference_fn(q, both):
    """The reference computation of quantizer q (rowwise, and columnwise when `both`)."""
    from qmoe.quant.quantizer import (Float8BlockQuantizer, Float8CurrentQuantizer, Float8DelayedQuantizer,
                                      MXFP8Quantizer, NVFP4Quantizer)
    from qmoe.reference import quantize as R
    from qmoe.reference import quantize_nvfp4 as R4
    if isinstance(q, Float8DelayedQuantizer):
        return lambda x, s: R.quantize_fp8_tensorwise(x, s, q.fmt, True, both)
    if isinstance(q, Float8CurrentQuantizer):
        return lambda x, s: R.quantize_fp8_tensorwise(
            x, R.compute_fp8_scale(R.tensor_amax(x), q.fmt.max, q.power_2_scale), q.fmt, True, both)
    if isinstance(q, Float8BlockQuantizer):
        return lambda x, s: R.quantize_fp8_block(x, q.block[0], q.block[1], q.fmt, q.power_2_scale, q.amax_epsilon,
                                                 True, both)
    if isinstance(q, MXFP8Quantizer):
        return lambda x, s: R.quantize_mxfp8(x, q.fmt, q.scale_mode, True, both)
    if isinstance(q, NVFP4Quantizer):
        return lambda x, s: R4.quantize_nvfp4(x, q.block_2d, True, both, q.rht, q.stochastic, None)
    raise TypeError(q)


_COMPILED: dict = {}


def peer_call(q, x, splits, both):
    key = (signature(q), both)
    if key not in _COMPILED:  # dynamic shapes: one graph serves every shape (and the warm-up jobs' caches)
        _COMPILED[key] = torch.compile(reference_fn(q, both), dynamic=True)
    fn, scale = _COMPILED[key], torch.ones((), device=x.device)
    if splits is None:
        return lambda: fn(x, scale)
    m = x.shape[0] // splits.numel()
    parts = [x[i * m:(i + 1) * m] for i in range(splits.numel())]
    return lambda: [fn(p, scale) for p in parts]


def bench_ms(fn, rep):
    return median_ms(fn, max(5, rep // 4), rep)


# ---------------------------------------------------------------- driver

def parse(argv):
    p = argparse.ArgumentParser(prog="qmoe bench quantize", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    p.add_argument("--roles", nargs="+", default=list(ROLES), choices=ROLES)
    p.add_argument("--quick", action="store_true", help="65536x7168 only, no torch.compile peer")
    p.add_argument("--no-peer", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--rep", type=int, default=60, help="do_bench repetition budget per measurement (ms)")
    p.add_argument("--warm-jobs", type=int, default=0,
                   help="compile kernels and peers in this many processes first (caches shared on disk)")
    p.add_argument("--out", type=Path, default=RESULT)
    p.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.no_peer = ["65536x7168"], True
    return args


def warm(args, part: str) -> int:
    """Warm-up job: for its share of the distinct computations, run the qmoe call on every shape
    (compiling each autotune config) and the compiled peer (one dynamic-shape graph each)."""
    i, n = map(int, part.split("/"))
    jobs = {}
    for shape, recipe, role, both in plan(args):
        q = make_recipe(recipe).quantizer(role)
        jobs.setdefault((signature(q, recipe), both), (recipe, role, both))
    for recipe, role, both in list(jobs.values())[i::n]:
        for shape in args.shapes:
            x, splits = inputs(shape)
            with region(recipe):
                qmoe_call(make_recipe(recipe).quantizer(role), x, splits, both, recipe)()
            if not args.no_peer and recipe != "current-amax":
                try:
                    peer_call(make_recipe(recipe).quantizer(role), x, splits, both)()
                except Exception as e:  # measured (and reported) by the main process
                    print(f"warm-up peer {recipe}/{role}: {type(e).__name__}: {e}"[:200], file=sys.stderr)
            del x, splits
    torch.cuda.synchronize()
    return 0


def region(recipe):
    """Delayed scaling inside an autocast region, as in training: the scale update runs once at
    region exit (outside one, every grad_output call would update the history and scale)."""
    import contextlib
    if recipe != "delayed":
        return contextlib.nullcontext()
    import qmoe
    return qmoe.autocast(recipe=make_recipe(recipe), enabled=True)


def spawn_warm_jobs(args, argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    base = [sys.executable, "-m", "benchmarks.bench_quantize", *(sys.argv[1:] if argv is None else argv)]
    procs = [subprocess.Popen(base + ["--warm-part", f"{i}/{args.warm_jobs}"], env=env)
             for i in range(args.warm_jobs)]
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"warning: warm-up jobs exited with {codes}; measuring anyway", file=sys.stderr)


def write(args, rows):
    rows = [{k: v for k, v in r.items() if k != "error"} for r in rows]  # errors: printed
    write_results(args.out, args.header, {"suite": "quantize", "rows": rows}, indent=1, quiet=True)


def measure(args) -> list[dict]:
    copy = copy_gbps(args.rep)
    print(f"device-to-device copy: {copy:.0f} GB/s", flush=True)
    rows, cache, tensors = [], {}, {}
    for shape, recipe, role, both in plan(args):
        q = make_recipe(recipe).quantizer(role)
        key = (signature(q, recipe), shape, both)
        if key not in cache:
            if shape not in tensors:
                tensors = {shape: inputs(shape)}
                torch.cuda.empty_cache()
            x, splits = tensors[shape]
            gbps = graphed = graph_err = peer = err = None
            try:
                call = qmoe_call(q, x, splits, both, recipe)
                with region(recipe):
                    nbytes = x.numel() * x.element_size() + output_bytes(call())
                    gbps = nbytes / bench_ms(call, args.rep) / 1e6
                    graph, graph_err = capture_graph(call)
                    if graph is not None:
                        graphed = nbytes / bench_ms(graph.replay, args.rep) / 1e6
                        del graph
            except Exception as e:  # keep measuring the rest; the row says what failed
                err = f"{type(e).__name__}: {e}"[:300]
            if gbps is not None and not args.no_peer and recipe != "current-amax":  # the peer measures its amax
                try:
                    peer = nbytes / bench_ms(peer_call(q, x, splits, both), args.rep) / 1e6
                except Exception as e:
                    err = f"peer: {type(e).__name__}: {e}"[:300]
            cache[key] = (gbps, graphed, graph_err, peer, err)
        gbps, graphed, graph_err, peer, err = cache[key]
        row = {"recipe": recipe, "role": role, "shape": shape, "grouped": SHAPES[shape][2] is not None,
               "both_orientations": both, "gbps": gbps, "copy_gbps": copy,
               "frac_copy": None if gbps is None else gbps / copy, "graphed_gbps": graphed,
               "graphed_frac_copy": None if graphed is None else graphed / copy, "torch_compile_gbps": peer}
        if graph_err:
            row["graph_error"] = graph_err
        if err:
            row["error"] = err
        rows.append(row)
        write(args, rows)  # a run cut short keeps what it measured
        print(format_row(row), flush=True)
    return rows


def format_row(r) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    speed = r["gbps"] / r["torch_compile_gbps"] if r["gbps"] and r["torch_compile_gbps"] else None
    return (f"{r['recipe']:8} {r['role']:11} {r['shape']:13} {'grouped' if r['grouped'] else '':7} "
            f"{'row+col' if r['both_orientations'] else 'row':7} {f(r['gbps'], '8.0f')} {f(r['frac_copy'], '6.3f')} "
            f"{f(r.get('graphed_frac_copy'), '6.3f')} {f(r['torch_compile_gbps'], '8.0f')} {f(speed, '6.2f')}"
            + (f"  {r['error']}" if "error" in r else ""))


def print_table(header, rows):
    print(f"\n{header['device']}, torch {header['torch']}, triton {header['triton']}")
    print(f"{'recipe':8} {'role':11} {'shape':13} {'':7} {'copies':7} {'GB/s':>8} {'frac':>6} {'graph':>6} "
          f"{'compile':>8} {'x':>6}")
    for r in rows:
        print(format_row(r))


def print_autotune_choices():
    """The config each autotuned kernel chose per key (shape axes and dtypes)."""
    from triton.runtime.autotuner import Autotuner

    import qmoe.kernels.quantize as kq
    import qmoe.kernels.quantize_nvfp4 as kn
    for mod in (kq, kn):
        for name, obj in vars(mod).items():
            if isinstance(obj, Autotuner):
                for key, cfg in obj.cache.items():
                    print(f"autotune {name} {key[:3]}: {cfg}")


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("qmoe bench quantize needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.warm_part:
        return warm(args, args.warm_part)
    t0 = time.time()
    if args.warm_jobs:
        spawn_warm_jobs(args, argv)
        print(f"warm-up jobs done in {time.time() - t0:.0f} s", flush=True)
    args.header = run_header("benchmarks.bench_quantize", argv)
    print_table(args.header, measure(args))
    print_autotune_choices()
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
