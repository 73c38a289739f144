"""Where the FP8 per-tensor quantizer's transposed copy loses bandwidth: variants in one run.

`_fp8_tensorwise_kernel` (qmoe/kernels/quantize.py) writes both orientations of a [BM, BK] tile
at 0.67 of the copy bandwidth on an H200 (0.86 rowwise only; quantize.json). It transposes the
fp32 tile (4 bytes an element through shared memory) and casts each orientation. A per-tensor
scale makes both orientations the same codes, so the tile can be cast once and its bytes moved:

  fp32-trans   trans(x) * scale, cast, stored as words of 4 codes along M (the kernel today)
  byte-trans   cast once; the uint8 codes transposed, then packed 4 to a word along M
  word-trans   cast once; 4 rows' codes packed into one int32 word per column first, then the
               [BM/4, BK] words transposed: one word (4 codes) per shared-memory move
  row-only     rowwise copy alone (the ceiling of the tile loop)
  +masked-load / +store8   fp32-trans with qmoe's masked tile load and its store8 helper
  qmoe-kernel  qmoe's _fp8_tensorwise_kernel itself at each tile of its autotune list
  +amax        the same, also reducing the tile's max|x| into one guarded atomic (delayed scaling)

Bytes counted: 2 read + 1 (+ 1) written per element; the device copy of the same bytes is the
peer. `exact` compares the codes with qmoe's quantizer's; the scale here is 1 / its scale_inv,
which may differ from its scale by an ulp, so `exact` false flags only a few codes a rounding apart.

On an H200 (fp8_transpose_variants.json) the three transposes run alike (0.80-0.81 of copy at
64x64 and 32x64 tiles): moving bytes or words instead of fp32 does not matter. qmoe's kernel
reaches 0.67-0.69. The bisect variants (qmoe's body with its pieces switchable) put 0.04 on its
per-tile amax and 0.02 on the runtime row stride, and gain 0.07 by casting both orientations
before storing either; that reorder, applied to qmoe's kernel itself, did not move it (see the
results file's note), so the remaining gap is in code generation, not in the kernel's logic.

    python -m benchmarks.explore_fp8_transpose [--out PATH]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.results_file import run_environment, write_results
from qmoe.kernels._triton_utils import atomic_max_bits, cast_bits, max_abs_bits, pack4, store8, tile_rows, tile_span
from qmoe.kernels.activation import load_rows

_MAX = tl.constexpr(448.0)


@triton.jit
def _cast_both_kernel(x_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, M, K,
                      VARIANT: tl.constexpr, AMAX: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pm, pk = tl.program_id(0), tl.program_id(1)
    rows = pm * BM + tl.arange(0, BM)
    cols = pk * BK + tl.arange(0, BK)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]).to(tl.float32)
    scale = tl.load(scale_ptr)
    if AMAX:  # what delayed scaling records: max|x| of the tile, one guarded atomic per tile
        atomic_max_bits(amax_ptr, max_abs_bits(x, False))
    q = cast_bits(x * scale, _MAX, tl.float8e4nv)  # [BM, BK] uint8
    words_k = pm * BM // 4 + tl.arange(0, BM // 4)  # word columns of the [K, M] copy
    row_words = pk * BK // 4 + tl.arange(0, BK // 4)
    tl.store(row_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * ((K // 16) * 4) + row_words[None, :],
             pack4(q, BM, BK))
    if VARIANT == 0:  # fp32-trans
        qt = cast_bits(tl.trans(x) * scale, _MAX, tl.float8e4nv)  # [BK, BM]
        w = pack4(qt, BK, BM)
    elif VARIANT == 1:  # byte-trans
        w = pack4(tl.trans(q.to(tl.int32)).to(tl.uint8), BK, BM)
    elif VARIANT == 2:  # word-trans
        b = tl.reshape(q.to(tl.int32), (BM // 4, 4, BK))
        packed = tl.sum(b << (tl.arange(0, 4) * 8)[None, :, None], 1)  # [BM/4, BK]: byte j = row 4i + j
        w = tl.trans(packed)
    if VARIANT < 3:
        tl.store(col_ptr.to(tl.pointer_type(tl.int32)) + cols.to(tl.int64)[:, None] * ((M // 16) * 4) + words_k[None, :],
                 w)


@triton.jit
def _cast_both_like_qmoe_kernel(x_ptr, row_ptr, col_ptr, scale_ptr, M, K,
                                MASKED_LOAD: tl.constexpr, STORE8: tl.constexpr, BM: tl.constexpr,
                                BK: tl.constexpr):
    """The fp32-trans variant with qmoe's helpers swapped in one at a time: masked loads of a
    tile that may end mid-tile (`tile_span`), and `store8` (packed words for whole aligned tiles,
    a masked byte store otherwise) for both orientations."""
    pm = tl.program_id(0)
    row0 = pm * BM
    rows, col0, cols, m_ok, k_ok = tile_span(row0, M, K, BM, BK)
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    if MASKED_LOAD:
        x = tl.load(ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    else:
        x = tl.load(ptrs).to(tl.float32)
    scale = tl.load(scale_ptr)
    q = cast_bits(x * scale, _MAX, tl.float8e4nv)
    qt = cast_bits(tl.trans(x) * scale, _MAX, tl.float8e4nv)
    if STORE8:
        store8(row_ptr, q, row0, col0, K, M, K, BM, BK)
        store8(col_ptr, qt, col0, row0, M, K, M, BK, BM)
    else:
        row_words = col0 // 4 + tl.arange(0, BK // 4)
        tl.store(row_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * ((K // 16) * 4)
                 + row_words[None, :], pack4(q, BM, BK))
        col_words = row0 // 4 + tl.arange(0, BM // 4)
        tl.store(col_ptr.to(tl.pointer_type(tl.int32)) + cols.to(tl.int64)[:, None] * ((M // 16) * 4)
                 + col_words[None, :], pack4(qt, BK, BM))


@triton.jit
def _bisect_kernel(x_ptr, probs_ptr, scale_ptr, row_ptr, col_ptr, splits_ptr, M, K, G, stride_xm,
                   STRIDE: tl.constexpr, TILE_ROWS: tl.constexpr, LOAD_ROWS: tl.constexpr, CAST_FIRST: tl.constexpr,
                   BM: tl.constexpr, BK: tl.constexpr):
    """qmoe's _fp8_tensorwise_kernel (amax off) with each of its general pieces switchable: the
    runtime row stride, tile_rows' group lookup (and its early return), load_rows."""
    if TILE_ROWS:
        g, row0, row_end, _, _ = tile_rows(splits_ptr, M, G, tl.program_id(0), BM, BM, 2, False)
        if g >= G:
            return
    else:
        g = 0
        row0 = tl.program_id(0) * BM
        row_end = M
    rows, col0, cols, m_ok, k_ok = tile_span(row0, row_end, K, BM, BK)
    stride = stride_xm if STRIDE else K
    if LOAD_ROWS:
        x = load_rows(x_ptr, probs_ptr, rows, cols, m_ok, k_ok, stride, K, -1, 0).to(tl.float32)
    else:
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + g)
    if CAST_FIRST:  # both orientations cast before either store
        q = cast_bits(x * scale, _MAX, tl.float8e4nv)
        qt = cast_bits(tl.trans(x) * scale, _MAX, tl.float8e4nv)
        store8(row_ptr, q, row0, col0, K, row_end, K, BM, BK)
        store8(col_ptr, qt, col0, row0, M, K, row_end, BK, BM)
    else:
        store8(row_ptr, cast_bits(x * scale, _MAX, tl.float8e4nv), row0, col0, K, row_end, K, BM, BK)
        store8(col_ptr, cast_bits(tl.trans(x) * scale, _MAX, tl.float8e4nv), col0, row0, M, K, row_end, BK, BM)


