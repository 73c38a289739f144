"""Every autotune config of the FP8 / MXFP8 cast kernels, timed one by one and checked bit for bit.

For FP8 per tensor (delayed), FP8 blocks 1x128 and 128x128, and MXFP8 (E4M3), rowwise +
columnwise and rowwise only, on bf16 65536x7168 and grouped 32 x 2048 x 7168 (one launch), each
config the autotuner could pick (`qmoe.kernels._cast_variants.configs_for`: plain tiles, row
quads, K-major order, chunks, register caps) runs alone (`forced_config`, no tuning) through the
public kernel function:

- exact: its output bytes (codes, scales, amax) equal qmoe.reference's on the same device, NaN
  sign and payload aside (NUMERICS.md); a config that fails or differs is recorded, not fatal;
- ms: median kernel time (`benchmarks.harness.median_ms`);
- frac_copy: (input read once + every output written once) / ms over the device copy bandwidth;
- then the autotuner's own pick for the case (`autotuned`).

Kernels compile first in --jobs processes (Triton's on-disk cache then serves this one). A time
budget (--budget seconds) stops measuring and still writes what was measured. --tiny runs tiny
shapes on inputs whose scaled values are exact in E4M3, so under TRITON_INTERPRET=1 on the CPU
(whose float -> fp8 cast mis-rounds) the checks still hold.

    PYTHONPATH=. python3 -m benchmarks.sweep_quantize_tiles --out $OUT/quantize_tiles.json
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import copy_gbps, gpu_or_tiny, median_ms, run_header, write_results

FAMILIES = ("tensorwise", "block1x128", "block128x128", "mxfp8")
# name: (rows, columns, groups, uneven). Uneven groups ("~"): sizes around rows / groups in
# multiples of 16, as the MoE layer pads its experts' groups (the layer's casts at DeepSeek-V3
# and Qwen3-30B-A3B; the first two are the shapes, the default).
SHAPES = {"65536x7168": (65536, 7168, 0, False), "32x2048x7168": (65536, 7168, 32, False),
          "32x~2048x2048": (65536, 2048, 32, True), "128x~1024x2048": (131072, 2048, 128, True),
          "128x~1024x1536": (131072, 1536, 128, True), "131072x2048": (131072, 2048, 0, False),
          "128x1024x2048": (131072, 2048, 128, False), "128x1536x2048": (196608, 2048, 128, False)}
DEFAULT_SHAPES = ("65536x7168", "32x2048x7168")
TINY_SHAPES = {"136x264": (136, 264, 0, False), "4x(0,37,33,66)x200": (136, 200, 4, False)}
TINY_SPLITS = [0, 37, 33, 66]


def cases(args):
    shapes = list(TINY_SHAPES) if args.tiny else args.shapes
    return [(fam, both, shape) for shape in shapes for fam in args.families for both in (True, False)]


def uneven_sizes(m, groups, g):
    """Group sizes in multiples of 16 around m / groups (+-10 %), summing to m."""
    w = (1 + 0.1 * torch.randn(groups, generator=g, device=g.device)).clamp(min=0.5)
    sizes = (w / w.sum() * m / 16).floor().long() * 16
    sizes[-1] += m - int(sizes.sum())
    return sizes.tolist()


def make_input(m, k, groups, uneven, exact, device):
    """bf16 randn (a few NaN / +-inf), or with `exact` +-(1 + j/8) 2^e with e in a narrow window,
    whose power-of-two scalings are exact E4M3 values. Splits: equal groups, uneven ones
    (`uneven_sizes`), or TINY_SPLITS."""
    g = torch.Generator(device=device).manual_seed(0)
    if exact:
        mant = 1 + torch.randint(0, 8, (m, k), generator=g, device=device).float() / 8
        e = (torch.randint(0, 4, (m, k), generator=g, device=device) + torch.randint(-2, 3, (m, 1), generator=g,
             device=device) + torch.randint(-2, 3, (1, k), generator=g, device=device))
        x = mant * torch.exp2(e.float()) * torch.where(torch.rand(m, k, generator=g, device=device) < 0.5, -1.0, 1.0)
    else:
        x = torch.randn(m, k, generator=g, device=device)
        idx = torch.randint(0, m * k, (3 * 64,), generator=g, device=device)
        x.view(-1)[idx[:64]] = float("nan")
        x.view(-1)[idx[64:128]] = float("inf")
        x.view(-1)[idx[128:]] = -float("inf")
    x = x.to(torch.bfloat16)
    if not groups:
        return x, None
    sizes = TINY_SPLITS if exact else uneven_sizes(m, groups, g) if uneven else [m // groups] * groups
    return x, torch.tensor(sizes, device=device)


def calls(fam, both, x, splits):
    """(kernel function, reference function, Autotuner, its constexprs for configs_for) of a case."""
    from qmoe.contracts.formats import E4M3, ScaleMode
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.kernels import quantize as K
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize as R

    orient = (True, both)
    if fam == "tensorwise":
        if splits is None:
            scale = R.compute_fp8_scale(R.tensor_amax(x), E4M3.max, power_2_scale=True)
            kern, ref = (lambda: K.quantize_fp8_tensorwise(x, scale, E4M3, *orient),
                         lambda: R.quantize_fp8_tensorwise(x, scale, E4M3, *orient))
        else:
            scales = R.compute_fp8_scale(RG.grouped_tensor_amax(x, splits), E4M3.max, power_2_scale=True)
            kern, ref = (lambda: KG.grouped_quantize_fp8_tensorwise(x, splits, scales, E4M3, *orient),
                         lambda: RG.grouped_quantize_fp8_tensorwise(x, splits, scales, E4M3, *orient))
        return kern, ref, K._fp8_tensorwise_kernel, dict(ROWWISE=True, COLWISE=both)
    if fam.startswith("block"):
        br = 1 if fam == "block1x128" else 128
        if splits is None:
            kern, ref = (lambda: K.quantize_fp8_block(x, br, 128, E4M3, True, 0.0, *orient),
                         lambda: R.quantize_fp8_block(x, br, 128, E4M3, True, 0.0, *orient))
        else:
            kern, ref = (lambda: KG.grouped_quantize_fp8_block(x, splits, br, 128, E4M3, True, 0.0, *orient),
                         lambda: RG.grouped_quantize_fp8_block(x, splits, br, 128, E4M3, True, 0.0, *orient))
        return kern, ref, K._fp8_block_kernel, dict(B=128, BLOCK_2D=br == 128, ROWWISE=True, COLWISE=both)
    mode = ScaleMode.ROUND_UP
    if splits is None:
        kern, ref = (lambda: K.quantize_mxfp8(x, E4M3, mode, *orient), lambda: R.quantize_mxfp8(x, E4M3, mode, *orient))
    else:
        kern, ref = (lambda: KG.grouped_quantize_mxfp8(x, splits, E4M3, mode, *orient),
                     lambda: RG.grouped_quantize_mxfp8(x, splits, E4M3, mode, *orient))
    return kern, ref, K._mxfp8_kernel, dict(B=32, ROWWISE=True, COLWISE=both)


def label(cfg) -> str:
    kw = cfg.kwargs
    s = f"{kw['BM']}x{kw['BK']} w{cfg.num_warps}"
    s += " quad" if kw.get("QUAD") else ""
    s += " kmajor" if kw.get("K_MAJOR") else ""
    s += f" chunk{kw['BKC']}" if kw.get("BKC", kw["BK"]) != kw["BK"] else ""
    s += f" maxnreg{cfg.maxnreg}" if cfg.maxnreg else ""
    return s


def mismatches(got, want) -> int:
    """Elements whose bits differ (NaN equal to NaN), summed over the outputs; -1 if shapes differ."""
    n = 0
    for a, b in zip(got, want):
        if b is None:
            continue
        if a is None or a.shape != b.shape or a.dtype != b.dtype:
            return -1
        if a.dtype == torch.float32:
            same = (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))
        else:
            same = a.view(torch.uint8) == b.view(torch.uint8)
            if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                same |= torch.isnan(a.float()) & torch.isnan(b.float())
        n += int((~same).sum())
    return n


def nbytes(x, out) -> int:
    return x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in out if t is not None)


def timer(tiny):
    if not tiny:
        return lambda fn, rep: median_ms(fn, max(5, rep // 4), rep)

    def once(fn, rep):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return once


def warm(args, part: str) -> int:
    """Compile job `part` = "i/n": run its share of (case, config) pairs once."""
    from qmoe.kernels._cast_variants import configs_for, forced_config

    i, n = map(int, part.split("/"))
    device = "cpu" if args.tiny else "cuda"
    shapes = TINY_SHAPES if args.tiny else SHAPES
    pairs = []
    for fam, both, shape in cases(args):
        m, k = shapes[shape][:2]
        _, _, kernel, meta = calls(fam, both, torch.empty(0), None)
        pairs += [(fam, both, shape, cfg) for cfg in configs_for(kernel, m, k, **meta)]
    inputs = {}
    for fam, both, shape, cfg in pairs[i::n]:
        if shape not in inputs:
            inputs[shape] = make_input(*shapes[shape], args.tiny, device)
        kern, _, kernel, _ = calls(fam, both, *inputs[shape])
        try:
            with forced_config(kernel, cfg):
                kern()
        except Exception as err:  # measured (and reported) by the main process
            print(f"warm-up {fam} {label(cfg)}: {type(err).__name__}: {err}"[:300], file=sys.stderr)
    if not args.tiny:
        torch.cuda.synchronize()
    return 0


def spawn_warm_jobs(args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    base = [sys.executable, "-m", "benchmarks.sweep_quantize_tiles", "--families", *args.families,
            "--shapes", *args.shapes]
    base += ["--tiny"] if args.tiny else []
    procs = [subprocess.Popen(base + ["--warm-part", f"{i}/{args.jobs}"], env=env) for i in range(args.jobs)]
    deadline = time.monotonic() + args.budget / 2
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            print("warning: a compile job ran past half the budget and was stopped", file=sys.stderr)


def measure(args, t0: float) -> list[dict]:
    from qmoe.kernels._cast_variants import configs_for, forced_config

    device = "cpu" if args.tiny else "cuda"
    shapes = TINY_SHAPES if args.tiny else SHAPES
    copy = None if args.tiny else copy_gbps(args.rep)
    if copy:
        print(f"device-to-device copy: {copy:.0f} GB/s", flush=True)
    time_ms = timer(args.tiny)
    rows, inputs = [], {}
    for fam, both, shape in cases(args):
        if shape not in inputs:
            inputs.clear()
            inputs[shape] = make_input(*shapes[shape], args.tiny, device)
        x, splits = inputs[shape]
        kern, ref, kernel, meta = calls(fam, both, x, splits)
        want = ref()
        case = {"family": fam, "orientation": "row+col" if both else "row", "shape": shape}
        m, k = shapes[shape][:2]
        for cfg in configs_for(kernel, m, k, **meta):
            row = dict(case, config=label(cfg), **{f"meta_{k_}": v for k_, v in cfg.kwargs.items()},
                       num_warps=cfg.num_warps, maxnreg=cfg.maxnreg)
            if time.monotonic() - t0 > args.budget:
                rows.append(dict(row, error="skipped: time budget"))
                continue
            try:
                with forced_config(kernel, cfg):
                    got = kern()
                    row["mismatches"] = mismatches(got, want)
                    row["exact"] = row["mismatches"] == 0
                    ms = time_ms(kern, args.rep)
                row["ms"] = round(ms, 4)
                if copy:
                    row["gbps"] = round(nbytes(x, got) / ms / 1e6, 1)
                    row["frac_copy"] = round(row["gbps"] / copy, 3)
                del got
            except Exception as err:  # a config that does not compile or run is a result too
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            rows.append(row)
            print({k_: v for k_, v in row.items() if not k_.startswith("meta_")}, flush=True)
        if not args.tiny and time.monotonic() - t0 < args.budget:
            got = kern()  # the autotuner's own pick (tunes on first call)
            ms = time_ms(kern, args.rep)
            pick = getattr(kernel, "best_config", None)
            rows.append(dict(case, config="autotuned", picked=label(pick) if pick else None,
                             exact=mismatches(got, want) == 0, ms=round(ms, 4),
                             gbps=round(nbytes(x, got) / ms / 1e6, 1),
                             frac_copy=round(nbytes(x, got) / ms / 1e6 / copy, 3)))
            print(rows[-1], flush=True)
            del got
        del want
    return rows


def plain(row) -> bool:
    """A config of the tiles the kernels had before the variants."""
    return not (row.get("meta_QUAD") or row.get("meta_K_MAJOR") or row.get("maxnreg")
                or row.get("meta_BKC", row["meta_BK"]) != row["meta_BK"])


def table(rows) -> str:
    """Per case: the fastest config, the fastest plain tile, the autotuner's pick, configs not exact."""
    lines = []
    for fam in FAMILIES:
        for orient in ("row+col", "row"):
            for shape in sorted({r["shape"] for r in rows}):
                case = [r for r in rows if r["family"] == fam and r["orientation"] == orient and r["shape"] == shape]
                timed = [r for r in case if "ms" in r and r["config"] != "autotuned"]
                if not timed:
                    continue
                frac = lambda r: f"{r['frac_copy']:.3f}" if "frac_copy" in r else f"{r['ms']:.1f} ms"  # noqa: E731
                best = min(timed, key=lambda r: r["ms"])
                line = f"{fam:13s} {orient:8s} {shape:19s} best {frac(best)} {best['config']:30s}"
                old = [r for r in timed if plain(r)]
                if old:
                    line += f" plain {frac(min(old, key=lambda r: r['ms']))}"
                line += "".join(f" autotuned {frac(r)} ({r['picked']})" for r in case if r["config"] == "autotuned")
                bad = [r["config"] for r in case if r.get("exact") is False or "error" in r and
                       not r["error"].startswith("skipped")]
                lines.append(line + (f"  NOT EXACT OR FAILED: {bad}" if bad else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("quantize_tiles.json"))
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=list(SHAPES))
    p.add_argument("--tiny", action="store_true", help="tiny shapes, exact inputs (CPU interpreter check)")
    p.add_argument("--rep", type=int, default=25, help="do_bench budget per config (ms)")
    p.add_argument("--jobs", type=int, default=12, help="compile processes (0: compile in this one)")
    p.add_argument("--budget", type=float, default=110.0, help="seconds; later configs are skipped")
    p.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm_part:
        return warm(args, args.warm_part)
    if gpu_or_tiny(args.tiny) is None:
        return 2
    t0 = time.monotonic()
    if args.jobs:
        spawn_warm_jobs(args)
    print(f"compiled in {time.monotonic() - t0:.0f} s", flush=True)
    header = run_header("benchmarks.sweep_quantize_tiles", argv, "cpu" if args.tiny else None)
    rows = measure(args, t0)
    write_results(args.out, header, {"suite": "quantize_tiles", "seconds": round(time.monotonic() - t0, 1),
                                     "rows": rows})
    print(table(rows))
    bad = [r for r in rows if r.get("exact") is False or ("error" in r and not r["error"].startswith("skipped"))]
    print(f"{len(rows)} rows, {len(bad)} not exact or failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
