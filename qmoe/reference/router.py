"""Reference top-k router: the executable specification of `qmoe.kernels.router`.

Dimensions: T tokens, E experts, K top-k (experts chosen per token), G expert groups.

Everything is float32 whatever the logits dtype (float64 logits stay float64, so that
`torch.autograd.gradcheck` can check the reference), readable before fast, and differentiable
through plain autograd (the kernels' hand-written backward is tested against it).

Selection order (the kernel follows it bit for bit). Each token ranks its experts by
1. eligibility: with group-limited routing, experts of the token's best `group_topk` groups
   come before all others, so a -inf score inside a kept group still beats every expert outside;
2. NaN before every number (the order of `torch.sort` and `torch.topk`, so a NaN is never
   hidden: the expert is chosen and the token's probabilities show it);
3. larger score first; +inf is the largest number, -inf the smallest, -0.0 equals +0.0;
4. among equals, the lower expert index.
The first `top_k` are chosen: every token gets exactly `top_k` experts whatever its values
(a row of NaNs gets experts 0..top_k-1, with NaN probabilities). A group's score is the sum
of its top `group_score_count` scores in this order, so one NaN makes it NaN and ranks the
group first, again ties to the lower group. Non-finite values stay in their own token; only
`expert_bias`, shared by all tokens, reaches every token (a NaN there makes that expert
everyone's first choice, while the probabilities, which never include the bias, stay finite).
Stable sorts rather than `torch.topk`, whose tie order is unspecified.
"""
from __future__ import annotations

import torch

from qmoe.contracts.carriers import NORMALIZE_EPS
from qmoe.contracts.enums import ScoreFunction, parse_score_function
from qmoe.contracts.validate import (check_capacity_factor, check_topk_route_args, group_score_count,
                                    resolve_normalize)

def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def compute_scores(logits: torch.Tensor, fn: ScoreFunction, pre_softmax: bool) -> torch.Tensor:
    """Scores [T, E] fp32 that selection ranks (before any expert bias)."""
    x = logits.to(compute_dtype(logits))
    if fn is ScoreFunction.SOFTMAX:
        # Without pre_softmax the ranking is on the logits; softmax comes after selection.
        return torch.softmax(x, dim=-1) if pre_softmax else x
    if fn is ScoreFunction.SIGMOID:
        return torch.sigmoid(x)
    return _SqrtSoftplus.apply(x)


class _SqrtSoftplus(torch.autograd.Function):
    """sqrt(softplus(x)) whose derivative, sigmoid(x) / (2 s), is 0 where s underflows to 0 (its
    limit at x -> -inf), not autograd's inf * 0 = NaN: a masked (-inf) logit gets no gradient."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sqrt(torch.nn.functional.softplus(x))
        ctx.save_for_backward(x, s)
        return s

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.saved_tensors
        return grad * torch.where(s > 0, torch.sigmoid(x) / (2 * s), torch.zeros_like(s))


def _order_by(value: torch.Tensor, tier: torch.Tensor, dim: int) -> torch.Tensor:
    """Indices along `dim`, best first: higher `tier`, then larger `value`, then the lower index.

    A stable sort by value, then a stable sort by tier: lexicographic, every remaining tie left
    in index order. `value` must hold no NaN and no -0.0 (`_comparable`), so the order does not
    depend on where a backend's sort puts them.
    """
    order = torch.sort(value, dim=dim, descending=True, stable=True).indices
    by_tier = torch.sort(tier.gather(dim, order), dim=dim, descending=True, stable=True).indices
    return order.gather(dim, by_tier)


def _comparable(x: torch.Tensor) -> torch.Tensor:
    """x with NaN and -0.0 replaced by +0.0 (the caller ranks NaN through a tier)."""
    return torch.where(torch.isnan(x) | (x == 0), torch.zeros_like(x), x)


def rank_order(scores: torch.Tensor, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Column indices [T, E] of each row, best first, in the selection order of this module:
    eligible first, then NaN, then larger values (-0.0 == +0.0), then the lower index."""
    tier = torch.isnan(scores).to(torch.int8)
    if eligible is not None:
        tier = tier + 2 * eligible.to(torch.int8)
    return _order_by(_comparable(scores), tier, dim=-1)


