"""Where one MoE layer step's GPU time goes: per-kernel time of forward + backward under
torch.profiler, per recipe at bench_moe's shapes.

    PYTHONPATH=. python3 -m benchmarks.profile_moe --shapes qwen3-30b-a3b --recipes bf16 current --out $OUT/p.json

Per shape: `qmoe.nn.MoELayer` (bench_moe's weights, input and upstream gradient) in bf16 and under
each recipe. After warm-up steps, `--steps` steps run under the profiler; each kernel name's
device time and launches are divided by the step count (rows as in benchmarks.profile_linear:
`kernel_ms`, the step's summed kernel time, and the `--top` kernels with their share).
`--weight-cache` repeats the quantized rows with `cache_quantized_weights=True`: the weights never
change here, so every profiled step is a micro-batch that reuses them.
"""
from __future__ import annotations

import sys

import torch

from benchmarks.bench_moe import RECIPES, SHAPES, inputs
from benchmarks.profile_linear import kernel_times, profile_main, row


def run(shapes, recipes, steps: int, top: int, weight_cache: bool) -> list[dict]:
    import qmoe
    from qmoe.recipes import recipe_from_config

    rows = []
    for name in shapes:
        layer, x, dy = inputs(SHAPES[name])
        for rname in recipes:
            recipe = None if rname == "bf16" else recipe_from_config({"name": rname})
            for cache in ([False, True] if weight_cache and recipe is not None else [False]):
                layer.cache_quantized_weights = cache

                def step(layer=layer, x=x, dy=dy, recipe=recipe):
                    x.grad = None
                    for p in layer.parameters():
                        p.grad = None
                    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
                        y = layer(x)
                    y.backward(dy)
                for _ in range(3):  # warm-up; with the cache, the weights stay put: every profiled step reuses
                    step()
                impl = "qmoe" + (" +wc" if cache else "")
                rows.append(row(name, impl, rname, kernel_times(step, steps), top))
                print(f"{name:<16} {impl:<9} {rname:<8} {rows[-1]['kernel_ms']:8.3f} ms of kernels; top: "
                      + ", ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in rows[-1]["kernels"][:3]), flush=True)
            layer.cache_quantized_weights = False
        layer = x = dy = None
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    return profile_main("benchmarks.profile_moe", __doc__, SHAPES, "qwen3-30b-a3b", RECIPES, ["bf16", "current"],
                        run, argv)


if __name__ == "__main__":
    sys.exit(main())
