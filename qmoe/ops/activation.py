"""Expert activation scaled by the routing prob: act(h) * probs[row], differentiable in both.

Dimensions: R permuted rows, F ffn columns (the activation's output width), k the GLU
interleave block.

On sm90+ GPUs the forward is one Triton launch and the backward another
(`qmoe.kernels.activation`); elsewhere, and for float64 h, `qmoe.reference.activation`. Either
way the Function saves only h and probs: the backward recomputes act(h) from h.
"""
from __future__ import annotations

import torch

from qmoe.reference import activation as reference
from qmoe.contracts.validate import check_scaled_activation_args
from qmoe.dispatch import ACTIVATION
from qmoe.ops.amp import autocast_off

__all__ = ["expert_activation"]


def _twin(name: str, *tensors: torch.Tensor):
    """The kernel or reference version of `name` for these tensors. The kernels compute in fp32 and
    take fp32 / bf16 / fp16 h; float64 h (double-precision checks) always runs the reference."""
    if tensors[0].dtype == torch.float64:
        return getattr(reference, name)
    return ACTIVATION.pick(name, *tensors)


class _ExpertActivation(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, h, probs, activation, glu_interleave_size):
        ctx.save_for_backward(h, probs)
        ctx.args = (activation, glu_interleave_size)
        return activation_forward(h, probs, activation, glu_interleave_size)

    @staticmethod
    @autocast_off
    def backward(ctx, da):
        h, probs = ctx.saved_tensors
        dh, dprobs = activation_backward(h, probs, da, *ctx.args, ctx.needs_input_grad[1])
        return dh if ctx.needs_input_grad[0] else None, dprobs, None, None


def activation_forward(h, probs, activation, glu_interleave_size, amax_offsets=None):
    """act(h) * probs without autograd: the one forward shared with consumers that rebuild the
    activation themselves (qmoe.ops.grouped_linear's recompute_activation). amax_offsets [G+1]:
    the result comes as `RowsWithAmax` (each row group's amax, reduced by the same launch)."""
    return _twin("scaled_activation_forward", h, probs)(h, probs, activation, glu_interleave_size, amax_offsets)


def activation_backward(h, probs, da, activation, glu_interleave_size, need_dprobs, amax_offsets=None):
    """(dh, dprobs in probs' dtype or None) of expert_activation: the one backward shared with
    activations fused into their consumer (qmoe.ops.grouped_linear's input_activation).
    amax_offsets [G+1]: dh comes as `RowsWithAmax` (each row group's amax of dh)."""
    need_dprobs = probs is not None and need_dprobs
    dh, dprobs = _twin("scaled_activation_backward", h, probs, da)(h, probs, da, activation, glu_interleave_size,
                                                                   need_dprobs, amax_offsets)
    return dh, dprobs.to(probs.dtype) if need_dprobs else None


def expert_activation(h: torch.Tensor, probs: torch.Tensor | None, activation: str,
                      glu_interleave_size: int | None = None) -> torch.Tensor:
    """act(h) * probs[:, None], computed in fp32 and returned in h's dtype.

    Args:
        h: [R, 2F] for GLU activations (swiglu, geglu, clamped_qgeglu): gate columns then linear
            columns, or with `glu_interleave_size=k` alternating k-column gate / linear blocks;
            [R, F] for relu2 and gelu. float32, bfloat16, float16 (or float64: reference only).
        probs: [R] float routing probability per row (0 on padding rows), or None (prob 1).
        activation: one of `qmoe.reference.activation.ACTIVATIONS`.
        glu_interleave_size: k, a positive divisor of F, or None / 0 (ignored for non-GLU activations).

    Returns: a [R, F] in h's dtype. Autograd gives dh (h's dtype and layout) and, when probs
    requires grad, dprobs[r] = sum_j da[r, j] * act(h)[r, j] (fp32 sum, returned in probs' dtype).

    Example:
        >>> h = torch.randn(6, 8, requires_grad=True)
        >>> probs = torch.rand(6, requires_grad=True)
        >>> expert_activation(h, probs, "swiglu").sum().backward()   # h.grad [6, 8], probs.grad [6]
    """
    check_scaled_activation_args(h, probs, activation, glu_interleave_size)
    return _ExpertActivation.apply(h, probs, activation, glu_interleave_size)
