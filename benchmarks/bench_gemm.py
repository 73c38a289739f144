"""`qmoe bench gemm`: grouped GEMM TFLOP/s per recipe and layout, against peers timed in the same run.

Shapes are BASELINES.md's (experts x rows per expert, K -> N) plus memory-bound cases (8
experts, 16/32/64 rows each, 4096 -> 14336) for the 8- and 4-bit recipes. Layouts: fprop
y = x W^T, dgrad dx = dy W, wgrad dW = dy^T x (TFLOP/s = 2 T N K / time). Operands are
quantized before timing (the GEMM alone); the exact-emulation "dequant" route includes its
dequantize passes, weights too (nothing is cached across calls).

Peers: torch._grouped_mm (bf16), torch._scaled_grouped_mm (FP8 rowwise, fast accumulation),
dense F.scaled_mm 1x128 x 128x128 and Triton tl.dot_scaled MXFP8 at the same total work.
Targets are BASELINES.md's ratios; ratio_to_target >= 1 means met.

    python -m benchmarks.bench_gemm [--quick] [--sweep] [--out PATH]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.harness import run_header, write_results

SHAPES = {  # name: (experts, rows per expert, K, N)
    "dsv3-fc1": (32, 2048, 7168, 4096),
    "dsv3-fc2": (32, 2048, 2048, 7168),
    "mixtral-fc1": (8, 4096, 4096, 28672),
    "qwen3-fc1": (128, 512, 2048, 1536),
    # the MoE layer's own groups (bench_moe: 16384 tokens, top 8 of 128 experts)
    "qwen3-fc1-layer": (128, 1024, 2048, 1536),
    "qwen3-fc2-layer": (128, 1024, 768, 2048),
}
MEMORY_BOUND = {f"mem-8x{m}": (8, m, 4096, 14336) for m in (16, 32, 64)}
QUICK = ("dsv3-fc1", "mem-8x32")
LAYOUTS = ("fprop", "dgrad", "wgrad")
DSV3 = ("dsv3-fc1", "dsv3-fc2")


def _recipes():
    from qmoe.recipes import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling

    return {"bf16": None, "current": Float8CurrentScaling(), "block": Float8BlockScaling(),
            "mxfp8": MXFP8BlockScaling(), "nvfp4": NVFP4BlockScaling()}


def _ms(fn) -> float | None:
    import triton

    try:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as e:  # a peer this torch build lacks: reported, not fatal
        print(f"  (skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def _ms_of(flops: float, tflops: float | None) -> float | None:
    return None if not tflops else round(flops / tflops / 1e9, 4)


def _tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else round(flops / ms / 1e9, 1)


# ---------------------------------------------------------------- peers

def _peer_bf16(layout, x, w, dy, offs):
    mat = {"fprop": (x, w.transpose(1, 2)), "dgrad": (dy, w), "wgrad": (dy.t(), x)}[layout]
    return _ms(lambda: torch._grouped_mm(mat[0], mat[1], offs=offs))


def _peer_fp8_rowwise(layout, x, w, dy, offs):
    f8 = torch.float8_e4m3fn
    if layout == "wgrad":
        return None
    a = (x if layout == "fprop" else dy).to(f8)
    b = (w if layout == "fprop" else w.transpose(1, 2)).to(f8).contiguous().transpose(1, 2)  # [E, K, N] col-major
    sa = torch.ones(a.shape[0], device=a.device)
    sb = torch.ones(b.shape[0], b.shape[2], device=a.device)
    return _ms(lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                                use_fast_accum=True))


def _peer_dense_block(t, n, k, device):
    import torch.nn.functional as F

    a = torch.randn(t, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    sa = torch.rand(k // 128, t, device=device).t()  # [T, K/128], outer-dim-major as cuBLAS wants
    sb = torch.rand(n // 128, k // 128, device=device).t()
    return _ms(lambda: F.scaled_mm(a, b.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                                   swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
                                   output_dtype=torch.bfloat16))


def _dot_scaled_kernel():
    """A plain dense Triton MXFP8 GEMM through tl.dot_scaled (emulated on sm90): the peer."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        rs = tl.arange(0, BK // 32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
            b = tl.load(b_ptr + rn[None, :] * K + (k0 + rk)[:, None])
            sa = tl.load(sa_ptr + rm[:, None] * (K // 32) + (k0 // 32 + rs)[None, :])
            sb = tl.load(sb_ptr + rn[:, None] * (K // 32) + (k0 // 32 + rs)[None, :])
            acc = tl.dot_scaled(a, sa, "e4m3", b, sb, "e4m3", acc)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))

    return kernel


def _peer_dot_scaled(t, n, k, device):
    kernel = _dot_scaled_kernel()
    c = torch.empty(t, n, device=device, dtype=torch.bfloat16)

    def dense_dot_scaled_mxfp8(a, sa, b, sb):
        kernel[(t // 128, n // 128)](a, sa, b, sb, c, t, n, k, BM=128, BN=128, BK=128, num_warps=8, num_stages=3)

    a = torch.randn(t, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    sa = torch.full((t, k // 32), 127, dtype=torch.uint8, device=device)
    sb = torch.full((n, k // 32), 127, dtype=torch.uint8, device=device)
    return _ms(lambda: dense_dot_scaled_mxfp8(a, sa, b, sb))


# ---------------------------------------------------------------- qmoe

def _operands(recipe, x, w, dy, splits):
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor

    if recipe is None:
        return {"x": x, "w": w, "dy": dy}
    return {"x": GroupedTensor.quantize(x, splits, recipe.quantizer("input"), validate=False),
            "w": quantize_weights(w, recipe.quantizer("weight"), rowwise=True, columnwise=True),
            "dy": GroupedTensor.quantize(dy, splits, recipe.quantizer("grad_output"), validate=False)}


def _qmoe_fn(layout, ops, splits, route="auto", config=None):
    from qmoe.kernels.grouped_gemm import k_grouped_gemm_with, m_grouped_gemm_with

    s = None if not isinstance(ops["x"], torch.Tensor) else splits
    if layout == "wgrad":
        return lambda: k_grouped_gemm_with(ops["dy"], ops["x"], s, route=route, config=config)
    a = ops["x"] if layout == "fprop" else ops["dy"]
    return lambda: m_grouped_gemm_with(a, ops["w"], s, b_columnwise=layout == "dgrad", route=route, config=config)


def _route_used(name, layout, ops):
    from qmoe.kernels.grouped_gemm import DEQUANT_MIN_ROWS

    if name == "bf16":  # wgrad too: bf16 out, features contiguous with 16-byte aligned strides
        return "torch._grouped_mm"
    if name not in ("mxfp8", "nvfp4"):
        return "triton"
    x = ops["x"]
    return "dequant" if x.shape[0] >= DEQUANT_MIN_ROWS * x.num_groups else "fused"


def _target(name, layout, shape, memory_bound, peers, fprop_tflops):
    """(peer name, peer TFLOP/s, target TFLOP/s) for a row, from BASELINES.md's targets."""
    bf16 = peers.get(("bf16", layout))
    if layout == "wgrad" and name != "bf16" and fprop_tflops:
        return f"qmoe {name} fprop x0.8", fprop_tflops, 0.8 * fprop_tflops
    if name == "bf16":
        return "torch._grouped_mm bf16", bf16, bf16
    if name == "current":
        p = peers.get(("fp8-rowwise", layout))
        return "torch._scaled_grouped_mm fp8 rowwise", p, p
    if name == "block":
        p = peers.get(("dense-block", "fprop"))
        return ("F.scaled_mm dense block x0.95 (1100 on DSV3)", p,
                1100.0 if shape in DSV3 else (0.95 * p if p else None))
    if name == "mxfp8":
        ds = peers.get(("dot-scaled", "fprop"))
        cands = [v for v in (0.9 * bf16 if bf16 else None, 3 * ds if ds else None) if v]
        return "max(0.9x bf16 _grouped_mm, 3x tl.dot_scaled)", bf16, max(cands) if cands else None
    factor = 2.5 if memory_bound else 0.85
    return f"torch._grouped_mm bf16 x{factor}", bf16, factor * bf16 if bf16 else None


def _sweep_candidates(name, layout, memory_bound, rows_per_group):
    """(route, TileConfig) pairs worth timing for one case (--sweep)."""
    from dataclasses import replace

    from qmoe.kernels.grouped_gemm import TileConfig, k_tile_config, tile_configs
    from qmoe.contracts.enums import Scaling

    if name == "block" and layout == "wgrad":  # two token-scaled operands: the outer-product promotion
        return [("fused", c) for c in (k_tile_config(Scaling.BLOCK), TileConfig(64, 128, 128, 4, 4),
                                       TileConfig(64, 256, 128, 8, 3), TileConfig(128, 128, 128, 8, 4))]
    if name == "block":  # the per-tile weight scale against the per-column outer product
        tiles = tile_configs(Scaling.BLOCK, small_m=memory_bound)
        return [("fused", c) for c in tiles + [replace(tiles[0], tile_scale=False)]]
    if name in ("mxfp8", "nvfp4"):
        if memory_bound:
            tiles = tile_configs(Scaling.MX, small_m=True, rows_per_group=rows_per_group)
            return [("fused", c) for c in tiles]
        base = tile_configs(Scaling.NONE, small_m=False)
        dqs = [(32, 64, 4), (64, 256, 8), (128, 128, 8)]
        fused = tile_configs(Scaling.MX, small_m=False) + [TileConfig(128, 128, 128, 8, 3),
                                                            TileConfig(128, 256, 128, 8, 2)]
        return ([("dequant", c) for c in base] + [("dequant", replace(base[0], dq=d)) for d in dqs]
                + [("fused", c) for c in fused])
    if name == "bf16" and layout == "wgrad":
        return [("fused", c) for c in tile_configs(Scaling.NONE, small_m=False) + [TileConfig(128, 128, 64, 4, 4)]]
    if name == "current" and layout == "wgrad":  # short token groups: tiles that overlap their dW stores
        return [("fused", c) for c in (k_tile_config(Scaling.TENSOR), TileConfig(128, 128, 128, 8, 3),
                                       TileConfig(128, 128, 128, 4, 3), TileConfig(64, 256, 128, 8, 3),
                                       TileConfig(64, 128, 128, 4, 4), TileConfig(128, 256, 128, 8, 2),
                                       TileConfig(128, 128, 128, 4, 2), TileConfig(128, 256, 128, 8, 4),
                                       TileConfig(128, 256, 128, 8, 3, group_m=16))]
    return []


def run_shape(shape, dims, recipes, layouts, sweep, rows, details):
    e, m, k, n = dims
    t, dev = e * m, "cuda"
    memory_bound = shape.startswith("mem")
    splits = torch.full((e,), m, dtype=torch.int64, device=dev)
    offs = torch.cumsum(splits, 0).to(torch.int32)
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    dy = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * t * n * k
    peers = {}
    for layout in layouts:
        peers[("bf16", layout)] = _tflops(flops, _peer_bf16(layout, x, w, dy, offs))
        if "current" in recipes and not memory_bound:
            peers[("fp8-rowwise", layout)] = _tflops(flops, _peer_fp8_rowwise(layout, x, w, dy, offs))
    if "block" in recipes and not memory_bound:
        peers[("dense-block", "fprop")] = _tflops(flops, _peer_dense_block(t, n, k, dev))
    if "mxfp8" in recipes:
        peers[("dot-scaled", "fprop")] = _tflops(flops, _peer_dot_scaled(t, n, k, dev))
    details.append({"shape": shape, "peers": {f"{kk[0]} {kk[1]}": v for kk, v in peers.items()}})
    for name, recipe in recipes.items():
        ops = _operands(recipe, x, w, dy, splits)
        fprop = None
        for layout in layouts:
            tf = _tflops(flops, _ms(_qmoe_fn(layout, ops, splits)))
            fprop = tf if layout == "fprop" else fprop
            peer, peer_tf, target = _target(name, layout, shape, memory_bound, peers, fprop)
            rows.append({"recipe": name, "layout": layout, "shape": f"{shape} ({e}x{m}, {k}->{n})", "tflops": tf,
                         "peer": peer, "peer_tflops": peer_tf, "target": round(target, 1) if target else None,
                         "ratio_to_target": round(tf / target, 3) if tf and target else None})
            route = _route_used(name, layout, ops)
            detail = {"recipe": name, "layout": layout, "shape": shape, "route": route, "ms": _ms_of(flops, tf)}
            if name in ("mxfp8", "nvfp4"):  # the other exact route, timed for the record
                other = "fused" if route == "dequant" else "dequant"
                detail["other_route"] = {other: _tflops(flops, _ms(_qmoe_fn(layout, ops, splits, other)))}
            if sweep:
                tried = {f"{route} {c.bm}x{c.bn}x{c.bk} w{c.warps} s{c.stages} x{c.ctas_per_sm}"
                         f"{' swap' if c.swap else ''}"
                         f"{' dq%dx%dw%d' % c.dq if c.dq else ''}{'' if c.tile_scale else ' outer'}":
                         _tflops(flops, _ms(_qmoe_fn(layout, ops, splits, route, c)))
                         for route, c in _sweep_candidates(name, layout, memory_bound, m)}
                if tried:
                    detail["sweep"] = tried
                    print(f"  sweep {name} {layout} {shape}: " + ", ".join(f"{kk}={v}" for kk, v in tried.items()))
            details.append(detail)
            print(f"{shape:12s} {name:7s} {layout:6s} {tf!s:>8} TF/s  peer {peer_tf!s:>8} ({peer})  "
                  f"target {rows[-1]['target']!s:>8}  ratio {rows[-1]['ratio_to_target']}", flush=True)
        del ops
    del x, w, dy
    torch.cuda.empty_cache()


def print_table(rows):
    print(f"\n{'shape':34s} {'recipe':7s} {'layout':6s} {'TFLOP/s':>8s} {'peer':>8s} {'target':>8s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['shape']:34s} {r['recipe']:7s} {r['layout']:6s} {r['tflops']!s:>8s} {r['peer_tflops']!s:>8s} "
              f"{r['target']!s:>8s} {r['ratio_to_target']!s:>6s}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qmoe bench gemm", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--shapes", nargs="*", help="shape names to run (default: all)")
    p.add_argument("--recipes", nargs="*", help="recipes to run (bf16 current block mxfp8 nvfp4)")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    p.add_argument("--sweep", action="store_true", help="also time every tile config and route (slow)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gemm.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("qmoe bench gemm needs a CUDA GPU of compute capability >= 9.0", file=sys.stderr)
        return 2
    header = run_header("benchmarks.bench_gemm", argv)
    shapes = {**SHAPES, **MEMORY_BOUND}
    names = list(QUICK) if args.quick else (args.shapes or list(shapes))
    all_recipes = _recipes()
    rows, details = [], []
    for shape in names:
        memory_bound = shape.startswith("mem")
        wanted = args.recipes or (["bf16", "mxfp8", "nvfp4"] if memory_bound else list(all_recipes))
        layouts = ["fprop"] if memory_bound else args.layouts
        run_shape(shape, shapes[shape], {r: all_recipes[r] for r in wanted}, layouts, args.sweep, rows, details)
        # after every shape: partial runs keep their rows
        write_results(args.out, header, {"suite": "gemm", "rows": rows, "details": details}, indent=1, quiet=True)
    print_table(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
