"""Triton top-k router, forward and backward. Reference twin: `qmoe.reference.router`.

Dimensions: T tokens, E experts, K top-k, G expert groups.

One program owns BLOCK_T whole rows of logits ([BLOCK_T, BLOCK_E] in registers, E padded to a
power of two), so scoring, group selection, top-k and normalisation need no second pass and no
host value. Selection follows the reference's order bit for bit (`qmoe.reference.router`:
eligible experts first, then NaN, then larger scores with -0.0 == +0.0, then the lower index),
so every token gets exactly K experts whatever its values. The scores become int32 keys in that
order (`_rank_key`), and selection repeats "take the maximum key, lowest index among equals" K
times: integer comparisons see no NaN, so the order cannot depend on how a float max treats NaN
(maxnum on the GPU, NaN-propagating in Triton's interpreter).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from qmoe.kernels._launch import kernel_op, wrapped
from qmoe.kernels._layout import rows_contiguous
from qmoe.contracts.carriers import NORMALIZE_EPS
from qmoe.contracts.enums import ScoreFunction, parse_score_function
from qmoe.contracts.validate import check_topk_route_args, group_score_count, resolve_normalize

# Kernel constants for `ScoreFunction`: the one place the enum becomes a number.
_SCORE_CODE = {ScoreFunction.SOFTMAX: 0, ScoreFunction.SIGMOID: 1, ScoreFunction.SQRTSOFTPLUS: 2}

# Elements of logits per program. Router rows are short (E <= a few thousand), so rows are
# batched until a program holds about this many values: enough work per program to hide
# latency while leaving registers for the half-dozen [BLOCK_T, BLOCK_E] temporaries.
_ELEMENTS_PER_PROGRAM = 2048

NORM_EPS = tl.constexpr(NORMALIZE_EPS)


@triton.jit
def _log1p(z):
    # log(1 + z) accurate for small z (Goldberg's trick); tl has no log1p.
    u = 1.0 + z
    return tl.where(u == 1.0, z, tl.log(u) * (z / (u - 1.0)))


@triton.jit
def _scores(x, SCORE_FN: tl.constexpr, PRE_SOFTMAX: tl.constexpr):
    """Scores [BLOCK_T, BLOCK_E] fp32 that selection ranks (padded columns are -inf logits)."""
    if SCORE_FN == 0:
        if PRE_SOFTMAX:
            m = tl.max(x, axis=1)
            ex = tl.exp(x - m[:, None])
            s = ex / tl.sum(ex, axis=1)[:, None]
        else:
            s = x
    elif SCORE_FN == 1:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        # softplus(x) = max(x, 0) + log1p(exp(-|x|)): no overflow, no cancellation.
        s = tl.sqrt(tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x))))
    return s


# Key of experts that may not be chosen (padding, taken, outside the kept groups): below every
# `_rank_key` of an eligible score, the smallest of which is -inf's.
_NEVER = tl.constexpr(-2147483648)
# Key of a NaN score: above +inf's.
_NAN_KEY = tl.constexpr(2147483647)


@triton.jit
def _rank_key(v, eligible):
    """int32 keys whose order is the selection order of the fp32 scores `v`: NaN above +inf,
    -0.0 equal to +0.0, columns not `eligible` below everything."""
    v = tl.where(v == 0.0, 0.0, v)
    b = v.to(tl.int32, bitcast=True)
    # Non-negative floats order as their bits; flipping a negative float's magnitude bits
    # makes larger magnitudes smaller integers.
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    key = tl.where(v != v, _NAN_KEY, key)
    return tl.where(eligible, key, _NEVER)


@triton.jit
def _topk_mask(key, cols, K: tl.constexpr, BLOCK: tl.constexpr):
    """Bool [BLOCK_T, BLOCK] marking each row's K largest `_rank_key` keys; ties to the lower column.

    Every row holds at least K eligible keys (the launch arguments are validated so), so a
    taken or ineligible column (`_NEVER`) is never the maximum.
    """
    chosen = key != key  # all False
    for _ in tl.static_range(K):
        best = tl.max(key, axis=1)
        idx = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK), axis=1)
        hit = cols[None, :] == idx[:, None]
        chosen = chosen | hit
        key = tl.where(hit, _NEVER, key)
    return chosen


@triton.jit
def _group_limited(key, sel, cols, NUM_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr,
                   PER_GROUP_K: tl.constexpr, EXPERTS_PER_GROUP: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """`key` (the `_rank_key` of `sel`, both [BLOCK_T, BLOCK_E]) with the experts outside each
    row's best GROUP_TOPK groups made ineligible. A group's score is the sum of its top
    PER_GROUP_K scores (`group_score_count`), added largest first as the reference adds them,
    and NaN if the group holds a NaN (a NaN ranks first, so it is always among them)."""
    gcols = tl.arange(0, BLOCK_G)
    group = cols // EXPERTS_PER_GROUP  # padded columns fall in no group (E = NUM_GROUPS * EXPERTS_PER_GROUP)
    group_score = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        in_g = group[None, :] == g
        work = tl.where(in_g, sel, float("-inf"))
        score = tl.zeros([BLOCK_T], tl.float32)
        for i in tl.static_range(PER_GROUP_K):
            best = tl.max(work, axis=1)
            # Remove one instance of the maximum, so equal values count as often as they occur.
            idx = tl.min(tl.where((work == best[:, None]) & in_g, cols[None, :], 1 << 30), axis=1)
            work = tl.where(cols[None, :] == idx[:, None], float("-inf"), work)
            if i == 0:
                score = best
            else:
                score = score + best
        # The sum above is only used where the group holds no NaN (what a float max does with
        # a NaN differs between the GPU and the interpreter).
        has_nan = tl.max(tl.where(in_g & (sel != sel), 1, 0), axis=1) > 0
        score = tl.where(has_nan, float("nan"), score)
        group_score = tl.where(gcols[None, :] == g, score[:, None], group_score)
    kept = _topk_mask(_rank_key(group_score, (gcols < NUM_GROUPS)[None, :]), gcols, GROUP_TOPK, BLOCK_G)
    keep = tl.zeros_like(key) != 0  # all False
    for g in tl.static_range(NUM_GROUPS):
        kept_g = tl.max(tl.where(gcols[None, :] == g, kept.to(tl.int32), 0), axis=1) > 0
        keep = keep | (kept_g[:, None] & (group[None, :] == g))
    return tl.where(keep, key, _NEVER)


@triton.jit
def _topk_route_kernel(
    # pointers
    logits_ptr, bias_ptr, probs_ptr, map_ptr,
    # sizes
    T, E,
    # strides (rows; columns are contiguous)
    stride_logits, stride_probs, stride_map,
    # scalars
    scaling,
    # meta
    TOP_K: tl.constexpr, SCORE_FN: tl.constexpr, PRE_SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_TOPK: tl.constexpr, PER_GROUP_K: tl.constexpr,
    EXPERTS_PER_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    mask = (rows < T)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_logits + cols[None, :], mask=mask,
                other=float("-inf")).to(tl.float32)

    scores = _scores(x, SCORE_FN, PRE_SOFTMAX)
    sel = scores
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    key = _rank_key(sel, col_ok[None, :])
    if NUM_GROUPS > 1:
        key = _group_limited(key, sel, cols, NUM_GROUPS, GROUP_TOPK, PER_GROUP_K, EXPERTS_PER_GROUP,
                             BLOCK_T, BLOCK_G)
    chosen = _topk_mask(key, cols, TOP_K, BLOCK_E)

    # A chosen NaN or inf makes its row's sums NaN: the outer selects keep the experts that
    # were not chosen at exactly 0 there (0 / NaN would be NaN).
    if SCORE_FN == 0 and not PRE_SOFTMAX:
        # softmax over the chosen logits only (the bias never enters the probs)
        m = tl.max(tl.where(chosen, x, float("-inf")), axis=1)
        ex = tl.where(chosen, tl.exp(x - m[:, None]), 0.0)
        p = tl.where(chosen, ex / tl.sum(ex, axis=1)[:, None], 0.0)
    else:
        p = tl.where(chosen, scores, 0.0)
        if NORMALIZE:
            p = tl.where(chosen, p / (tl.sum(p, axis=1)[:, None] + NORM_EPS), 0.0)
    p = p * scaling
    tl.store(probs_ptr + rows64[:, None] * stride_probs + cols[None, :], p, mask=mask)
    tl.store(map_ptr + rows64[:, None] * stride_map + cols[None, :], chosen.to(tl.uint8), mask=mask)



@triton.jit
def _topk_route_bwd_kernel(
    # pointers
    grad_ptr, logits_ptr, map_ptr, dlogits_ptr,
    # sizes
    T, E,
    # strides (rows)
    stride_grad, stride_logits, stride_map, stride_dlogits,
    # scalars
    scaling,
    # meta
    TOP_K: tl.constexpr, SCORE_FN: tl.constexpr, PRE_SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    mask = (rows < T)[:, None] & (cols < E)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_logits + cols[None, :], mask=mask,
                other=float("-inf")).to(tl.float32)
    chosen = tl.load(map_ptr + rows64[:, None] * stride_map + cols[None, :], mask=mask, other=0) != 0
    g = tl.load(grad_ptr + rows64[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0)
    g = tl.where(chosen, g.to(tl.float32), 0.0) * scaling

    if SCORE_FN == 0 and not PRE_SOFTMAX:
        m = tl.max(tl.where(chosen, x, float("-inf")), axis=1)
        ex = tl.where(chosen, tl.exp(x - m[:, None]), 0.0)
        p = ex / tl.sum(ex, axis=1)[:, None]
        dx = tl.where(chosen, p * (g - tl.sum(g * p, axis=1)[:, None]), 0.0)
    else:
        s = _scores(x, SCORE_FN, PRE_SOFTMAX)
        if NORMALIZE:
            # p = s / S with S = sum of chosen s + eps: dL/ds_j = (g_j - sum_i g_i p_i) / S
            total = tl.sum(tl.where(chosen, s, 0.0), axis=1)[:, None] + NORM_EPS
            ds = tl.where(chosen, (g - tl.sum(g * tl.where(chosen, s, 0.0) / total, axis=1)[:, None]) / total, 0.0)
        else:
            ds = g
        if SCORE_FN == 0:
            # s is the softmax over all experts (pre_softmax): every logit gets a gradient
            dx = s * (ds - tl.sum(ds * s, axis=1)[:, None])
        else:
            sig = 1.0 / (1.0 + tl.exp(-x))
            if SCORE_FN == 1:
                dsdx = sig * (1.0 - sig)
            else:
                # d sqrt(softplus(x)) / dx = sigmoid(x) / (2 s); s == 0 only where softplus underflows
                dsdx = tl.where(s > 0.0, sig / (2.0 * s), 0.0)
            dx = tl.where(chosen, ds * dsdx, 0.0)
    tl.store(dlogits_ptr + rows64[:, None] * stride_dlogits + cols[None, :],
             dx.to(dlogits_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=4096)
def _route_launch(t: int, e: int, top_k: int, fn: ScoreFunction, pre_softmax: bool,
                  num_groups, group_topk, has_bias: bool, per_group_k: int, normalize: bool):
    """(grid, forward meta, backward meta) of one routing configuration.

    Memoised: the router runs every step with the same shapes and options, so a launch costs
    a dict lookup here instead of re-deriving block sizes and kernel constants.
    """
    block_e = triton.next_power_of_2(max(e, 1))
    block_t = max(1, min(triton.next_power_of_2(max(t, 1)), _ELEMENTS_PER_PROGRAM // block_e))
    num_warps = 4 if block_t * block_e <= 2048 else 8
    groups = num_groups or 1
    shared = dict(TOP_K=top_k, SCORE_FN=_SCORE_CODE[fn], PRE_SOFTMAX=bool(pre_softmax), NORMALIZE=normalize,
                  BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps)
    fwd = dict(shared, HAS_BIAS=has_bias, NUM_GROUPS=groups, GROUP_TOPK=group_topk or 1, PER_GROUP_K=per_group_k,
               EXPERTS_PER_GROUP=e // groups, BLOCK_G=triton.next_power_of_2(groups))
    return (triton.cdiv(t, block_t),), fwd, shared


def route_forward(logits, top_k, fn, pre_softmax, num_groups, group_topk, scaling_factor, expert_bias,
                  group_score_topk=None, normalize_topk_probs=None):
    """(probs [T, E] fp32, routing_map [T, E] bool) for validated arguments (`fn` parsed).

    Unchecked: `qmoe.ops.topk_route` validates once per call, `topk_route` below for callers
    of the twin.
    """
    return _route_forward_op(
        rows_contiguous(logits), expert_bias.contiguous() if expert_bias is not None else None, top_k, fn.value,
        bool(pre_softmax), num_groups, group_topk, 1.0 if scaling_factor is None else float(scaling_factor),
        group_score_count(top_k, group_topk, group_score_topk),
        resolve_normalize(fn, pre_softmax, top_k, normalize_topk_probs))


@kernel_op("qmoe::route_forward")
def _route_forward_op(logits: torch.Tensor, expert_bias: Optional[torch.Tensor], top_k: int, score_function: str,
                      pre_softmax: bool, num_groups: Optional[int], group_topk: Optional[int],
                      scaling_factor: float, per_group_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One opaque op (kernels/launch.KernelOp): (probs, routing map).

    The kernel stores the map's 0/1 bytes through a uint8 view of the bool tensor. The view
    stays inside the op, where torch.compile does not look (Inductor cannot lower a bool ->
    uint8 view), so the map costs no conversion pass.
    """
    t, e = logits.shape
    probs = torch.empty(t, e, dtype=torch.float32, device=logits.device)
    routing_map = torch.empty(t, e, dtype=torch.bool, device=logits.device)
    if t:
        grid, meta, _ = _route_launch(t, e, top_k, ScoreFunction(score_function), pre_softmax, num_groups,
                                      group_topk, expert_bias is not None, per_group_k, normalize)
        wrapped(_topk_route_kernel)[grid](
            logits, expert_bias if expert_bias is not None else probs, probs,  # probs: never read as bias
            routing_map.view(torch.uint8),
            t, e,
            logits.stride(0), probs.stride(0), routing_map.stride(0),
            scaling_factor,
            **meta,
        )
    return probs, routing_map


