"""The Gluon MXFP8 m-grouped GEMM (qmoe/kernels/_mx_gemm_gl.py) against the other exact routes and
bf16, same run.

Per shape (bench_gemm's) and layout (fprop y = x W^T, dgrad dx = dy W): torch._grouped_mm on the
bf16 operands (the target's base), the MXFP8 "dequant" route (a bf16 dequantize pass per operand,
weights included, then the bf16 GEMM), the Triton "fused" route, and the Gluon kernel in its
dispatched configuration and variants (tile N, ring stages, the bf16 route forced, the warp-specialised
schedule). Each Gluon variant's output
is compared with the Triton fused route's (`bits_equal`, `max_abs_diff`) and, once per case,
against the fp32 product of the dequantized operands (`rel_err`, NUMERICS.md: <= 1e-2 in bf16).

    PYTHONPATH=. python3 -m benchmarks.sweep_mx_gemm --out $OUT/mx_gemm.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_gemm import SHAPES
from benchmarks.harness import error_line, median_ms, run_header, write_results

VARIANTS = [dict(bn=256, bk=64, stages=4), dict(bn=256, bk=64, stages=4, f16=False), dict(bn=256, bk=64, stages=3),
            dict(bn=256, bk=64, stages=4, ws_regs=(232, 40)), dict(bn=128, bk=64, stages=6, ws_regs=(232, 40))]


def _operands(shape, layout):
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import MXFP8BlockScaling

    e, m, k, n = SHAPES[shape]
    recipe = MXFP8BlockScaling()
    splits = torch.full((e,), m, dtype=torch.int64, device="cuda")
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    a16 = torch.randn(e * m, k if layout == "fprop" else n, device="cuda", dtype=torch.bfloat16)
    role = "input" if layout == "fprop" else "grad_output"
    a = GroupedTensor.quantize(a16, splits, recipe.quantizer(role), columnwise=False, validate=False)
    b = quantize_weights(w, recipe.quantizer("weight"), rowwise=True, columnwise=True)
    return a, b, a16, w, splits


def _oracle_rel_err(out, a, b, layout):
    from qmoe.reference import grouped_gemm as reference

    ref = reference.m_grouped_gemm(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32)
    return float((out.float() - ref).norm() / ref.norm())


def run_case(shape, layout, rep, rows):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _mx_gemm_gl as mx
    from qmoe.kernels import grouped_gemm as gg

    e, m, k, n = SHAPES[shape]
    a, b, a16, w, splits = _operands(shape, layout)
    columnwise = layout == "dgrad"
    flops = 2.0 * e * m * n * k
    offs = torch.cumsum(splits, 0).to(torch.int32)
    mat = (a16, w.transpose(1, 2)) if layout == "fprop" else (a16, w)
    a_op = gg.activation_operand(a, Scaling.MX)
    b_op, n_out, contraction = gg.weight_operand(b, Scaling.MX, columnwise)

    def tf(ms):
        return round(flops / ms / 1e9, 1)

    base = dict(shape=shape, layout=layout)
    bf16_ms = median_ms(lambda: torch._grouped_mm(mat[0], mat[1], offs=offs), rep=rep)
    rows.append(dict(base, route="bf16 torch._grouped_mm", ms=bf16_ms, tflops=tf(bf16_ms)))
    fused = gg.m_grouped_gemm_with(a, b, b_columnwise=columnwise, route="fused",
                                   config=gg.tile_configs(Scaling.MX, small_m=False)[0])
    for route in ("dequant", "fused"):
        cfg = None if route == "dequant" else gg.tile_configs(Scaling.MX, small_m=False)[0]
        ms = median_ms(lambda: gg.m_grouped_gemm_with(a, b, b_columnwise=columnwise, route=route, config=cfg), rep=rep)
        rows.append(dict(base, route=f"mxfp8 {route}", ms=ms, tflops=tf(ms), vs_bf16=round(bf16_ms / ms, 3)))
    ms = median_ms(lambda: gg.m_grouped_gemm(a, b, b_columnwise=columnwise), rep=rep)
    rows.append(dict(base, route="mxfp8 dispatched (m_grouped_gemm)", ms=ms, tflops=tf(ms),
                     vs_bf16=round(bf16_ms / ms, 3)))
    print(" | ".join(f"{r['route']} {r['tflops']}" for r in rows[-4:]), flush=True)
    checked = False
    for kw in VARIANTS:
        info = {}
        try:
            def go():
                return mx.launch_mx_gemm(a_op, b_op, a.offsets, a.shape[0], n_out, contraction, b.num_groups,
                                         torch.bfloat16, b_columnwise=columnwise, info=info, **kw)
            out = go()
            torch.cuda.synchronize()
            row = dict(base, route="mxfp8 gluon", variant=kw, bits_equal=bool(torch.equal(out, fused)),
                       max_abs_diff=float((out.float() - fused.float()).abs().max()))
            if not checked:
                row["rel_err"] = _oracle_rel_err(out, a, b, layout)
                checked = True
            ms = median_ms(go, rep=rep)
            row.update(ms=ms, tflops=tf(ms), vs_bf16=round(bf16_ms / ms, 3), **info)
        except Exception as err:  # a variant that does not compile or fit: recorded
            row = dict(base, route="mxfp8 gluon", variant=kw, error=error_line(err))
        rows.append(row)
        print({k_: v for k_, v in row.items() if k_ not in ("shape", "layout")}, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("mx_gemm.json"))
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--layouts", nargs="*", default=["fprop", "dgrad"])
    p.add_argument("--rep", type=int, default=40, help="do_bench budget per variant (ms)")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds; cases left are recorded as skipped")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    header = run_header("benchmarks.sweep_mx_gemm", argv)
    rows, skipped = [], []
    start = time.monotonic()
    for shape in args.shapes:
        for layout in args.layouts:
            if time.monotonic() - start > args.deadline:
                skipped.append(f"{shape} {layout}")
                continue
            print(f"== {shape} {layout}", flush=True)
            run_case(shape, layout, args.rep, rows)
            torch.cuda.empty_cache()
            write_results(args.out, header, dict(suite="sweep_mx_gemm", method=__doc__, rows=rows, skipped=skipped),
                          quiet=True)
    write_results(args.out, header, dict(suite="sweep_mx_gemm", method=__doc__, rows=rows, skipped=skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
