"""Triton grouped bias: y + bias[group] * scale per row, and its deterministic backward.

Twin of `qmoe/reference/bias.py` (same names and signatures). Dimensions: R rows (packed tokens
of all groups), E groups, N features; offsets [E+1] on the device, rows past offsets[E] in no group.

The forward is one elementwise pass; as a kernel op it is opaque to torch.compile, which
miscompiled the reference's torch glue on CUDA (torch 2.11: the bias-added output aliased an
intermediate and AOTAutograd gave it a zero gradient).

The backward reduces dy twice over: dbias [E, N] over each group's rows, dscales [R] over the
columns. Adding fp32 partials with atomics would make dbias depend on the order the programs
happen to run in (two runs, or a CUDA-graph replay and eager, could differ in the last bits), so
it runs in two launches whose every sum has a fixed order:

1. Each group's rows are cut into chunks of `_CHUNK` rows, numbered group after group. The launch
   covers cdiv(R, _CHUNK) + E virtual chunks (a bound on their number from the shapes alone, as
   `tiles.tile_rows` does for row tiles) x column blocks; each program finds its group
   from the device offsets, sums its chunk's rows into one partial row of dbias_part
   [chunks, N], and its columns into dscales_part [column blocks, R]. Every chunk lies inside one
   group, so work is even however the rows are split (one group holding them all, or most
   groups empty), and a chunk past the last one does nothing.
2. One program per (group, column block) adds that group's partial rows in chunk order and
   writes dbias (zeros for an empty group); one per row block adds the dscales partials in
   column-block order (zeros for rows in no group).

No output is written by more than one program, and each is the same fp32 additions in the
same order whenever it runs: the order follows from the shapes, the offsets' values and the
compiled kernels' fixed reduction trees, never from scheduling. So identical runs, and a
CUDA-graph replay and eager, give the same bits. The grids depend on shapes only and the host
never reads the offsets, so the backward is sync-free and capturable. Against the reference the
order differs (here a tree per chunk, there row after row): equal up to fp32 summation order.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qmoe.kernels._launch import kernel_op, wrapped
from qmoe.kernels._layout import group_pow2, rows_contiguous
from qmoe.contracts.carriers import row_groups

@triton.jit
def _grouped_bias_forward_kernel(
    # pointers
    y_ptr, bias_ptr, scales_ptr, groups_ptr, out_ptr,
    # sizes
    num_rows, n, num_groups,
    # strides
    stride_y, stride_bias, stride_out,
    # meta
    HAS_SCALES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < num_rows, cols < n
    g = tl.load(groups_ptr + rows, mask=row_ok, other=num_groups)
    m = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], mask=m, other=0.0)
    b = tl.load(bias_ptr + g[:, None].to(tl.int64) * stride_bias + cols[None, :],
                mask=m & (g < num_groups)[:, None], other=0.0).to(tl.float32)  # no group: no bias
    if HAS_SCALES:
        b = b * tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = y.to(tl.float32) + b
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m)


_FWD_BLOCK_R = 16
_FWD_BLOCK_N = 128


def grouped_bias_forward(y: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor,
                         scales: torch.Tensor | None = None) -> torch.Tensor:
    """y [R, N] + bias [E, N] per group (times scales [R] when given), fp32 math, y's dtype out."""
    if y.dim() != 2 or bias.dim() != 2 or y.shape[1] != bias.shape[1]:
        raise ValueError(f"grouped_bias_forward needs y [R, N] and bias [E, N], got {tuple(y.shape)} "
                         f"and {tuple(bias.shape)}")
    if scales is not None and (scales.dim() != 1 or scales.shape[0] != y.shape[0]):
        raise ValueError(f"scales must be [R] = [{y.shape[0]}], got {tuple(scales.shape)}")
    return _forward_op(rows_contiguous(y), bias.contiguous(), offsets,
                       scales.contiguous() if scales is not None else None)


