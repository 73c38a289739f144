"""Reference grouped quantization: each group quantized exactly as if alone (NUMERICS.md).

Input x [sum(M_g), K] packs the groups' rows; `split_sizes` [G] gives M_g. Outputs use the
grouped layouts that the grouped kernels (`qmoe/kernels/grouped_quantize.py`) write:
- data: rowwise [sum M, K] (NVFP4 [sum M, K/2]), columnwise [K, sum M] (NVFP4 [K, sum M / 2],
  packed globally, so a group may start in the middle of a byte);
- per-tensor scales and amaxes: [G];
- 1-D block scales: rowwise [sum M, ceil(K/b)]; columnwise [K, sum M // b + G], group g's
  ceil(M_g/b) columns starting at `group_scale_offsets(split_sizes, b)[g]`;
- 2-D block scales: rowwise [sum M // b + G, ceil(K/b)] (rows at the same offsets), columnwise
  its transpose. Scale entries no group uses are zero.
x may also be an `ActivatedRows` (act(h) * probs, the expert activation fused into FC2's input
quantization): its values are quantized. This loops over groups on the host; it is the spec,
not the fast path.
"""
from __future__ import annotations

import torch

from qmoe.contracts.formats import ElementFormat, ScaleMode, e2m1_decode, pack_e2m1, unpack_e2m1
from qmoe.reference import quantize as q
from qmoe.reference import quantize_nvfp4 as q4
from qmoe.reference.activation import rows_of


def group_scale_offsets(split_sizes: torch.Tensor, block: int) -> torch.Tensor:
    """[G+1] start of each group's scale blocks along the grouped dimension (device op, no sync)."""
    counts = (split_sizes.to(torch.int64) + block - 1) // block
    return torch.cat((counts.new_zeros(1), counts.cumsum(0)))


def scale_capacity(total_rows: int, num_groups: int, block: int) -> int:
    """Static upper bound of sum_g ceil(M_g / block) over any split of total_rows into num_groups."""
    return total_rows // block + num_groups


def _bounds(split_sizes: torch.Tensor):
    sizes = [int(s) for s in split_sizes.tolist()]
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    return list(zip(starts[:-1], starts[1:]))


