"""Reference grouped GEMMs: the executable spec of `qmoe/kernels/grouped_gemm.py` (NUMERICS.md).

Dimension legend: T tokens (rows of the packed activations, sum of the split sizes, plus any
trailing padding rows that belong to no group), E experts (= groups), N output features,
K input features.

Every product is the NT GEMM of NUMERICS.md, `out = dequant(A_g) @ dequant(B_g)^T` per group,
with both operands quantized along the contraction dimension:

    fprop  y_g  = x_g    @ W_g^T   m_grouped_gemm(x,  W)                    x rowwise,  W rowwise
    dgrad  dx_g = dy_g   @ W_g     m_grouped_gemm(dy, W, b_columnwise=True) dy rowwise, W columnwise
    wgrad  dW_g = dy_g^T @ x_g     k_grouped_gemm(dy, x)                    dy and x columnwise

Weights are a per-expert quantized stack: `qmoe.ops.quantize_weights(w[E, N, K], quantizer)`
quantizes the rows of w.reshape(E*N, K) as a GroupedTensor with split sizes [N]*E, so every
expert has its own scales; its columnwise copy [K, E*N] holds each W_g^T quantized along N
(the dgrad operand). The wgrad operands' Hadamard transforms (NVFP4 RHT) act on both
operands along the tokens and cancel in the product; the reference multiplies the stored
(transformed) copies as they are.

Plain (unquantized) tensors follow the same contracts: a [T, K] with `split_sizes`, b [E, N, K];
k_grouped_gemm takes dy [T, N] and x [T, K] directly (no columnwise copies).

Arithmetic: operands dequantized to fp32, matmul in fp32, output cast once to `out_dtype`.
This loops over groups on the host (it reads split sizes); it is the spec, not the fast path.
"""
from __future__ import annotations

import torch

from qmoe.contracts.enums import Scaling, is_grouped, scaling_of
from qmoe.contracts.formats import e2m1_decode, unpack_e2m1
from qmoe.contracts.scales import tensor_factor
from qmoe.reference.quantize import expand_blocks

def host_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    off = [int(v) for v in offsets.tolist()]
    return list(zip(off[:-1], off[1:]))


def _offsets_of(split_sizes) -> torch.Tensor:
    s = torch.as_tensor(split_sizes, dtype=torch.int64)
    return torch.cat((s.new_zeros(1), s.cumsum(0)))


def reads_values(scaling, rows: int, groups: int) -> bool:
    """Twin of the kernels' route question: the reference multiplies dequantized codes and exact
    values alike, so no cast needs to write values for it."""
    return False


# ---------------------------------------------------------------- per-group fp32 operands

def _copy_parts(gt, columnwise: bool) -> list[torch.Tensor]:
    """Per-group fp32 values of gt's rowwise copies [M_g, K] or columnwise ones [K, M_g], held as
    codes or as exact values: GroupedTensor.dequantize reads either, per group."""
    whole = gt.dequantize(torch.float32, columnwise=columnwise)
    return [whole[:, s:e] if columnwise else whole[s:e] for s, e in host_bounds(gt.offsets)]


def _m_operands(a, b, split_sizes, b_columnwise):
    """(row bounds per group, [A_g fp32], [B_g fp32], total rows, out features)."""
    if is_grouped(a):
        bounds = host_bounds(a.offsets)
        a_parts = _copy_parts(a, False)
        b_parts = _copy_parts(b, b_columnwise)
        rows = a.shape[0]
    else:
        bounds = host_bounds(_offsets_of(split_sizes))
        a_parts = [a[s:e].float() for s, e in bounds]
        b_parts = [(w.t() if b_columnwise else w).float() for w in b]
        rows = a.shape[0]
    return bounds, a_parts, b_parts, rows, b_parts[0].shape[0]


def _nvfp4_columnwise(gt) -> list[torch.Tensor]:
    """Per-group fp32 columnwise copies of NVFP4 tokens, q * s_b * S_dec (NUMERICS.md).

    Decoded from the grouped layout directly: an odd-sized group starts mid-byte there, which
    per-group QuantizedTensors (two codes per byte) cannot hold.
    """
    values = e2m1_decode(unpack_e2m1(gt.columnwise_data))
    soff = [int(v) for v in gt.columnwise_scale_offsets.tolist()]
    s_dec = tensor_factor(gt, True)
    out = []
    for g, (s, e) in enumerate(host_bounds(gt.offsets)):
        scale = gt.columnwise_scale_inv[:, soff[g]:soff[g + 1]].float()
        out.append(values[:, s:e] * expand_blocks(scale, gt.quantizer.block, (values.shape[0], e - s)) * s_dec[g])
    return out


