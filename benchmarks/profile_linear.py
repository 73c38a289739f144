"""Where a grouped linear forward + backward spends its time, per recipe (torch.profiler).

Run: `PYTHONPATH=. python -m benchmarks.profile_linear [--shape qwen3-fc1] [--recipes ...]`.
The step is `qmoe bench linear`'s (quantization included); the tables list its kernels by CUDA
time per step under the kernel, wall and issue times, then the Python functions with the most
own time (cProfile). A diagnostic, not a benchmark file: the
times of record are linear.json's.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_linear import SHAPES, _recipes
from benchmarks.profile_moe import kernel_table, print_tables
from benchmarks.profile_quantize import top_functions


def step_fn(shape: str, recipe):
    import qmoe

    e, m, k, n = SHAPES[shape]
    torch.manual_seed(0)
    x = torch.randn(e * m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(e * m, n, device="cuda", dtype=torch.bfloat16)
    splits = torch.full((e,), m, device="cuda", dtype=torch.int64)
    layer = qmoe.nn.GroupedLinear(e, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")

    def step():
        x.grad = None
        layer.weight.grad = None
        with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            y = layer(x, splits)
        y.backward(dy)
    return step


def main(argv=None) -> int:
    recipes = {"bf16": None, **_recipes()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-fc1")
    parser.add_argument("--recipes", nargs="+", choices=list(recipes), default=["bf16", "delayed", "current"])
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args(argv)
    print_tables((lambda name=name: table(args.shape, recipes[name], name) for name in args.recipes), args.out)
    return 0


def table(shape: str, recipe, name: str) -> str:
    step = step_fn(shape, recipe)
    out = kernel_table(step, f"{shape} {name}", steps=6, top=20)
    return out + "\n-- host: Python functions by own time over 20 steps\n" + "\n".join(top_functions(step, 20, 12))


if __name__ == "__main__":
    raise SystemExit(main())
