"""The FP8 and MXFP8 cast kernels' variants (`qmoe.kernels.quantize`): configs, pruning, row quads.

- Autotune keys: `TILE_KEY` (shape, groups, fused activation), `ORIENTED_KEY` (and orientations).
- Configs: the plain tiles the kernels always had, then the variants the autotuner may pick, all
  giving the same bits: QUAD (the tile held as a row quad, `qmoe.kernels._tiles`, so a transposed
  copy packs its words in registers), K_MAJOR (grid order along K), BKC (the FP8 block kernel's
  block in column chunks, read twice) and maxnreg (a register cap, more programs per SM).
- `forced_config` / `configs_for`: run one config, bypassing the autotuner (tests, sweeps).
- The device bodies of the row-quad variants: loads, stores, the FP8 block in chunks, MXFP8 rows.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import triton
import triton.language as tl

from qmoe.kernels._arith import (abs_bits, bits_to_float, cast_codes, exp2_int, fp8_scale_from_amax, mx_exponent,
                                reciprocal)
from qmoe.kernels._launch import launch, prune_oversized, wrapped
from qmoe.kernels._tiles import (block_amax_last, interleave4, quad_abs_bits, runs_max_first, scale_first, scale_last,
                                store8, store8_rows4)
from qmoe.kernels.activation import load_rows


# ---------------------------------------------------------------- autotune keys and configs

TILE_KEY = ["M", "K", "G", "ACT"]
# Kernels with block scales also key on orientation and block shape: they decide which tiles are
# legal (a tile tuned for a rowwise-only call cannot hold the 128-row blocks of a columnwise one).
ORIENTED_KEY = TILE_KEY + ["ROWWISE", "COLWISE"]


def prune_blocks(configs, named_args, **kwargs):
    """Tiles must hold whole blocks: BK % B along K; BM % B where blocks run along M too."""
    b = kwargs.get("B", 1)
    along_m = kwargs.get("COLWISE", False) or kwargs.get("BLOCK_2D", False)
    ok = [c for c in configs if c.kwargs["BK"] % b == 0 and (not along_m or c.kwargs["BM"] % b == 0)]
    return prune_oversized(ok, named_args, **kwargs)


def prune_variants(configs, named_args, **kwargs):
    """prune_blocks of the variants that apply to this call: row quads only serve a transposed
    copy or a 2-D block; the FP8 block kernel's quads hold exactly one B x B block (BM = BK = B),
    in chunks of BKC columns that divide it (BKC = BK everywhere else)."""
    b, two_d, col = kwargs.get("B", 1), kwargs.get("BLOCK_2D", False), kwargs.get("COLWISE", False)

    def applies(kw):
        if kw["QUAD"] and not (col or two_d):
            return False
        if kw["QUAD"] and "BKC" in kw:
            return kw["BM"] == kw["BK"] == b and b % kw["BKC"] == 0
        return kw.get("BKC", kw["BK"]) == kw["BK"]

    return prune_blocks([c for c in configs if applies(c.kwargs)], named_args, **kwargs)


def _config(bm: int, bk: int, warps: int, quad: int = 0, k_major: int = 0, bkc: Optional[int] = None,
            maxnreg: Optional[int] = None) -> triton.Config:
    """A cast kernel's config: tile BM x BK, row quads (QUAD), grid order (K_MAJOR), the FP8 block
    kernel's chunk width (BKC, default BK), and a register cap (maxnreg) that trades a few spills
    for more programs per SM."""
    meta = {"BM": bm, "BK": bk, "QUAD": quad, "K_MAJOR": k_major, **({} if bkc is None else {"BKC": bkc})}
    return triton.Config(meta, num_warps=warps, num_stages=1, maxnreg=maxnreg)


# Configs: a plain tile that serves every call (16-64 elements per thread, the range where the
# reductions and the transposed store stay in registers, ptxas -v on sm_90a), then the variants
# that won benchmarks/sweep_quantize_tiles.py on the GPU for some family and orientation (the
# sweep times any config list one by one; the rest lost everywhere and were dropped, so the first
# call of a shape tunes few). prune_variants drops what does not apply to a call; the autotuner
# picks per (M, K, G), orientation and fused activation. Row quads of 8 x 64 (BM = 32, BK = 64)
# are left out: that tile gave wrong columnwise MXFP8 codes on grouped inputs in compiled code.
CAST_CONFIGS = [_config(32, 128, 4),  # the plain tile
                _config(32, 128, 4, k_major=1),  # rowwise alone (per tensor, MXFP8)
                _config(32, 128, 4, quad=1, k_major=1),  # both orientations (per tensor: capped, below)
                _config(64, 64, 4, quad=1)]  # MXFP8, both orientations
# FP8 per tensor: the plain tiles and the per-tensor row quads, capped at the registers their
# dense kernel uses (the grouped kernel's rare group-boundary path would otherwise raise every
# tile's count and lower occupancy); the 64 x 64 quads lost to them on every shape once capped.
TENSORWISE_CONFIGS = CAST_CONFIGS[:2] + [_config(32, 128, 4, quad=1, k_major=1, maxnreg=72)]
# 128-wide blocks: BK = 128; BM = 128 whenever blocks also run along M (columnwise, 128x128).
BLOCK128_CONFIGS = [_config(128, 128, 8, bkc=128),  # the plain tile (every orientation)
                    _config(32, 128, 4, k_major=1, bkc=128),  # 1x128 rowwise alone
                    _config(128, 128, 8, quad=1, bkc=128, maxnreg=128),  # both orientations (1x128, 128x128)
                    _config(128, 128, 16, quad=1, k_major=1, bkc=128)]  # 128x128 rowwise alone


# ---------------------------------------------------------------- one config at a time

_FORCED: dict = {}  # Autotuner -> the config its launches run instead of tuning (forced_config)


@contextlib.contextmanager
def forced_config(kernel, config: triton.Config):
    """Launches of `kernel` (an autotuned cast kernel of qmoe.kernels.quantize) inside this block run `config`
    directly, whatever their size, bypassing the autotuner: how tests and sweeps check and time
    every config it could pick (`configs_for` lists them)."""
    _FORCED[kernel] = config
    try:
        yield
    finally:
        del _FORCED[kernel]


def is_forced(kernel) -> bool:
    """Whether launches of `kernel` run a forced config now (no other kernel may stand in for it)."""
    return kernel in _FORCED


def configs_for(kernel, m: int, k: int, **meta) -> list[triton.Config]:
    """The configs the autotuner of `kernel` would try for an [m, k] input and these constexprs."""
    prune = kernel.early_config_prune or (lambda configs, named_args, **kw: configs)
    return prune(kernel.configs, {"M": m, "K": k}, **meta)


def launch_cast(kernel, grid, args: tuple, small: triton.Config, numel: int, **meta) -> None:
    """`launch`, or the forced config with its register cap."""
    forced = _FORCED.get(kernel)
    if forced is None:
        launch(kernel, grid, args, small, numel, **meta)
    else:
        cap = {"maxnreg": forced.maxnreg} if forced.maxnreg else {}
        wrapped(kernel.fn)[grid](*args, **meta, **forced.kwargs, num_warps=forced.num_warps,
                                 num_stages=forced.num_stages, **cap)


# ---------------------------------------------------------------- row quads

@triton.jit
def load_quads(x_ptr, probs_ptr, row0, row_end, cols, k_ok, stride_xm, K, ACT: tl.constexpr,
               GLU_BLOCK: tl.constexpr, R4: tl.constexpr):
    """The input's rows row0 + 4i + j (i < R4) at `cols` as four fp32 tiles x_j [R4, len(cols)]
    (a row quad, `qmoe.kernels._tiles`)."""
    r = row0 + tl.arange(0, R4) * 4
    x0 = load_rows(x_ptr, probs_ptr, r, cols, r < row_end, k_ok, stride_xm, K, ACT, GLU_BLOCK).to(tl.float32)
    x1 = load_rows(x_ptr, probs_ptr, r + 1, cols, r + 1 < row_end, k_ok, stride_xm, K, ACT, GLU_BLOCK).to(tl.float32)
    x2 = load_rows(x_ptr, probs_ptr, r + 2, cols, r + 2 < row_end, k_ok, stride_xm, K, ACT, GLU_BLOCK).to(tl.float32)
    x3 = load_rows(x_ptr, probs_ptr, r + 3, cols, r + 3 < row_end, k_ok, stride_xm, K, ACT, GLU_BLOCK).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def store_quads(row_ptr, col_ptr, y0, y1, y2, y3, row0, col0, M, K, row_end, FMT_MAX: tl.constexpr,
                OUT_DTYPE: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, R4: tl.constexpr,
                C: tl.constexpr):
    """Cast the scaled row quad y_j [R4, C] at (row0, col0) and store the codes rowwise and / or
    transposed (each column's four codes of a quad packed in one thread, `interleave4`)."""
    q0 = cast_codes(y0, FMT_MAX, OUT_DTYPE)
    q1 = cast_codes(y1, FMT_MAX, OUT_DTYPE)
    q2 = cast_codes(y2, FMT_MAX, OUT_DTYPE)
    q3 = cast_codes(y3, FMT_MAX, OUT_DTYPE)
    if ROWWISE:
        store8_rows4(row_ptr, q0, row0, 0, col0, K, row_end, K, R4, C)
        store8_rows4(row_ptr, q1, row0, 1, col0, K, row_end, K, R4, C)
        store8_rows4(row_ptr, q2, row0, 2, col0, K, row_end, K, R4, C)
        store8_rows4(row_ptr, q3, row0, 3, col0, K, row_end, K, R4, C)
    if COLWISE:
        store8(col_ptr, interleave4(tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3), C, R4), col0, row0, M, K,
               row_end, C, 4 * R4)


