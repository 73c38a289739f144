"""Where one grouped linear step's GPU time goes: per-kernel time of forward + backward (dx and dW),
under torch.profiler, per recipe at bench_linear's shapes.

    PYTHONPATH=. python3 -m benchmarks.profile_linear --shapes qwen3-fc1 --recipes mxfp8 --out $OUT/p.json

Per shape: torch._grouped_mm on bf16 operands (the target's base) and `qmoe.nn.GroupedLinear` under
each recipe, with the same inputs as bench_linear. After warm-up steps, `--steps` steps run under
the profiler; each kernel name's device time and launches are divided by the step count. Rows
carry the step's summed kernel time (`kernel_ms`: gaps between kernels are not in it) and the
`--top` kernels by time with their share of it; `weight_cache` repeats the qmoe rows with
`cache_quantized_weights=True`: the weights never change here, so every profiled step is a
micro-batch that reuses them (the first micro-batch of an optimizer step quantizes, unprofiled).
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch

from benchmarks.bench_linear import SHAPES, _recipes, inputs
from benchmarks.harness import run_header, write_results


def kernel_times(step, steps: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (device us per step, launches per step)} of `steps` calls of `step`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    us = collections.Counter()
    calls = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us[event.name] += event.device_time
            calls[event.name] += 1
    return {name: (us[name] / steps, calls[name] / steps) for name in us}


def row(shape: str, impl: str, recipe: str, times: dict, top: int) -> dict:
    total = sum(t for t, _ in times.values())
    ranked = sorted(times.items(), key=lambda item: -item[1][0])[:top]
    return dict(shape=shape, impl=impl, recipe=recipe, kernel_ms=round(total / 1e3, 4),
                kernels=[dict(name=name[:160], us=round(t, 1), launches=round(c, 2), share=round(t / total, 3))
                         for name, (t, c) in ranked])


def run(shapes, recipes, steps: int, top: int, weight_cache: bool) -> list[dict]:
    import qmoe

    rows = []
    for shape in shapes:
        e, m, k, n = SHAPES[shape]
        x, w, dy, ends, splits = inputs(shape)

        def bf16_step():
            x.grad = w.grad = None
            torch._grouped_mm(x, w.transpose(-2, -1), offs=ends).backward(dy)

        cases = [("torch._grouped_mm", "bf16", bf16_step)]
        for cache in ([False, True] if weight_cache else [False]):
            layer = qmoe.nn.GroupedLinear(e, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda",
                                          cache_quantized_weights=cache)
            with torch.no_grad():
                layer.weight.copy_(w)
            for name, recipe in recipes.items():
                def step(layer=layer, recipe=recipe):
                    x.grad = layer.weight.grad = None
                    with qmoe.autocast(recipe=recipe):
                        y = layer(x, splits)
                    y.backward(dy)
                cases.append(("qmoe" + (" +wc" if cache else ""), name, step))
        for impl, name, step in cases:
            for _ in range(3):  # warm-up; with the cache, the weights stay put: every profiled step reuses
                step()
            rows.append(row(shape, impl, name, kernel_times(step, steps), top))
            print(f"{shape:<10} {impl:<18} {name:<7} {rows[-1]['kernel_ms']:8.3f} ms of kernels; top: "
                  + ", ".join(f"{kk['name'][:40]} {kk['share']:.0%}" for kk in rows[-1]["kernels"][:3]), flush=True)
        x = w = dy = None
        torch.cuda.empty_cache()
    return rows


def profile_main(module: str, doc: str, shapes, default_shape: str, recipes, default_recipes, run, argv=None) -> int:
    """The command line both profiles share: choose shapes and recipes, profile, write --out."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", default=[default_shape], choices=list(shapes))
    p.add_argument("--recipes", nargs="+", default=list(default_recipes), choices=list(recipes))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--weight-cache", action="store_true", help="also the qmoe rows with cache_quantized_weights=True")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{module} needs a CUDA GPU", file=sys.stderr)
        return 2
    header = run_header(module, argv)
    rows = run(args.shapes, args.recipes, args.steps, args.top, args.weight_cache)
    write_results(args.out, header, dict(suite=module.rsplit(".", 1)[-1], method=doc, steps=args.steps, rows=rows))
    return 0


def main(argv=None) -> int:
    recipes = _recipes()

    def run_named(shapes, names, steps, top, weight_cache):
        return run(shapes, {k: v for k, v in recipes.items() if k in names}, steps, top, weight_cache)
    return profile_main("benchmarks.profile_linear", __doc__, SHAPES, "qwen3-fc1", recipes, ["mxfp8"], run_named,
                        argv)


if __name__ == "__main__":
    sys.exit(main())
