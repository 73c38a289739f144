"""Triton device functions of the NVFP4 kernels (`qmoe.kernels.quantize_nvfp4`), on whole tiles.

- Two views of a tile, each loaded as the copy it feeds needs (the second load hits the cache):
  rows in order, 8 columns a thread (16-byte loads), for the rowwise copy; and the tile order,
  where tile row t = i * (BM/16) + j holds row row0 + 16 j + i: the load's layout puts the slowest
  index (i) in one thread's registers, so with narrow vectors along K each thread holds whole
  16-row runs of a few columns, and the columnwise blocks, their Hadamard transform and their
  packing along M need no exchange between threads.
- Arithmetic (NUMERICS.md, bit for bit, the same in the interpreter): E4M3 block scales and E2M1
  codes by one fp32 addition of a binade constant each (RNE onto the grid), 1 / (s_b * S_dec) by
  `_arith.rcp_rn`; codes packed eight to an int32 word, -0 made +0.
- Stochastic rounding draws: each value's Philox counter is fixed by its position (and which
  copy), not by the tile (`_tiles.uniform_tile`: one call per 4 values).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.contracts.formats import E4M3, FLT_MAX
from qmoe.kernels._arith import rcp_rn, reciprocal
from qmoe.kernels._tiles import rht16, uniform_tile

_FLT_MAX = tl.constexpr(FLT_MAX)
_ONE_SIXTH = tl.constexpr(float(torch.tensor(1.0 / 6.0, dtype=torch.float32)))  # fp32(1/6), as the reference
_E4M3_MAX = tl.constexpr(E4M3.max)


# ---------------------------------------------------------------- scales and codes

@triton.jit
def max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def e4m3_rne(v):
    """RNE satfinite E4M3 of v >= 0 or NaN -> (the value in fp32, its bits as uint8).

    The grid spacing in the binade 2^e of v is 2^(e-3) (2^-9 below 2^-6): one fp32 addition of
    1.5 * 2^(e+20) rounds v onto it, and the bits above the constant count steps (Triton's
    interpreter mis-rounds float -> fp8 conversions; this is exact in both)."""
    v = tl.minimum(v, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    eb = tl.maximum(v.to(tl.int32, bitcast=True) >> 23, 121)  # biased binade, at least 2^-6
    mb = ((eb + 20) << 23) | 0x400000
    s = v + mb.to(tl.float32, bitcast=True)
    code = ((eb - 121) << 3) + s.to(tl.int32, bitcast=True) - mb
    return s - mb.to(tl.float32, bitcast=True), tl.where(v != v, 0x7F, code).to(tl.uint8)


@triton.jit
def block_scale(amax_b, s_enc):
    """Per block: (E4M3 scale s_b as uint8 bits, encode multiplier min(1 / (s_b * S_dec), FLT_MAX),
    the clamp of |y|: 6, or 0 for a NaN block, whose codes are all 0)."""
    sb, bits = e4m3_rne(tl.minimum(amax_b * (s_enc * _ONE_SIXTH), _FLT_MAX, propagate_nan=tl.PropagateNan.ALL))
    enc = tl.where(sb == 0, _FLT_MAX, tl.minimum(rcp_rn(sb * reciprocal(s_enc)), _FLT_MAX))
    return bits, enc, tl.where(amax_b != amax_b, 0.0, 6.0)


@triton.jit
def e2m1_codes(y, lim, STOCHASTIC: tl.constexpr, u):
    """4-bit E2M1 codes (int32, sign in bit 3; `pack8` makes -0 +0) of y = x * enc.

    a = min(|y|, lim) (NaN -> lim). In the binade of max(a, 1) the grid spacing is 2^(e-1), e in
    {0, 1, 2}: a + 1.5 * 2^(22+e) rounds a onto that grid exactly once (RNE), and the bits above
    the constant count grid steps. Stochastic: the lower neighbour lo, plus one step when
    u < (a - lo) / spacing (u uniform in [0, 1)).
    """
    a = tl.minimum(tl.abs(y), lim)
    base = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000  # 2^e
    mb = base + 0x0B400000  # 1.5 * 2^(22+e)
    s = a + mb.to(tl.float32, bitcast=True)
    steps = s.to(tl.int32, bitcast=True) - mb
    if STOCHASTIC:  # d = (a - nearest) / spacing in [-1/2, 1/2] (exact): from lo = nearest - [d < 0]
        d = (a - (s - mb.to(tl.float32, bitcast=True))) * (0x7F800000 - base).to(tl.float32, bitcast=True)
        steps = steps + (u < d).to(tl.int32) - (d <= u - 1.0).to(tl.int32)
    return (steps + (base >> 22) - 254) | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def pack8(codes, R: tl.constexpr):
    """codes [R, 8] -> int32 words [R] (value i in bits 4i..4i+3), -0 codes made +0."""
    w = tl.sum(codes << (4 * tl.arange(0, 8))[None, :], 1)
    nonzero = ((w & 0x77777777) + 0x77777777) & -0x77777778  # 0x88888888: bit 3 of a nibble, magnitude != 0
    return w & (nonzero | 0x77777777)


@triton.jit
def words_to_bytes(words, R: tl.constexpr, C: tl.constexpr):
    """int32 words [R, C] -> uint8 [R, 4C] (little endian)."""
    b = (words[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF
    return tl.reshape(b, (R, 4 * C)).to(tl.uint8)


# ---------------------------------------------------------------- tile order

@triton.jit
def tile_rows_order(row0, BM: tl.constexpr):
    """The row each tile row holds: t = i * (BM/16) + j -> row0 + 16 j + i (module docstring)."""
    t = tl.arange(0, BM)
    return row0 + 16 * (t % (BM // 16)) + t // (BM // 16)


@triton.jit
def tile_runs(v, BM: tl.constexpr, BK: tl.constexpr):
    """A tile [BM, BK] in tile order -> its columnwise runs [BK * BM/16, 16]: run k * BM/16 + j holds
    column k, rows 16 j ..; in registers, no data moves."""
    return tl.reshape(tl.permute(tl.reshape(v, (16, BM // 16, BK)), (2, 1, 0)), (BK * BM // 16, 16))


# ---------------------------------------------------------------- stochastic rounding draws

@triton.jit
def rowwise_uniform(seed_ptr, rows, col0, K, R: tl.constexpr, BK: tl.constexpr):
    """The rowwise copy's draws [R, BK]: Philox counter row * K + column of the first of 4 columns."""
    offs = (rows.to(tl.int64) * K + col0)[:, None] + tl.arange(0, BK)[None, :]
    first, _ = tl.split(tl.split(tl.reshape(offs, (R, BK // 4, 2, 2)))[0])  # each run's first: as the tile
    return uniform_tile(tl.load(seed_ptr), first, R, BK)


@triton.jit
def colwise_uniform(seed_ptr, row0, cols, M, RUNS_OF_ROWS: tl.constexpr, BM: tl.constexpr, BKC: tl.constexpr):
    """The columnwise copy's draws (second seed) as runs [BKC * BM/16, 16] of columns `cols`.

    RUNS_OF_ROWS (RHT and 16x16 copies): counter column * M + row of the first of 4 rows (rows
    counted from row0), one Philox call per 4 values. Otherwise: counter (column of the first of
    4 columns) * M + row, value column % 4 of it (a call per value: the disable_rht ablation).
    """
    J: tl.constexpr = BM // 16
    seed = tl.load(seed_ptr + 1)
    if RUNS_OF_ROWS:
        offs = (cols.to(tl.int64) * M + row0)[:, None, None] + (16 * tl.arange(0, J))[None, :, None] \
            + (4 * tl.arange(0, 4))[None, None, :]
        return uniform_tile(seed, tl.reshape(offs, (BKC * J, 4)), BKC * J, 16)
    rows = row0 + (16 * tl.arange(0, J))[None, :, None] + tl.arange(0, 16)[None, None, :]
    c = cols[:, None, None]
    r0, r1, r2, r3 = tl.randint4x(seed, tl.reshape((c - c % 4).to(tl.int64) * M + rows, (BKC * J, 16)))
    t = tl.reshape(tl.broadcast_to(c % 4, (BKC, J, 16)), (BKC * J, 16))
    r = tl.where(t == 0, r0, tl.where(t == 1, r2, tl.where(t == 2, r1, r3)))  # uniform_tile's order
    return (r >> 8).to(tl.float32) * (1.0 / 16777216.0)


# ---------------------------------------------------------------- stores

@triton.jit
def store_row(row_ptr, words, rows, col0, m_ok, K, stride_row, ROW_WORDS: tl.constexpr, R: tl.constexpr,
              BK: tl.constexpr):
    """Rowwise words [R, BK/8] (word c: columns col0 + 8c ..) into data [M, K/2]."""
    r64 = rows[:, None].to(tl.int64)
    if ROW_WORDS:  # K % 8 == 0: whole words
        w = col0 // 8 + tl.arange(0, BK // 8)
        tl.store(row_ptr.to(tl.pointer_type(tl.int32)) + r64 * (stride_row // 4) + w[None, :], words,
                 mask=m_ok[:, None] & (w < K // 8)[None, :])
    else:
        c = col0 // 2 + tl.arange(0, BK // 2)
        tl.store(row_ptr + r64 * stride_row + c[None, :], words_to_bytes(words, R, BK // 8),
                 mask=m_ok[:, None] & (c < K // 2)[None, :])


@triton.jit
def or_nibbles(col_ptr, codes_t, cols, rows, stride_col, mask):
    """OR codes_t [BKC, BM] into their nibbles of col (bytes [K, M/2]) with int32 atomics (zeroed bytes)."""
    addr = cols[:, None].to(tl.int64) * stride_col + (rows // 2)[None, :]
    shift = ((addr & 3) * 8).to(tl.int32) + (rows % 2)[None, :] * 4
    words = col_ptr.to(tl.pointer_type(tl.int32)) + (addr >> 2)
    tl.atomic_or(words, codes_t << shift, mask=mask & (codes_t != 0))


@triton.jit
def store_col(col_ptr, words, cols, k_ok, row0, row_end, gstart, stride_col,
              COL_WORDS: tl.constexpr, GROUPED: tl.constexpr, BM: tl.constexpr, BKC: tl.constexpr):
    """Columnwise words [BKC, BM/8] (word w of column k: rows row0 + 8w ..) into data [K, M/2]."""
    c64 = cols[:, None].to(tl.int64)
    w = tl.arange(0, BM // 8)
    if COL_WORDS & (row0 % 8 == 0) & ((row_end % 8 == 0) | (row0 + BM <= row_end)):
        tl.store(col_ptr.to(tl.pointer_type(tl.int32)) + c64 * (stride_col // 4) + (row0 // 8 + w)[None, :], words,
                 mask=k_ok[:, None] & (row0 + 8 * w < row_end)[None, :])
    else:  # bytes; a byte shared with a neighbour group (odd start or end) by atomic OR of nibbles
        limit = row_end // 2
        if GROUPED:
            limit = tl.where(gstart % 2 == 0, limit, 0)
        b = row0 // 2 + tl.arange(0, BM // 2)
        tl.store(col_ptr + c64 * stride_col + b[None, :], words_to_bytes(words, BKC, BM // 8),
                 mask=k_ok[:, None] & (b < limit)[None, :])
        if GROUPED:
            if (gstart % 2 == 1) | ((row_end % 2 == 1) & (row0 + BM >= row_end)):
                rows = row0 + tl.arange(0, BM)
                codes_t = tl.reshape((words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF, (BKC, BM))
                shared = (rows < row_end) & (((rows * 0 + gstart) % 2 == 1) | (rows == row_end - 1))
                or_nibbles(col_ptr, codes_t, cols, rows, stride_col, k_ok[:, None] & shared[None, :])


# ---------------------------------------------------------------- the copies

@triton.jit
def encode_rows(xf, enc, lim, rows, col0, row_end, K, seed_ptr, row_ptr, stride_row, STOCHASTIC: tl.constexpr,
                ROW_WORDS: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """Codes of xf [R, BK/16, 16] (fp32, runs along K) with their blocks' enc / lim [R, BK/16], stored."""
    u = 0.0
    if STOCHASTIC:
        u = tl.reshape(rowwise_uniform(seed_ptr, rows, col0, K, R, BK), (R, BK // 16, 16))
    codes = e2m1_codes(xf * enc[:, :, None], lim[:, :, None], STOCHASTIC, u)
    words = tl.reshape(pack8(tl.reshape(codes, (R * BK // 8, 8)), R * BK // 8), (R, BK // 8))
    store_row(row_ptr, words, rows, col0, rows < row_end, K, stride_row, ROW_WORDS, R, BK)


@triton.jit
def encode_cols(y, enc, lim, cols, row0, row_end, gstart, M, K, seed_ptr, col_ptr, stride_col,
                RUNS_OF_ROWS: tl.constexpr, STOCHASTIC: tl.constexpr, COL_WORDS: tl.constexpr, GROUPED: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr):
    """Codes of the runs y [BK * BM/16, 16] (`tile_runs` of columns `cols`) with enc / lim per run, stored."""
    N: tl.constexpr = BK * BM // 16
    u = 0.0
    if STOCHASTIC:
        u = colwise_uniform(seed_ptr, row0, cols, M, RUNS_OF_ROWS, BM, BK)
    codes = e2m1_codes(y * enc[:, None], lim[:, None], STOCHASTIC, u)
    words = tl.reshape(pack8(tl.reshape(codes, (2 * N, 8)), 2 * N), (BK, BM // 8))
    store_col(col_ptr, words, cols, cols < K, row0, row_end, gstart, stride_col, COL_WORDS, GROUPED, BM, BK)


@triton.jit
def quantize_rows(x, rows, col0, row_end, K, s_enc, seed_ptr, row_ptr, row_s_ptr, stride_row, stride_rs,
                  STOCHASTIC: tl.constexpr, ROW_WORDS: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """1x16 blocks along K of rows x [R, BK]: codes and scales stored."""
    xf = tl.reshape(x.to(tl.float32), (R, BK // 16, 16))
    sb, enc, lim = block_scale(tl.reduce(tl.abs(xf), 2, max_keep_nan), s_enc)
    encode_rows(xf, enc, lim, rows, col0, row_end, K, seed_ptr, row_ptr, stride_row, STOCHASTIC, ROW_WORDS, R, BK)
    kb = col0 // 16 + tl.arange(0, BK // 16)
    tl.store(row_s_ptr + rows[:, None].to(tl.int64) * stride_rs + kb[None, :], sb,
             mask=(rows < row_end)[:, None] & (kb * 16 < K)[None, :])


@triton.jit
def quantize_cols(xt, cols, row0, row_end, gstart, sblk0, M, K, s_enc, seed_ptr, col_ptr, col_s_ptr, stride_col,
                  stride_cs, RHT: tl.constexpr, STOCHASTIC: tl.constexpr, COL_WORDS: tl.constexpr,
                  GROUPED: tl.constexpr, SIGN_MASK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """1x16 blocks along M of xt [BM, BK] (tile order; the columnwise copy, Hadamard-transformed with
    RHT): codes and scales stored."""
    if RHT:
        y = rht16(tile_runs(xt, BM, BK), BK * BM // 16, SIGN_MASK)
    else:
        y = tile_runs(xt, BM, BK).to(tl.float32)
    sb, enc, lim = block_scale(tl.reduce(tl.abs(y), 1, max_keep_nan), s_enc)
    encode_cols(y, enc, lim, cols, row0, row_end, gstart, M, K, seed_ptr, col_ptr, stride_col, RHT, STOCHASTIC,
                COL_WORDS, GROUPED, BM, BK)
    mb = sblk0 + tl.arange(0, BM // 16)
    tl.store(col_s_ptr + cols[:, None].to(tl.int64) * stride_cs + mb[None, :], tl.reshape(sb, (BK, BM // 16)),
             mask=(cols < K)[:, None] & (row0 + 16 * tl.arange(0, BM // 16) < row_end)[None, :])


@triton.jit
def quantize_16x16(x, xt, rows, row0, row_end, gstart, sblk0, col0, cols, M, K, s_enc, seed_ptr, row_ptr, row_s_ptr,
                   col_ptr, col_s_ptr, stride_row, stride_rs, stride_col, stride_cs, ROWWISE: tl.constexpr,
                   COLWISE: tl.constexpr, STOCHASTIC: tl.constexpr, ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr,
                   GROUPED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """16x16 blocks, one scale for both copies: scales from xt [BM, BK] (tile order: a block is 16 of a
    thread's rows), rowwise codes from x (natural order), columnwise codes from xt; all stored."""
    J: tl.constexpr = BM // 16
    yt = tile_runs(xt, BM, BK).to(tl.float32)  # run k * J + j
    runs = tl.reshape(tl.reduce(tl.abs(yt), 1, max_keep_nan), (BK // 16, 16, J))
    sb, enc, lim = block_scale(tl.reduce(runs, 1, max_keep_nan), s_enc)  # block (column block, row block)
    mb = sblk0 + tl.arange(0, J)
    mb_ok = row0 + 16 * tl.arange(0, J) < row_end
    kb = col0 // 16 + tl.arange(0, BK // 16)
    kb_ok = kb * 16 < K
    if ROWWISE:
        enc_r = tl.reshape(tl.broadcast_to(tl.trans(enc)[:, None, :], (J, 16, BK // 16)), (BM, BK // 16))
        lim_r = tl.reshape(tl.broadcast_to(tl.trans(lim)[:, None, :], (J, 16, BK // 16)), (BM, BK // 16))
        encode_rows(tl.reshape(x.to(tl.float32), (BM, BK // 16, 16)), enc_r, lim_r, rows, col0, row_end, K,
                    seed_ptr, row_ptr, stride_row, STOCHASTIC, ROW_WORDS, BM, BK)
        tl.store(row_s_ptr + mb[:, None] * stride_rs + kb[None, :], tl.trans(sb.to(tl.int32)).to(tl.uint8),
                 mask=mb_ok[:, None] & kb_ok[None, :])
    if COLWISE:
        enc_t = tl.reshape(tl.broadcast_to(enc[:, None, :], (BK // 16, 16, J)), (BK * J,))
        lim_t = tl.reshape(tl.broadcast_to(lim[:, None, :], (BK // 16, 16, J)), (BK * J,))
        encode_cols(yt, enc_t, lim_t, cols, row0, row_end, gstart, M, K, seed_ptr, col_ptr, stride_col, True,
                    STOCHASTIC, COL_WORDS, GROUPED, BM, BK)
        tl.store(col_s_ptr + kb[:, None] * stride_cs + mb[None, :], sb, mask=kb_ok[:, None] & mb_ok[None, :])
