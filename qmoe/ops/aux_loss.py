"""Expert-balance losses and the aux-loss-free bias update, as differentiable ops.

Dimensions: T tokens, E experts, K top-k, B sequences of L tokens (T = B * L, batch-major).

Each loss returns a 0-dim fp32 tensor with autograd to its probs/logits, computed by fused
Triton kernels on sm90+ GPUs and by `qmoe.reference.aux_loss` elsewhere. On the GPU a loss is
one forward launch (a deterministic multi-block fp32 reduction, no host read, graph-capturable)
and one backward launch (`qmoe.kernels.aux_loss` says why both are Triton's); arguments are
validated once per call, here, before either.
"""
from __future__ import annotations

import torch

from qmoe.backend import use_kernels
from qmoe.ops.amp import autocast_off
from qmoe.reference import aux_loss as reference
from qmoe.contracts.validate import (check_coeff, check_moe_aux_loss_args, check_scores, check_seq_aux_loss_args,
                                     check_update_expert_bias_args)
from qmoe.dispatch import AUX_LOSS

__all__ = ["moe_aux_loss", "seq_aux_loss", "z_loss", "update_expert_bias"]


# The Functions save only what their backward reads (no forward input is kept alive for
# shape or dtype) and call the kernels' unchecked launchers: the public op validated once.


class _MoEAuxLoss(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff, needs_grad):
        scale, nt = AUX_LOSS.kernel("moe_aux_constants")(num_tokens, num_experts, top_k, coeff)
        loss, rows = AUX_LOSS.kernel("aux_loss_forward")(probs, tokens_per_expert.contiguous(), scale, nt,
                                                         grad_rows=needs_grad)
        ctx.save_for_backward(rows)  # the gradient's row for a unit grad_loss
        ctx.meta = (probs.shape[0], probs.shape[1], probs.dtype)
        return loss

    @staticmethod
    @autocast_off
    def backward(ctx, grad_loss):
        (rows,) = ctx.saved_tensors
        t, e, dtype = ctx.meta
        grad = AUX_LOSS.kernel("grad_from_rows")(grad_loss, rows, t, e, t, dtype)
        return grad, None, None, None, None, None, None


class _SeqAuxLoss(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, probs, routing_map, seq_length, top_k, coeff):
        t, e = probs.shape
        scale = AUX_LOSS.kernel("seq_aux_scale")(t, e, seq_length, top_k, coeff)
        loss, rows = AUX_LOSS.kernel("seq_aux_loss_forward")(probs, routing_map, seq_length, scale)
        ctx.save_for_backward(rows)  # scale * per-sequence counts: the gradient's rows
        ctx.meta = (t, e, seq_length, probs.dtype)
        return loss

    @staticmethod
    @autocast_off
    def backward(ctx, grad_loss):
        (rows,) = ctx.saved_tensors
        return AUX_LOSS.kernel("grad_from_rows")(grad_loss, rows, *ctx.meta), None, None, None, None


class _ZLoss(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, logits, coeff):
        loss, lse = AUX_LOSS.kernel("z_loss_forward")(logits, coeff)
        # the backward kernel reads both: the logits are the op's input (the router's backward
        # keeps them alive anyway) and lse is [T], so the loss allocates no [T, E] of its own
        ctx.save_for_backward(logits, lse)
        ctx.coeff = coeff
        return loss

    @staticmethod
    @autocast_off
    def backward(ctx, grad_loss):
        logits, lse = ctx.saved_tensors
        return AUX_LOSS.kernel("z_loss_grad")(grad_loss, logits, ctx.coeff, lse), None


def moe_aux_loss(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff):
    """Switch-style load-balancing loss (Megatron's "aux_loss").

    loss = sum_e (sum_t probs[t, e]) * tokens_per_expert[e] * E * coeff / (top_k * num_tokens^2)

    Args:
        probs: [T, E] float (fp32, bf16, fp16), router probabilities; gets the gradient.
        tokens_per_expert: [E] int or float on the same device, e.g. routing_map.sum(0).
        num_tokens: int, or a 0-dim device tensor (e.g. a global count after an all-reduce),
            read on the device so the op stays graph-safe.
        num_experts, top_k: ints. coeff: float.

    Returns: 0-dim fp32 loss.

    Example:
        >>> probs, routing_map = topk_route(torch.randn(32, 8), 2, pre_softmax=True)
        >>> loss = moe_aux_loss(probs, routing_map.sum(0), 32, 8, 2, 1e-2)
    """
    check_moe_aux_loss_args(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff)
    if use_kernels(probs, tokens_per_expert):
        return _MoEAuxLoss.apply(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff,
                                 torch.is_grad_enabled() and probs.requires_grad)
    return reference.moe_aux_loss(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff)


def seq_aux_loss(probs, routing_map, seq_length, top_k, coeff):
    """Sequence-level balance loss (DeepSeek-V2/V3), averaged over sequences.

    With B = T / L sequences of L = seq_length tokens (rows batch-major):
    loss = coeff / B * sum_b sum_e (E / (K * L) * count[b, e]) * (1 / L * sum_{t in b} probs[t, e])

    Args:
        probs: [T, E] float, each token's scores over all experts (DeepSeek-V3: normalised to
            sum 1 per token); gets the gradient.
        routing_map: [T, E] bool, the chosen experts.
        seq_length: L, must divide T. top_k: K. coeff: float.

    Returns: 0-dim fp32 loss.
    """
    check_seq_aux_loss_args(probs, routing_map, seq_length, top_k, coeff)
    if use_kernels(probs, routing_map):
        return _SeqAuxLoss.apply(probs, routing_map, seq_length, top_k, coeff)
    return reference.seq_aux_loss(probs, routing_map, seq_length, top_k, coeff)


def z_loss(logits, coeff):
    """Router z-loss, coeff * mean_t(logsumexp(logits[t, :])^2): keeps logits small.

    Args: logits [T, E] float (gets the gradient); coeff float. Returns: 0-dim fp32 loss.
    """
    check_scores("logits", logits)
    check_coeff(coeff)
    if use_kernels(logits):
        return _ZLoss.apply(logits, coeff)
    return reference.z_loss(logits, coeff)


def update_expert_bias(bias, tokens_per_expert, rate=1e-3):
    """Aux-loss-free balancing (DeepSeek-V3), in place: bias += rate * sign(mean(count) - count).

    Call it once per step after routing, with the step's counts (summed over data-parallel
    ranks if you balance globally). One kernel, no host read: graph-safe.

    Args:
        bias: [E] float (fp32 recommended), the `expert_bias` given to `topk_route`.
        tokens_per_expert: [E] int or float, on the device of `bias`.
        rate: update step (a Python float).

    Returns: `bias`, updated in place.
    """
    check_update_expert_bias_args(bias, tokens_per_expert, rate)
    if use_kernels(bias, tokens_per_expert):
        return AUX_LOSS.kernel("update_expert_bias")(bias, tokens_per_expert, rate)
    return reference.update_expert_bias(bias, tokens_per_expert, rate)
