"""Where a small quantizer call spends its time: host overhead against device time.

`qmoe bench quantize` finds the 16384x2048 shape at 3-25% of copy bandwidth although its kernels
move only ~100 MB: the call is bound by the host, not the device. For each recipe this measures,
on a tiny input (the device idle most of the time, so wall time per call is the host's cost) and
on 16384x2048:

- host_us: wall time per call over many calls without synchronizing;
- device_us: the summed time of the call's kernels (torch.profiler), and their count (launches);
- the Python functions with the most own time (cProfile), so the overhead has names;
- host_us_via_dispatcher: the same calls through torch's custom-op dispatcher (KernelOp.direct
  off), the path every call took before kernels were called directly in eager.

    PYTHONPATH=. python -m benchmarks.profile_quantize --out benchmarks/results/profile_quantize.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from benchmarks.bench_quantize import RECIPES, make_recipe, region
from benchmarks.results_file import write_results

SHAPES = {"128x2048": (128, 2048), "16384x2048": (16384, 2048)}


def issue_and_wall_s(fn, calls: int, warmup: int) -> tuple[float, float]:
    """Seconds per call: to issue it (no synchronisation inside the loop), and until the GPU is done."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    issue = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return issue, (time.perf_counter() - t0) / calls


def host_us(fn, calls: int = 300) -> float:
    return issue_and_wall_s(fn, calls, warmup=20)[0] * 1e6


def device_profile(fn, calls: int = 20) -> tuple[float, float, dict[str, float]]:
    """(kernel microseconds per call, launches per call, {kernel name: microseconds per call}) of
    `fn`, by torch.profiler; it sees the kernels inside a replayed CUDA graph too."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel: dict[str, float] = {}
    for e in kernels:
        per_kernel[e.name[:60]] = per_kernel.get(e.name[:60], 0.0) + e.device_time / calls
    total_us = sum(per_kernel.values())
    return total_us, len(kernels) / calls, dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))


def top_functions(fn, calls: int = 200, n: int = 14) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip() and ln.strip()[0].isdigit()]
    return lines[:n]


def measure(q, x, both: bool, recipe_name: str) -> dict:
    from qmoe.kernels._triton_utils import KernelOp

    fn = lambda: q.quantize(x, rowwise=True, columnwise=both)  # noqa: E731
    with region(recipe_name):  # delayed scaling: its scale update at the region's exit
        fn()
        dev_us, launches, kernels = device_profile(fn)
        row = dict(host_us=host_us(fn), device_us=dev_us, launches=launches, kernels=kernels)
        KernelOp.direct = False  # the same calls through torch's custom-op dispatcher
        try:
            row["host_us_via_dispatcher"] = host_us(fn)
        finally:
            KernelOp.direct = True
        if x.shape[0] <= 128:
            row["top_functions"] = top_functions(fn)
    return row


def main(argv=None) -> int:
    import triton

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES))
    args = p.parse_args(argv)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  rows=[])
    for recipe_name in args.recipes:
        q = make_recipe(recipe_name).quantizer("input")
        for shape, (m, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for both in (False, True):
                row = dict(recipe=recipe_name, shape=shape, both_orientations=both)
                try:
                    row.update(measure(q, x, both, recipe_name))
                    print(f"{recipe_name:8s} {shape:11s} both={both!s:5s} host {row['host_us']:7.1f} us "
                          f"(via dispatcher {row['host_us_via_dispatcher']:7.1f})  device {row['device_us']:7.1f} us  "
                          f"launches {row['launches']:4.1f}", flush=True)
                    if "top_functions" in row and not both:
                        print("\n".join(row["top_functions"]), flush=True)
                except Exception as e:  # keep profiling the rest; the row says what failed
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{recipe_name} {shape} both={both}: {row['error']}", flush=True)
                result["rows"].append(row)
                if args.out:
                    write_results(args.out, result, indent=1, quiet=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
