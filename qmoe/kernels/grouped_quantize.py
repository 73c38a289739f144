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
written; the result equals quantizing that output bit for bit. x may be a `GatheredRows`: the
kernels read each row from its source row (the permute of FC1's input fused into its cast).

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

import torch

from qmoe.contracts.carriers import ActivatedRows, GatheredRows, glu_block
from qmoe.contracts.errors import UnsupportedError
from qmoe.contracts.formats import ElementFormat, ScaleMode
from qmoe.kernels.activation import GATHER, NO_ACTIVATION, activation_code
from qmoe.kernels._layout import as_rows, device_splits
from qmoe.kernels.quantize import amax_op, fp8_block_op, fp8_block_supported, fp8_meta, fp8_tensorwise_op, mxfp8_op
from qmoe.kernels.quantize_nvfp4 import check_nvfp4_shape, draw_seeds, nvfp4_op


def _prepare(x, split_sizes):
    """(the tensor the kernels read, device splits, G, the fused activation's op arguments: probs,
    act, glu_block, which every quantize op takes in that order; none fused: their defaults)."""
    fused = (None, NO_ACTIVATION, 0)
    if isinstance(x, GatheredRows):  # the rows are read from the source as the kernels load them
        if x.source.shape[0] == 0:  # no source rows: every row is zero
            x = x.materialize()
        else:
            index = x.index.to(torch.int32).contiguous()
            return as_rows(x.source), device_splits(split_sizes, x.source), split_sizes.numel(), (index, GATHER, 0)
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
