"""Triton grouped quantization: each group quantized exactly as if alone, in one or two launches.

Twin of `qmoe/reference/grouped_quantize.py` (read its docstring for the layouts). x [sum M_g, K]
packs the groups' rows and `split_sizes` [G] (int, on x's device) gives M_g. The kernels of
`qmoe.kernels.quantize` / `quantize_nvfp4` run with GROUPED: a static grid of
`cdiv(sum M, BM) + G` row tiles x `cdiv(K, BM)` column tiles, each tile finding its group from
the device split sizes and exiting when past the last group. Shapes and launches depend only
on (sum M, K, G), never on the split values: no host synchronisation, CUDA-graph capturable,
zero-size groups allowed, and no block crosses a group boundary.

x may be an `ActivatedRows` (act(h) * probs): the kernels then read h and apply the expert
activation as they load (kernels.activation.load_rows), so the activation output is never
written; the result equals quantizing that output bit for bit.

Per-tensor formats need the group amax before the cast: `grouped_tensor_amax` (one launch,
atomic max of |x| bits per group) feeds the quantizer's scale, then one cast launch. NVFP4
runs its amax launch and its quantize launch inside `grouped_quantize_nvfp4`.

>>> from qmoe.contracts.formats import E4M3, ScaleMode
>>> x = torch.randn(96, 256, device="cuda", dtype=torch.bfloat16)
>>> splits = torch.tensor([32, 0, 64], device="cuda")
>>> row, row_s, col, col_s = grouped_quantize_mxfp8(x, splits, E4M3, ScaleMode.ROUND_UP, True, True)
>>> col_s.shape  # [K, sum M // 32 + G]
torch.Size([256, 6])
"""
from __future__ import annotations

from typing import Optional

import torch

from qmoe.contracts.carriers import ActivatedRows, glu_block
from qmoe.contracts.errors import UnsupportedError
from qmoe.contracts.formats import ElementFormat, ScaleMode
from qmoe.kernels.activation import NO_ACTIVATION, activation_code, input_width
from qmoe.kernels._cast_tensorwise import _fp8_current_kernel
from qmoe.kernels._launch import kernel_op, num_sms, wrapped
from qmoe.kernels._layout import as_rows, device_splits
from qmoe.kernels.quantize import (TL_FP8, amax_op, fp8_block_op, fp8_block_supported, fp8_meta, fp8_scale_op,
                                   fp8_tensorwise_op, mxfp8_op)
from qmoe.kernels.quantize_nvfp4 import check_nvfp4_shape, draw_seeds, nvfp4_op


def _prepare(x, split_sizes):
    """(the tensor the kernels read, device splits, G, the fused activation's op arguments: probs,
    act, glu_block, which every quantize op takes in that order; none fused: their defaults)."""
    fused = (None, NO_ACTIVATION, 0)
    if isinstance(x, ActivatedRows):
        h = x.h if x.h.stride(1) == 1 else x.h.contiguous()
        probs = (x.probs.float().contiguous() if x.probs is not None
                 else torch.ones(h.shape[0], dtype=torch.float32, device=h.device))  # x * 1 == x exactly
        fused = (probs, activation_code(x.activation), glu_block(x.activation, x.glu_interleave_size))
        x = h
    x = as_rows(x)
    return x, device_splits(split_sizes, x), split_sizes.numel(), fused


