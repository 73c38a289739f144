"""Token permutation for expert dispatch and combine, differentiable and host-sync-free.

Dimensions: T tokens, E experts, K top-k, H hidden size, S scale columns,
R = T * K + E * (align_size - 1) permuted rows (static: the worst case).

`moe_permute` groups token copies by expert (expert order, token order kept inside an expert),
pads each group with zero rows to a multiple of `align_size`, and keeps split sizes on the
device; `moe_unpermute` adds each token's expert outputs back, weighted by the routing probs.
Triton kernels on sm90+ GPUs, `qmoe.reference.permute` elsewhere.
"""
from __future__ import annotations

import torch

from qmoe.backend import use_kernels
from qmoe.ops.amp import autocast_off
from qmoe.reference import permute as reference
from qmoe.contracts.carriers import (AmaxSlot, GatheredRows, RowIdMap, RowsWithAmax, permuted_sources,
                                     routed_max)
from qmoe.contracts.validate import (check_amax_rows, check_flag, check_merging_probs, check_permute_index_args,
                                     check_routing_top_k, check_rows)
from qmoe.dispatch import PERMUTE

__all__ = ["moe_permute", "moe_unpermute", "gathered_rows", "gathered_amax", "RowIdMap"]


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, x, row_id_map, with_amax):
        ctx.row_id_map = row_id_map
        out = PERMUTE.kernel("permute_rows")(x, row_id_map, with_amax)
        if not with_amax:
            return out
        ctx.mark_non_differentiable(out.amax)
        return tuple(out)

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out, grad_amax=None):
        return PERMUTE.kernel("permute_rows_backward")(grad_out, ctx.row_id_map), None, None


class _PermuteProbs(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, probs, row_id_map):
        ctx.row_id_map, ctx.dtype = row_id_map, probs.dtype
        return PERMUTE.kernel("permute_probs")(probs, row_id_map)

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out):
        return PERMUTE.kernel("permute_probs_backward")(grad_out, ctx.row_id_map, ctx.dtype), None


class _UnpermuteRows(torch.autograd.Function):
    # y's values are read back only for the merging probs' gradient; without it the backward
    # keeps y's shape alone (the expert outputs, R x H: 940 MB of bf16 at the DeepSeek-V3 shard).
    # The kernels' path runs the kernels; the reference path comes here only to fill a grad_amax
    # slot (its plain autograd graph has no place to hand the amax over), with the twins.
    @staticmethod
    @autocast_off
    def forward(ctx, y, merging_probs, row_id_map, grad_amax):
        keep_y = merging_probs is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(y if keep_y else None, merging_probs)
        ctx.y_meta = (y.shape, y.dtype, y.device)
        ctx.row_id_map, ctx.grad_amax = row_id_map, grad_amax
        return PERMUTE.pick("unpermute_rows", y, row_id_map.rows)(y, row_id_map, merging_probs)

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out):
        y, merging_probs = ctx.saved_tensors
        if y is None:  # a stand-in with y's shape and dtype: one row, never read
            shape, dtype, device = ctx.y_meta
            y = torch.empty(1, shape[1], dtype=dtype, device=device).expand(shape)
        slot = ctx.grad_amax
        grad_y, grad_probs = PERMUTE.pick("unpermute_rows_backward", grad_out, ctx.row_id_map.rows)(
            grad_out, y, ctx.row_id_map, merging_probs, need_probs_grad=ctx.needs_input_grad[1],
            with_amax=slot is not None)
        if slot is not None:
            slot.put(*grad_y)
            grad_y = grad_y.rows
        return grad_y, grad_probs, None, None


def _check_permute_args(x, routing_map, probs, align_size, top_k, row_scales):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [T, H], got {tuple(getattr(x, 'shape', ()))}; "
                         "flatten leading dimensions and pass restore_shape to moe_unpermute")
    check_permute_index_args(routing_map, 1 if top_k is None else top_k, align_size)
    check_routing_top_k(routing_map, top_k)
    t, e = routing_map.shape
    check_rows("x", x, t, routing_map.device)
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise TypeError("probs must be a floating-point tensor [T, E] (topk_route's probs)")
        if tuple(probs.shape) != (t, e) or probs.device != routing_map.device:
            raise ValueError(f"probs must be [T, E]=({t}, {e}) on {routing_map.device}, got "
                             f"{tuple(probs.shape)} on {probs.device}")
    if row_scales is not None:
        check_rows("row_scales", row_scales, t, routing_map.device)


