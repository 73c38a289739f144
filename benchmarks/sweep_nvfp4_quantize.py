"""Sweep of the NVFP4 quantize kernels: every exposed config, every role, against the device copy.

For bf16 65536x7168 and 32 groups x 2048 rows x 7168 (one grouped launch), for each role as
NVFP4BlockScaling quantizes it (input: 1x16, RHT columnwise copy; weight: 16x16; grad_output:
1x16, RHT columnwise, stochastic rounding), rowwise + columnwise and rowwise only:

- every config of the quantize launch (`CAST_CONFIGS`, amax launch at its first config), timed
  as the whole op (amax launch + quantize launch, `op_ms`) and as the quantize launch alone
  (`cast_ms`: what the op costs once a producer hands it the amaxes);
- every config of the amax launch (`AMAX_CONFIGS`), alone (`amax_ms`), on the row+col cases of
  input and weight (its RHT and plain specializations);
- the kernels before the rewrite (`benchmarks/nvfp4_main_kernel.py`, its small-problem config)
  as `main`;
- gbps = minimum bytes (x read once, every output written once) / time; frac_copy = gbps over a
  device-to-device copy measured in the same run;
- bits: round to nearest against the reference (`qmoe.reference`, on the device), every byte;
  stochastic rounding against the first config (the draws depend only on a value's position);
  and the fraction of each output's bytes equal to `main`'s (same seed: same stream).

Kernels compile first in --warm-jobs processes (Triton's disk cache), so the run fits in two
minutes; a failing variant is recorded with its error and the sweep goes on.

    PYTHONPATH=. python3 -m benchmarks.sweep_nvfp4_quantize --out $OUT/nvfp4_quantize.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 -m benchmarks.sweep_nvfp4_quantize --tiny --out /tmp/n.json
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import copy_gbps, median_ms, run_header, write_results

SHAPES = {"65536x7168": (65536, 7168, None), "32x2048x7168": (65536, 7168, 32)}
TINY_SHAPES = {"128x256": (128, 256, None), "4x32x256": (128, 256, 4)}
# role: (16x16 blocks, RHT columnwise copy, stochastic rounding), as NVFP4BlockScaling quantizes it
ROLES = {"input": (False, True, False), "weight": (True, False, False), "grad_output": (False, True, True)}
NAMES = ("row", "row_s", "amax", "col", "col_s", "col_amax")
SEED = 1234


def cases(shapes):
    return [(s, role, both) for s in shapes for role in ROLES for both in (True, False)]


def variants(case):
    """What is measured for a case: ("main", None), ("cast", i), ("amax", i)."""
    from qmoe.kernels import quantize_nvfp4 as K4
    _, role, both = case
    out = [("main", None)] + [("cast", i) for i in range(len(K4.CAST_CONFIGS))]
    if both and role in ("input", "weight"):
        out += [("amax", i) for i in range(len(K4.AMAX_CONFIGS))]
    return out


def inputs(shape, table, device):
    m, k, groups = table[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    splits = torch.full((groups,), m // groups, device=device, dtype=torch.int64) if groups else None
    return x, splits


def op_args(x, splits, role, both):
    """nvfp4_op's arguments (the stochastic-rounding seeds drawn from a fixed generator)."""
    block_2d, rht, sr = ROLES[role]
    seeds = None
    if sr:
        seeds = torch.randint(0, 2 ** 62, (2,), generator=torch.Generator(device=x.device).manual_seed(SEED),
                              dtype=torch.int64, device=x.device)
    return (x, splits, 1 if splits is None else splits.numel(), block_2d, True, both, rht, seeds)


def forced(kind, i):
    from qmoe.kernels import quantize_nvfp4 as K4
    if kind == "cast":
        return K4.forced_configs(cast=K4.CAST_CONFIGS[i], amax=K4.AMAX_CONFIGS[0])
    return K4.forced_configs(cast=K4.CAST_CONFIGS[0], amax=K4.AMAX_CONFIGS[i])


def main_op():
    """The pre-rewrite op with its small-problem config at every size (one compile per specialization)."""
    from benchmarks import nvfp4_main_kernel as M

    def small_launch(kernel, grid, args, small, numel, **meta):
        kernel.fn[grid](*args, **meta, **small.kwargs, num_warps=small.num_warps, num_stages=small.num_stages)

    M.launch = small_launch
    return M.nvfp4_op


