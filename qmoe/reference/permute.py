"""Reference token permutation for expert dispatch: the specification of `qmoe.kernels.permute`.

Dimensions: T tokens, E experts, K top-k (most experts per token), H row width (hidden size,
or bytes of a quantized row, or scale columns), R output rows.

`permute` groups each token's copies by expert, in expert order, keeping token order inside an
expert, and pads every group with zero rows to a multiple of `align_size` (what a grouped GEMM
of the recipe needs). The output has a **static** row count

    R = T * K + E * (align_size - 1)

(the worst case), so nothing about its shape depends on the routing and no host has to read a
count; the rows past the last group are zero too. `unpermute` sums each token's expert outputs
back, optionally weighted by the routing probabilities.

Each token may choose at most K experts (`topk_route` guarantees it). Extra choices are dropped
from the token's slots, and any row that would land past R is dropped rather than written.
"""
from __future__ import annotations

import torch

from qmoe.contracts.carriers import RowIdMap, RowsWithAmax, num_permuted_rows, permuted_destinations
from qmoe.contracts.validate import check_amax_rows, check_merging_probs, check_permute_index_args, check_rows
from qmoe.reference.quantize import finite_row_amax, group_amax


def _byte_movable(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or an integer view of its bits where indexing kernels may lack the dtype.

    Permutation only moves bits, so FP8 data and E8M0 scales travel as uint8; float tensors
    stay themselves so autograd sees the op.
    """
    if t.is_floating_point() and t.element_size() >= 2:
        return t
    return t.view(torch.uint8) if t.element_size() == 1 else t


def permute_index(routing_map, top_k, align_size):
    """Plan a permutation: (RowIdMap, split_sizes [E] int32, padded per-expert row counts)."""
    check_permute_index_args(routing_map, top_k, align_size)
    t, e = routing_map.shape
    chosen = routing_map.to(torch.int32)
    counts = chosen.sum(dim=0, dtype=torch.int32)
    split_sizes = (counts + align_size - 1) // align_size * align_size
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=routing_map.device)
    offsets[1:] = torch.cumsum(split_sizes, dim=0, dtype=torch.int32)
    rank = torch.cumsum(chosen, dim=0, dtype=torch.int32) - chosen                   # tokens before
    dest = offsets[:-1] + rank                                                        # [T, E]
    # The token's chosen experts first, in ascending order (stable sort of 1s before 0s).
    order = torch.sort(chosen, dim=1, descending=True, stable=True).indices[:, :top_k]
    used = routing_map.gather(1, order)
    experts = torch.where(used, order, -1).to(torch.int32)
    rows = torch.where(used, dest.gather(1, order), -1).to(torch.int32)
    row_id_map = RowIdMap(rows, experts, counts, offsets, num_permuted_rows(t, top_k, e, align_size))
    return row_id_map, split_sizes


def permute_rows(x, row_id_map, with_amax=False):
    """Copy token rows to their permuted places: x [T, N] any dtype -> [R, N], padding zero.

    with_amax (x bf16 / fp16 / fp32 [T, N]): return `RowsWithAmax(out, amax [E] fp32)`, each
    expert group's max|out| over finite values, for a current-scaling quantizer of `out`.
    """
    check_rows("x", x, row_id_map.rows.shape[0], row_id_map.rows.device)
    if with_amax:
        check_amax_rows("x", x)
        out = permute_rows(x, row_id_map)
        return RowsWithAmax(out, group_amax(out, row_id_map.offsets))
    data = _byte_movable(x)
    flat = data if data.dim() == 2 else data.unsqueeze(1)
    k = row_id_map.rows.shape[1]
    copies = flat.unsqueeze(1).expand(-1, k, -1).reshape(-1, flat.shape[1])          # [T*K, N]
    out = flat.new_zeros(row_id_map.num_rows + 1, flat.shape[1])
    out = out.index_copy(0, permuted_destinations(row_id_map), copies)[:-1]
    out = out if x.dim() == 2 else out.squeeze(1)
    return out if data is x else out.view(x.dtype)


def row_amax(x):
    """max|x[t]| over each row's finite values, [T] fp32: what `permute_rows(with_amax)` reduces per
    expert, from the tokens themselves."""
    return finite_row_amax(x)


def permute_probs(probs, row_id_map):
    """Each permuted row's routing probability: probs [T, E] -> [R] (probs dtype), padding 0."""
    experts = row_id_map.experts.long().clamp(min=0)
    copies = probs.gather(1, experts).flatten()                                       # [T*K]
    out = probs.new_zeros(row_id_map.num_rows + 1)
    return out.index_copy(0, permuted_destinations(row_id_map), copies)[:-1]


def unpermute_rows(y, row_id_map, merging_probs=None):
    """Sum each token's expert rows: y [R, H] float -> [T, H] (y dtype), fp32 accumulation.

    out[t] = sum over the token's copies c of y[row(c)] * merging_probs[t, expert(c)]
    (weight 1 without merging_probs), added in slot order (ascending expert).
    """
    check_rows("y", y, row_id_map.num_rows, row_id_map.rows.device)
    if merging_probs is not None:
        check_merging_probs(merging_probs, row_id_map)
    t, k = row_id_map.rows.shape
    padded = torch.cat([y, y.new_zeros(1, y.shape[1])])                                # dump row R
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32  # fp64: for gradcheck
    gathered = padded.index_select(0, permuted_destinations(row_id_map)).view(t, k, y.shape[1]).to(acc)
    used = row_id_map.rows >= 0
    if merging_probs is not None:
        weights = merging_probs.gather(1, row_id_map.experts.long().clamp(min=0)).to(acc) * used
        gathered = gathered * weights.unsqueeze(-1)
    out = gathered[:, 0]
    for slot in range(1, k):
        out = out + gathered[:, slot]
    return out.to(y.dtype)


def permute_rows_backward(grad_out, row_id_map):
    """Gradient of `permute_rows`: [R, N] -> [T, N], the sum over each token's copies."""
    return unpermute_rows(grad_out, row_id_map)


def permute_probs_backward(grad_out_probs, row_id_map, probs_dtype=torch.float32):
    """Gradient of `permute_probs`: [R] -> [T, E] in `probs_dtype`, zero where not routed."""
    t, k = row_id_map.rows.shape
    e = row_id_map.counts.shape[0]
    padded = torch.cat([grad_out_probs, grad_out_probs.new_zeros(1)])
    picked = padded.index_select(0, permuted_destinations(row_id_map)).view(t, k)
    picked = picked * (row_id_map.rows >= 0)
    grad = torch.zeros(t, e + 1, dtype=probs_dtype, device=grad_out_probs.device)
    experts = torch.where(row_id_map.experts >= 0, row_id_map.experts, e).long()      # dump column
    return grad.scatter(1, experts, picked.to(probs_dtype))[:, :e]


def unpermute_rows_backward(grad_out, y, row_id_map, merging_probs=None, need_probs_grad=True, with_amax=False):
    """Gradients of `unpermute_rows`: (grad_y [R, H], grad_merging_probs [T, E] or None).

    with_amax: grad_y comes as `RowsWithAmax(grad_y, amax [E] fp32)` (per expert group, as
    `permute_rows`), for a current-scaling quantizer of the experts' output gradient.
    """
    if with_amax:
        check_amax_rows("y", y)
        grad_y, grad_probs = unpermute_rows_backward(grad_out, y, row_id_map, merging_probs, need_probs_grad)
        return RowsWithAmax(grad_y, group_amax(grad_y, row_id_map.offsets)), grad_probs
    need_probs_grad = need_probs_grad and merging_probs is not None
    with torch.enable_grad():
        y = y.detach().requires_grad_(True)
        inputs = [y]
        if merging_probs is not None:
            merging_probs = merging_probs.detach().requires_grad_(need_probs_grad)
            if need_probs_grad:
                inputs.append(merging_probs)
        out = unpermute_rows(y, row_id_map, merging_probs)
        grads = torch.autograd.grad(out, inputs, grad_out)
    return grads[0], (grads[1] if need_probs_grad else None)


def with_num_rows(row_id_map: RowIdMap, num_rows: int | None) -> RowIdMap:
    """The plan with a larger static output row count (e.g. R rounded up to align_size)."""
    if num_rows is None:
        return row_id_map
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < row_id_map.num_rows:
        raise ValueError(f"num_rows must be an int >= T*top_k + E*(align_size-1) = {row_id_map.num_rows}, "
                         f"got {num_rows!r}")
    return row_id_map._replace(num_rows=num_rows)


def moe_permute(x, routing_map, probs=None, align_size=1, *, top_k=None, row_scales=None, num_rows=None,
                with_amax=False):
    """Permute tokens for the experts (reference of `qmoe.ops.moe_permute`, same contract).

    Returns (out [R, H], out_probs [R] or None, row_id_map, split_sizes [E] int32), and a fifth
    item, the permuted row_scales [R, S], when `row_scales` is given. with_amax: out is a
    `RowsWithAmax` (out.rows [R, H], out.amax [E] fp32).
    """
    if top_k is None:  # the reference may read the device; the kernels' path asks for top_k
        top_k = int(routing_map.sum(dim=1).max()) if routing_map.numel() else 1
    row_id_map, split_sizes = permute_index(routing_map, top_k, align_size)
    row_id_map = with_num_rows(row_id_map, num_rows)
    out = permute_rows(x, row_id_map, with_amax)
    out_probs = None if probs is None else permute_probs(probs, row_id_map)
    if row_scales is None:
        return out, out_probs, row_id_map, split_sizes
    return out, out_probs, row_id_map, split_sizes, permute_rows(row_scales, row_id_map)


def moe_unpermute(y, row_id_map, merging_probs=None, restore_shape=None):
    """Combine expert outputs (reference of `qmoe.ops.moe_unpermute`): [R, H] -> [T, H]."""
    out = unpermute_rows(y, row_id_map, merging_probs)
    return out if restore_shape is None else out.view(restore_shape)