def route_backward(grad_probs, logits, routing_map, top_k, fn, pre_softmax, scaling_factor,
                   normalize_topk_probs=None):
    """d probs / d logits [T, E] in the logits' dtype, for validated arguments. Unchecked."""
    return _route_backward_op(rows_contiguous(grad_probs), rows_contiguous(logits), rows_contiguous(routing_map),
                              top_k, fn.value, bool(pre_softmax),
                              1.0 if scaling_factor is None else float(scaling_factor),
                              resolve_normalize(fn, pre_softmax, top_k, normalize_topk_probs))


@kernel_op("qmoe::route_backward")
def _route_backward_op(grad_probs: torch.Tensor, logits: torch.Tensor, routing_map: torch.Tensor, top_k: int,
                       score_function: str, pre_softmax: bool, scaling_factor: float, normalize: bool) -> torch.Tensor:
    # routing_map (bool) is read through a uint8 view, made here inside the opaque op (see
    # `_route_forward_op`): no copy.
    t, e = logits.shape
    dlogits = torch.empty(t, e, dtype=logits.dtype, device=logits.device)
    if t == 0:
        return dlogits
    grid, _, meta = _route_launch(t, e, top_k, ScoreFunction(score_function), pre_softmax, None, None, False, 1,
                                  normalize)
    wrapped(_topk_route_bwd_kernel)[grid](
        grad_probs, logits, routing_map.view(torch.uint8), dlogits,
        t, e,
        grad_probs.stride(0), logits.stride(0), routing_map.stride(0), dlogits.stride(0),
        scaling_factor,
        **meta,
    )
    return dlogits


