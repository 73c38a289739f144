"""Reference auxiliary losses for expert balance: the specification of `qmoe.kernels.aux_loss`.

Dimensions: T tokens, E experts, K top-k, B sequences of L tokens (T = B * L, batch-major).

Every loss is a 0-dim float32 tensor, accumulated in float32 whatever the input dtype (float64
inputs stay float64, for `torch.autograd.gradcheck`); the
backward twins are autograd of the forward, so the kernels' hand-written gradients are checked
against the definition itself.
"""
from __future__ import annotations

import torch

from qmoe.contracts.validate import (check_coeff, check_moe_aux_loss_args, check_scores, check_seq_aux_loss_args,
                                     check_update_expert_bias_args)


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def moe_aux_loss(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff):
    """Switch-style load-balancing loss.

    loss = sum_e (sum_t probs[t, e]) * tokens_per_expert[e] * E * coeff / (top_k * num_tokens^2)

    Args:
        probs: [T, E] float, router probabilities (before or after top-k, caller's choice).
        tokens_per_expert: [E] int or float, on the device of probs.
        num_tokens: int, or a 0-dim device tensor (keeps a CUDA graph free of host values).
        num_experts, top_k: ints. coeff: float.

    Returns: 0-dim fp32 loss.

    Example:
        >>> p = torch.full((4, 2), 0.5)
        >>> float(moe_aux_loss(p, torch.tensor([2, 2]), 4, 2, 1, 1.0))
        1.0
    """
    check_moe_aux_loss_args(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff)
    acc = _acc(probs)
    per_expert = probs.to(acc).sum(dim=0) * tokens_per_expert.to(acc)
    if isinstance(num_tokens, torch.Tensor):  # 0 tokens (an empty batch): the loss of nothing is 0
        n = torch.where(num_tokens == 0, torch.ones_like(num_tokens), num_tokens).to(acc)
    else:
        n = float(num_tokens) or 1.0
    return per_expert.sum() * (num_experts * coeff / top_k) / (n * n)


def seq_aux_loss(probs, routing_map, seq_length, top_k, coeff):
    """Sequence-level balance loss (DeepSeek-V2/V3), averaged over the B sequences.

    For sequence b of L tokens: f[b, e] = E / (K * L) * (tokens of b routed to e),
    P[b, e] = mean over b's tokens of probs[t, e]; loss = coeff * mean_b sum_e f[b, e] * P[b, e].

    Args:
        probs: [T, E] float, T = B * L batch-major; DeepSeek-V3 uses each token's scores
            normalised to sum 1 over all experts.
        routing_map: [T, E] bool, the chosen experts.
        seq_length: L. top_k: K. coeff: float.

    Returns: 0-dim fp32 loss.
    """
    check_seq_aux_loss_args(probs, routing_map, seq_length, top_k, coeff)
    t, e = probs.shape
    b = t // seq_length
    counts = routing_map.view(b, seq_length, e).sum(dim=1, dtype=_acc(probs))       # [B, E]
    prob_sums = probs.to(_acc(probs)).view(b, seq_length, e).sum(dim=1)              # [B, E]
    return (counts * prob_sums).sum() * (e * coeff / (top_k * seq_length * seq_length * max(b, 1)))


def z_loss(logits, coeff):
    """Router z-loss: coeff * mean_t(logsumexp(logits[t, :])^2). logits: [T, E] float; 0 for T = 0."""
    check_scores("logits", logits)
    check_coeff(coeff)
    if logits.shape[0] == 0 or logits.shape[1] == 0:  # no tokens, no loss (and a gradient of zeros)
        return logits.to(_acc(logits)).sum() * coeff
    return torch.logsumexp(logits.to(_acc(logits)), dim=-1).square().mean() * coeff


def _grad_of(loss_fn, grad_loss, x, *args):
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        loss = loss_fn(x, *args)
        (grad,) = torch.autograd.grad(loss, x, grad_loss.to(loss.dtype))
    return grad


def moe_aux_loss_backward(grad_loss, probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff):
    """d loss / d probs: [T, E] in the dtype of probs. grad_loss: 0-dim."""
    return _grad_of(moe_aux_loss, grad_loss, probs, tokens_per_expert, num_tokens, num_experts,
                    top_k, coeff)


def seq_aux_loss_backward(grad_loss, probs, routing_map, seq_length, top_k, coeff):
    """d loss / d probs: [T, E] in the dtype of probs. grad_loss: 0-dim."""
    return _grad_of(seq_aux_loss, grad_loss, probs, routing_map, seq_length, top_k, coeff)


def z_loss_backward(grad_loss, logits, coeff):
    """d loss / d logits: [T, E] in the dtype of logits. grad_loss: 0-dim."""
    return _grad_of(z_loss, grad_loss, logits, coeff)


@torch.no_grad()
def update_expert_bias(bias, tokens_per_expert, rate=1e-3):
    """Aux-loss-free balancing step, in place: bias += rate * sign(mean(count) - count).

    Under-loaded experts (count below the mean) get a higher bias, so selection (which adds
    the bias to the scores) sends them more tokens; the probs themselves stay unbiased.

    Args:
        bias: [E] float, updated in place and returned. tokens_per_expert: [E] int or float.
        rate: step size (a Python float: a host value is fine, it is not data).
    """
    check_update_expert_bias_args(bias, tokens_per_expert, rate)
    counts = tokens_per_expert.float()
    step = torch.sign(counts.mean() - counts) * rate
    bias.copy_((bias.float() + step).to(bias.dtype))
    return bias
