"""Quantized dense linear: forward, dgrad and wgrad, each GEMM fed by the recipe's quantizers.

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

from qmoe.quant import QuantizedTensor


def gemm_nt(a: QuantizedTensor, b: QuantizedTensor, a_columnwise: bool, b_columnwise: bool,
            out_dtype: torch.dtype) -> torch.Tensor:
    """dequant(a) @ dequant(b)^T accumulated in fp32 (NUMERICS.md GEMM contract, reference path)."""
    a2 = a.dequantize(torch.float32, columnwise=a_columnwise)
    b2 = b.dequantize(torch.float32, columnwise=b_columnwise)
    return (a2.reshape(-1, a2.shape[-1]) @ b2.reshape(-1, b2.shape[-1]).t()).to(out_dtype)


def _drop_rowwise(qt: QuantizedTensor) -> QuantizedTensor:
    """Backward needs only the columnwise copy: free the rowwise one."""
    qt.rowwise_data = qt.rowwise_scale_inv = None
    return qt


class QuantizedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, q_input, q_weight, q_grad):
        k = weight.shape[1]
        x2d = x.reshape(-1, k)
        need_dgrad, need_wgrad = x.requires_grad, weight.requires_grad
        xq = q_input.quantize(x2d, rowwise=True, columnwise=need_wgrad)
        wq = q_weight.quantize(weight, rowwise=True, columnwise=need_dgrad)
        y = gemm_nt(xq, wq, False, False, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.q_grad = q_grad
        ctx.need = (need_dgrad, need_wgrad, bias is not None and bias.requires_grad)
        ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
        ctx.xq = _drop_rowwise(xq) if need_wgrad else None
        ctx.wq = _drop_rowwise(wq) if need_dgrad else None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        need_dgrad, need_wgrad, need_bias = ctx.need
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if need_dgrad or need_wgrad:
            gq = ctx.q_grad.quantize(dy2d, rowwise=need_dgrad, columnwise=need_wgrad)
            if need_dgrad:
                dx = gemm_nt(gq, ctx.wq, False, True, dy.dtype).reshape(ctx.x_shape)
            if need_wgrad:
                dw = gemm_nt(gq, ctx.xq, True, True, ctx.w_dtype)
        if need_bias:
            db = dy2d.float().sum(0).to(dy.dtype)
        ctx.xq = ctx.wq = None
        return dx, dw, db, None, None, None


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quantizers: dict):
    """y = x @ W^T + b with the recipe's quantizers {"input", "weight", "grad_output"}.

    x: [..., K] float; weight: [N, K]; bias: [N] or None. Differentiable in all three.
    """
    return QuantizedLinearFunction.apply(x, weight, bias, quantizers["input"], quantizers["weight"],
                                         quantizers["grad_output"])