def _bisect(x, scale, m, k, copy_gbps):
    row = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    col = torch.empty(k, m, dtype=torch.uint8, device="cuda")
    out = []
    cases = [(a, b, c, False, 1) for a in (False, True) for b in (False, True) for c in (False, True)]
    cases += [(True, True, True, cast_first, stages) for cast_first in (False, True) for stages in (1, 3)]
    cases += [(False, True, True, cast_first, stages) for cast_first in (False, True) for stages in (1, 3)]
    for stride, tile_rows_on, load_rows_on, cast_first, stages in cases:
        for bm, bk, warps in ((32, 128, 4), (32, 64, 4)):
            def run(bm=bm, bk=bk, warps=warps, a=stride, b=tile_rows_on, c=load_rows_on, d=cast_first, e=stages):
                _bisect_kernel[(m // bm, k // bk)](x, x, scale, row, col, x, m, k, 1, x.stride(0), STRIDE=a,
                                                   TILE_ROWS=b, LOAD_ROWS=c, CAST_FIRST=d, BM=bm, BK=bk,
                                                   num_warps=warps, num_stages=e)
            ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
            gbps = m * k * 4 / ms / 1e6
            name = "bisect" + "".join(f" +{n}" for n, on in (("stride", stride), ("tile_rows", tile_rows_on),
                                                             ("load_rows", load_rows_on), ("cast_first", cast_first),
                                                             (f"stages{stages}", stages != 1)) if on)
            out.append({"variant": name, "tile": f"{bm}x{bk} w{warps}", "gbps": round(gbps, 1),
                        "frac_copy": round(gbps / copy_gbps, 3)})
            print(out[-1], flush=True)
    return out


def _like_qmoe(x, scale, m, k, copy_gbps):
    row = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    col = torch.empty(k, m, dtype=torch.uint8, device="cuda")
    out = []
    for masked, st8 in ((False, False), (True, False), (False, True), (True, True)):
        for bm, bk, warps in ((32, 64, 4), (64, 64, 4), (32, 128, 4)):
            def run(bm=bm, bk=bk, warps=warps, masked=masked, st8=st8):
                _cast_both_like_qmoe_kernel[(m // bm, k // bk)](x, row, col, scale, m, k, MASKED_LOAD=masked,
                                                                STORE8=st8, BM=bm, BK=bk, num_warps=warps)
            ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
            gbps = m * k * 4 / ms / 1e6
            out.append({"variant": f"fp32-trans{' +masked-load' if masked else ''}{' +store8' if st8 else ''}",
                        "tile": f"{bm}x{bk} w{warps}", "gbps": round(gbps, 1), "frac_copy": round(gbps / copy_gbps, 3)})
            print(out[-1], flush=True)
    return out


VARIANTS = {"fp32-trans": (0, False), "byte-trans": (1, False), "word-trans": (2, False), "row-only": (3, False),
            "fp32-trans+amax": (0, True), "row-only+amax": (3, True)}
TILES = [(32, 64, 4), (32, 128, 4), (64, 128, 8), (128, 128, 8), (64, 64, 4), (128, 64, 8)]


def _qmoe_kernel_tiles(x, scale, m, k, copy_gbps):
    """qmoe's own _fp8_tensorwise_kernel at every tile of its autotune list, both orientations."""
    from qmoe.kernels import quantize as kq
    from qmoe.kernels._triton_utils import group_pow2
    from qmoe.kernels.activation import NO_ACTIVATION

    row = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    col = torch.empty(k, m, dtype=torch.uint8, device="cuda")
    bits = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = []
    for cfg in kq._TILE_CONFIGS:
        bm, bk = cfg.kwargs["BM"], cfg.kwargs["BK"]

        def run(bm=bm, bk=bk, warps=cfg.num_warps):
            kq._fp8_tensorwise_kernel.fn[(triton.cdiv(m, bm), triton.cdiv(k, bk))](
                x, x, scale, row, col, bits, x, m, k, 1, x.stride(0), ACT=NO_ACTIVATION, GLU_BLOCK=0,
                FMT_MAX=448.0, OUT_DTYPE=tl.float8e4nv, ROWWISE=True, COLWISE=True, GROUPED=False,
                G_P2=group_pow2(1), BM=bm, BK=bk, num_warps=warps, num_stages=1)
        ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
        gbps = m * k * 4 / ms / 1e6
        out.append({"variant": "qmoe-kernel", "tile": f"{bm}x{bk} w{cfg.num_warps}", "gbps": round(gbps, 1),
                    "frac_copy": round(gbps / copy_gbps, 3)})
        print(out[-1], flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "fp8_transpose_variants.json"))
    p.add_argument("--shape", type=int, nargs=2, default=[65536, 7168], help="M K")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from qmoe.recipes import Float8CurrentScaling

    m, k = args.shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    qt = Float8CurrentScaling().quantizer("input").quantize(x, rowwise=True, columnwise=True)
    scale = (1.0 / qt.rowwise_scale_inv.float()).reshape(1).contiguous()
    want_row, want_col = qt.rowwise_data.view(torch.uint8), qt.columnwise_data.view(torch.uint8)
    row = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    col = torch.empty(k, m, dtype=torch.uint8, device="cuda")
    src, dst = torch.empty(m * k * 2, dtype=torch.uint8, device="cuda"), None
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    rows = [{"variant": "copy", "gbps": round(copy_gbps, 1)}]
    print(f"copy {copy_gbps:.0f} GB/s", flush=True)
    amax = torch.zeros(1, dtype=torch.int32, device="cuda")
    for name, (v, with_amax) in VARIANTS.items():
        for bm, bk, warps in TILES:
            def run(bm=bm, bk=bk, warps=warps, v=v, with_amax=with_amax):
                _cast_both_kernel[(m // bm, k // bk)](x, row, col, scale, amax, m, k, VARIANT=v, AMAX=with_amax,
                                                       BM=bm, BK=bk, num_warps=warps)
            try:
                col.zero_()
                run()
                torch.cuda.synchronize()
                exact = torch.equal(row, want_row) and (v == 3 or torch.equal(col, want_col))
                ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
                nbytes = m * k * (3 if v == 3 else 4)
                gbps = nbytes / ms / 1e6
                r = {"variant": name, "tile": f"{bm}x{bk} w{warps}", "gbps": round(gbps, 1),
                     "frac_copy": round(gbps / copy_gbps, 3), "exact": exact}
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                r = {"variant": name, "tile": f"{bm}x{bk} w{warps}", "error": f"{type(e).__name__}: {e}"[:200]}
            rows.append(r)
            print(r, flush=True)
    rows += _like_qmoe(x, scale, m, k, copy_gbps)
    rows += _bisect(x, scale, m, k, copy_gbps)
    rows += _qmoe_kernel_tiles(x, scale, m, k, copy_gbps)
    write_results(args.out, {**run_environment(), "shape": {"M": m, "K": k}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
