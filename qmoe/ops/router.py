"""Top-k routing op: scores, expert-bias selection, group-limited top-k, capacity.

Dimensions: T tokens, E experts, K top-k, G expert groups.

`topk_route` runs the Triton kernel (forward and a fused backward) on sm90+ GPUs and the
reference in `qmoe.reference.router` elsewhere (see `qmoe.backend.use_kernels`). Neither
reads a value back to the host, so a routed step can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from qmoe.backend import use_kernels
from qmoe.ops.amp import autocast_off
from qmoe.reference import router as reference
from qmoe.contracts.carriers import NORMALIZE_EPS
from qmoe.contracts.enums import ScoreFunction, parse_score_function
from qmoe.contracts.validate import check_capacity_factor, check_topk_route_args
from qmoe.dispatch import ROUTER
from qmoe.reference.router import apply_capacity

__all__ = ["topk_route", "apply_capacity", "router_logits"]


class _TopKRoute(torch.autograd.Function):
    # Gets the parsed score function: `topk_route` validated everything once, so the kernels'
    # unchecked launchers run here without a second check.
    @staticmethod
    @autocast_off
    def forward(ctx, logits, expert_bias, top_k, fn, pre_softmax, num_groups, group_topk,
                scaling_factor, group_score_topk, normalize_topk_probs):
        probs, routing_map = ROUTER.kernel("route_forward")(logits, top_k, fn, pre_softmax, num_groups,
                                                            group_topk, scaling_factor, expert_bias,
                                                            group_score_topk, normalize_topk_probs)
        ctx.save_for_backward(logits, routing_map)
        ctx.args = (top_k, fn, pre_softmax, scaling_factor, normalize_topk_probs)
        ctx.mark_non_differentiable(routing_map)
        # no zero-filled stand-in for the bool map's (never used) gradient: a memset launch
        ctx.set_materialize_grads(False)
        return probs, routing_map

    @staticmethod
    @autocast_off
    def backward(ctx, grad_probs, _grad_routing_map):
        if grad_probs is None:
            return (None,) * 10
        logits, routing_map = ctx.saved_tensors
        grad_logits = ROUTER.kernel("route_backward")(grad_probs, logits, routing_map, *ctx.args)
        return (grad_logits,) + (None,) * 9


class _RouterLogits(torch.autograd.Function):
    # Saves x and the weight in their own dtypes: autograd of `x.float() @ w.float().t()` would
    # keep the fp32 copy of x (twice a bf16 input's bytes, 235 MB at the DeepSeek-V3 shard) for
    # the weight gradient. The math is fp32 whatever either dtype (a router cast to bf16 with the
    # rest of a model still selects experts from fp32 logits); gradients return in their dtypes.
    @staticmethod
    @autocast_off
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        logits = x.float() @ weight.float().t()
        return logits if bias is None else logits + bias.float()

    @staticmethod
    @autocast_off
    def backward(ctx, grad_logits):
        x, weight = ctx.saved_tensors
        dx = (grad_logits @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (grad_logits.t() @ x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = grad_logits.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 router logits [T, E] = x [T, H] @ weight [E, H]^T (+ bias [E]), each of any float dtype.

    The same values and gradients as `x.float() @ weight.float().t() + bias.float()`, without
    keeping an fp32 copy of x alive for the backward; gradients come back in x's, weight's and
    bias's dtypes. The bias is gpt-oss's learned router bias.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits needs x [T, H] and weight [E, H], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"router bias must have shape [E]=({weight.shape[0]},), got {tuple(bias.shape)}")
    return _RouterLogits.apply(x, weight, bias)


def topk_route(logits, top_k, *, score_function="softmax", pre_softmax=False, num_groups=None,
               group_topk=None, scaling_factor=None, expert_bias=None, capacity_factor=None,
               group_score_topk=None, normalize_topk_probs=None):
    """Choose `top_k` experts per token from router logits.

    Args:
        logits: [T, E] any float dtype; all math is fp32.
        top_k: experts per token (K).
        score_function: "softmax" (default), "sigmoid" or "sqrtsoftplus" (sqrt(softplus(x))).
            By default sigmoid and sqrtsoftplus scores are normalised to sum 1 over the chosen
            when K > 1 (see normalize_topk_probs).
        pre_softmax: softmax over all E then top-k; otherwise (default) top-k on the logits and
            softmax over the K chosen. Softmax only.
        num_groups, group_topk: group-limited routing (DeepSeek-V3): a group's score is the sum
            of its top `group_score_topk` scores; only the best `group_topk` groups are eligible.
        scaling_factor: multiplies the returned probs.
        expert_bias: [E] float (fp32), shifts the scores for selection only; the probs stay
            unbiased. See `update_expert_bias`.
        capacity_factor: None (dropless, default) or a positive float: each expert keeps at most
            ceil(T * K * capacity_factor / E) assignments, the highest-probability ones
            (`apply_capacity`).
        group_score_topk: how many of a group's highest scores make its score; None: K // group_topk
            (Megatron's rule); DeepSeek-V3 and Hugging Face use 2.
        normalize_topk_probs: whether the chosen probs are divided by their sum (before
            scaling_factor); None keeps the rule of the score function: softmax after top-k is
            normalised by construction, pre_softmax is not, sigmoid and sqrtsoftplus are when K > 1.

    Returns:
        probs: [T, E] fp32, zero where not chosen, differentiable to `logits`.
        routing_map: [T, E] bool.

    Every token gets exactly K experts, whatever its values: ties go to the lower expert (and
    group) index, NaN ranks above every number (as in `torch.topk`), -inf below every number but
    above the experts that group-limited routing excludes (the order in `qmoe.reference.router`).

    Example:
        >>> logits = torch.randn(8, 16, requires_grad=True)
        >>> probs, routing_map = topk_route(logits, 2, score_function="sigmoid",
        ...                                 num_groups=4, group_topk=2)
        >>> probs.sum().backward()
    """
    fn = check_topk_route_args(logits, top_k, score_function, pre_softmax, num_groups, group_topk,
                               scaling_factor, expert_bias, group_score_topk, normalize_topk_probs)
    if capacity_factor is not None:  # validated before any kernel runs
        check_capacity_factor(capacity_factor)
    if use_kernels(logits, expert_bias):
        probs, routing_map = _TopKRoute.apply(logits, expert_bias, top_k, fn, pre_softmax,
                                              num_groups, group_topk, scaling_factor, group_score_topk,
                                              normalize_topk_probs)
    else:
        probs, routing_map = reference.topk_route(
            logits, top_k, score_function=score_function, pre_softmax=pre_softmax,
            num_groups=num_groups, group_topk=group_topk, scaling_factor=scaling_factor,
            expert_bias=expert_bias, group_score_topk=group_score_topk,
            normalize_topk_probs=normalize_topk_probs)
    if capacity_factor is not None:
        probs, routing_map = apply_capacity(probs, routing_map, capacity_factor)
    return probs, routing_map


def balance_scores(logits: torch.Tensor, score_function="softmax") -> torch.Tensor:
    """Every expert's score [T, E] (fp32), normalised to sum 1 per token: what the balance losses see.

    Softmax over all E for "softmax"; sigmoid / sqrtsoftplus scores divided by their sum (plus
    NORMALIZE_EPS, so an all-zero row stays finite). Differentiable by autograd.
    """
    fn = parse_score_function(score_function)
    scores = reference.compute_scores(logits, fn, pre_softmax=True)
    if fn is not ScoreFunction.SOFTMAX:
        scores = scores / (scores.sum(dim=-1, keepdim=True) + NORMALIZE_EPS)
    return scores