@triton.jit
def _chunk(x_ptr, probs_ptr, row0, row_end, col0, c, K, stride_xm, ACT: tl.constexpr, GLU_BLOCK: tl.constexpr,
           R4: tl.constexpr, BKC: tl.constexpr):
    """Chunk c (columns col0 + c * BKC, BKC of them) of a block as a row quad."""
    cols = col0 + c * BKC + tl.arange(0, BKC)
    return load_quads(x_ptr, probs_ptr, row0, row_end, cols, cols < K, stride_xm, K, ACT, GLU_BLOCK, R4)


@triton.jit
def block_quads(x_ptr, probs_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, sblk0, col0, M, K, eps,
                 stride_xm, stride_rs, stride_rsk, stride_cs, stride_csm, ACT: tl.constexpr, GLU_BLOCK: tl.constexpr,
                 FMT_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr, POW2: tl.constexpr, B: tl.constexpr,
                 BLOCK_2D: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, BKC: tl.constexpr):
    """One B x B block at (row0, col0) as a row quad, BKC columns at a time.

    First pass over the chunks: 1 x B columnwise runs (all B rows are in each chunk) are cast and
    stored; 1 x B rowwise runs and 2-D blocks gather their amax. Second pass: rowwise codes, and
    both orientations of a 2-D block (cast once: one scale), from the registers when one chunk is
    the whole block, else from the chunks loaded again (the program read them a moment before).
    Each chunk's load is issued before the previous chunk's stores, which it could not overtake.
    """
    R4: tl.constexpr = B // 4
    NC: tl.constexpr = B // BKC
    kb = col0 // B
    r = row0 + tl.arange(0, R4) * 4
    zero = tl.zeros([R4], dtype=tl.int32)
    a0, a1, a2, a3 = zero, zero, zero, zero  # 1 x B rowwise amax bits per row; 2-D: a0 holds the block's
    x0, x1, x2, x3 = _chunk(x_ptr, probs_ptr, row0, row_end, col0, 0, K, stride_xm, ACT, GLU_BLOCK, R4, BKC)
    for c in tl.static_range(NC):
        if NC > 1:  # the next chunk, or (last) the first one again for the second pass
            n0, n1, n2, n3 = _chunk(x_ptr, probs_ptr, row0, row_end, col0, (c + 1) % NC, K, stride_xm, ACT, GLU_BLOCK,
                                    R4, BKC)
        if BLOCK_2D:
            a0 = tl.maximum(a0, tl.max(quad_abs_bits(x0, x1, x2, x3), 1))
        else:
            if ROWWISE:
                a0 = tl.maximum(a0, tl.max(abs_bits(x0), 1))
                a1 = tl.maximum(a1, tl.max(abs_bits(x1), 1))
                a2 = tl.maximum(a2, tl.max(abs_bits(x2), 1))
                a3 = tl.maximum(a3, tl.max(abs_bits(x3), 1))
            if COLWISE:
                cols = col0 + c * BKC + tl.arange(0, BKC)
                s = fp8_scale_from_amax(bits_to_float(tl.max(quad_abs_bits(x0, x1, x2, x3), 0)), FMT_MAX, POW2, eps)
                store_quads(row_ptr, col_ptr, x0 * s[None, :], x1 * s[None, :], x2 * s[None, :], x3 * s[None, :],
                            row0, col0 + c * BKC, M, K, row_end, FMT_MAX, OUT_DTYPE, False, True, R4, BKC)
                tl.store(col_s_ptr + cols.to(tl.int64) * stride_cs + sblk0 * stride_csm, reciprocal(s), mask=cols < K)
        if NC > 1:
            x0, x1, x2, x3 = n0, n1, n2, n3
    if BLOCK_2D:
        s = fp8_scale_from_amax(bits_to_float(tl.max(a0, 0)), FMT_MAX, POW2, eps)
        if ROWWISE:
            tl.store(row_s_ptr + sblk0 * stride_rs + kb * stride_rsk, reciprocal(s))
        if COLWISE:
            tl.store(col_s_ptr + kb * stride_cs + sblk0 * stride_csm, reciprocal(s))
        s0 = tl.zeros([R4], dtype=tl.float32) + s
        s1, s2, s3 = s0, s0, s0
    elif ROWWISE:
        s0 = fp8_scale_from_amax(bits_to_float(a0), FMT_MAX, POW2, eps)
        s1 = fp8_scale_from_amax(bits_to_float(a1), FMT_MAX, POW2, eps)
        s2 = fp8_scale_from_amax(bits_to_float(a2), FMT_MAX, POW2, eps)
        s3 = fp8_scale_from_amax(bits_to_float(a3), FMT_MAX, POW2, eps)
        at = row_s_ptr + r.to(tl.int64) * stride_rs + kb * stride_rsk
        tl.store(at, reciprocal(s0), mask=r < row_end)
        tl.store(at + stride_rs, reciprocal(s1), mask=r + 1 < row_end)
        tl.store(at + 2 * stride_rs, reciprocal(s2), mask=r + 2 < row_end)
        tl.store(at + 3 * stride_rs, reciprocal(s3), mask=r + 3 < row_end)
    if BLOCK_2D or ROWWISE:
        for c in tl.static_range(NC):
            if c + 1 < NC:
                n0, n1, n2, n3 = _chunk(x_ptr, probs_ptr, row0, row_end, col0, c + 1, K, stride_xm, ACT, GLU_BLOCK,
                                        R4, BKC)
            store_quads(row_ptr, col_ptr, x0 * s0[:, None], x1 * s1[:, None], x2 * s2[:, None], x3 * s3[:, None],
                        row0, col0 + c * BKC, M, K, row_end, FMT_MAX, OUT_DTYPE, ROWWISE, COLWISE and BLOCK_2D, R4, BKC)
            if c + 1 < NC:
                x0, x1, x2, x3 = n0, n1, n2, n3


