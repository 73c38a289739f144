"""Quantized dense linear: a grouped linear with one group, so it runs the grouped kernels.

Roles (NUMERICS.md): `input` and `weight` quantize the forward operands, `grad_output` the
gradient. In TN-GEMM terms every product is A @ B^T with both operands quantized along the
reduction dimension:
    fprop  y  = x        @ W^T      (x rowwise,  W rowwise)
    dgrad  dx = dy       @ W        (dy rowwise, W columnwise = W^T quantized along N)
    wgrad  dW = dy^T     @ x        (dy columnwise, x columnwise: both along the tokens)
Backward keeps the quantized columnwise copies, not the high-precision activations.
"""
from __future__ import annotations

import torch

from qmoe.ops.grouped_linear import grouped_linear


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quantizers: dict,
                     weight_cache=None):
    """y = x @ W^T + b with the recipe's quantizers {"input", "weight", "grad_output"}.

    x: [..., K] float; weight: [N, K]; bias: [N] or None. Differentiable in all three.
    weight_cache: `WeightCache.bind(the weight's parameters)` to keep the quantized weight across
    calls (`qmoe.quant.weight_cache`), or None.
    """
    k = weight.shape[1]
    x2d = x.reshape(-1, k)
    rows = torch.full((1,), x2d.shape[0], dtype=torch.int64, device=x.device)  # a fill: no host copy
    y = grouped_linear(x2d, rows, weight.unsqueeze(0), None if bias is None else bias.unsqueeze(0),
                       quantizers=quantizers, path="grouped", weight_cache=weight_cache)
    return y.reshape(*x.shape[:-1], weight.shape[0])
