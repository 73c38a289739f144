"""Expert-activation benchmark: act(h) * prob, forward + backward, eager PyTorch vs qmoe's kernels.

Run: `PYTHONPATH=. python -m benchmarks.bench_activation [--quick]` (GPU only).

Each case is timed twice in the same run: the eager pure-torch op qmoe used before the kernels
(`qmoe.reference.activation.scaled_activation` with autograd: fp32 silu / gelu, mul, prob scale,
casts, ~15 elementwise launches) and `qmoe.ops.expert_activation` (one Triton launch forward, one
backward). Medians of `triton.testing.do_bench`. Shapes: a DeepSeek-V3 expert shard (65536
permuted rows, F 2048, bf16) for every activation, and swiglu with FC1 rows interleaved in
blocks of 128. Writes benchmarks/results/activation.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness import copy_gbps, median_ms, run_header, write_results

CASES = [("swiglu", None), ("swiglu", 128), ("geglu", None), ("clamped_qgeglu", None), ("relu2", None),
         ("gelu", None)]
ROWS, FFN = 65536, 2048
QUICK_SCALE = 8  # --quick divides the row count by this


def _min_bytes(rows: int, width: int, f: int, elt: int = 2) -> int:
    """Forward reads h and probs and writes a; backward reads h, da and probs, writes dh and dprobs."""
    return (rows * width + rows * f) * elt + 4 * rows + (2 * rows * width + rows * f) * elt + 8 * rows


def _eager(h, probs, activation, k):
    from qmoe.contracts.carriers import deinterleave_glu
    from qmoe.reference.activation import scaled_activation
    return scaled_activation(deinterleave_glu(h.t(), k).t() if k else h, probs, activation)


def bench_case(rows_out, activation, k, r, f, gbps):
    from qmoe.ops import expert_activation
    from qmoe.contracts.carriers import is_glu
    torch.manual_seed(0)
    width = 2 * f if is_glu(activation) else f
    h = (torch.randn(r, width, device="cuda") * 3).bfloat16().requires_grad_(True)
    probs = torch.rand(r, device="cuda", requires_grad=True)
    da = torch.randn(r, f, device="cuda", dtype=torch.bfloat16)
    row = dict(activation=activation, glu_interleave_size=k, R=r, F=f, dtype="bf16")
    for name, fn in (("eager", _eager), ("qmoe", expert_activation)):
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = median_ms(lambda: fn(h, probs, activation, k))

        def step():
            h.grad = probs.grad = None
            fn(h, probs, activation, k).backward(da)
        row[f"{name}_ms"] = median_ms(step)
    row["speedup"] = row["eager_ms"] / row["qmoe_ms"]
    row["min_bytes"] = _min_bytes(r, width, f)
    row["roofline_ms"] = row["min_bytes"] / (gbps * 1e9) * 1e3
    row["qmoe_frac_roofline"] = row["roofline_ms"] / row["qmoe_ms"]
    rows_out.append(row)
    print(f"{activation:>15} k={str(k):<5} R={r} F={f}  eager {row['eager_ms']:7.3f} ms "
          f"(fwd {row['eager_fwd_ms']:.3f})  qmoe {row['qmoe_ms']:7.3f} ms (fwd {row['qmoe_fwd_ms']:.3f})  "
          f"x{row['speedup']:.1f}  {100 * row['qmoe_frac_roofline']:.0f}% of copy bandwidth", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench_activation", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"rows / {QUICK_SCALE}: a smoke run")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "activation.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_activation needs a CUDA GPU (the kernels run on sm90+); none found", file=sys.stderr)
        return 2
    from qmoe.backend import use_kernels
    probe = torch.empty(1, device="cuda")
    if not use_kernels(probe):
        print("warning: qmoe ops run the reference on this device (sm < 90 or QMOE_BACKEND=reference)",
              file=sys.stderr)
    header = run_header("benchmarks.bench_activation", argv)
    gbps = copy_gbps()
    rows = []
    r = ROWS // (QUICK_SCALE if args.quick else 1)
    for activation, k in CASES:
        bench_case(rows, activation, k, r, FFN, gbps)
        torch.cuda.empty_cache()
    result = dict(
        suite="activation",
        qmoe_backend="triton" if use_kernels(probe) else "reference",
        method="triton.testing.do_bench medians, ms; *_ms = forward + backward (probs and h get "
               "gradients), *_fwd_ms = forward (no_grad); eager = the pure-torch op with autograd, "
               "qmoe = qmoe.ops.expert_activation; roofline_ms = min_bytes / copy_gbps (same run)",
        quick=args.quick, copy_gbps=gbps, rows=rows,
    )
    write_results(args.out, header, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
