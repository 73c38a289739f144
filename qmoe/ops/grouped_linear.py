"""Grouped linear (the experts' GEMMs) as one autograd Function: quantize, GEMM, bias, backward.

Dimensions: R packed rows (tokens of all experts, each group padded to the recipe's
align_size), E experts, K in features, N out features.

    y[rows of g] = x_g @ W_g^T (+ bias_g, times scales[row] with scale_bias)

Paths (DESIGN.md): "grouped" quantizes all groups into one GroupedTensor and runs one grouped
GEMM (split sizes stay on the device); "split" reads the split sizes on the host and quantizes
and multiplies every group on its own: the cross-check, and the fallback. Weights are quantized
once per forward (rowwise for fprop plus columnwise for dgrad, in one call) and reused by dgrad;
backward keeps the quantized columnwise copies of x, not x itself.

`input_activation` fuses the expert MLP's activation into FC2: the input is act(h) * probs,
quantized straight from h on the grouped path with a recipe (GroupedTensor.quantize of an
ActivatedRows), so the [R, F] activation output is neither written nor read back; the backward
turns FC2's dgrad into dh and dprobs with the activation's own backward. Elsewhere the
activation runs first (qmoe.ops.expert_activation): the results are the same.
"""
from __future__ import annotations

import torch

from qmoe.dispatch import BIAS
from qmoe.ops.activation import activation_backward, expert_activation
from qmoe.ops.grouped_gemm import host_readable, k_grouped_gemm, m_grouped_gemm, quantize_weights
from qmoe.quant import GroupedTensor, QuantizedTensor
from qmoe.contracts.carriers import ActivatedRows
from qmoe.contracts.validate import check_scaled_activation_args


def gemm_nt(a: QuantizedTensor, b: QuantizedTensor, a_columnwise: bool, b_columnwise: bool,
            out_dtype: torch.dtype) -> torch.Tensor:
    """dequant(a) @ dequant(b)^T accumulated in fp32 (the NUMERICS.md contract; the split path)."""
    a2 = a.dequantize(torch.float32, columnwise=a_columnwise)
    b2 = b.dequantize(torch.float32, columnwise=b_columnwise)
    return (a2.reshape(-1, a2.shape[-1]) @ b2.reshape(-1, b2.shape[-1]).t()).to(out_dtype)


