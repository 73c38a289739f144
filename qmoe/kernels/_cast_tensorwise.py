"""The FP8 per-tensor cast's Triton kernel (private helper of `qmoe/kernels/quantize.py`, whose
`fp8_tensorwise_op` launches it): q = cast(x * scale[g]) in both orientations and max|x| per group.

Grouped inputs: the tiles cover the rows as if ungrouped, and each reads its group from a table
of row units that one small launch builds from the split sizes (`_row_units_kernel`, which also
writes their cumulative sums); the few tiles that hold a group boundary cast row by row
(`_tensorwise_mixed`). The block-scaled casts cannot do this: their scale blocks start afresh at
every group, so their tiles do too (`tiles.tile_rows`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.kernels._arith import abs_bits, cast_codes, max_abs_bits
from qmoe.kernels._cast_variants import (ORIENTED_KEY, TENSORWISE_CONFIGS, load_quads, prune_variants,
                                         store_quads)
from qmoe.kernels._launch import wrapped
from qmoe.kernels._layout import group_pow2
from qmoe.kernels._tiles import quad_abs_bits, store8, tile_pids
from qmoe.kernels.activation import load_rows

# a row unit's entry holds the groups of its first and last rows in the halves of one int32
MAX_TENSORWISE_GROUPS = 1 << 15
# rows per entry of the row-unit table: every tile's BM is a multiple (prune_units)
ROW_UNIT = 16


def prune_units(configs, named_args, **kwargs):
    """prune_variants, keeping the tiles whose rows are whole row units."""
    return prune_variants([c for c in configs if c.kwargs["BM"] % ROW_UNIT == 0], named_args, **kwargs)


@triton.jit
def _row_units_kernel(splits_ptr, ends_ptr, units_ptr, G, U, UNIT: tl.constexpr, GC: tl.constexpr,
                      BU: tl.constexpr):
    """ends = cumsum(splits) (program 0 writes it) and, for each unit u of UNIT rows, units[u] =
    (group of row u * UNIT) | (group of its last row) << 16, a row's group being how many ends lie
    at or before it (G past the last group). Each program counts for BU units over all G ends, in
    chunks of GC: a few compares per unit and group, against a reduction in every cast tile."""
    pid = tl.program_id(0)
    u = pid * BU + tl.arange(0, BU)
    first = u * UNIT
    last = first + (UNIT - 1)
    n_first = tl.zeros([BU], dtype=tl.int32)
    n_last = tl.zeros([BU], dtype=tl.int32)
    base = tl.sum(tl.zeros([GC], dtype=tl.int32), 0)
    for c in range(0, G, GC):
        idx = c + tl.arange(0, GC)
        ok = idx < G
        sizes = tl.load(splits_ptr + idx, mask=ok, other=0).to(tl.int32)
        ends = base + tl.cumsum(sizes, 0)
        if pid == 0:
            tl.store(ends_ptr + idx, ends, mask=ok)
        ends = tl.where(ok, ends, 2147483647)
        n_first += tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
        n_last += tl.sum((ends[None, :] <= last[:, None]).to(tl.int32), 1)
        base += tl.sum(sizes, 0)
    tl.store(units_ptr + u, n_first | (n_last << 16), mask=u < U)


def row_units(splits, m: int):
    """(ends [G] int32, units [ceil(m / ROW_UNIT)] int32): `_row_units_kernel` in one launch."""
    g = splits.shape[0]
    n_units = triton.cdiv(m, ROW_UNIT)
    ends = torch.empty(g, dtype=torch.int32, device=splits.device)
    units = torch.empty(n_units, dtype=torch.int32, device=splits.device)
    bu = 256
    wrapped(_row_units_kernel)[(triton.cdiv(n_units, bu),)](splits, ends, units, g, n_units, UNIT=ROW_UNIT,
                                                            GC=min(128, group_pow2(g)), BU=bu, num_warps=4)
    return ends, units


@triton.jit
def _groups_of_tile(units_ptr, U, row0, BM: tl.constexpr, UNIT: tl.constexpr):
    """(group of row row0, group of row row0 + BM - 1) from the row-unit table (units past the
    table's end: its last unit, whose last row is at or past every group end that matters)."""
    first = tl.load(units_ptr + row0 // UNIT)
    last = tl.load(units_ptr + tl.minimum((row0 + BM - 1) // UNIT, U - 1))
    return first & 0xFFFF, last >> 16


@triton.jit
def _tensorwise_tile(x_ptr, probs_ptr, row_ptr, col_ptr, scale, row0, col0, M, K, stride_xm, ACT: tl.constexpr,
                     GLU_BLOCK: tl.constexpr, FMT_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr, ROWWISE: tl.constexpr,
                     COLWISE: tl.constexpr, QUAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Cast the [BM, BK] tile at (row0, col0), rows before M, with one scale; its max|x| bits."""
    cols = col0 + tl.arange(0, BK)
    if QUAD:
        x0, x1, x2, x3 = load_quads(x_ptr, probs_ptr, row0, M, cols, cols < K, stride_xm, K, ACT, GLU_BLOCK, BM // 4)
        amax = tl.max(tl.max(quad_abs_bits(x0, x1, x2, x3), 1), 0)  # before the stores: x dies with them
        store_quads(row_ptr, col_ptr, x0 * scale, x1 * scale, x2 * scale, x3 * scale, row0, col0, M, K, M,
                    FMT_MAX, OUT_DTYPE, ROWWISE, COLWISE, BM // 4, BK)
    else:
        rows = row0 + tl.arange(0, BM)
        x = load_rows(x_ptr, probs_ptr, rows, cols, rows < M, cols < K, stride_xm, K, ACT, GLU_BLOCK).to(tl.float32)
        amax = max_abs_bits(x, False)
        q = cast_codes(x * scale, FMT_MAX, OUT_DTYPE)
        if ROWWISE:
            store8(row_ptr, q, row0, col0, K, M, K, BM, BK)
        if COLWISE:  # the quantized transpose [K, M]
            store8(col_ptr, tl.trans(q), col0, row0, M, K, M, BK, BM)
    return amax


@triton.jit
def _tensorwise_mixed(x_ptr, probs_ptr, scale_ptr, row_ptr, col_ptr, amax_ptr, ends_ptr, row0, col0, g, g_last,
                      M, K, G, stride_xm, ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, FMT_MAX: tl.constexpr,
                      OUT_DTYPE: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, BM: tl.constexpr,
                      BK: tl.constexpr):
    """A tile whose rows run from group g into group g_last (G: past the last group): each row is
    cast with its group's scale, each group's maximum recorded; rows past the last group stay
    unwritten. In chunks of CW columns: few tiles take this path, and its registers would
    otherwise count against every tile's (the kernel's register budget is its largest path's)."""
    CW: tl.constexpr = 32 if BM <= 32 else 16
    rows = row0 + tl.arange(0, BM)
    row_end = tl.minimum(tl.load(ends_ptr + G - 1), M)
    grp = tl.zeros([BM], dtype=tl.int32) + g
    for h in range(g, g_last):  # the group ends inside the tile
        grp += (rows >= tl.load(ends_ptr + h)).to(tl.int32)
    ok = rows < row_end
    scale = tl.load(scale_ptr + grp, mask=ok, other=0.0)[:, None]
    bits = tl.zeros([BM], dtype=tl.int32)
    for c in range(col0, tl.minimum(col0 + BK, K), CW):
        cols = c + tl.arange(0, CW)
        x = load_rows(x_ptr, probs_ptr, rows, cols, ok, cols < K, stride_xm, K, ACT, GLU_BLOCK).to(tl.float32)
        bits = tl.maximum(bits, tl.max(abs_bits(x), 1))
        q = cast_codes(x * scale, FMT_MAX, OUT_DTYPE)
        if ROWWISE:
            store8(row_ptr, q, row0, c, K, row_end, K, BM, CW)
        if COLWISE:
            store8(col_ptr, tl.trans(q), c, row0, M, K, row_end, CW, BM)
    for h in range(g, tl.minimum(g_last, G - 1) + 1):
        amax = tl.max(tl.where(ok & (grp == h), bits, 0), 0)
        if amax > tl.load(amax_ptr + h):
            tl.atomic_max(amax_ptr + h, amax)


@triton.autotune(configs=TENSORWISE_CONFIGS, key=ORIENTED_KEY, reset_to_zero=["amax_ptr"],
                 prune_configs_by={"early_config_prune": prune_units})
@triton.jit
def _fp8_tensorwise_kernel(
        # pointers
        x_ptr, probs_ptr, scale_ptr, row_ptr, col_ptr, amax_ptr, ends_ptr, units_ptr,
        # sizes
        M, K, G, U,
        # strides
        stride_xm,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, FMT_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
        ROWWISE: tl.constexpr, COLWISE: tl.constexpr, GROUPED: tl.constexpr, UNIT: tl.constexpr,
        QUAD: tl.constexpr, K_MAJOR: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """q = cast(x * scale[g]) in both orientations, and max|x| per group with inf and NaN (what
    delayed scaling records: a non-finite step is left out of its history).

    One scale: the codes are cast once and the transposed copy is their transpose. QUAD holds
    the tile as a row quad (its transposed words are built in registers, `interleave4`), else
    as one tile (`store8`). The scale and the recorded maximum are read before the first store,
    and the atomic comes last, so no global round trip waits between the tile's load and stores.

    Grouped: the tiles cover the rows as if ungrouped, and a tile reads its group from the table
    of U row units (units_ptr, `_row_units_kernel`; ends_ptr: the cumulative split sizes): the
    few tiles that hold a group boundary scale row by row (`_tensorwise_mixed`). (The other cast
    kernels start their tiles afresh at every group, `tiles.tile_rows`, as their scale blocks
    must, at the cost of scans over the split sizes in every program.)
    """
    pid_m, pid_k = tile_pids(K, BK, K_MAJOR)
    row0 = pid_m * BM
    if GROUPED:
        g, g_last = _groups_of_tile(units_ptr, U, row0, BM, UNIT)
    else:
        g, g_last = 0, 0
    if g >= G:
        return
    if g == g_last:
        scale = tl.load(scale_ptr + g)
        seen = tl.load(amax_ptr + g)
        amax = _tensorwise_tile(x_ptr, probs_ptr, row_ptr, col_ptr, scale, row0, pid_k * BK, M, K, stride_xm, ACT,
                                GLU_BLOCK, FMT_MAX, OUT_DTYPE, ROWWISE, COLWISE, QUAD, BM, BK)
        if amax > seen:  # see atomic_max_bits; a stale `seen` only costs an atomic
            tl.atomic_max(amax_ptr + g, amax)
    else:
        _tensorwise_mixed(x_ptr, probs_ptr, scale_ptr, row_ptr, col_ptr, amax_ptr, ends_ptr, row0, pid_k * BK, g,
                          g_last, M, K, G, stride_xm, ACT, GLU_BLOCK, FMT_MAX, OUT_DTYPE, ROWWISE, COLWISE, BM, BK)