def topk_lowest_index(scores: torch.Tensor, k: int, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [T, k] of the k best-ranked scores per row (`rank_order`); ties to the lower index."""
    return rank_order(scores, eligible)[:, :k]


def best_groups(scores: torch.Tensor, num_groups: int, group_topk: int, score_count: int) -> torch.Tensor:
    """Bool [T, E]: True for experts in each token's best `group_topk` groups.

    A group's score is the sum of its top `score_count` scores (`group_score_count`) in
    selection order, added largest first (the kernel adds in the same order, so both pick the
    same groups bit for bit): NaN when the group holds a NaN.
    """
    t, e = scores.shape
    per_group = scores.view(t, num_groups, e // num_groups)
    nan = torch.isnan(per_group)
    best = torch.sort(per_group.masked_fill(nan, float("-inf")), dim=-1, descending=True).values
    group_score = best[..., 0]
    for i in range(1, score_count):
        group_score = group_score + best[..., i]
    group_score = group_score.masked_fill(nan.any(dim=-1), float("nan"))
    keep_groups = topk_lowest_index(group_score, group_topk)                     # [T, group_topk]
    keep = torch.zeros(t, num_groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, keep_groups, True)
    return keep.repeat_interleave(e // num_groups, dim=1)                        # [T, E]


def probs_of_chosen(logits: torch.Tensor, idx: torch.Tensor, fn: ScoreFunction, pre_softmax: bool,
                    top_k: int, normalize_topk_probs: bool | None = None) -> torch.Tensor:
    """Probabilities [T, K] fp32 of the chosen experts `idx`, differentiable to the logits.

    Recomputed from the gathered logits (not gathered scores) so experts that were not chosen
    get an exact zero gradient, even where a score's derivative is infinite (sqrt at 0).
    """
    x = logits.to(compute_dtype(logits))
    if fn is ScoreFunction.SOFTMAX and not pre_softmax:
        return torch.softmax(x.gather(1, idx), dim=-1)
    if fn is ScoreFunction.SOFTMAX:
        chosen = torch.softmax(x, dim=-1).gather(1, idx)
    else:
        chosen = compute_scores(x.gather(1, idx), fn, pre_softmax)
    if resolve_normalize(fn, pre_softmax, top_k, normalize_topk_probs):
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + NORMALIZE_EPS)
    return chosen


def topk_route(logits, top_k, *, score_function="softmax", pre_softmax=False, num_groups=None,
               group_topk=None, scaling_factor=None, expert_bias=None, group_score_topk=None,
               normalize_topk_probs=None):
    """Choose `top_k` experts per token.

    Args:
        logits: [T, E] any float dtype.
        top_k: experts per token, 1 <= top_k <= E.
        score_function: "softmax" | "sigmoid" | "sqrtsoftplus" (or a `ScoreFunction`).
        pre_softmax: softmax over all experts before top-k (softmax only); otherwise top-k on
            the logits and softmax over the k chosen.
        num_groups, group_topk: group-limited routing (both or neither).
        scaling_factor: multiplies the returned probs.
        expert_bias: [E] float, added to the scores for selection only.
        group_score_topk: a group's score is the sum of its top `group_score_topk` scores;
            None: top_k // group_topk.
        normalize_topk_probs: divide the chosen probs by their sum; None: `resolve_normalize`.

    Returns:
        probs: [T, E] fp32 (fp64 for fp64 logits), zero where not chosen; routing_map: [T, E] bool,
        exactly `top_k` True per row whatever the values (selection order: module docstring).

    Example:
        >>> probs, routing_map = topk_route(torch.randn(4, 8), 2, score_function="sigmoid")
        >>> routing_map.sum(dim=1).tolist()
        [2, 2, 2, 2]
    """
    fn = check_topk_route_args(logits, top_k, score_function, pre_softmax, num_groups, group_topk,
                               scaling_factor, expert_bias, group_score_topk, normalize_topk_probs)
    t, e = logits.shape
    scores = compute_scores(logits.detach(), fn, pre_softmax)
    if expert_bias is not None:
        scores = scores + expert_bias.to(scores.dtype)
    eligible = None
    if num_groups is not None:
        eligible = best_groups(scores, num_groups, group_topk,
                               group_score_count(top_k, group_topk, group_score_topk))
    idx = topk_lowest_index(scores, top_k, eligible)
    chosen = probs_of_chosen(logits, idx, fn, pre_softmax, top_k, normalize_topk_probs)
    if scaling_factor is not None:
        chosen = chosen * scaling_factor
    probs = torch.zeros(t, e, dtype=chosen.dtype, device=logits.device).scatter(1, idx, chosen)
    routing_map = torch.zeros(t, e, dtype=torch.bool, device=logits.device).scatter(1, idx, True)
    return probs, routing_map


def topk_route_backward(grad_probs, logits, routing_map, top_k, *, score_function="softmax",
                        pre_softmax=False, scaling_factor=None, normalize_topk_probs=None):
    """Gradient [T, E] (logits dtype) of `topk_route`'s probs with respect to the logits.

    The twin of the kernel's backward; it is autograd of the forward above, given the same
    routing (selection itself has no gradient, so only the chosen experts matter).
    """
    fn = parse_score_function(score_function)
    # Chosen indices in ascending expert order: the same set the forward chose.
    idx = topk_lowest_index(routing_map.to(torch.int8), top_k)
    with torch.enable_grad():
        x = logits.detach().requires_grad_(True)
        chosen = probs_of_chosen(x, idx, fn, pre_softmax, top_k, normalize_topk_probs)
        if scaling_factor is not None:
            chosen = chosen * scaling_factor
        (grad,) = torch.autograd.grad(chosen, x, grad_probs.to(chosen.dtype).gather(1, idx))
    return grad.to(logits.dtype)


def apply_capacity(probs, routing_map, capacity_factor):
    """Drop, per expert, the lowest-probability assignments beyond its capacity.

    capacity = ceil(num_assignments * capacity_factor / E), with num_assignments the number of
    True entries of `routing_map` (T * top_k when every token chose top_k experts). Among equal
    probabilities the lower token index is kept; NaN probabilities rank below every number, so
    a token with non-finite logits is the first dropped. Pure tensor ops, computed on the device:
    no host synchronisation, so the kernels' path uses this function as it is.

    Args:
        probs: [T, E] float, zero where not routed. routing_map: [T, E] bool.
        capacity_factor: positive float.

    Returns:
        (probs * kept, routing_map & kept), same shapes and dtypes; differentiable in probs.
    """
    check_capacity_factor(capacity_factor)
    if probs.shape != routing_map.shape or probs.dim() != 2:
        raise ValueError(f"probs {tuple(probs.shape)} and routing_map {tuple(routing_map.shape)} "
                         "must both be [T, E]")
    if routing_map.dtype != torch.bool:
        raise TypeError(f"routing_map must be torch.bool, got {routing_map.dtype}")
    t, e = probs.shape
    assignments = routing_map.sum(dtype=torch.float64)
    capacity = torch.ceil(assignments * capacity_factor / e)
    value = probs.detach().float()
    # routed before not routed; a NaN probability (a token with non-finite logits) after every
    # routed number, so it never takes another token's place
    tier = 2 * routing_map.to(torch.int8) + (routing_map & ~torch.isnan(value)).to(torch.int8)
    order = _order_by(_comparable(value), tier, dim=0)                              # [T, E]
    ranks = torch.arange(t, device=probs.device).unsqueeze(1).expand(t, e)
    rank = torch.empty_like(order).scatter_(0, order, ranks)                         # rank in column
    kept = routing_map & (rank < capacity)
    return probs * kept, kept