@kernel_op("qmoe::grouped_bias_forward")
def _forward_op(y: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor,
                scales: Optional[torch.Tensor]) -> torch.Tensor:
    r, n = y.shape
    out = torch.empty(r, n, dtype=y.dtype, device=y.device)
    if r and n:
        groups = row_groups(offsets, r).to(torch.int32)
        wrapped(_grouped_bias_forward_kernel)[(triton.cdiv(r, _FWD_BLOCK_R), triton.cdiv(n, _FWD_BLOCK_N))](
            y, bias, scales if scales is not None else y, groups, out,  # y: a placeholder, never read
            r, n, bias.shape[0],
            y.stride(0), bias.stride(0), out.stride(0),
            HAS_SCALES=scales is not None, BLOCK_R=_FWD_BLOCK_R, BLOCK_N=_FWD_BLOCK_N,
            enable_fp_fusion=False)  # round bias * scale before the add, as the reference does
    return out


# ---------------------------------------------------------------- backward

# Stage 1 tile: a chunk of _CHUNK rows of one group x _BLOCK_N columns ([64, 128] fp32 in
# registers). Fewer rows per chunk means more partial rows to write and re-read (R / 64 x N
# fp32: 1/32 of a bf16 dy's bytes); more means fewer programs when there are few rows.
_CHUNK = 64
_BLOCK_N = 128
# Stage 2 tiles: a group's partials are summed _REDUCE_CHUNKS chunk rows x _REDUCE_N columns at
# a time. Narrow column blocks give a group holding every row N / 64 programs to share its
# cdiv(R, 64) partial rows; dscales sums its per-column-block partials _REDUCE_ROWS rows at a time.
_REDUCE_CHUNKS = 32
_REDUCE_N = 64
_REDUCE_ROWS = 1024


@triton.jit
def _group_chunks(offsets_ptr, num_rows, num_groups, CHUNK: tl.constexpr, G_P2: tl.constexpr):
    """Per group, as [G_P2] vectors (zero past num_groups): first row, row count, first chunk, chunk count.

    Group g holds rows [offsets[g], offsets[g+1]) clamped to [0, num_rows), group 0 from row 0
    (as `row_groups` assigns them); its rows are cut into cdiv(rows, CHUNK) chunks, and chunks
    are numbered group after group. Read from the device offsets: the host never sees them.
    """
    idx = tl.arange(0, G_P2)
    ok = idx < num_groups
    end = tl.load(offsets_ptr + 1 + idx, mask=ok, other=0)
    start = tl.load(offsets_ptr + idx, mask=ok & (idx > 0), other=0)
    end = tl.minimum(tl.maximum(end, 0), num_rows).to(tl.int32)
    start = tl.minimum(tl.maximum(start, 0), num_rows).to(tl.int32)
    size = tl.maximum(end - start, 0)
    chunks = (size + CHUNK - 1) // CHUNK
    return start, size, tl.cumsum(chunks, 0) - chunks, chunks