def moe_permute(x, routing_map, probs=None, align_size=1, *, top_k=None, row_scales=None, num_rows=None,
                with_amax=False, gather=False):
    """Group token copies by expert, each group padded with zero rows to `align_size`.

    Args:
        x: [T, H] any dtype: bf16 activations, or already-quantized rows (FP8 data, or FP4
            packed as uint8) so tokens are quantized once before dispatch; bits are copied.
            Differentiable when floating point.
        routing_map: [T, E] bool, from `topk_route`.
        probs: optional [T, E] float; its routed entries are permuted along (differentiable).
        align_size: each expert's row count is padded to a multiple of this (ask the recipe:
            `recipe.align_size`; 1 = no padding).
        top_k: the most experts a token chose (K). Pass it: R depends on it, and without it the
            op reads K back from the device (a host synchronisation, not graph-capturable).
        num_rows: optional static row count larger than R (e.g. R rounded up to align_size, so
            the zero tail after the last group is a whole number of blocks).
        row_scales: optional [T, S] (or [T]) per-row tensor of any dtype, e.g. FP8 1x128 or
            MXFP8 E8M0 scales of a quantized `x`, permuted the same way; padding rows get zero
            bytes.
        with_amax: x bf16 / fp16 / fp32: `out` comes as `RowsWithAmax(rows, amax)`, amax [E]
            fp32 each expert group's max|row| over finite values, reduced while the rows are
            copied: hand it to the experts' current-scaling quantizer (`GroupedLinear(...,
            input_amax=amax)`), which then only casts.
        gather: x bf16 / fp16 / fp32: no row is copied; `out` comes as a `GatheredRows(x, index,
            row_id_map)` standing for the permuted rows, which the experts' quantize kernels read
            straight from x (`qmoe.ops.grouped_linear` under a recipe on the grouped path; elsewhere
            they are copied first, `gathered_rows`). The same results and gradients bit for bit,
            without writing and reading the [R, H] copy. With with_amax the amax comes from x's
            rows (`RowsWithAmax(GatheredRows, amax)`).

    Returns:
        out: [R, H] x's dtype, R = T * K + E * (align_size - 1): rows grouped by expert in
            expert order, token order kept inside each group, zero padding after each group and
            zero rows after the last. A `RowsWithAmax` with with_amax.
        out_probs: [R] probs' dtype (0 on padding), or None without probs.
        row_id_map: `RowIdMap`, pass it to `moe_unpermute`.
        split_sizes: [E] int32 on the device, padded rows per expert (sum <= R).
        out_scales: [R, S], only when `row_scales` is given (a fifth item).

    Example:
        >>> probs, routing_map = topk_route(torch.randn(6, 4), 2)
        >>> x = torch.randn(6, 8)
        >>> out, out_probs, row_id_map, split_sizes = moe_permute(x, routing_map, probs,
        ...                                                      align_size=4, top_k=2)
        >>> out.shape                      # 6 * 2 + 4 * 3
        torch.Size([24, 8])
        >>> y = moe_unpermute(out, row_id_map, probs)   # == x * probs.sum(1, keepdim=True)
    """
    _check_permute_args(x, routing_map, probs, align_size, top_k, row_scales)
    check_flag("with_amax", with_amax, "moe_permute")
    check_flag("gather", gather, "moe_permute")
    if with_amax or gather:
        check_amax_rows("x", x, "with_amax" if with_amax else "gather")
    if gather:
        if row_scales is not None:
            raise ValueError("gather=True copies no rows, so it permutes no row_scales: quantized rows are "
                             "permuted with gather=False")
        return _gathered(x, routing_map, probs, align_size, top_k, num_rows, with_amax)
    if not use_kernels(x, routing_map, probs, row_scales):
        return reference.moe_permute(x, routing_map, probs, align_size, top_k=top_k,
                                     row_scales=row_scales, num_rows=num_rows, with_amax=with_amax)
    row_id_map, split_sizes = _permute_map(routing_map, top_k, align_size, num_rows)
    if x.is_floating_point() and x.element_size() >= 2:
        out = _PermuteRows.apply(x, row_id_map, with_amax)
        out = RowsWithAmax(*out) if with_amax else out
    else:  # quantized bits: nothing to differentiate
        out = PERMUTE.kernel("permute_rows")(x, row_id_map)
    out_probs = None if probs is None else _PermuteProbs.apply(probs, row_id_map)
    if row_scales is None:
        return out, out_probs, row_id_map, split_sizes
    return out, out_probs, row_id_map, split_sizes, PERMUTE.kernel("permute_rows")(row_scales, row_id_map)


def _permute_map(routing_map, top_k, align_size, num_rows):
    """(row_id_map with num_rows, split_sizes) of a permute, from the kernel or its twin."""
    if top_k is None:  # host read, documented in moe_permute
        top_k = max(int(routing_map.sum(dim=1).max()), 1) if routing_map.numel() else 1
    row_id_map, split_sizes = PERMUTE.pick("permute_index", routing_map)(routing_map, top_k, align_size)
    return reference.with_num_rows(row_id_map, num_rows), split_sizes


