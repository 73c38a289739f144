"""The reference's grouped ops as torch.compile sees them: custom ops, and no host reads outside them.

The grouped reference (grouped_quantize, grouped_gemm) is the spec: it loops over the groups
on the host, reading the split sizes. torch.compile cannot trace that (a data-dependent
`.tolist()` breaks the graph), so while compiling, `qmoe.dispatch` returns the
twins below instead: same names, signatures and results, with every host-looping step behind a
`torch.library.custom_op` (namespace `qmoe_ref`) whose fake implementation gives the static
output shapes, exactly as the Triton kernels are `qmoe::` ops on the GPU. Eager runs never come
here.

- Grouped quantization: the reference function itself, run inside the op. Formats travel as
  their FP8 dtype and scale modes as their value (custom ops take no Python objects); outputs
  not asked for travel as empty tensors and come back as None, as the kernels' ops do.
- Grouped GEMMs: the operands are dequantized from their grouped layouts with device-side
  gathers (what `GroupedTensor.split()` + `dequantize` compute per group, bit for bit), then
  the plain fp32 reference GEMM runs inside the op (`ag @ bg.t()` per group, as in eager).

Dimension legend: M rows of all groups, K columns, G groups, E experts, N out features, T tokens.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from qmoe.contracts.carriers import row_groups
from qmoe.contracts.enums import Scaling, is_grouped, scaling_of
from qmoe.contracts.formats import ScaleMode, e2m1_decode, e8m0_to_float, fp8_format, nvfp4_tensor_scale, unpack_e2m1
from qmoe.reference import grouped_gemm as _gemm
from qmoe.reference import grouped_quantize as _gq
from qmoe.reference.grouped_quantize import scale_capacity
from qmoe.reference.quantize import expand_blocks

_E4M3, _E8M0, _FP32 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float32


def _empty(x: torch.Tensor, shape, dtype, wanted: bool = True) -> torch.Tensor:
    """An output of `shape`, or the empty fp32 placeholder of one not asked for."""
    return x.new_empty(shape, dtype=dtype) if wanted else x.new_empty((0,), dtype=_FP32)


def _present(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return t if t is not None else _empty(x, (0,), _FP32, False)


def _or_none(t: torch.Tensor, wanted: bool):
    return t if wanted else None


def _block_scale_shapes(m: int, k: int, g: int, block: tuple[int, int]):
    """Grouped scale shapes (rowwise, columnwise) of blocks (br, bc), per grouped_quantize's layouts."""
    br, bc = block
    nk, cap = -(-k // bc), scale_capacity(m, g, bc)
    return ((m, nk), (k, cap)) if br == 1 else ((cap, nk), (nk, cap))


# ---------------------------------------------------------------- grouped quantization

@custom_op("qmoe_ref::grouped_tensor_amax", mutates_args=())
def _amax_op(x: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    return _gq.grouped_tensor_amax(x, split_sizes)


@_amax_op.register_fake
def _(x, split_sizes):
    return _empty(x, (split_sizes.numel(),), _FP32)


@custom_op("qmoe_ref::grouped_quantize_fp8_tensorwise", mutates_args=())
def _fp8_tensorwise_op(x: torch.Tensor, split_sizes: torch.Tensor, scales: torch.Tensor, fp8_dtype: torch.dtype,
                       rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col, amax = _gq.grouped_quantize_fp8_tensorwise(x, split_sizes, scales, fp8_format(fp8_dtype), rowwise,
                                                         columnwise)
    return _present(row, x), _present(col, x), amax


@_fp8_tensorwise_op.register_fake
def _(x, split_sizes, scales, fp8_dtype, rowwise, columnwise):
    m, k = x.shape
    return (_empty(x, (m, k), fp8_dtype, rowwise), _empty(x, (k, m), fp8_dtype, columnwise),
            _empty(x, (split_sizes.numel(),), _FP32))


@custom_op("qmoe_ref::grouped_quantize_fp8_block", mutates_args=())
def _fp8_block_op(x: torch.Tensor, split_sizes: torch.Tensor, block_rows: int, block_cols: int,
                  fp8_dtype: torch.dtype, power_2_scale: bool, amax_epsilon: float, rowwise: bool,
                  columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = _gq.grouped_quantize_fp8_block(x, split_sizes, block_rows, block_cols, fp8_format(fp8_dtype),
                                           power_2_scale, amax_epsilon, rowwise, columnwise)
    return tuple(_present(t, x) for t in parts)


@_fp8_block_op.register_fake
def _(x, split_sizes, block_rows, block_cols, fp8_dtype, power_2_scale, amax_epsilon, rowwise, columnwise):
    m, k = x.shape
    rs, cs = _block_scale_shapes(m, k, split_sizes.numel(), (block_rows, block_cols))
    return (_empty(x, (m, k), fp8_dtype, rowwise), _empty(x, rs, _FP32, rowwise),
            _empty(x, (k, m), fp8_dtype, columnwise), _empty(x, cs, _FP32, columnwise))


@custom_op("qmoe_ref::grouped_quantize_mxfp8", mutates_args=())
def _mxfp8_op(x: torch.Tensor, split_sizes: torch.Tensor, fp8_dtype: torch.dtype, scale_mode: str, rowwise: bool,
              columnwise: bool, row_values: bool,
              col_values: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    values = ("rowwise",) * row_values + ("columnwise",) * col_values
    parts = _gq.grouped_quantize_mxfp8(x, split_sizes, fp8_format(fp8_dtype), ScaleMode(scale_mode), rowwise,
                                       columnwise, values)
    return tuple(_present(t, x) for t in parts)


@_mxfp8_op.register_fake
def _(x, split_sizes, fp8_dtype, scale_mode, rowwise, columnwise, row_values, col_values):
    m, k = x.shape
    rs, cs = _block_scale_shapes(m, k, split_sizes.numel(), (1, 32))
    return (_empty(x, (m, k), torch.bfloat16 if row_values else fp8_dtype, rowwise),
            _empty(x, rs, _E8M0, rowwise and not row_values),
            _empty(x, (m, k) if col_values else (k, m), torch.bfloat16 if col_values else fp8_dtype, columnwise),
            _empty(x, cs, _E8M0, columnwise and not col_values))


@custom_op("qmoe_ref::grouped_quantize_nvfp4", mutates_args=())
def _nvfp4_op(x: torch.Tensor, split_sizes: torch.Tensor, block_2d: bool, rowwise: bool, columnwise: bool,
              rht: bool, stochastic: bool, row_values: bool, col_values: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    values = ("rowwise",) * row_values + ("columnwise",) * col_values
    parts = list(_gq.grouped_quantize_nvfp4(x, split_sizes, block_2d, rowwise, columnwise, rht, stochastic, None,
                                            values))
    if col_values and not block_2d:
        parts[3] = parts[3].t()  # its [K, M] buffer: an op returns no view
    return tuple(_present(t, x) for t in parts)


@_nvfp4_op.register_fake
def _(x, split_sizes, block_2d, rowwise, columnwise, rht, stochastic, row_values, col_values):
    m, k = x.shape
    g = split_sizes.numel()
    rs, cs = _block_scale_shapes(m, k, g, (16, 16) if block_2d else (1, 16))
    return (_empty(x, (m, k) if row_values else (m, k // 2), torch.bfloat16 if row_values else torch.uint8, rowwise),
            _empty(x, rs, _E4M3, rowwise and not row_values), _empty(x, (g,), _FP32),
            _empty(x, ((m, k) if block_2d else (k, m)) if col_values else (k, m // 2),
                   torch.bfloat16 if col_values else torch.uint8, columnwise),
            _empty(x, cs, _E4M3, columnwise and not col_values), _empty(x, (g,), _FP32, columnwise))


def grouped_tensor_amax(x, split_sizes):
    return torch.ops.qmoe_ref.grouped_tensor_amax(x, split_sizes)


def grouped_quantize_fp8_tensorwise(x, split_sizes, scales, fmt, rowwise=True, columnwise=False):
    row, col, amax = torch.ops.qmoe_ref.grouped_quantize_fp8_tensorwise(x, split_sizes, scales, fmt.dtype, rowwise,
                                                                        columnwise)
    return _or_none(row, rowwise), _or_none(col, columnwise), amax


def grouped_quantize_fp8_block(x, split_sizes, block_rows, block_cols, fmt, power_2_scale=True, amax_epsilon=0.0,
                               rowwise=True, columnwise=False):
    row, rs, col, cs = torch.ops.qmoe_ref.grouped_quantize_fp8_block(
        x, split_sizes, block_rows, block_cols, fmt.dtype, power_2_scale, float(amax_epsilon), rowwise, columnwise)
    return _or_none(row, rowwise), _or_none(rs, rowwise), _or_none(col, columnwise), _or_none(cs, columnwise)


def grouped_quantize_mxfp8(x, split_sizes, fmt, scale_mode=ScaleMode.ROUND_UP, rowwise=True, columnwise=False,
                           values=()):
    row_values, col_values = rowwise and "rowwise" in values, columnwise and "columnwise" in values
    row, rs, col, cs = torch.ops.qmoe_ref.grouped_quantize_mxfp8(x, split_sizes, fmt.dtype, scale_mode.value,
                                                                 rowwise, columnwise, row_values, col_values)
    return (_or_none(row, rowwise), _or_none(rs, rowwise and not row_values), _or_none(col, columnwise),
            _or_none(cs, columnwise and not col_values))


def grouped_quantize_nvfp4(x, split_sizes, block_2d=False, rowwise=True, columnwise=False, rht=False,
                           stochastic=False, generator=None, values=()):
    if stochastic and generator is not None:
        # a Generator cannot enter a custom op: run the spec as it is (torch.compile breaks the graph there)
        return _gq.grouped_quantize_nvfp4(x, split_sizes, block_2d, rowwise, columnwise, rht, stochastic, generator,
                                          values)
    row_values, col_values = rowwise and "rowwise" in values, columnwise and "columnwise" in values
    row, rs, amax, col, cs, camax = torch.ops.qmoe_ref.grouped_quantize_nvfp4(
        x, split_sizes, block_2d, rowwise, columnwise, rht, stochastic, row_values, col_values)
    if col_values and not block_2d:
        col = col.t()
    return (_or_none(row, rowwise), _or_none(rs, rowwise and not row_values), amax, _or_none(col, columnwise),
            _or_none(cs, columnwise and not col_values), _or_none(camax, columnwise))


# ---------------------------------------------------------------- grouped GEMMs

@custom_op("qmoe_ref::m_grouped_gemm", mutates_args=())
def _m_gemm_op(a: torch.Tensor, b: torch.Tensor, split_sizes: torch.Tensor, b_columnwise: bool,
               out_dtype: torch.dtype) -> torch.Tensor:
    return _gemm.m_grouped_gemm(a, b, split_sizes, b_columnwise=b_columnwise, out_dtype=out_dtype)


@_m_gemm_op.register_fake
def _(a, b, split_sizes, b_columnwise, out_dtype):
    return _empty(a, (a.shape[0], b.shape[2] if b_columnwise else b.shape[1]), out_dtype)


@custom_op("qmoe_ref::k_grouped_gemm", mutates_args=())
def _k_gemm_op(a: torch.Tensor, b: torch.Tensor, split_sizes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _gemm.k_grouped_gemm(a, b, split_sizes, out_dtype=out_dtype)


@_k_gemm_op.register_fake
def _(a, b, split_sizes, out_dtype):
    return _empty(a, (split_sizes.numel(), a.shape[1], b.shape[1]), out_dtype)


@custom_op("qmoe_ref::e8m0_to_float", mutates_args=())
def _e8m0_op(scale: torch.Tensor) -> torch.Tensor:
    # an op of its own: Inductor's CPU code generation has no E8M0 type to read the bytes with
    return e8m0_to_float(scale)


@_e8m0_op.register_fake
def _(scale):
    return scale.new_empty(scale.shape, dtype=_FP32)


def dequantize_grouped(gt, columnwise: bool = False) -> torch.Tensor:
    """fp32 values of a GroupedTensor from its grouped layout, on the device (no host read).

    rowwise: [M, K]; columnwise: the [K, M] copies. Each element is computed as
    `GroupedTensor.split()[g].dequantize(...)` computes it (codes x block scale x group factor,
    in that order), with every token's scales gathered through its group's offsets. A copy held
    as exact values is GroupedTensor.dequantize's to read: it takes their group factors on the
    device as well.
    """
    if gt.exact_values(columnwise) is not None:
        return gt.dequantize(torch.float32, columnwise=columnwise)
    scaling = scaling_of(gt)
    data, scale = (gt.columnwise_data, gt.columnwise_scale_inv) if columnwise else \
        (gt.rowwise_data, gt.rowwise_scale_inv)
    values = e2m1_decode(unpack_e2m1(data)) if scaling is Scaling.NVFP4 else data.float()
    tokens = values.shape[1] if columnwise else values.shape[0]
    groups = row_groups(gt.offsets, tokens).clamp(max=gt.num_groups - 1)  # rows past the groups: any scale
    if scaling is not Scaling.TENSOR:
        s = torch.ops.qmoe_ref.e8m0_to_float(scale) if scaling is Scaling.MX else scale.float()
        values = values * _token_scales(gt, s, groups, columnwise, tuple(values.shape))
    if scaling in (Scaling.TENSOR, Scaling.NVFP4):
        if scaling is Scaling.TENSOR:
            factor = scale.float()
        else:
            factor = 1.0 / nvfp4_tensor_scale(gt.columnwise_amax if columnwise else gt.amax)
        factor = factor[groups]
        values = values * (factor[None, :] if columnwise else factor[:, None])
    return values


def _token_scales(gt, s: torch.Tensor, groups: torch.Tensor, columnwise: bool, shape) -> torch.Tensor:
    """Block scales s (grouped layout) expanded to every element of `shape`."""
    br, bc = gt.quantizer.block
    if br == 1 and not columnwise:  # per-row blocks along K: independent of the groups
        return expand_blocks(s, (1, bc), shape)
    tokens = torch.arange(shape[1] if columnwise else shape[0], device=s.device)
    along = br if not columnwise else bc  # blocks along the tokens
    offsets = gt.columnwise_scale_offsets if br == 1 else gt.rowwise_scale_offsets
    index = offsets[groups] + (tokens - gt.offsets[groups]) // along  # each token's scale row / column
    if not columnwise:  # 2-D blocks, rowwise: scale rows [cap, ceil(K/bc)]
        return expand_blocks(s[index], (1, bc), shape)
    s = s[:, index]  # [K or ceil(K/br), M]
    return s if br == 1 else expand_blocks(s, (br, 1), shape)


def _weights(b, columnwise: bool) -> torch.Tensor:
    """Every expert's W_g [N, K] (or W_g^T [K, N] columnwise) as a contiguous fp32 [E, ., .]."""
    e = b.num_groups
    n, k = b.shape[0] // e, b.shape[1]
    w = dequantize_grouped(b, columnwise)
    return w.view(k, e, n).permute(1, 0, 2).contiguous() if columnwise else w.view(e, n, k)


def m_grouped_gemm(a, b, split_sizes=None, *, b_columnwise: bool = False, out_dtype=torch.bfloat16):
    if is_grouped(a):
        a, b, split_sizes = dequantize_grouped(a), _weights(b, b_columnwise), a.split_sizes
        b_columnwise = False  # _weights already holds the operand the GEMM multiplies by
    return torch.ops.qmoe_ref.m_grouped_gemm(a, b, torch.as_tensor(split_sizes, device=a.device), b_columnwise,
                                             out_dtype)


def k_grouped_gemm(a, b, split_sizes=None, *, out_dtype=torch.bfloat16, out=None, accumulate: bool = False):
    if accumulate and out is None:
        raise ValueError("k_grouped_gemm(accumulate=True) adds into `out`: pass out=[E, N, K] tensor")
    if is_grouped(a):
        a, b, split_sizes = dequantize_grouped(a, True).t(), dequantize_grouped(b, True).t(), a.split_sizes
    splits = torch.as_tensor(split_sizes, device=a.device)
    if out is None:
        return torch.ops.qmoe_ref.k_grouped_gemm(a, b, splits, out_dtype)
    res = torch.ops.qmoe_ref.k_grouped_gemm(a, b, splits, _FP32)
    out.copy_((out.float() + res).to(out.dtype) if accumulate else res.to(out.dtype))
    return out


# (family, name) -> twin, for qmoe.dispatch while compiling
TWINS = {("grouped_quantize", f.__name__): f for f in (
    grouped_tensor_amax, grouped_quantize_fp8_tensorwise, grouped_quantize_fp8_block, grouped_quantize_mxfp8,
    grouped_quantize_nvfp4)}
TWINS.update({("grouped_gemm", f.__name__): f for f in (m_grouped_gemm, k_grouped_gemm)})