def grouped_tensor_amax(x: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """max|x_g| per group -> [G] fp32 (0 for an empty group, NaN for a group holding one)."""
    x, splits, g, fused = _prepare(x, split_sizes)
    return amax_op(x, splits, g, *fused)


def grouped_quantize_fp8_tensorwise(x, split_sizes, scales, fmt: ElementFormat, rowwise=True, columnwise=False):
    """Per-group scales [G] -> (row [sum M, K], col [K, sum M], amax [G])."""
    fp8_meta(fmt)
    x, splits, g, fused = _prepare(x, split_sizes)
    if scales.numel() != g:
        raise ValueError(f"grouped FP8 cast needs one scale per group ({g}), got {scales.numel()}")
    row, col, amax = fp8_tensorwise_op(x, scales.float().reshape(-1), splits, g, fmt.dtype,
                                       fmt.max, rowwise, columnwise, *fused)
    return row if rowwise else None, col if columnwise else None, amax


# Current scaling in one read (`_fp8_current_kernel`): the input bytes of the groups in flight at
# once stay within this share of the L2 cache (whose other part takes the codes written meanwhile),
# and groups larger than it on average take the amax launch and the cast launch instead.
CURRENT_L2_BYTES = 24 << 20
CURRENT_PROGRAMS_PER_SM = 4
CURRENT_PATIENCE = 4096  # polls before a member takes its group's amax alone
_CURRENT_TILE = dict(BM=32, BK=128, num_warps=4)
# registers per thread that let CURRENT_PROGRAMS_PER_SM programs share an SM's 64K, so that a team is
# resident at once (without spills at this tile: ptxas -v on sm_90a)
_CURRENT_REGS = 65536 // (32 * _CURRENT_TILE["num_warps"] * CURRENT_PROGRAMS_PER_SM)


def current_teams(m: int, width: int, groups: int, elem_bytes: int, device: torch.device,
                  l2_bytes: int | None = None, per_sm: int = CURRENT_PROGRAMS_PER_SM) -> tuple[int, int] | None:
    """(teams, programs per team) of the one-read cast for `groups` groups of m rows in all, each
    row `width` values read from memory (an activation's input is twice its output); None where
    an average group alone would not fit `l2_bytes` (default CURRENT_L2_BYTES; then two launches
    read x twice anyway)."""
    l2_bytes = CURRENT_L2_BYTES if l2_bytes is None else l2_bytes
    if groups == 0 or m == 0:
        return None
    group_bytes = max(1, m * width * elem_bytes // groups)
    if group_bytes > l2_bytes:
        return None
    teams = max(1, min(groups, l2_bytes // group_bytes))
    programs = num_sms(device) * (per_sm if device.type == "cuda" else 1)
    return teams, max(1, programs // teams)


@kernel_op("qmoe::quantize_fp8_current")
def fp8_current_op(x: torch.Tensor, splits: torch.Tensor, num_groups: int, out_dtype: torch.dtype, fmt_max: float,
                   power_2_scale: bool, amax_epsilon: float, rowwise: bool, columnwise: bool, teams: int, team: int,
                   patience: int, probs: Optional[torch.Tensor] = None, act: int = NO_ACTIVATION,
                   glu_block: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [M, K] | empty, col [K, M] | empty, scales [G], amax [G]) of current scaling per group,
    from one launch of `teams` x `team` programs (`_fp8_current_kernel`)."""
    m, k = x.shape[0], input_width(x, act)
    row = torch.empty((m, k) if rowwise else (0,), dtype=out_dtype, device=x.device)
    col = torch.empty((k, m) if columnwise else (0,), dtype=out_dtype, device=x.device)
    scales = torch.ones(num_groups, dtype=torch.float32, device=x.device)
    state = torch.zeros((2, num_groups), dtype=torch.int32, device=x.device)  # amax bits, members done
    if m * k and num_groups:
        wrapped(_fp8_current_kernel)[(teams * team,)](
            x, probs if probs is not None else x, scales, row.view(torch.uint8), col.view(torch.uint8), state[0],
            state[1], torch.cumsum(splits, 0, dtype=torch.int32), m, k, num_groups, amax_epsilon, team, patience,
            x.stride(0), ACT=act, GLU_BLOCK=glu_block, FMT_MAX=fmt_max, OUT_DTYPE=TL_FP8[out_dtype],
            POW2=power_2_scale, ROWWISE=rowwise, COLWISE=columnwise, QUAD=columnwise, **_CURRENT_TILE,
            maxnreg=_CURRENT_REGS)
    return row, col, scales, state[0].view(torch.float32)


def grouped_quantize_fp8_current(x, split_sizes, fmt: ElementFormat, power_2_scale=False, amax_epsilon=0.0,
                                 rowwise=True, columnwise=False, teams: tuple[int, int] | None = None,
                                 patience: int = CURRENT_PATIENCE):
    """Current scaling per group -> (row [sum M, K], col [K, sum M], scales [G], amax [G]): the
    scales `compute_fp8_scale` gives for the groups' finite amaxes and the codes of the cast with
    them, bit for bit, from one read of x where its groups fit in L2 (`current_teams`; teams:
    (teams, programs per team) chosen by the caller; patience: `_fp8_current_kernel`'s), else
    from the amax launch and the cast launch."""
    fp8_meta(fmt)
    x, splits, g, fused = _prepare(x, split_sizes)
    layout = teams or current_teams(x.shape[0], x.shape[1], g, x.element_size(), x.device)
    if layout is None:
        amax = amax_op(x, splits, g, *fused)
        scales = fp8_scale_op(amax, fmt.max, power_2_scale, float(amax_epsilon))
        row, col, _ = fp8_tensorwise_op(x, scales, splits, g, fmt.dtype, fmt.max, rowwise, columnwise, *fused)
    else:
        row, col, scales, amax = fp8_current_op(x, splits, g, fmt.dtype, fmt.max, power_2_scale,
                                                float(amax_epsilon), rowwise, columnwise, *layout, patience,
                                                *fused)
    return row if rowwise else None, col if columnwise else None, scales, amax


def grouped_quantize_fp8_block(x, split_sizes, block_rows, block_cols, fmt, power_2_scale=True,
                               amax_epsilon=0.0, rowwise=True, columnwise=False):
    """-> (row [sum M, K], row_s, col [K, sum M], col_s) in the reference's grouped scale layouts."""
    fp8_meta(fmt)
    if not fp8_block_supported(block_rows, block_cols):
        raise UnsupportedError("the grouped_quantize_fp8_block kernel", why=f"{block_rows}x{block_cols} blocks",
                               fix="qmoe.dispatch.GROUPED_QUANTIZE runs the reference for these")
    x, splits, g, fused = _prepare(x, split_sizes)
    row, rs, col, cs = fp8_block_op(x, splits, g, block_rows, block_cols, fmt.dtype, fmt.max,
                                    power_2_scale, float(amax_epsilon), rowwise, columnwise, *fused)
    return (row if rowwise else None, rs if rowwise else None, col if columnwise else None,
            cs if columnwise else None)


def grouped_quantize_mxfp8(x, split_sizes, fmt, scale_mode: ScaleMode = ScaleMode.ROUND_UP, rowwise=True,
                           columnwise=False, values=()):
    """-> (row [sum M, K], row_s [sum M, ceil(K/32)], col [K, sum M], col_s [K, sum M // 32 + G]) (E8M0).

    values: copies ("rowwise", "columnwise") wanted as exact bf16 values [sum M, K] with no scales;
    where the kernel cannot write them (`mxfp8_op`) they come as codes: a bf16 copy is values."""
    fp8_meta(fmt)
    x, splits, g, fused = _prepare(x, split_sizes)
    row, rs, col, cs = mxfp8_op(x, splits, g, fmt.dtype, fmt.max, fmt.emax,
                                scale_mode is ScaleMode.ROUND_UP, 32, rowwise, columnwise, *fused,
                                "rowwise" in values, "columnwise" in values)
    return (row if rowwise else None, rs if rowwise and row.dtype != torch.bfloat16 else None,
            col if columnwise else None, cs if columnwise and col.dtype != torch.bfloat16 else None)


def grouped_quantize_nvfp4(x, split_sizes, block_2d=False, rowwise=True, columnwise=False, rht=False,
                           stochastic=False, generator=None, values=()):
    """-> (row, row_scale, amax [G], col, col_scale, col_amax [G]); data packed over all groups.

    With rht, every group's row count must be a multiple of 16 (NVFP4's align_size, 128, is);
    a group that is not is transformed as if padded with zero rows (the reference raises).
    values: copies ("rowwise", "columnwise") wanted as their exact values q * s_b, [sum M, K]
    bf16 with no scale (the tensor factor stays with the amaxes); a 1 x 16 columnwise copy's is
    the transpose of a [K, sum M] buffer (`nvfp4_op`).
    """
    m, k = x.shape
    x, splits, g, fused = _prepare(x, split_sizes)
    check_nvfp4_shape(m, k, rowwise, columnwise, rht, block_2d)
    row_values, col_values = rowwise and "rowwise" in values, columnwise and "columnwise" in values
    row, rs, amax, col, cs, camax = nvfp4_op(
        x, splits, g, block_2d, rowwise, columnwise, rht, draw_seeds(stochastic, generator, x.device), *fused,
        row_values, col_values)
    if col_values and not block_2d:
        col = col.t()
    return (row if rowwise else None, rs if rowwise and not row_values else None, amax,
            col if columnwise else None, cs if columnwise and not col_values else None,
            camax if columnwise else None)