def run_variant(kind, i, args):
    from qmoe.kernels import quantize_nvfp4 as K4
    if kind == "main":
        return main_op()(*args)
    with forced(kind, i):
        return K4.nvfp4_op(*args)


# ---------------------------------------------------------------- checks

def same_bits(a, b) -> bool:
    if a.dtype == torch.float32:
        return bool(((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool((a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all())


def compare(got, want) -> dict:
    """Per output: True when every byte is equal, else the fraction of equal bytes."""
    out = {}
    for n, a, b in zip(NAMES, got, want):
        if a is None or b is None or a.numel() == 0:
            continue
        if a.shape != b.shape:
            out[n] = f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
            continue
        if same_bits(a, b):
            out[n] = True
        else:
            ab, bb = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
            out[n] = round(float((ab == bb).float().mean()), 6)
    return out


def reference(x, splits, role, both):
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize_nvfp4 as R4
    block_2d, rht, _ = ROLES[role]
    if splits is None:
        r = R4.quantize_nvfp4(x, block_2d, True, both, rht)
        return r[:2] + (r[2].reshape(1),) + r[3:5] + ((r[5].reshape(1),) if both else (None,))
    return RG.grouped_quantize_nvfp4(x, splits, block_2d, True, both, rht)


def nbytes(x, out) -> int:
    return x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in out if t is not None)


# ---------------------------------------------------------------- driver

def parse(argv):
    p = argparse.ArgumentParser(prog="sweep_nvfp4_quantize", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="small shapes, for TRITON_INTERPRET=1 on a CPU")
    p.add_argument("--rep", type=int, default=30, help="do_bench repetition budget per measurement (ms)")
    p.add_argument("--warm-jobs", type=int, default=8, help="processes compiling the kernels first")
    p.add_argument("--warm-timeout", type=float, default=60.0, help="seconds the warm-up may take")
    p.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.table = TINY_SHAPES if args.tiny else SHAPES
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny or args.device == "cpu":
        args.warm_jobs = 0
    return args


def warm(args) -> int:
    """A warm-up job: its share of the variants, run once each (compiles land in the disk cache)."""
    i, n = map(int, args.warm_part.split("/"))
    jobs = [(case, v) for case in cases(args.table) for v in variants(case)][i::n]
    tensors = {}
    for (shape, role, both), (kind, j) in jobs:
        if shape not in tensors:
            tensors = {shape: inputs(shape, args.table, args.device)}
        x, splits = tensors[shape]
        try:
            if kind == "amax":
                with forced(kind, j):
                    from qmoe.kernels import quantize_nvfp4 as K4
                    K4.nvfp4_plan(*op_args(x, splits, role, both))[1]()
            else:
                run_variant(kind, j, op_args(x, splits, role, both))
        except Exception as e:  # measured (and recorded) by the main process
            print(f"warm-up {shape} {role} {kind} {j}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
    torch.cuda.synchronize()
    return 0


def spawn_warm_jobs(args, argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    base = [sys.executable, "-m", "benchmarks.sweep_nvfp4_quantize", *(sys.argv[1:] if argv is None else argv)]
    procs = [subprocess.Popen(base + ["--warm-part", f"{i}/{args.warm_jobs}"], env=env)
             for i in range(args.warm_jobs)]
    deadline = time.time() + args.warm_timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            print("warning: a warm-up job ran out of time; the rest compiles while measuring", file=sys.stderr)


def time_ms(fn, args):
    if args.device == "cpu":  # the interpreter: one call, wall clock (no bandwidth meaning)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return median_ms(fn, max(5, args.rep // 4), args.rep)


def measure_case(args, case, x, splits, copy, rows, refs):
    from qmoe.kernels import quantize_nvfp4 as K4
    shape, role, both = case
    sr = ROLES[role][2]
    a = op_args(x, splits, role, both)
    want = None
    if not sr:  # rowwise only: the rowwise part of both copies' reference
        if (shape, role) not in refs:
            refs.clear()
            refs[(shape, role)] = reference(x, splits, role, True)
        want = refs[(shape, role)] if both else refs[(shape, role)][:3] + (None, None, None)
    base = dict(shape=shape, grouped=splits is not None, role=role, both_orientations=both)
    main_out, first = None, None
    for kind, i in variants(case):
        row = dict(base, variant=kind if kind == "main" else f"{kind}{i}")
        try:
            if kind == "amax":
                cfg = K4.AMAX_CONFIGS[i]
                row["config"] = dict(cfg.kwargs, num_warps=cfg.num_warps)
                with forced(kind, i):
                    out, amax_launch, _ = K4.nvfp4_plan(*a)
                    amax_launch()
                    row["amax_ms"] = time_ms(amax_launch, args)
                row["amax_frac_read"] = x.numel() * x.element_size() / (row["amax_ms"] * 1e-3) / 1e9 / (copy / 2)
                if want is not None:  # the amaxes (the other outputs: None here)
                    row["bits_vs_reference"] = compare((None, None, out[2], None, None, out[5]), want)
            else:
                if kind == "cast":
                    cfg = K4.CAST_CONFIGS[i]
                    row["config"] = dict(cfg.kwargs, num_warps=cfg.num_warps)
                got = run_variant(kind, i, a)
                size = nbytes(x, got)
                row["op_ms"] = time_ms(lambda: run_variant(kind, i, a), args)
                row["op_gbps"] = size / (row["op_ms"] * 1e-3) / 1e9
                row["frac_copy"] = row["op_gbps"] / copy
                if kind == "cast":
                    with forced(kind, i):
                        _, amax_launch, cast_launch = K4.nvfp4_plan(*a)
                        amax_launch()
                        row["cast_ms"] = time_ms(cast_launch, args)
                    row["cast_frac_copy"] = size / (row["cast_ms"] * 1e-3) / 1e9 / copy
                if want is not None:
                    row["bits_vs_reference"] = compare(got, want)
                if kind == "main":
                    main_out = got
                else:
                    if main_out is not None:
                        row["bytes_equal_to_main"] = compare(got, main_out)
                    if first is None:
                        first = got
                    row["bits_vs_first_config"] = compare(got, first)
        except Exception as e:  # record and go on
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
        write_results(args.out, args.header, {"suite": "sweep_nvfp4_quantize", "copy_gbps": copy, "rows": rows},
                      indent=1, quiet=True)
        print(format_row(row), flush=True)


def format_row(r) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    def ok(d):
        if not d:
            return "-"
        return "equal" if all(v is True for v in d.values()) else "DIFF " + ",".join(
            f"{k}={v}" for k, v in d.items() if v is not True)
    cfg = r.get("config")
    cfg = "" if cfg is None else f"{cfg['BM']}x{cfg['BK']} w{cfg['num_warps']} kt{cfg['K_TILES']} v{cfg['COL_VEC']}"
    return (f"{r['shape']:13} {r['role']:11} {'row+col' if r['both_orientations'] else 'row':7} {r['variant']:6} "
            f"{cfg:22} op {f(r.get('op_ms'), '7.3f')} ms {f(r.get('frac_copy'), '5.3f')} | cast "
            f"{f(r.get('cast_ms'), '7.3f')} {f(r.get('cast_frac_copy'), '5.3f')} | amax {f(r.get('amax_ms'), '7.3f')} "
            f"| "
            f"ref {ok(r.get('bits_vs_reference'))} | 1st {ok(r.get('bits_vs_first_config'))} | main "
            f"{ok(r.get('bytes_equal_to_main'))}" + (f" | ERROR {r['error']}" if "error" in r else ""))


def main(argv=None) -> int:
    args = parse(argv)
    if args.warm_part is not None:
        return warm(args)
    args.header = run_header("benchmarks.sweep_nvfp4_quantize", argv)
    t0 = time.time()
    if args.warm_jobs:
        spawn_warm_jobs(args, argv)
        print(f"warm-up: {time.time() - t0:.0f} s", flush=True)
    copy = copy_gbps(args.rep) if args.device == "cuda" else 1.0
    print(f"device-to-device copy: {copy:.0f} GB/s", flush=True)
    rows, tensors, refs = [], {}, {}
    for case in cases(args.table):
        if case[0] not in tensors:
            tensors = {case[0]: inputs(case[0], args.table, args.device)}
            if args.device == "cuda":
                torch.cuda.empty_cache()
        measure_case(args, case, *tensors[case[0]], copy, rows, refs)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