@triton.jit
def mx_multiplier(amax, FMT_MAX: tl.constexpr, EMAX: tl.constexpr, ROUND_UP: tl.constexpr):
    """(the multiplier 2^-b of each block amax, NaN for a NaN block; the E8M0 byte b + 127)."""
    b = mx_exponent(amax, FMT_MAX, EMAX, ROUND_UP)
    return tl.where(b == 128, amax, exp2_int(-b)), (b + 127).to(tl.uint8)


@triton.jit
def mx_rows(x, row_s_ptr, rows, row_end, kb, K, stride_rs, stride_rsk, FMT_MAX: tl.constexpr, EMAX: tl.constexpr,
            ROUND_UP: tl.constexpr, B: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """x [R, C] (rows `rows`) times its rowwise MXFP8 multipliers, ready to cast; the E8M0 bytes go
    to row_s_ptr."""
    mult, e = mx_multiplier(block_amax_last(x, R, C, B, False), FMT_MAX, EMAX, ROUND_UP)
    tl.store(row_s_ptr + rows[:, None].to(tl.int64) * stride_rs + kb[None, :] * stride_rsk, e,
             mask=(rows < row_end)[:, None] & (kb * B < K)[None, :])
    return scale_last(x, mult, R, C, B)


@triton.jit
def mx_quads(x_ptr, probs_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, col0, cols, kb, mb, mb_ok, M, K,
             stride_xm, stride_rs, stride_rsk, stride_cs, stride_csm, ACT: tl.constexpr, GLU_BLOCK: tl.constexpr,
             FMT_MAX: tl.constexpr, EMAX: tl.constexpr, ROUND_UP: tl.constexpr, OUT_DTYPE: tl.constexpr,
             B: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, R4: tl.constexpr, BK: tl.constexpr):
    """The MXFP8 kernel's tile as a row quad: 1 x B runs along K per quad row; a run of B rows
    along M is B / 4 rows of every quad tile. Scale bytes at kb (rowwise) and mb (columnwise)."""
    r = row0 + tl.arange(0, R4) * 4
    k_ok = cols < K
    x0, x1, x2, x3 = load_quads(x_ptr, probs_ptr, row0, row_end, cols, k_ok, stride_xm, K, ACT, GLU_BLOCK, R4)
    if ROWWISE:
        y0 = mx_rows(x0, row_s_ptr, r, row_end, kb, K, stride_rs, stride_rsk, FMT_MAX, EMAX, ROUND_UP, B, R4, BK)
        y1 = mx_rows(x1, row_s_ptr, r + 1, row_end, kb, K, stride_rs, stride_rsk, FMT_MAX, EMAX, ROUND_UP, B, R4, BK)
        y2 = mx_rows(x2, row_s_ptr, r + 2, row_end, kb, K, stride_rs, stride_rsk, FMT_MAX, EMAX, ROUND_UP, B, R4, BK)
        y3 = mx_rows(x3, row_s_ptr, r + 3, row_end, kb, K, stride_rs, stride_rsk, FMT_MAX, EMAX, ROUND_UP, B, R4, BK)
        store_quads(row_ptr, col_ptr, y0, y1, y2, y3,
                    row0, col0, M, K, row_end, FMT_MAX, OUT_DTYPE, True, False, R4, BK)
    if COLWISE:  # a run of B rows along M is B / 4 rows of every quad tile
        amax = bits_to_float(runs_max_first(quad_abs_bits(x0, x1, x2, x3), R4, BK, B // 4))  # [BM // B, BK]
        mult, e = mx_multiplier(amax, FMT_MAX, EMAX, ROUND_UP)
        store_quads(row_ptr, col_ptr, scale_first(x0, mult, R4, BK, B // 4), scale_first(x1, mult, R4, BK, B // 4),
                    scale_first(x2, mult, R4, BK, B // 4), scale_first(x3, mult, R4, BK, B // 4), row0, col0, M, K,
                    row_end, FMT_MAX, OUT_DTYPE, False, True, R4, BK)
        tl.store(col_s_ptr + cols[None, :].to(tl.int64) * stride_cs + mb[:, None] * stride_csm, e,
                 mask=k_ok[None, :] & mb_ok[:, None])
