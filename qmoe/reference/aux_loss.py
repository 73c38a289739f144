"""Reference auxiliary losses for expert balance: the specification of `qmoe.kernels.aux_loss`.

Dimensions: T tokens, E experts, K top-k, B sequences of L tokens (T = B * L, batch-major).

Every loss is a 0-dim float32 tensor, accumulated in float32 whatever the input dtype (float64
inputs stay float64, for `torch.autograd.gradcheck`); the
backward twins are autograd of the forward, so the kernels' hand-written gradients are checked
against the definition itself.
"""
from __future__ import annotations

import math

import torch


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_scores(name, t, *, dims=2):
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D [T, E], got shape {tuple(t.shape)}")


def _check_positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def _check_coeff(coeff):
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not math.isfinite(coeff):
        raise TypeError(f"coeff must be a finite Python number, got {coeff!r}")


def check_moe_aux_loss_args(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff):
    _check_scores("probs", probs)
    if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (probs.shape[1],):
        raise ValueError(f"tokens_per_expert must be a tensor of shape [E]=({probs.shape[1]},), got "
                         f"{getattr(tokens_per_expert, 'shape', type(tokens_per_expert).__name__)}")
    if tokens_per_expert.device != probs.device:
        raise ValueError(f"tokens_per_expert is on {tokens_per_expert.device} but probs on {probs.device}")
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.dim() != 0 or num_tokens.device != probs.device:
            raise ValueError("num_tokens as a tensor must be 0-dim and on the device of probs, got "
                             f"shape {tuple(num_tokens.shape)} on {num_tokens.device}")
    else:
        _check_positive_int("num_tokens", num_tokens)
    _check_positive_int("num_experts", num_experts)
    _check_positive_int("top_k", top_k)
    _check_coeff(coeff)


def check_seq_aux_loss_args(probs, routing_map, seq_length, top_k, coeff):
    _check_scores("probs", probs)
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool:
        raise TypeError("routing_map must be a torch.bool tensor [T, E]")
    if routing_map.shape != probs.shape or routing_map.device != probs.device:
        raise ValueError(f"routing_map {tuple(routing_map.shape)} on {routing_map.device} must match "
                         f"probs {tuple(probs.shape)} on {probs.device}")
    _check_positive_int("seq_length", seq_length)
    if probs.shape[0] % seq_length:
        raise ValueError(f"T={probs.shape[0]} tokens is not a whole number of sequences of "
                         f"seq_length={seq_length}; tokens must be laid out [B * L, E], batch-major")
    _check_positive_int("top_k", top_k)
    _check_coeff(coeff)


def check_update_expert_bias_args(bias, tokens_per_expert, rate):
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.dim() != 1:
        raise TypeError("expert bias must be a 1-D floating-point tensor [E] (fp32 recommended)")
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.shape != bias.shape:
        raise ValueError(f"tokens_per_expert must have the shape of the bias {tuple(bias.shape)}")
    if tokens_per_expert.device != bias.device:
        raise ValueError(f"tokens_per_expert is on {tokens_per_expert.device} but bias on {bias.device}")
    if not bias.is_contiguous():
        raise ValueError("expert bias must be contiguous: it is updated in place")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate):
        raise TypeError(f"rate must be a finite Python number, got {rate!r}")


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
    n = num_tokens.to(acc) if isinstance(num_tokens, torch.Tensor) else float(num_tokens)
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
    """Router z-loss: coeff * mean_t(logsumexp(logits[t, :])^2). logits: [T, E] float."""
    _check_scores("logits", logits)
    _check_coeff(coeff)
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
