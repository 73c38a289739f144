"""Triton device functions on whole tiles: group scheduling, block reductions, transforms, stores.

- Tile scheduling over groups: a launch covers `cdiv(M, BM) + G` virtual row tiles (a static
  bound on sum_g cdiv(M_g, BM)); `tile_rows` maps a tile to its group from the device split
  sizes, so no tile and no block crosses a group boundary and the host never reads the splits.
- Block amaxes and scale broadcasts over runs of B along either axis of a [R, C] tile, or over
  B x B blocks (exact: see `qmoe.kernels._arith`).
- The random Hadamard transform of runs of 16, 8-bit stores, Philox uniforms for stochastic rounding.
- Row quads: a tile held as four tiles x_j of its rows 4i + j, so that four codes of one column,
  which a transposed copy stores as one 32-bit word, sit in one thread (`interleave4`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from qmoe.contracts.formats import RHT_SIGNS
from qmoe.kernels._arith import INF_BITS, abs_bits, bits_to_float

# Bit i set where the RHT sign vector s has s_i = -1.
RHT_SIGN_MASK = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)


@triton.jit
def tile_rows(splits_ptr, M, G, pid, BM: tl.constexpr, SB: tl.constexpr, G_P2: tl.constexpr,
              GROUPED: tl.constexpr):
    """Rows of virtual row tile `pid`: (group, first row, group end row, first scale block, group start).

    Groups start their tiles (and their SB-row scale blocks) afresh; tiles past the last group
    get group index >= G. Ungrouped: one group of M rows.
    """
    if GROUPED:
        idx = tl.arange(0, G_P2)
        sizes = tl.load(splits_ptr + idx, mask=idx < G, other=0).to(tl.int32)
        tiles = (sizes + BM - 1) // BM
        tile_end = tl.cumsum(tiles, 0)
        g = tl.sum((tile_end <= pid).to(tl.int32), 0)
        sel = idx == g
        tile0 = tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
        start = tl.sum(tl.where(sel, tl.cumsum(sizes, 0) - sizes, 0), 0)
        size = tl.sum(tl.where(sel, sizes, 0), 0)
        blocks = (sizes + SB - 1) // SB
        sblk = tl.sum(tl.where(sel, tl.cumsum(blocks, 0) - blocks, 0), 0)
        local = (pid - tile0) * BM
        return g, start + local, start + size, sblk + local // SB, start
    else:
        return 0, pid * BM, M, pid * (BM // SB), 0


@triton.jit
def tile_pids(K, BK: tl.constexpr, K_MAJOR: tl.constexpr):
    """(virtual row tile, column tile) of this program.

    K_MAJOR: a 1-D grid of row tiles x cdiv(K, BK) in which consecutive programs walk along K, so
    the programs running together read whole rows and write neighbouring entries of per-row scale
    arrays; else the 2-D grid (row tiles, column tiles), consecutive programs walking down M.
    """
    if K_MAJOR:
        nk = tl.cdiv(K, BK)
        pid = tl.program_id(0)
        return pid // nk, pid % nk
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit
def tile_span(row0, row_end, K, BM: tl.constexpr, BK: tl.constexpr):
    """The [BM, BK] tile from row0 and column program_id(1) * BK: (rows, first column, columns,
    row mask (rows before row_end), column mask (columns before K))."""
    rows = row0 + tl.arange(0, BM)
    col0 = tl.program_id(1) * BK
    cols = col0 + tl.arange(0, BK)
    return rows, col0, cols, rows < row_end, cols < K


# ---------------------------------------------------------------- block reductions on tiles

@triton.jit
def block_amax_last(x, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr, IGNORE_NAN: tl.constexpr):
    """max|x| over runs of B along the last axis of a [R, C] fp32 tile -> [R, C // B]."""
    b = abs_bits(tl.reshape(x, (R, C // B, B)))
    if IGNORE_NAN:
        b = tl.where(b > INF_BITS, 0, b)
    return bits_to_float(tl.max(b, 2))


@triton.jit
def scale_last(x, s, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """x [R, C] times s [R, C // B] broadcast over runs of B along the last axis."""
    return tl.reshape(tl.reshape(x, (R, C // B, B)) * s[:, :, None], (R, C))


@triton.jit
def block_amax_first(x, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr, IGNORE_NAN: tl.constexpr):
    """max|x| over runs of B along the first axis of a [R, C] fp32 tile -> [R // B, C]."""
    b = abs_bits(tl.reshape(x, (R // B, B, C)))
    if IGNORE_NAN:
        b = tl.where(b > INF_BITS, 0, b)
    return bits_to_float(tl.max(b, 1))


@triton.jit
def scale_first(x, s, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """x [R, C] times s [R // B, C] broadcast over runs of B along the first axis."""
    return tl.reshape(tl.reshape(x, (R // B, B, C)) * s[:, None, :], (R, C))


@triton.jit
def block_amax_2d(x, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """max|x| over B x B blocks of a [R, C] fp32 tile -> [R // B, C // B] (NaN propagates)."""
    per_row = tl.max(abs_bits(tl.reshape(x, (R, C // B, B))), 2)  # [R, C/B]
    return bits_to_float(tl.max(tl.reshape(per_row, (R // B, B, C // B)), 1))


@triton.jit
def scale_2d(x, s, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """x [R, C] times s [R // B, C // B] broadcast over B x B blocks."""
    rows = tl.reshape(tl.broadcast_to(s[:, None, :], (R // B, B, C // B)), (R, C // B))
    return scale_last(x, rows, R, C, B)


@triton.jit
def hadamard16(DTYPE: tl.constexpr, SIGN_MASK: tl.constexpr):
    """(diag(s) @ H16) / 4 as a [16, 16] tile: entry (i, j) = s_i (-1)^popcount(i & j) / 4."""
    i = tl.arange(0, 16)[:, None]
    j = tl.arange(0, 16)[None, :]
    v = i & j
    parity = (v ^ (v >> 1) ^ (v >> 2) ^ (v >> 3)) & 1
    neg = parity ^ ((SIGN_MASK >> i) & 1)
    return tl.where(neg == 1, -0.25, 0.25).to(DTYPE)


@triton.jit
def rht_last(x, R: tl.constexpr, C: tl.constexpr, SIGN_MASK: tl.constexpr):
    """Random Hadamard transform of every run of 16 along the last axis of x [R, C] -> fp32.

    One [R*C/16, 16] @ [16, 16] product; the +-1/4 entries are exact in x's dtype, so bf16 and
    fp16 tiles use tensor cores with fp32 accumulation and fp32 tiles an IEEE fp32 product.
    """
    h = hadamard16(x.dtype, SIGN_MASK)
    runs = tl.reshape(x, (R * C // 16, 16))
    if x.dtype == tl.float32:
        y = tl.dot(runs, h, input_precision="ieee", out_dtype=tl.float32)
    else:
        y = tl.dot(runs, h, out_dtype=tl.float32)
    return tl.reshape(y, (R, C))


@triton.jit
def pack4(vals, R: tl.constexpr, C: tl.constexpr):
    """An 8-bit tile [R, C] as int32 words [R, C // 4] (byte j of a word = column 4w + j)."""
    w = tl.reshape(vals.to(tl.uint8, bitcast=True).to(tl.int32), (R, C // 4, 4))
    return tl.sum(w << (tl.arange(0, 4) * 8)[None, None, :], 2)


@triton.jit
def store8(ptr, vals, row0, col0, stride, row_end, col_end, R: tl.constexpr, C: tl.constexpr):
    """Store an 8-bit tile vals [R, C] at ptr[(row0 + i) * stride + col0 + j], for rows < row_end and
    columns < col_end.

    Whole tiles starting 16-byte aligned are stored as int32 words packed in registers, so the
    layout conversion before a transposed store moves 32-bit words (see cast_bits), and grouped
    tiles, whose first row is only known at run time, still store 16 bytes at a time.
    """
    rows = row0 + tl.arange(0, R)
    if (row0 + R <= row_end) & (col0 + C <= col_end) & (col0 % 16 == 0) & (stride % 16 == 0):
        words = (col0 // 16) * 4 + tl.arange(0, C // 4)  # == col0 / 4 + j, visibly 16-byte aligned
        tl.store(ptr.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * ((stride // 16) * 4)
                 + words[None, :], pack4(vals, R, C))
    else:
        cols = col0 + tl.arange(0, C)
        tl.store(ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], vals,
                 mask=(rows < row_end)[:, None] & (cols < col_end)[None, :])


@triton.jit
def store8_rows4(ptr, vals, row0, j, col0, stride, row_end, col_end, R4: tl.constexpr, C: tl.constexpr):
    """store8 of rows row0 + 4i + j (i < R4) of an 8-bit [4 * R4, C] tile, vals [R4, C]: the same
    16-byte words for whole aligned tiles, masked bytes otherwise."""
    rows = row0 + tl.arange(0, R4) * 4 + j
    if (row0 + 4 * R4 <= row_end) & (col0 + C <= col_end) & (col0 % 16 == 0) & (stride % 16 == 0):
        words = (col0 // 16) * 4 + tl.arange(0, C // 4)
        tl.store(ptr.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * ((stride // 16) * 4)
                 + words[None, :], pack4(vals, R4, C))
    else:
        cols = col0 + tl.arange(0, C)
        tl.store(ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], vals,
                 mask=(rows < row_end)[:, None] & (cols < col_end)[None, :])


@triton.jit
def interleave4(v0, v1, v2, v3, R: tl.constexpr, C4: tl.constexpr):
    """The [R, 4 * C4] tile t with t[r, 4i + j] = v_j[r, i], each thread's four values of a column
    group in its own registers (tl.join keeps what it joins in one thread): the transposed copy of
    a row quad, whose runs of four along M then pack into words without moving between threads."""
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (R, 4 * C4))


@triton.jit
def quad_abs_bits(x0, x1, x2, x3):
    """Elementwise max of |x_j|'s bits over a row quad (NaN wins): a [R4, C] int32 tile."""
    return tl.maximum(tl.maximum(abs_bits(x0), abs_bits(x1)), tl.maximum(abs_bits(x2), abs_bits(x3)))


@triton.jit
def runs_max_first(b, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """Max of an int [R, C] tile over runs of B along the first axis -> [R // B, C]."""
    return tl.max(tl.reshape(b, (R // B, B, C)), 1)


@triton.jit
def uniform_tile(seed, offs, R: tl.constexpr, C: tl.constexpr):
    """[R, C] uniforms in [0, 1) (24-bit resolution) from one Philox call per 4 elements.

    offs [R, C // 4]: distinct Philox counters, one per run of 4 elements along the last axis.
    """
    r0, r1, r2, r3 = tl.randint4x(seed, offs)
    r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (R, C))
    return (r >> 8).to(tl.float32) * (1.0 / 16777216.0)