def absorb_tail(split_sizes: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Split sizes whose last group also takes the rows past their sum (device op, no sync).

    `moe_permute` returns a static row count with unused zero rows at the end; giving them to the
    last group changes no amax, scale or product of the real rows.
    """
    tail = num_rows - split_sizes.sum()
    return torch.cat((split_sizes[:-1], (split_sizes[-1:] + tail)))


def _offsets(split_sizes: torch.Tensor) -> torch.Tensor:
    return torch.cat((split_sizes.new_zeros(1), split_sizes.cumsum(0)))


def _drop_rowwise(t):
    t.rowwise_data = t.rowwise_scale_inv = None
    return t


class _SplitOperands:
    """Per-group quantized tensors of the split path (host split sizes)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.bounds = []
        start = 0
        for m in sizes:
            self.bounds.append((start, start + m))
            start += m


def _split_quantize(x, bounds, q, rowwise, columnwise):
    e = len(bounds)
    return [q.for_group(g, e, x.device).quantize(x[a:b], rowwise=rowwise, columnwise=columnwise) if b > a else None
            for g, (a, b) in enumerate(bounds)]


def _split_weights(w, q, rowwise, columnwise):
    e = w.shape[0]
    return [q.for_group(g, e, w.device).quantize(w[g], rowwise=rowwise, columnwise=columnwise) for g in range(e)]


class GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_sizes, weight, bias, scales, quantizers, path, wgrad_sink, quantized_input=None,
                act_probs=None, activation=None):
        # activation: (name, glu_interleave_size) when x is h and the input is act(h) * act_probs
        # (grouped path with quantizers only: grouped_linear runs the activation first otherwise)
        ctx.activation = activation
        need_dgrad = ctx.needs_input_grad[0] or (activation is not None and ctx.needs_input_grad[9])
        need_wgrad = ctx.needs_input_grad[2]
        h = x if activation is not None else None
        e, n, _ = weight.shape
        split_sizes = absorb_tail(split_sizes, x.shape[0])
        ctx.path, ctx.quantizers, ctx.wgrad_sink = path, quantizers, wgrad_sink
        ctx.w_dtype, ctx.has_bias, ctx.has_scales = weight.dtype, bias is not None, scales is not None
        offsets = _offsets(split_sizes)
        if path == "split":
            ctx.split = _SplitOperands([int(s) for s in split_sizes.tolist()])  # the split path reads the host
        if quantizers is None:
            w = weight.to(x.dtype)
            if path == "grouped":
                y = m_grouped_gemm(x, w, split_sizes, out_dtype=x.dtype)
            else:
                y = torch.cat([x[a:b] @ w[g].t() for g, (a, b) in enumerate(ctx.split.bounds)], 0)
            ctx.save_for_backward(x if need_wgrad else None, w if need_dgrad else None, split_sizes, offsets,
                                  bias, scales, None, None)
        else:
            q_in, q_w = quantizers["input"], quantizers["weight"]
            if path == "grouped":
                if activation is not None:
                    xq = GroupedTensor.quantize(ActivatedRows(h, act_probs, *activation), split_sizes, q_in,
                                                rowwise=True, columnwise=need_wgrad, validate=False)
                elif quantized_input is None:
                    xq = GroupedTensor.quantize(x, split_sizes, q_in, rowwise=True, columnwise=need_wgrad,
                                                validate=False)
                else:  # rows quantized before dispatch; wgrad's columnwise copy comes from x's values
                    xq = GroupedTensor.from_rows(quantized_input, split_sizes)
                    if need_wgrad:
                        xq.columnwise_data, xq.columnwise_scale_inv = _columnwise(x, split_sizes, q_in)
                wq = quantize_weights(weight, q_w, rowwise=True, columnwise=need_dgrad)
                y = m_grouped_gemm(xq, wq, out_dtype=x.dtype)
                ctx.xq = _drop_rowwise(xq) if need_wgrad else None
                ctx.wq = _drop_rowwise(wq) if need_dgrad else None
            else:
                if quantized_input is None:
                    xs = _split_quantize(x, ctx.split.bounds, q_in, True, need_wgrad)
                else:
                    xs = GroupedTensor.from_rows(quantized_input, split_sizes).split()
                    cols = _split_quantize(x, ctx.split.bounds, q_in, False, True) if need_wgrad else None
                    for t, c in zip(xs, cols or ()):
                        if c is not None:
                            t.columnwise_data, t.columnwise_scale_inv = c.columnwise_data, c.columnwise_scale_inv
                ws = _split_weights(weight, q_w, True, need_dgrad)
                y = x.new_zeros(x.shape[0], n)
                for g, (a, b) in enumerate(ctx.split.bounds):
                    if b > a:
                        y[a:b] = gemm_nt(xs[g], ws[g], False, False, x.dtype)
                ctx.xq = [_drop_rowwise(t) if t is not None else None for t in xs] if need_wgrad else None
                ctx.wq = [_drop_rowwise(t) for t in ws] if need_dgrad else None
            ctx.save_for_backward(None, None, split_sizes, offsets, bias, scales, h, act_probs)
        if bias is not None:
            y = BIAS.pick("grouped_bias_forward", y)(y, bias, offsets, scales)
        ctx.x_shape = x.shape if activation is None else xq.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, split_sizes, offsets, bias, scales, h, act_probs = ctx.saved_tensors
        need_dprobs = ctx.activation is not None and ctx.needs_input_grad[9]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0] or need_dprobs, ctx.needs_input_grad[2]
        dy = dy.contiguous()
        dx = dw = dbias = dscales = None
        if ctx.quantizers is None:
            dy_c = dy.to(w.dtype if w is not None else x.dtype)
            if need_dgrad:
                dx = (m_grouped_gemm(dy_c, w, split_sizes, b_columnwise=True, out_dtype=dy.dtype)
                      if ctx.path == "grouped" else _split_dgrad_plain(dy_c, w, ctx.split, ctx.x_shape))
            if need_wgrad:
                def wgrad(dy_c=dy_c, x=x):
                    if ctx.path == "grouped":
                        return k_grouped_gemm(dy_c, x, split_sizes, out_dtype=_wgrad_dtype(ctx.w_dtype))
                    return torch.stack([dy_c[a:b].float().t() @ x[a:b].float() for a, b in ctx.split.bounds])
        else:
            q_grad = ctx.quantizers["grad_output"]
            if ctx.path == "grouped":
                gq = GroupedTensor.quantize(dy, split_sizes, q_grad, rowwise=need_dgrad, columnwise=need_wgrad,
                                            validate=False)
                if need_dgrad:
                    dx = m_grouped_gemm(gq, ctx.wq, b_columnwise=True, out_dtype=dy.dtype)
                if need_wgrad:
                    def wgrad(gq=gq, xq=ctx.xq):
                        return k_grouped_gemm(gq, xq, out_dtype=_wgrad_dtype(ctx.w_dtype))
            else:
                gs = _split_quantize(dy, ctx.split.bounds, q_grad, need_dgrad, need_wgrad)
                if need_dgrad:
                    dx = dy.new_zeros(ctx.x_shape)
                    for g, (a, b) in enumerate(ctx.split.bounds):
                        if b > a:
                            dx[a:b] = gemm_nt(gs[g], ctx.wq[g], False, True, dy.dtype)
                if need_wgrad:
                    def wgrad(gs=gs, xs=ctx.xq, shape=(len(ctx.split.sizes), dy.shape[1], ctx.x_shape[1])):
                        out = torch.zeros(shape, dtype=torch.float32, device=dy.device)
                        for g, (a, b) in enumerate(ctx.split.bounds):
                            if b > a:
                                out[g] = gemm_nt(gs[g], xs[g], True, True, torch.float32)
                        return out
        if need_wgrad:
            if ctx.wgrad_sink is not None:
                ctx.wgrad_sink.append(wgrad)  # delay_wgrad_compute: the module runs it in backward_dw()
            else:
                dw = wgrad().to(ctx.w_dtype)
        if ctx.has_bias and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4]):
            fn = BIAS.pick("grouped_bias_backward", dy)
            dbias, dscales = fn(dy, bias, offsets, scales, ctx.needs_input_grad[4])
            dbias = dbias.to(bias.dtype) if ctx.needs_input_grad[3] else None
            dscales = dscales.to(scales.dtype) if dscales is not None else None
        ctx.xq = ctx.wq = None
        dprobs = None
        if ctx.activation is not None and dx is not None:  # dx is the activation output's gradient
            dx, dprobs = activation_backward(h, act_probs, dx, *ctx.activation, need_dprobs)
        return dx if ctx.needs_input_grad[0] else None, None, dw, dbias, dscales, None, None, None, None, dprobs, None


