"""FP8 per-tensor grouped GEMMs (delayed / current scaling): the Triton kernels ("triton", their
default tiles forced through `config`) against what the public GEMMs dispatch ("dispatched": the
warp-specialised Gluon kernels of qmoe/kernels/_tensor_gemm_ws.py where they apply) and the Gluon
kernels' other tiles, side by side at the layer's shapes (DeepSeek-V3 FC1 / FC2, Mixtral FC1 / FC2,
Qwen3's 128 small experts at the layer's token count), fprop, dgrad and wgrad, groups as the
layer's permute pads them (starts on 16 tokens); the bf16 grouped GEMM (torch._grouped_mm) of the
same work for scale.

Every variant is checked against the Triton kernel's output (bit equality, relative Frobenius
difference) and timed with benchmarks.harness.median_ms; a variant that fails is recorded with
its error and the sweep goes on.

    PYTHONPATH=. python3 -m benchmarks.sweep_tensor_gemm --out $OUT/tensor_gemm.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_gemm import SHAPES as GEMM_SHAPES
from benchmarks.harness import run_header, write_results
from benchmarks.sweep_block_gemm import _compare, _operands, _time, uneven_splits

SHAPES = {**{name: GEMM_SHAPES[name] for name in ("dsv3-fc1", "dsv3-fc2", "mixtral-fc1")},
          "mixtral-fc2": (8, 4096, 14336, 4096),  # (experts, mean rows per expert, K, N)
          **{name: GEMM_SHAPES[name] for name in ("qwen3-fc1-layer", "qwen3-fc2-layer")}}
LAYOUTS = ("fprop", "dgrad", "wgrad")
M_VARIANTS = {"gluon n128 s4": dict(bn=128, stages=4), "gluon n256 s3 gm16": dict(bn=256, stages=3, group_m=16),
              "gluon n256 s4 direct": dict(bn=256, stages=4, tma_store=False),
              "gluon n256 s4 direct gm16": dict(bn=256, stages=4, group_m=16, tma_store=False),
              "gluon n256 s3 direct": dict(bn=256, stages=3, tma_store=False)}
K_VARIANTS = {"gluon s3 gm4": dict(stages=3, group_m=4),
              "gluon s3 gm16": dict(stages=3, group_m=16),
              **{f"gluon s3 lead{lead}": dict(stages=3, lead=lead) for lead in (16, 32, 64, 128)}}


def _runner(name, kw, a, b, layout, info):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _tensor_gemm_ws as tw
    from qmoe.kernels import grouped_gemm as gg

    if layout == "wgrad":
        if name == "dispatched":
            return lambda: gg.k_grouped_gemm_with(a, b)
        if kw is None:
            return lambda: gg.k_grouped_gemm_with(a, b, config=gg.k_tile_config(Scaling.TENSOR))
        a_op, b_op = gg.tokens_operand(a, Scaling.TENSOR), gg.tokens_operand(b, Scaling.TENSOR)
        out = torch.empty((a.num_groups, a.shape[1], b.shape[1]), dtype=torch.bfloat16, device=a_op.data.device)
        return lambda: tw.launch_tensor_wgrad_ws(a_op, b_op, a.offsets, a.shape[1], b.shape[1], a.num_groups, out,
                                                 info=info, **kw)
    columnwise = layout == "dgrad"
    if name == "dispatched":
        return lambda: gg.m_grouped_gemm_with(a, b, b_columnwise=columnwise)
    if kw is None:
        cfg = gg.tile_configs(Scaling.TENSOR, small_m=False)[0]
        return lambda: gg.m_grouped_gemm_with(a, b, b_columnwise=columnwise, config=cfg)
    a_op = gg.activation_operand(a, Scaling.TENSOR)
    b_op, n_out, k = gg.weight_operand(b, Scaling.TENSOR, columnwise)
    return lambda: tw.launch_tensor_gemm_ws(a_op, b_op, a.offsets, a.shape[0], n_out, k, b.num_groups,
                                            b_columnwise=columnwise, info=info, **kw)


def _bf16_ms(splits, rows, k_c, n_c, layout, device) -> float | None:
    """ms of torch._grouped_mm in bf16 at the same work (what qmoe's bf16 layer runs)."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    e = len(splits)
    offs = torch.tensor(splits, device=device).cumsum(0).to(torch.int32)
    if layout == "wgrad":  # [n, T] @ [T, k] per group
        a = torch.randn(n_c, rows, device=device, dtype=torch.bfloat16)
        b = torch.randn(rows, k_c, device=device, dtype=torch.bfloat16)
    else:
        a = torch.randn(rows, k_c, device=device, dtype=torch.bfloat16)
        b = torch.randn(e, n_c, k_c, device=device, dtype=torch.bfloat16).transpose(1, 2)
    return _time(lambda: torch._grouped_mm(a, b, offs=offs), True)


def run(args, header) -> list[dict]:
    from qmoe.recipes import Float8CurrentScaling

    recipe = Float8CurrentScaling()
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    rows = []

    def save():
        write_results(args.out, header, {"suite": "sweep_tensor_gemm", "recipe": "current", "rows": rows}, indent=1,
                      quiet=True)

    for ci, (shape, (e, m, k, n)) in enumerate(SHAPES.items()):
        if args.shapes and shape not in args.shapes:
            continue
        splits = [v // 16 * 16 for v in uneven_splits(e, m, seed=ci, empty=shape.startswith("dsv3"))]
        splits[-1] += e * m - sum(splits)  # as the layer's permute pads them: groups start on 16 tokens
        for layout in args.layouts:
            a, b = _operands(e, splits, k, n, layout, device, ci, recipe)  # quantized by the reference backend
            t = sum(splits)
            k_c, n_c = (k, n) if layout in ("fprop", "wgrad") else (n, k)
            flops = 2.0 * t * n_c * k_c
            case = dict(shape=shape, layout=layout, experts=e, rows=t, K=k_c, N=n_c, min_split=min(splits),
                        max_split=max(splits))
            if on_gpu:
                ms = _bf16_ms(splits, t, k_c, n_c, layout, device)
                rows.append(dict(case, variant="bf16 torch._grouped_mm", status="ok", ms=round(ms, 4),
                                 tflops=round(flops / ms / 1e9, 1)))
            ref = None
            variants = {"triton": None, "dispatched": None, **(K_VARIANTS if layout == "wgrad" else M_VARIANTS)}
            for name, kw in variants.items():
                row, info = dict(case, variant=name), {}
                try:
                    fn = _runner(name, kw, a, b, layout, info)
                    out = fn()
                    if on_gpu:
                        torch.cuda.synchronize()
                    ref = out if name == "triton" else ref
                    row.update(_compare(out, ref))
                    ms = _time(fn, on_gpu)
                    row.update(status="ok", ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), **info)
                except Exception as err:  # compile or launch failure: recorded, the sweep goes on
                    row.update(status="error", error=f"{type(err).__name__}: {str(err).strip()[-300:]}")
                rows.append(row)
                print(f"{shape:16s} {layout:6s} {name:24s} {row['status']:6s} {row.get('tflops', '-')!s:>8} TF/s "
                      f"exact={row.get('exact', '-')}{'  ' + row['error'] if 'error' in row else ''}", flush=True)
            same = [r for r in rows if (r.get("shape"), r.get("layout")) == (shape, layout)]
            base = next((r for r in same if r["variant"] == "triton" and r.get("tflops")), None)
            for r in same:
                if base and r.get("tflops"):
                    r["vs_triton"] = round(r["tflops"] / base["tflops"], 3)
            del a, b, ref
            if on_gpu:
                torch.cuda.empty_cache()
            save()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sweep_tensor_gemm", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="*", help=f"of {list(SHAPES)}")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = p.parse_args(argv)
    rows = run(args, run_header("benchmarks.sweep_tensor_gemm", argv))
    print(f"\n{sum(r.get('status') == 'ok' for r in rows)} of {len(rows)} rows ran; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
