"""`qmoe bench linear`: one grouped linear forward+backward, quantization included.

Peers measured in the same run: bf16 `torch._grouped_mm` (autograd) and, when importable,
torchao's FP8 rowwise `_to_fp8_rowwise_then_scaled_grouped_mm` (carry its wheel to the device).
Writes benchmarks/results/linear.json: {"header", "suite", "rows": [{"shape", "impl", "recipe",
"ms", "tflops", "speedup_vs_bf16", "ratio_vs_torchao"}]}.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.harness import run_header, write_results

SHAPES = {  # name: (experts, rows per expert, K, N), BASELINES.md
    "dsv3-fc1": (32, 2048, 7168, 4096),
    "dsv3-fc2": (32, 2048, 2048, 7168),
    "mixtral-fc1": (8, 4096, 4096, 28672),
    "qwen3-fc1": (128, 512, 2048, 1536),
}
RESULTS = Path(__file__).resolve().parent / "results" / "linear.json"


def _recipes():
    from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                              NVFP4BlockScaling)
    return {"delayed": DelayedScaling(), "current": Float8CurrentScaling(), "block": Float8BlockScaling(),
            "mxfp8": MXFP8BlockScaling(), "nvfp4": NVFP4BlockScaling()}


def _bench(fn, reps):
    import triton

    return triton.testing.do_bench(fn, warmup=reps, rep=reps * 10, return_mode="median")


def inputs(name: str):
    """Seeded CUDA inputs of shape `name`: x [E*M, K] and w [E, N, K] (bf16, requiring grad), dy
    [E*M, N], the groups' int32 end rows (torch._grouped_mm's offs) and int64 sizes."""
    e, m, k, n = SHAPES[name]
    torch.manual_seed(0)
    x = torch.randn(e * m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).requires_grad_(True)
    dy = torch.randn(e * m, n, device="cuda", dtype=torch.bfloat16)
    ends = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * m
    splits = torch.full((e,), m, device="cuda", dtype=torch.int64)
    return x, w, dy, ends, splits


def run(shapes, recipes, reps=10, on_shape=None):
    """Rows for every shape; on_shape(rows) is called after each shape (partial results survive)."""
    import qmoe

    rows = []
    for name in shapes:
        e, m, k, n = SHAPES[name]
        flops = 3 * 2 * e * m * n * k
        x, w, dy, ends, splits = inputs(name)

        def step(f):
            def go():
                x.grad = None
                w.grad = None
                f().backward(dy)
            return go

        timings = {}
        timings[("torch._grouped_mm", "bf16")] = _bench(
            step(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)), reps)
        try:
            from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as tao
            timings[("torchao", "fp8-rowwise")] = _bench(
                step(lambda: tao(x, w.transpose(-2, -1), ends, pad_token_groups_for_grouped_mm=False)), reps)
        except Exception as err:  # noqa: BLE001 - a missing peer is recorded, not fatal
            print(f"torchao peer unavailable: {err!r}", file=sys.stderr)
        print(f"  {name} peers: " + ", ".join(f"{k[0]} {v:.3f} ms" for k, v in timings.items()), flush=True)
        layer = qmoe.nn.GroupedLinear(e, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            layer.weight.copy_(w)
        for rname, recipe in recipes.items():
            def fwd(recipe=recipe):
                with qmoe.autocast(recipe=recipe):
                    return layer(x, splits)

            def go(fwd=fwd):
                x.grad = None
                layer.weight.grad = None
                fwd().backward(dy)
            try:
                timings[("qmoe", rname)] = _bench(go, reps)
                print(f"  {name} qmoe {rname}: {timings[('qmoe', rname)]:.3f} ms", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"qmoe {rname} failed on {name}: {err!r}", file=sys.stderr)
        bf16 = timings[("torch._grouped_mm", "bf16")]
        tao_ms = timings.get(("torchao", "fp8-rowwise"))
        for (impl, rname), ms in timings.items():
            rows.append(dict(shape=name, impl=impl, recipe=rname, ms=round(ms, 4),
                             tflops=round(flops / ms / 1e9, 1), speedup_vs_bf16=round(bf16 / ms, 3),
                             ratio_vs_torchao=round(tao_ms / ms, 3) if tao_ms else None))
            print(f"{name:<12} {impl:<18} {rname:<12} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TF/s  "
                  f"x{bf16 / ms:5.2f} vs bf16" + (f"  x{tao_ms / ms:5.2f} vs torchao" if tao_ms else ""))
        x = w = dy = layer = None  # free this shape's tensors before the next
        torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(rows)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qmoe bench linear", description=__doc__)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--recipes", nargs="*", default=None)
    p.add_argument("--quick", action="store_true", help="one shape, fewer repetitions")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("qmoe bench linear needs a CUDA GPU", file=sys.stderr)
        return 2
    header = run_header("benchmarks.bench_linear", argv)
    recipes = _recipes()
    if args.recipes:
        recipes = {k: v for k, v in recipes.items() if k in args.recipes}
    shapes = args.shapes[:1] if args.quick else args.shapes
    def write(rows):
        write_results(args.out, header, {"suite": "linear", "rows": rows}, quiet=True)

    rows = run(shapes, recipes, reps=5 if args.quick else 10, on_shape=write)
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