def _wgrad_dtype(w_dtype: torch.dtype) -> torch.dtype:
    """The grouped wgrad GEMM writes the weight's dtype directly (no fp32 [E, N, K] round trip:
    at the DeepSeek-V3 shard that pass cost ~2 ms a step). It accumulates in fp32 either way;
    fp32 output also promotes FP8 tensor-core partial sums every K step (NUMERICS.md: bf16
    output <= 1e-2, fp32 accumulation <= 1e-3)."""
    return w_dtype if w_dtype in (torch.bfloat16, torch.float16) else torch.float32


def _columnwise(x, split_sizes, q):
    """The columnwise data and scales of x's groups, quantized from x's values."""
    gt = GroupedTensor.quantize(x, split_sizes, q, rowwise=False, columnwise=True, validate=False)
    return gt.columnwise_data, gt.columnwise_scale_inv


def _split_dgrad_plain(dy, w, split, x_shape):
    dx = dy.new_zeros(x_shape)
    for g, (a, b) in enumerate(split.bounds):
        if b > a:
            dx[a:b] = dy[a:b] @ w[g]
    return dx


def grouped_linear(x: torch.Tensor, split_sizes: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   scales: torch.Tensor | None = None, quantizers: dict | None = None, path: str = "grouped",
                   wgrad_sink: list | None = None, quantized_input: QuantizedTensor | None = None,
                   input_activation: tuple | None = None) -> torch.Tensor:
    """y [R, N] = grouped x [R, K] @ weight[g]^T (+ bias[g] (* scales[row])).

    split_sizes: [E] int on x's device; rows past their sum join the last group (absorb_tail).
    weight: [E, N, K]; bias: [E, N] or None; scales: [R] per-row bias scale or None.
    quantizers: {"input", "weight", "grad_output"} from the active recipe, or None (high precision).
    path: "grouped" or "split". wgrad_sink: a list to defer weight gradients into (callables
    returning [E, N, K] in the weight's dtype or fp32); None computes them in backward.
    quantized_input: x's rows already quantized rowwise (`Quantizer.quantize_for_dispatch`, e.g.
    before an expert-parallel all-to-all), used by the forward GEMM instead of quantizing x;
    x still takes the gradient, and the weight gradient's columnwise copy is quantized from x's
    values (pass the dequantized rows as x). Needs `quantizers`.
    input_activation: (activation, probs, glu_interleave_size): x is h ([R, 2K] for GLU
    activations, [R, K] otherwise) and the input is `expert_activation(h, probs, activation,
    glu_interleave_size)`; fused into the input's quantization on the grouped path with
    quantizers (see the module docstring). h and probs get their gradients.
    """
    if path == "split" or host_readable(split_sizes):
        # host-readable sizes are checked (the split path reads them anyway); device sizes on the
        # grouped path stay unread (no host sync) and are trusted
        host = split_sizes.tolist()
        if any(s < 0 for s in host) or sum(host) > x.shape[0]:
            raise ValueError(f"split_sizes must be non-negative and sum to at most the {x.shape[0]} rows of x, "
                             f"got {host}")
    if quantized_input is not None:
        if quantizers is None:
            raise ValueError("quantized_input needs a recipe's quantizers (run inside qmoe.autocast)")
        if not isinstance(quantized_input, QuantizedTensor) or quantized_input.shape_2d != tuple(x.shape):
            raise ValueError(f"quantized_input must be a QuantizedTensor of x's shape {tuple(x.shape)}, got "
                             f"{getattr(quantized_input, 'shape', type(quantized_input).__name__)}")
    if input_activation is not None:
        activation, probs, glu = input_activation
        check_scaled_activation_args(x, probs, activation, glu)
        if quantized_input is not None:
            raise ValueError("input_activation and quantized_input exclude each other: FC2's input is computed here")
        if quantizers is None or path != "grouped":  # nothing to fuse into: the activation runs first
            x = expert_activation(x, probs, activation, glu)
        else:
            return GroupedLinearFunction.apply(x, split_sizes, weight, bias, scales, quantizers, path, wgrad_sink,
                                               None, probs, (activation, glu))
    return GroupedLinearFunction.apply(x, split_sizes, weight, bias, scales, quantizers, path, wgrad_sink,
                                       quantized_input)