def _gathered(x, routing_map, probs, align_size, top_k, num_rows, with_amax):
    """moe_permute(..., gather=True): the map and the probs as usual, the rows left where they are."""
    row_id_map, split_sizes = _permute_map(routing_map, top_k, align_size, num_rows)
    out = GatheredRows(x, permuted_sources(row_id_map), row_id_map)
    if with_amax:
        out = RowsWithAmax(out, gathered_amax(out))
    if probs is None:
        out_probs = None
    elif use_kernels(x, routing_map, probs):
        out_probs = _PermuteProbs.apply(probs, row_id_map)
    else:
        out_probs = reference.permute_probs(probs, row_id_map)
    return out, out_probs, row_id_map, split_sizes


def gathered_amax(rows: GatheredRows) -> torch.Tensor:
    """[E] fp32 per-expert amax of the rows a `GatheredRows` (with its row_id_map) stands for: each
    expert's rows are copies of its tokens' rows, so the max of those tokens' row amaxes (finite
    values; padding rows are zero), the bits `permute_rows(with_amax=True)` reduces."""
    x = rows.source.detach()
    return routed_max(PERMUTE.pick("row_amax", x)(x), rows.row_id_map)


def gathered_rows(rows: GatheredRows) -> torch.Tensor:
    """The [R, H] rows a `GatheredRows` from `moe_permute(..., gather=True)` stands for, copied now,
    differentiable: what moe_permute(gather=False) returns."""
    if not isinstance(rows, GatheredRows) or rows.row_id_map is None:
        raise TypeError("gathered_rows takes the GatheredRows of moe_permute(..., gather=True)")
    x, row_id_map = rows.source, rows.row_id_map
    if use_kernels(x, row_id_map.rows):
        return _PermuteRows.apply(x, row_id_map, False)
    return reference.permute_rows(x, row_id_map)


def moe_unpermute(y, row_id_map, merging_probs=None, restore_shape=None, *, grad_amax=None):
    """Add each token's expert outputs back together: [R, H] -> [T, H].

    out[t] = sum over the experts e that t was sent to of y[row of (t, e)] * merging_probs[t, e]
    (weight 1 without merging_probs), accumulated in fp32. Padding rows are never read.

    Args:
        y: [R, H] float, expert outputs in `moe_permute`'s row order; gets the gradient.
        row_id_map: from `moe_permute`.
        merging_probs: optional [T, E] float (e.g. topk_route's probs); gets the gradient.
        restore_shape: optional shape [..., H] for the result (e.g. the input's [B, S, H]).
        grad_amax: optional `AmaxSlot`: the backward reduces y's gradient's amax per expert
            group as it writes it and puts both there, for the experts' current-scaling
            grad_output quantizer (`GroupedLinear(..., grad_output_amax=slot)`).

    Returns: [T, H] (or restore_shape) in y's dtype.
    """
    if not isinstance(row_id_map, RowIdMap):
        raise TypeError(f"row_id_map must be the RowIdMap moe_permute returned, got {type(row_id_map).__name__}")
    if not isinstance(y, torch.Tensor) or not y.is_floating_point() or y.dim() != 2:
        raise TypeError(f"y must be a 2-D floating-point tensor [R, H], got "
                        f"{getattr(y, 'dtype', type(y).__name__)} {tuple(getattr(y, 'shape', ()))}")
    check_rows("y", y, row_id_map.num_rows, row_id_map.rows.device)
    if merging_probs is not None:
        check_merging_probs(merging_probs, row_id_map)
    if restore_shape is not None:
        restore_shape = tuple(restore_shape)
        t = row_id_map.rows.shape[0]
        if not restore_shape or restore_shape[-1] != y.shape[1] or \
                torch.Size(restore_shape).numel() != t * y.shape[1]:
            raise ValueError(f"restore_shape {restore_shape} must be [..., H={y.shape[1]}] with "
                             f"{t} tokens in all")
    if grad_amax is not None:
        if not isinstance(grad_amax, AmaxSlot):
            raise TypeError(f"grad_amax must be an AmaxSlot or None, got {type(grad_amax).__name__}")
        check_amax_rows("y", y)
    if use_kernels(y, merging_probs, row_id_map.rows) or grad_amax is not None:
        out = _UnpermuteRows.apply(y, merging_probs, row_id_map, grad_amax)
        return out if restore_shape is None else out.view(restore_shape)
    return reference.moe_unpermute(y, row_id_map, merging_probs, restore_shape)