def topk_route(logits, top_k, *, score_function="softmax", pre_softmax=False, num_groups=None,
               group_topk=None, scaling_factor=None, expert_bias=None, group_score_topk=None,
               normalize_topk_probs=None):
    """Triton twin of `qmoe.reference.router.topk_route` (same arguments and results)."""
    fn = check_topk_route_args(logits, top_k, score_function, pre_softmax, num_groups, group_topk,
                               scaling_factor, expert_bias, group_score_topk, normalize_topk_probs)
    return route_forward(logits, top_k, fn, pre_softmax, num_groups, group_topk, scaling_factor,
                         expert_bias, group_score_topk, normalize_topk_probs)


def topk_route_backward(grad_probs, logits, routing_map, top_k, *, score_function="softmax",
                        pre_softmax=False, scaling_factor=None, normalize_topk_probs=None):
    """Triton twin of `qmoe.reference.router.topk_route_backward`: d probs / d logits."""
    fn = parse_score_function(score_function)
    if grad_probs.shape != logits.shape or routing_map.shape != logits.shape:
        raise ValueError(f"grad_probs {tuple(grad_probs.shape)}, logits {tuple(logits.shape)} and "
                         f"routing_map {tuple(routing_map.shape)} must all be [T, E]")
    return route_backward(grad_probs, logits, routing_map, top_k, fn, pre_softmax, scaling_factor,
                          normalize_topk_probs)