def grouped_tensor_amax(x: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """max|x_g| per group -> [G] fp32 (0 for an empty group)."""
    x = rows_of(x)
    return torch.stack([q.tensor_amax(x[a:b]) for a, b in _bounds(split_sizes)]) if len(split_sizes) else \
        x.new_zeros(0, dtype=torch.float32)


def grouped_quantize_fp8_tensorwise(x, split_sizes, scales, fmt: ElementFormat, rowwise=True, columnwise=False):
    """Per-group scales [G] -> (row [sum M, K], col [K, sum M], amax [G])."""
    x = rows_of(x)
    rows, cols, amaxes = [], [], []
    for g, (a, b) in enumerate(_bounds(split_sizes)):
        r, c, m = q.quantize_fp8_tensorwise(x[a:b], scales[g], fmt, rowwise, columnwise)
        rows.append(r), cols.append(c), amaxes.append(m)
    row = torch.cat(rows, 0) if rowwise else None
    col = torch.cat(cols, 1) if columnwise else None
    return row, col, torch.stack(amaxes) if amaxes else scales.new_zeros(0)


def _place_1d_col_scales(col_scales, offsets, k, cap, dtype, device):
    out = torch.zeros((k, cap), dtype=dtype, device=device)
    for g, s in enumerate(col_scales):
        start = int(offsets[g])
        out[:, start:start + s.shape[1]] = s
    return out


def _place_2d_scales(scales, offsets, nk, cap, dtype, device):
    out = torch.zeros((cap, nk), dtype=dtype, device=device)
    for g, s in enumerate(scales):
        start = int(offsets[g])
        out[start:start + s.shape[0]] = s
    return out


def _grouped_blocks(x, split_sizes, block, quantize_one, rowwise, columnwise, scale_dtype):
    """Shared layout logic for 1x b and b x b block formats; quantize_one(x_g) -> (r, rs, c, cs)."""
    m, k = x.shape
    br, bc = block
    bounds = _bounds(split_sizes)
    num_groups = len(bounds)
    parts = [quantize_one(x[a:b]) for a, b in bounds]
    offsets = group_scale_offsets(split_sizes, bc).tolist()
    cap = scale_capacity(m, num_groups, bc)
    nk = -(-k // bc)
    row = row_s = col = col_s = None
    if rowwise:
        row = torch.cat([p[0] for p in parts], 0)
        row_s = (torch.cat([p[1] for p in parts], 0) if br == 1
                 else _place_2d_scales([p[1] for p in parts], offsets, nk, cap, scale_dtype, x.device))
    if columnwise:
        col = torch.cat([p[2] for p in parts], 1)
        col_s = (_place_1d_col_scales([p[3] for p in parts], offsets, k, cap, scale_dtype, x.device) if br == 1
                 else _place_2d_scales([p[3].t() for p in parts], offsets, nk, cap, scale_dtype, x.device).t()
                 .contiguous())
    return row, row_s, col, col_s


def grouped_quantize_fp8_block(x, split_sizes, block_rows, block_cols, fmt, power_2_scale=True,
                               amax_epsilon=0.0, rowwise=True, columnwise=False):
    x = rows_of(x)
    def one(xg):
        return q.quantize_fp8_block(xg, block_rows, block_cols, fmt, power_2_scale, amax_epsilon, True, True)

    return _grouped_blocks(x, split_sizes, (block_rows, block_cols), one, rowwise, columnwise, torch.float32)


def grouped_quantize_mxfp8(x, split_sizes, fmt, scale_mode: ScaleMode = ScaleMode.ROUND_UP, rowwise=True,
                           columnwise=False, values=()):
    """values: the copies ("rowwise", "columnwise") returned as their exact bf16 values [sum M, K]
    (the dequantized codes, which the emulated GEMMs multiply) with no scales, instead of codes."""
    x = rows_of(x)
    def one(xg):
        return q.quantize_mxfp8(xg, fmt, scale_mode, True, True)

    row, row_s, col, col_s = _grouped_blocks(x, split_sizes, (1, 32), one, rowwise, columnwise, torch.float8_e8m0fnu)
    if rowwise and "rowwise" in values:
        row, row_s = q.dequantize_mxfp8(row, row_s, torch.bfloat16), None
    if columnwise and "columnwise" in values:
        starts = group_scale_offsets(split_sizes, 32).tolist()
        parts = [q.dequantize_mxfp8(col[:, a:b], col_s[:, s:s + -(-(b - a) // 32)], torch.bfloat16).t()
                 for (a, b), s in zip(_bounds(split_sizes), starts)]
        col, col_s = (torch.cat(parts, 0) if parts else x.new_zeros((0, x.shape[1]), dtype=torch.bfloat16)), None
    return row, row_s, col, col_s


def grouped_quantize_nvfp4(x, split_sizes, block_2d=False, rowwise=True, columnwise=False, rht=False,
                           stochastic=False, generator=None, values=()):
    """-> (row, row_scale, amax [G], col, col_scale, col_amax [G]); data packed over all groups.

    values: the copies ("rowwise", "columnwise") returned as their exact values q * s_b, [sum M, K]
    bf16 with no scale (the columnwise one in the Hadamard domain with rht; for 1 x 16 blocks the
    transpose of a [K, sum M] buffer): what the emulated GEMMs multiply before the amaxes' tensor
    factor, exact in bf16 (NUMERICS.md)."""
    x = rows_of(x)
    block = (16, 16) if block_2d else (1, 16)
    amaxes, col_amaxes, row_values, col_values = [], [], [], []

    def one(xg):
        odd = xg.shape[0] % 2
        if odd:  # an odd group cannot be packed alone: one zero row more changes no amax or code
            xg = torch.cat((xg, xg.new_zeros(1, xg.shape[1])), 0)
        r, rs, amax, c, cs, camax = q4.quantize_nvfp4(xg, block_2d, True, columnwise, rht, stochastic, generator)
        amaxes.append(amax), col_amaxes.append(camax if columnwise else amax)
        rc, cc = unpack_e2m1(r), unpack_e2m1(c) if columnwise else None
        if odd:
            rc, cc = rc[:-1], cc[:, :-1] if columnwise else None
            rs = rs if block_2d else rs[:-1]
        row_values.append(_exact_values(rc, rs, block))
        if columnwise:
            col_values.append(_exact_values(cc, cs, block))
        return rc, rs, cc, cs

    row, row_s, col, col_s = _grouped_blocks(x, split_sizes, block, one, True, columnwise, torch.float8_e4m3fn)
    empty = x.new_zeros(0, dtype=torch.float32)
    row, col = pack_e2m1(row), pack_e2m1(col) if columnwise else None
    nothing = x.new_zeros((0, x.shape[1]), dtype=torch.bfloat16)
    if rowwise and "rowwise" in values:
        row, row_s = (torch.cat(row_values, 0) if row_values else nothing), None
    if columnwise and "columnwise" in values:  # 1 x 16: a [K, sum M] buffer, tokens contiguous as wgrad reads them
        col = torch.cat(col_values, 1) if col_values else nothing.t()
        col, col_s = (col.t().contiguous() if block_2d else col.t()), None
    return (row if rowwise else None, row_s if rowwise else None,
            torch.stack(amaxes) if amaxes else empty,
            col, col_s,
            (torch.stack(col_amaxes) if col_amaxes else empty) if columnwise else None)


def _exact_values(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """bf16 q * s_b of E2M1 codes [R, C] (one per byte) and their E4M3 block scales: exact."""
    return (e2m1_decode(codes) * q.expand_blocks(scales.float(), block, tuple(codes.shape))).to(torch.bfloat16)
