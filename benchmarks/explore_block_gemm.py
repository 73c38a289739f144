"""Where FP8 block GEMM time goes: dense 1x128 x 128x128 Triton variants against F.scaled_mm.

The grouped FP8 block GEMM (qmoe/kernels/grouped_gemm_triton.py, SCALING BLOCK) runs at 540-670
TFLOP/s on an H200 against 1100 targeted, while the same body without promotion (per-tensor
FP8) runs at 1100-1470. Each 128-deep step is a fresh tensor-core product, scaled and added to
the fp32 accumulator on the CUDA cores. This script isolates that promotion in a dense kernel and
times variants of it in one run:

  ptr-vec      pointer loads; B's block scale loaded per column and the [BM, BN] outer product
               sa x sb formed every step (what the grouped kernel did)
  ptr-scalar   B's scale is one number per 128 x 128 block, so one per tile and step: the
               promotion is one FMA per accumulator element (sa * sb is a [BM] vector)
  desc-scalar  the same through tensor descriptors (TMA loads)
  desc-ws      tensor descriptors and Triton's warp specialization of the K loop (loads in a
               producer partition, so the consumer's promotion overlaps the next loads)
  split        two half-width products per step, each promoted on its own (each half of a
               256-wide tile has its own weight scale)
  fp8-plain    no promotion (one accumulator across K): the ceiling of this kernel shape

    python -m benchmarks.explore_block_gemm [--out PATH]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.results_file import run_environment, write_results
from qmoe.kernels.grouped_gemm_triton import _swizzle


@triton.jit
def _block_gemm_ptr(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                    SCALAR_B: tl.constexpr, PROMOTE: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pm, pn = _swizzle(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    ks = K // 128
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, K, BK):
        a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * K + (kk + rk)[None, :])
        b = tl.load(b_ptr + rn.to(tl.int64)[:, None] * K + (kk + rk)[None, :])
        if PROMOTE:
            sa = tl.load(sa_ptr + rm * ks + kk // 128)
            if SCALAR_B:
                sb = tl.load(sb_ptr + (pn * BN // 128) * ks + kk // 128)
                acc += tl.dot(a, tl.trans(b)) * (sa * sb)[:, None]
            else:
                sb = tl.load(sb_ptr + (rn // 128) * ks + kk // 128)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


@triton.jit
def _block_gemm_desc(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, M, N, K,
                     WS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    pm, pn = _swizzle(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    ks = K // 128
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in tl.range(0, K, BK, num_stages=STAGES, warp_specialize=WS):
        a = a_desc.load([pm * BM, kk])
        b = b_desc.load([pn * BN, kk])
        sa = tl.load(sa_ptr + rm * ks + kk // 128)
        sb = tl.load(sb_ptr + (pn * BN // 128) * ks + kk // 128)
        acc += tl.dot(a, tl.trans(b)) * (sa * sb)[:, None]
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


@triton.jit
def _block_gemm_split(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """Two independent half-width products per step: if the second's tensor-core work overlaps
    the first's promotion, the CUDA cores stop stalling the tensor cores."""
    pm, pn = _swizzle(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    HALF: tl.constexpr = BN // 2
    rm = pm * BM + tl.arange(0, BM)
    rn1 = pn * BN + tl.arange(0, HALF)
    rn2 = rn1 + HALF
    rk = tl.arange(0, BK)
    ks = K // 128
    acc1 = tl.zeros((BM, HALF), dtype=tl.float32)
    acc2 = tl.zeros((BM, HALF), dtype=tl.float32)
    for kk in range(0, K, BK):
        a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * K + (kk + rk)[None, :])
        b1 = tl.load(b_ptr + rn1.to(tl.int64)[:, None] * K + (kk + rk)[None, :])
        b2 = tl.load(b_ptr + rn2.to(tl.int64)[:, None] * K + (kk + rk)[None, :])
        sa = tl.load(sa_ptr + rm * ks + kk // 128)
        sb1 = tl.load(sb_ptr + (pn * BN // 128) * ks + kk // 128)
        sb2 = tl.load(sb_ptr + ((pn * BN + HALF) // 128) * ks + kk // 128)
        p1 = tl.dot(a, tl.trans(b1))
        p2 = tl.dot(a, tl.trans(b2))
        acc1 += p1 * (sa * sb1)[:, None]
        acc2 += p2 * (sa * sb2)[:, None]
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn1[None, :], acc1.to(tl.bfloat16))
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn2[None, :], acc2.to(tl.bfloat16))


VARIANTS = {  # name: (kind, SCALAR_B, PROMOTE, WS)
    "ptr-vec": ("ptr", False, True, False),
    "ptr-scalar": ("ptr", True, True, False),
    "desc-scalar": ("desc", True, True, False),
    "desc-ws": ("desc", True, True, True),
    "split": ("split", True, True, False),
    "fp8-plain": ("ptr", True, False, False),
}
TILES = [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (128, 256, 8, 3)]  # BM, BN, warps, stages
SPLIT_TILES = [(128, 128, 8, 4), (64, 256, 8, 3), (64, 256, 8, 4), (128, 256, 8, 3)]


def _launch(variant, tile, a, b, sa, sb, c):
    kind, scalar_b, promote, ws = VARIANTS[variant]
    bm, bn, warps, stages = tile
    m, k = a.shape
    n = b.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    if kind == "split":
        return lambda: _block_gemm_split[grid](a, b, c, sa, sb, m, n, k, BM=bm, BN=bn, BK=128, GROUP_M=8,
                                               num_warps=warps, num_stages=stages)
    if kind == "ptr":
        return lambda: _block_gemm_ptr[grid](a, b, c, sa, sb, m, n, k, SCALAR_B=scalar_b, PROMOTE=promote,
                                             BM=bm, BN=bn, BK=128, GROUP_M=8, num_warps=warps, num_stages=stages)
    from triton.tools.tensor_descriptor import TensorDescriptor

    ad = TensorDescriptor.from_tensor(a, [bm, 128])
    bd = TensorDescriptor.from_tensor(b, [bn, 128])
    return lambda: _block_gemm_desc[grid](ad, bd, c, sa, sb, m, n, k, WS=ws, BM=bm, BN=bn, BK=128, GROUP_M=8,
                                          STAGES=stages, num_warps=warps)


def _operands(m, n, k, device):
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-3, 4, (m, k // 128), device=device).float())
    sb = torch.exp2(torch.randint(-3, 4, (n // 128, k // 128), device=device).float())
    return a, b, sa, sb


def _reference(a, b, sa, sb):
    af = a.float() * sa.repeat_interleave(128, 1)
    bf = b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return af @ bf.t()


def _rel(x, ref):
    return ((x.float() - ref).norm() / ref.norm()).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "block_gemm_variants.json"))
    p.add_argument("--shape", type=int, nargs=3, default=[65536, 4096, 7168], help="M N K")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = "cuda"
    small = _operands(256, 256, 512, dev)
    ref = _reference(*small)
    m, n, k = args.shape
    big = _operands(m, n, k, dev)
    c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * m * n * k
    rows = []
    import torch.nn.functional as F

    a, b, sa, sb = big
    try:
        peer = lambda: F.scaled_mm(a, b.t(), sa.t().contiguous().t(), F.ScalingType.BlockWise1x128,  # noqa: E731
                                   sb.t(), F.ScalingType.BlockWise128x128,
                                   swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
                                   output_dtype=torch.bfloat16)
        peer()
        ms = triton.testing.do_bench(peer, warmup=10, rep=50, return_mode="median")
        rows.append({"variant": "F.scaled_mm", "tile": None, "tflops": round(flops / ms / 1e9, 1), "rel_err": None})
    except Exception as e:  # noqa: BLE001 - a peer this build lacks is reported, not fatal
        print(f"F.scaled_mm: {type(e).__name__}: {e}"[:200])
    print(f"{'variant':12s} {'tile':16s} {'TFLOP/s':>8s} {'rel err':>9s}", flush=True)
    for r in rows:
        print(f"{r['variant']:12s} {'-':16s} {r['tflops']:8.1f}", flush=True)
    for variant in VARIANTS:
        for tile in SPLIT_TILES if variant == "split" else TILES:
            name = f"{tile[0]}x{tile[1]} w{tile[2]} s{tile[3]}"
            try:
                cs = torch.empty(256, 256, device=dev, dtype=torch.bfloat16)
                _launch(variant, tile, *small, cs)()
                err = _rel(cs, ref) if VARIANTS[variant][2] else None
                fn = _launch(variant, tile, *big, c)
                fn()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                row = {"variant": variant, "tile": name, "tflops": round(flops / ms / 1e9, 1),
                       "rel_err": None if err is None else float(f"{err:.3g}")}
            except Exception as e:  # noqa: BLE001 - a variant this Triton cannot compile is a result too
                row = {"variant": variant, "tile": name, "tflops": None, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            print(f"{variant:12s} {name:16s} {row['tflops']!s:>8s} {row.get('rel_err', row.get('error'))!s:>9s}",
                  flush=True)
    write_results(args.out, {**run_environment(), "shape": {"M": m, "N": n, "K": k}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
