"""Where an MoE layer step spends its GPU time: the top kernels per recipe (torch.profiler).

Run: `PYTHONPATH=. python -m benchmarks.profile_moe [--shape deepseek-v3-ep8] [--recipes ...]`.
Prints, per recipe, the kernels of two forward + backward steps sorted by total CUDA time
(per step), and writes the same tables to --out. This is a diagnostic, not a benchmark file:
the step times of record are `qmoe bench moe`'s.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_moe import RECIPES, SHAPES, _step_fn
from benchmarks.profile_quantize import issue_and_wall_s


def kernel_table(step, label: str, steps: int = 4, top: int = 25) -> str:
    """The kernels of `steps` calls of `step`, by total CUDA time per call, under a header with
    the kernel time, the wall time and the time to issue a call (host-bound when near the wall)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    host_s, wall_s = issue_and_wall_s(step, steps, warmup=3)
    host_ms, wall_ms = host_s * 1e3, wall_s * 1e3
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    lines = [f"== {label}: {total:.2f} ms of kernels per step, {wall_ms:.2f} ms wall "
             f"({host_ms:.2f} ms to issue it: near the wall time means the host bounds the step)"]
    for e in events[:top]:
        ms = e.self_device_time_total / steps / 1e3
        if ms <= 0:
            continue
        lines.append(f"{ms:8.3f} ms {e.count // steps:5d}x  {e.key[:110]}")
    return "\n".join(lines)


def profile(shape: dict, recipe_name: str, steps: int = 4, top: int = 25) -> str:
    import qmoe
    from qmoe.recipes import recipe_from_config

    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(shape["hidden"], shape["ffn"], shape["experts"], shape["top_k"],
                             params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(shape["tokens"], shape["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    recipe = None if recipe_name == "bf16" else recipe_from_config({"name": recipe_name})
    return kernel_table(_step_fn(layer, x, dy, recipe), recipe_name, steps, top)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="deepseek-v3-ep8")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args(argv)
    print_tables((lambda name=name: profile(SHAPES[args.shape], name) for name in args.recipes), args.out)
    return 0


def print_tables(tables, out: str | None) -> None:
    """Make each table (`tables` yields functions returning one), print it, then write them all to `out`."""
    made = []
    for table in tables:
        made.append(table())
        print(made[-1], flush=True)
        torch.cuda.empty_cache()
    if out:
        with open(out, "w") as f:
            f.write("\n\n".join(made) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
