"""Expert activation scaled by the routing prob: act(h) * probs[row], differentiable in both."""
from __future__ import annotations

import torch

from qmoe.reference.activation import check_activation, deinterleave_glu, is_glu, scaled_activation


def expert_activation(h: torch.Tensor, probs: torch.Tensor | None, activation: str,
                      glu_interleave_size: int | None = None) -> torch.Tensor:
    """h [R, 2F] (GLU: gate then linear, or interleaved in blocks of glu_interleave_size) or [R, F];
    probs [R] fp32 or None. Returns [R, F] in h's dtype, computed in fp32 (pure torch: autograd
    gives the backward to h and probs)."""
    check_activation(activation)
    if glu_interleave_size and is_glu(activation):
        h = deinterleave_glu(h.unsqueeze(-1), glu_interleave_size).squeeze(-1) if h.dim() == 1 else \
            deinterleave_glu(h.t(), glu_interleave_size).t()
    return scaled_activation(h, probs, activation)
