"""Triton grouped bias: y + bias[group] * scale per row, and its backward in one pass over dy.

Twin of `qmoe/reference/bias.py` (same names and signatures). The forward is one elementwise
pass; as a kernel op it is opaque to torch.compile, which miscompiled the reference's torch glue
on CUDA (torch 2.11: the bias-added output aliased an intermediate and AOTAutograd gave it a zero
gradient). In the backward, rows are sorted by group, so a block of rows spans few groups: each
program sums its rows per group and adds one fp32 partial per (group, column) with an atomic,
and writes its rows' dscales directly.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qmoe.kernels._triton_utils import kernel_op, rows_contiguous, wrapped
from qmoe.reference.bias import row_groups

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


# Row block: large enough that most blocks sit inside one group (few atomics per column),
# small enough to keep a [BLOCK_R, BLOCK_N] fp32 tile in registers.
_BLOCK_R = 64
_BLOCK_N = 128


@triton.jit
def _grouped_bias_backward_kernel(
    # pointers
    dy_ptr, bias_ptr, scales_ptr, groups_ptr, dbias_ptr, dscales_ptr,
    # sizes
    num_rows, n, num_groups,
    # strides
    stride_dy, stride_bias, stride_dbias,
    # meta
    HAS_SCALES: tl.constexpr, NEED_DSCALES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    g = tl.load(groups_ptr + rows, mask=row_ok, other=num_groups)
    row_ok = row_ok & (g < num_groups)
    g_first = tl.min(tl.where(row_ok, g, num_groups), axis=0)
    g_last = tl.max(tl.where(row_ok, g, -1), axis=0)
    if HAS_SCALES:
        s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dsc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for n0 in range(0, n, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        m = row_ok[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dy + cols[None, :], mask=m, other=0.0)
        dy = dy.to(tl.float32)
        w = dy * s[:, None] if HAS_SCALES else dy
        for gg in range(g_first, g_last + 1):
            part = tl.sum(tl.where((g == gg)[:, None], w, 0.0), axis=0)
            tl.atomic_add(dbias_ptr + gg * stride_dbias + cols, part, mask=col_ok)
        if NEED_DSCALES:
            b = tl.load(bias_ptr + g[:, None].to(tl.int64) * stride_bias + cols[None, :], mask=m, other=0.0)
            dsc += tl.sum(dy * b.to(tl.float32), axis=1)
    if NEED_DSCALES:
        tl.store(dscales_ptr + rows, dsc, mask=rows < num_rows)


def grouped_bias_backward(dy: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor,
                          scales: torch.Tensor | None = None, need_dscales: bool = True):
    """(dbias [E, N] fp32, dscales [R] fp32 or None) for dy [R, N], bias [E, N], offsets [E+1]."""
    if dy.dim() != 2 or bias.dim() != 2 or dy.shape[1] != bias.shape[1]:
        raise ValueError(f"grouped_bias_backward needs dy [R, N] and bias [E, N], got {tuple(dy.shape)} "
                         f"and {tuple(bias.shape)}")
    if scales is not None and (scales.dim() != 1 or scales.shape[0] != dy.shape[0]):
        raise ValueError(f"scales must be [R] = [{dy.shape[0]}], got {tuple(scales.shape)}")
    need = scales is not None and need_dscales
    dbias, dscales = _backward_op(dy.contiguous(), bias.contiguous(), offsets, scales, need)
    return dbias, (dscales if need else None)


@kernel_op("qmoe::grouped_bias_backward")
def _backward_op(dy: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor, scales: Optional[torch.Tensor],
                 need_dscales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dbias, dscales: [R], or [0] when not needed)."""
    r, n = dy.shape
    e = bias.shape[0]
    groups = row_groups(offsets, r).to(torch.int32)
    dbias = torch.zeros(e, n, dtype=torch.float32, device=dy.device)
    dscales = torch.empty(r if need_dscales else 0, dtype=torch.float32, device=dy.device)
    if r:
        wrapped(_grouped_bias_backward_kernel)[(triton.cdiv(r, _BLOCK_R),)](
            dy, bias, scales if scales is not None else dy, groups, dbias, dscales,  # dy: a placeholder, never read
            r, n, e,
            dy.stride(0), bias.stride(0), dbias.stride(0),
            HAS_SCALES=scales is not None, NEED_DSCALES=need_dscales, BLOCK_R=_BLOCK_R, BLOCK_N=_BLOCK_N)
    return dbias, dscales