@triton.jit
def _grouped_bias_backward_partials_kernel(
    # pointers
    dy_ptr, bias_ptr, scales_ptr, offsets_ptr, dbias_part_ptr, dscales_part_ptr,
    # sizes
    num_rows, n, num_groups,
    # strides
    stride_dy, stride_bias,
    # meta
    HAS_SCALES: tl.constexpr, NEED_DSCALES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
    G_P2: tl.constexpr,
):
    """Virtual chunk pid x column block: dbias_part[pid, cols] = sum over the chunk's rows of dy * s,
    and dscales_part[column block, row] = sum over the block's columns of dy * bias[group]."""
    pid = tl.program_id(0)
    start, size, chunk0, chunks = _group_chunks(offsets_ptr, num_rows, num_groups, CHUNK, G_P2)
    g = tl.sum((chunk0 + chunks <= pid).to(tl.int32), 0)  # the group whose chunks hold pid
    if g < num_groups:  # else: a chunk past the last one (the launch covers a static bound)
        sel = tl.arange(0, G_P2) == g
        row0 = tl.sum(tl.where(sel, start + (pid - chunk0) * CHUNK, 0), 0)
        row_end = tl.sum(tl.where(sel, start + size, 0), 0)
        rows = row0 + tl.arange(0, CHUNK)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < row_end, cols < n
        m = row_ok[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dy + cols[None, :], mask=m, other=0.0)
        dy = dy.to(tl.float32)
        w = dy
        if HAS_SCALES:
            w = dy * tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(dbias_part_ptr + pid.to(tl.int64) * n + cols, tl.sum(w, 0), mask=col_ok)
        if NEED_DSCALES:  # the whole chunk is one group: one bias row
            b = tl.load(bias_ptr + g.to(tl.int64) * stride_bias + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(dscales_part_ptr + tl.program_id(1).to(tl.int64) * num_rows + rows,
                     tl.sum(dy * b[None, :], 1), mask=row_ok)


@triton.jit
def _sum_group_partials(dbias_part_ptr, offsets_ptr, dbias_ptr, num_rows, n, num_groups, num_chunks,
                        stride_dbias, pid, col_blocks, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                        STEP: tl.constexpr, G_P2: tl.constexpr):
    """dbias[g, cols] = the sum of group g's chunk partials, STEP chunks at a time in chunk order."""
    g = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    _, _, chunk0, chunks = _group_chunks(offsets_ptr, num_rows, num_groups, CHUNK, G_P2)
    sel = tl.arange(0, G_P2) == g
    first = tl.sum(tl.where(sel, chunk0, 0), 0)
    last = first + tl.sum(tl.where(sel, chunks, 0), 0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)  # an empty group stores these zeros
    for c0 in range(first, last, STEP):
        c = c0 + tl.arange(0, STEP)
        ok = (c < last) & (c < num_chunks)  # the second only matters for offsets that decrease
        p = tl.load(dbias_part_ptr + c[:, None].to(tl.int64) * n + cols[None, :],
                    mask=ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(p, 0)
    tl.store(dbias_ptr + g.to(tl.int64) * stride_dbias + cols, acc, mask=col_ok)


@triton.jit
def _sum_row_partials(dscales_part_ptr, offsets_ptr, dscales_ptr, num_rows, num_groups, block, col_blocks,
                      CHUNK: tl.constexpr, ROWS: tl.constexpr, G_P2: tl.constexpr):
    """dscales[row] = the sum of its column blocks' partials in column order; 0 for rows in no group."""
    rows = block * ROWS + tl.arange(0, ROWS)
    start, size, _, _ = _group_chunks(offsets_ptr, num_rows, num_groups, CHUNK, G_P2)
    grouped = rows < tl.max(start + size, 0)  # the last group's end (0 when there are no groups)
    acc = tl.zeros([ROWS], dtype=tl.float32)
    ptrs = dscales_part_ptr + rows
    for cb in range(0, col_blocks):
        acc += tl.load(ptrs, mask=grouped, other=0.0)
        ptrs += num_rows  # the next column block's partials
    tl.store(dscales_ptr + rows, acc, mask=rows < num_rows)


@triton.jit
def _grouped_bias_backward_reduce_kernel(
    # pointers
    dbias_part_ptr, dscales_part_ptr, offsets_ptr, dbias_ptr, dscales_ptr,
    # sizes
    num_rows, n, num_groups, num_chunks, part_col_blocks, dbias_col_blocks,
    # strides
    stride_dbias,
    # meta
    CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr, ROWS: tl.constexpr, G_P2: tl.constexpr,
):
    """Programs [0, E * dbias_col_blocks) sum dbias per (group, column block); the rest, launched
    only when dscales is needed, sum dscales per block of ROWS rows."""
    pid = tl.program_id(0)
    dbias_programs = num_groups * dbias_col_blocks
    if pid < dbias_programs:
        _sum_group_partials(dbias_part_ptr, offsets_ptr, dbias_ptr, num_rows, n, num_groups, num_chunks,
                            stride_dbias, pid, dbias_col_blocks, CHUNK, BLOCK_N, STEP, G_P2)
    else:
        _sum_row_partials(dscales_part_ptr, offsets_ptr, dscales_ptr, num_rows, num_groups, pid - dbias_programs,
                          part_col_blocks, CHUNK, ROWS, G_P2)


def grouped_bias_backward(dy: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor,
                          scales: torch.Tensor | None = None, need_dscales: bool = True):
    """(dbias [E, N] fp32, dscales [R] fp32 or None) for dy [R, N], bias [E, N], offsets [E+1].

    offsets: [E+1] int32 / int64 on dy's device, non-decreasing (group g: rows [offsets[g],
    offsets[g+1]); rows past offsets[E] belong to no group). dscales is None without scales or
    with need_dscales=False. Bit-identical from run to run and in CUDA-graph replays.
    """
    if dy.dim() != 2 or bias.dim() != 2 or dy.shape[1] != bias.shape[1]:
        raise ValueError(f"grouped_bias_backward needs dy [R, N] and bias [E, N], got {tuple(dy.shape)} "
                         f"and {tuple(bias.shape)}")
    if scales is not None and (scales.dim() != 1 or scales.shape[0] != dy.shape[0]):
        raise ValueError(f"scales must be [R] = [{dy.shape[0]}], got {tuple(scales.shape)}")
    need = scales is not None and need_dscales
    dbias, dscales = _backward_op(rows_contiguous(dy), bias.contiguous(), offsets.contiguous(),
                                  scales.contiguous() if scales is not None else None, need)
    return dbias, (dscales if need else None)


@kernel_op("qmoe::grouped_bias_backward")
def _backward_op(dy: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor, scales: Optional[torch.Tensor],
                 need_dscales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dbias, dscales: [R], or [0] when not needed)."""
    r, n = dy.shape
    e = bias.shape[0]
    # sum_g cdiv(R_g, CHUNK) < cdiv(R, CHUNK) + E: a bound from the shapes alone
    num_chunks = triton.cdiv(r, _CHUNK) + e if r else 0
    part_col_blocks = triton.cdiv(n, _BLOCK_N)
    dbias_col_blocks = triton.cdiv(n, _REDUCE_N)
    f32 = dict(dtype=torch.float32, device=dy.device)
    dbias = torch.empty(e, n, **f32)  # stage 2 writes every entry (zeros for empty groups)
    dscales = torch.empty(r if need_dscales else 0, **f32)
    dbias_part = torch.empty(num_chunks, n, **f32)
    dscales_part = torch.empty(part_col_blocks if need_dscales else 0, r, **f32)
    g_p2 = group_pow2(e)
    if num_chunks and n:
        wrapped(_grouped_bias_backward_partials_kernel)[(num_chunks, part_col_blocks)](
            dy, bias, scales if scales is not None else dy, offsets, dbias_part, dscales_part,  # dy: a placeholder
            r, n, e,
            dy.stride(0), bias.stride(0),
            HAS_SCALES=scales is not None, NEED_DSCALES=need_dscales, CHUNK=_CHUNK, BLOCK_N=_BLOCK_N, G_P2=g_p2)
    programs = e * dbias_col_blocks + (triton.cdiv(r, _REDUCE_ROWS) if need_dscales else 0)
    if programs:
        wrapped(_grouped_bias_backward_reduce_kernel)[(programs,)](
            dbias_part, dscales_part, offsets, dbias, dscales,
            r, n, e, num_chunks, part_col_blocks, dbias_col_blocks,
            dbias.stride(0),
            CHUNK=_CHUNK, BLOCK_N=_REDUCE_N, STEP=_REDUCE_CHUNKS, ROWS=_REDUCE_ROWS, G_P2=g_p2)
    return dbias, dscales
