"""Reference expert activations with the routing-prob scale, the spec of `qmoe/kernels/activation.py`.

h: [R, 2F] for GLU activations (gate columns first, then linear columns), [R, F] otherwise;
probs: [R] fp32 routing probability of each permuted row (0 on padding rows) or None.
Returns act(h) * probs[:, None] in h's dtype, computed in fp32. Pure torch, so autograd gives
the backward (to h and to probs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GLU_ACTIVATIONS = ("swiglu", "geglu", "clamped_qgeglu")
ACTIVATIONS = GLU_ACTIVATIONS + ("relu2", "gelu")
QGEGLU_LIMIT = 7.0  # GPT-OSS clamps the gate above and the linear part to +-limit
QGEGLU_ALPHA = 1.702


def is_glu(activation: str) -> bool:
    return activation in GLU_ACTIVATIONS


def check_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
    return activation


def activation_fn(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h) in fp32 without the prob scale."""
    h = h.float()
    if activation == "relu2":
        return F.relu(h).square()
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    gate, linear = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(gate) * linear
    if activation == "geglu":
        return F.gelu(gate, approximate="tanh") * linear
    if activation == "clamped_qgeglu":
        gate = gate.clamp(max=QGEGLU_LIMIT)
        linear = linear.clamp(-QGEGLU_LIMIT, QGEGLU_LIMIT)
        return (linear + 1) * gate * torch.sigmoid(QGEGLU_ALPHA * gate)
    raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")


def scaled_activation(h: torch.Tensor, probs: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(h) * probs[:, None] -> [R, F] in h's dtype."""
    out = activation_fn(h, check_activation(activation))
    if probs is not None:
        out = out * probs.float()[:, None]
    return out.to(h.dtype)


def interleave_glu(w: torch.Tensor, block: int) -> torch.Tensor:
    """Logical FC1 rows [gate(F); linear(F)] -> alternating `block`-row gate/linear blocks.

    Works on the row dimension -2 of [.., 2F, K] weights and on the last dim of [.., 2F] biases
    (pass the bias as w[..., None] and squeeze back).
    """
    two_f = w.shape[-2]
    f = two_f // 2
    if two_f % 2 or f % block:
        raise ValueError(f"glu_interleave_size={block} must divide the FFN size {f}")
    gate, linear = w[..., :f, :], w[..., f:, :]
    g = gate.reshape(*w.shape[:-2], f // block, block, w.shape[-1])
    lin = linear.reshape(*w.shape[:-2], f // block, block, w.shape[-1])
    return torch.stack((g, lin), dim=-3).reshape(w.shape)


def deinterleave_glu(w: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of interleave_glu."""
    two_f = w.shape[-2]
    f = two_f // 2
    if two_f % 2 or f % block:
        raise ValueError(f"glu_interleave_size={block} must divide the FFN size {f}")
    v = w.reshape(*w.shape[:-2], f // block, 2, block, w.shape[-1])
    gate = v[..., 0, :, :].reshape(*w.shape[:-2], f, w.shape[-1])
    linear = v[..., 1, :, :].reshape(*w.shape[:-2], f, w.shape[-1])
    return torch.cat((gate, linear), dim=-2)