def _columnwise_parts(gt) -> list[torch.Tensor]:
    if scaling_of(gt) is Scaling.NVFP4 and gt.exact_values(True) is None:
        return _nvfp4_columnwise(gt)
    return _copy_parts(gt, True)


def _k_operands(a, b, split_sizes):
    """([dy_g^T fp32 [N, M_g]], [x_g^T fp32 [K, M_g]])."""
    if is_grouped(a):
        return _columnwise_parts(a), _columnwise_parts(b)
    bounds = host_bounds(_offsets_of(split_sizes))
    return [a[s:e].t().float() for s, e in bounds], [b[s:e].t().float() for s, e in bounds]


# ---------------------------------------------------------------- the two grouped GEMMs

def m_grouped_gemm(a, b, split_sizes=None, *, b_columnwise: bool = False, out_dtype=torch.bfloat16):
    """Tokens grouped along M: out[rows of group g] = dequant(A_g) @ dequant(B_g)^T.

    a: GroupedTensor with rowwise data, [T, K] (fprop: x; dgrad: dy with K = N), or a plain
       [T, K] tensor with `split_sizes`.
    b: weights: GroupedTensor from `qmoe.ops.quantize_weights` (E groups of N rows) or a plain
       [E, N, K] tensor. b_columnwise=False uses W_g [N, K] (fprop); True uses the columnwise
       copy W_g^T [K, N] (dgrad: a is dy [T, N], out is [T, K]).
    split_sizes: [E] ints, only for a plain `a` (a GroupedTensor carries its own).
    Returns out [T, out features] in out_dtype; rows that belong to no group are zeros.

    >>> out = m_grouped_gemm(torch.randn(5, 8), torch.randn(2, 3, 8), [2, 3], out_dtype=torch.float32)
    >>> out.shape
    torch.Size([5, 3])
    """
    bounds, a_parts, b_parts, rows, n_out = _m_operands(a, b, split_sizes, b_columnwise)
    device = a_parts[0].device if a_parts else b_parts[0].device
    out = torch.zeros((rows, n_out), dtype=torch.float32, device=device)
    for (s, e), ag, bg in zip(bounds, a_parts, b_parts):
        if e > s:
            out[s:e] = ag @ bg.t()
    return out.to(out_dtype)


def k_grouped_gemm(a, b, split_sizes=None, *, out_dtype=torch.bfloat16, out=None, accumulate: bool = False):
    """Grouped along the contraction (tokens): out[g] = dequant(dy_g)^T @ dequant(x_g) -> [E, N, K].

    a: dy: GroupedTensor with columnwise data ([N, T] copies), or a plain [T, N] tensor.
    b: x: GroupedTensor with columnwise data ([K, T] copies), same split sizes, or a plain [T, K].
    split_sizes: [E] ints, only for plain tensors.
    out: optional [E, N, K] tensor to write; with accumulate=True it is required and the
       result is added to it (fp32 `main_grad` accumulation): out += dW, summed in fp32.
    An expert with no tokens gets exact zeros (or, accumulating, its out is left unchanged).
    Returns out (a new [E, N, K] out_dtype tensor unless one was given).
    """
    a_parts, b_parts = _k_operands(a, b, split_sizes)
    if accumulate and out is None:
        raise ValueError("k_grouped_gemm(accumulate=True) adds into `out`: pass out=[E, N, K] tensor")
    n, k = a_parts[0].shape[0], b_parts[0].shape[0]
    res = torch.stack([ag @ bg.t() for ag, bg in zip(a_parts, b_parts)]) if a_parts else \
        torch.zeros((0, n, k), dtype=torch.float32)
    if out is None:
        return res.to(out_dtype)
    if accumulate:
        out.copy_((out.float() + res).to(out.dtype))
    else:
        out.copy_(res.to(out.dtype))
    return out
