"""The FP8 per-tensor cast's Triton kernel (private helper of `qmoe/kernels/quantize.py`, whose
`fp8_tensorwise_op` launches it): q = cast(x * scale[g]) in both orientations and max|x| per group.

Grouped inputs: the tiles cover the rows as if ungrouped, and each finds its group from the
cumulative split sizes with one reduction (`_groups_of_rows`); the few tiles that hold a group
boundary cast row by row (`_tensorwise_mixed`). The block-scaled casts cannot do this: their
scale blocks start afresh at every group, so their tiles do too (`tiles.tile_rows`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from qmoe.kernels._arith import abs_bits, atomic_max_bits, cast_codes, max_abs_bits
from qmoe.kernels._cast_variants import (ORIENTED_KEY, TENSORWISE_CONFIGS, load_quads, prune_variants,
                                         store_quads)
from qmoe.kernels._tiles import quad_abs_bits, store8, tile_pids
from qmoe.kernels.activation import load_rows

# _groups_of_rows counts two rows' groups in the halves of one int32
MAX_TENSORWISE_GROUPS = 1 << 15


@triton.jit
def _groups_of_rows(ends_ptr, G, first, last, G_P2: tl.constexpr):
    """(group of row `first`, group of row `last`): how many group ends (ends_ptr: the cumulative
    split sizes, [G]) lie at or before each row, so G for a row past the last group."""
    idx = tl.arange(0, G_P2)
    ends = tl.load(ends_ptr + idx, mask=idx < G, other=2147483647)
    both = tl.sum((ends <= first).to(tl.int32) + ((ends <= last).to(tl.int32) << 16), 0)  # G < 2^15
    return both & 0xFFFF, both >> 16


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
        atomic_max_bits(amax_ptr + h, tl.max(tl.where(ok & (grp == h), bits, 0), 0))


@triton.autotune(configs=TENSORWISE_CONFIGS, key=ORIENTED_KEY, reset_to_zero=["amax_ptr"],
                 prune_configs_by={"early_config_prune": prune_variants})
@triton.jit
def _fp8_tensorwise_kernel(
        # pointers
        x_ptr, probs_ptr, scale_ptr, row_ptr, col_ptr, amax_ptr, ends_ptr,
        # sizes
        M, K, G,
        # strides
        stride_xm,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, FMT_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
        ROWWISE: tl.constexpr, COLWISE: tl.constexpr, GROUPED: tl.constexpr, G_P2: tl.constexpr,
        QUAD: tl.constexpr, K_MAJOR: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """q = cast(x * scale[g]) in both orientations, and max|x| per group with inf and NaN (what
    delayed scaling records: a non-finite step is left out of its history).

    One scale: the codes are cast once and the transposed copy is their transpose. QUAD holds
    the tile as a row quad (its transposed words are built in registers, `interleave4`), else
    as one tile (`store8`). The scale and the recorded maximum are read before the first store,
    and the atomic comes last, so no global round trip waits between the tile's load and stores.
    Grouped (ends_ptr: the cumulative split sizes): see the module docstring.
    """
    pid_m, pid_k = tile_pids(K, BK, K_MAJOR)
    row0 = pid_m * BM
    if GROUPED:
        g, g_last = _groups_of_rows(ends_ptr, G, row0, row0 + BM - 1, G_P2)
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
