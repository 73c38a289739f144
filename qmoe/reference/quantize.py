"""Reference FP8 quantization (per-tensor, 1x128 / 128x128 blocks, MXFP8): the executable spec.

Pure torch, readable, runs on CPU and CUDA. Every Triton kernel in `qmoe/kernels/quantize.py`
has the same signature and must reproduce these codes and scales bit for bit. Shapes: x is
[M, K]; "rowwise" quantizes blocks along K, "columnwise" quantizes x.T ([K, M]) the same way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qmoe.contracts.carriers import row_groups
from qmoe.contracts.formats import E8M0_BIAS, E8M0_NAN, FLT_MAX, ElementFormat, ScaleMode

_MANTISSA_MASK = 0x007FFFFF


# ---------------------------------------------------------------- elementary operations

def cast_satfinite(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """RNE cast of fp32 values to an FP8 format, saturating (inf -> max); NaN stays NaN."""
    return x.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max|x| per (br x bc) block of a 2-D tensor -> [ceil(M/br), ceil(K/bc)]; NaN propagates.

    A partial trailing block takes its amax over the elements that exist (zero padding).
    """
    br, bc = block
    m, k = x.shape
    pad_m, pad_k = -m % br, -k % bc
    a = F.pad(x.abs().float(), (0, pad_k, 0, pad_m))
    if a.numel() == 0:
        return a.new_zeros((-(-m // br), -(-k // bc)))
    return a.reshape(a.shape[0] // br, br, a.shape[1] // bc, bc).amax(dim=(1, 3))


def expand_blocks(s: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast a per-block tensor back to elements, cropped to `shape`."""
    br, bc = block
    return s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: shape[0], : shape[1]]


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| over the finite values of a tensor, 0-dim fp32 (0 if empty or none is finite).

    The per-tensor amax that sets a scale (NUMERICS.md "Non-finite values"): one inf or NaN must
    not push every other value's scale to 1 and flush it to zero.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = x.abs().float()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax()



def finite_row_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x[t]| over each row's finite values, [T] fp32 (0 for a row with none)."""
    a = x.abs().float()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax(dim=1) if x.shape[1] else a.new_zeros(x.shape[0])


def group_amax(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`tensor_amax` of each group of rows at once: [G] fp32 (0 for an empty group).

    x: [R, K]; offsets: [G + 1] int on x's device, group g = rows offsets[g]:offsets[g+1]
    (offsets[0] = 0); rows past offsets[G] join no group. Device ops only (no host read), so a
    producer's reference twin can hand it over (`qmoe.contracts.carriers.RowsWithAmax`).
    """
    g = offsets.numel() - 1
    out = torch.zeros(g + 1, dtype=torch.float32, device=x.device)  # slot g: the rows of no group
    return out.scatter_reduce(0, row_groups(offsets, x.shape[0]), finite_row_amax(x), "amax")[:g]


def observed_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| of a whole tensor, 0-dim fp32, non-finite values included (NaN wins; 0 if empty).

    What delayed scaling records: a step that saw inf or NaN must be known as one, so the
    update can leave it out of the history (NUMERICS.md "Delayed scaling").
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().float()


def saturate_to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 y cast to `dtype`, values beyond its range clamped to its largest finite value (NaN kept).

    Finite in, finite out: a power-of-two scale times the largest code can exceed the range
    even though the input was finite (NUMERICS.md "Non-finite values").
    """
    if dtype.is_floating_point:
        big = torch.finfo(dtype).max
        y = y.clamp(-big, big)
    return y.to(dtype)


def compute_fp8_scale(amax: torch.Tensor, fmt_max: float, power_2_scale: bool = False,
                      amax_epsilon: float = 0.0) -> torch.Tensor:
    """FP8 scale from amax (NUMERICS.md): fmt_max / max(amax, eps), 1 where amax is 0 or not finite."""
    amax = amax.float()
    if amax_epsilon > 0:
        amax = torch.maximum(amax, torch.tensor(amax_epsilon, dtype=torch.float32, device=amax.device))
    scale = torch.full_like(amax, fmt_max) / amax  # a true fp32 division: `float / tensor` is reciprocal * float
    scale = torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(scale), scale)
    scale = torch.where(scale == float("inf"), torch.full_like(scale, FLT_MAX), scale)
    if power_2_scale:  # zero the mantissa: round down to a power of two
        scale = (scale.view(torch.int32) & ~_MANTISSA_MASK).view(torch.float32)
    return scale


# ---------------------------------------------------------------- FP8 per tensor

def quantize_fp8_tensorwise(x: torch.Tensor, scale: torch.Tensor, fmt: ElementFormat,
                            rowwise: bool = True, columnwise: bool = False):
    """Cast x [M, K] with one fp32 scale (0-dim) and record its amax.

    Returns (rowwise_data [M, K] | None, columnwise_data [K, M] | None, amax 0-dim fp32).
    Current scaling passes `compute_fp8_scale(tensor_amax(x), ...)`; delayed scaling passes
    the slot's scale and keeps the returned amax (`observed_amax`: inf/NaN included) for its history.
    """
    xs = x.float() * scale.float()
    row = cast_satfinite(xs, fmt) if rowwise else None
    col = cast_satfinite(xs.t(), fmt).contiguous() if columnwise else None
    return row, col, observed_amax(x)


def dequantize_fp8_tensorwise(data: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32):
    return saturate_to(data.float() * scale_inv.float(), dtype)


# ---------------------------------------------------------------- FP8 blocks (1x128, 128x128)

def _fp8_block_rowwise(x: torch.Tensor, block, fmt, power_2_scale, amax_epsilon):
    scale = compute_fp8_scale(block_amax(x, block), fmt.max, power_2_scale, amax_epsilon)
    q = cast_satfinite(x.float() * expand_blocks(scale, block, tuple(x.shape)), fmt)
    return q, scale


def quantize_fp8_block(x: torch.Tensor, block_rows: int, block_cols: int, fmt: ElementFormat,
                       power_2_scale: bool = True, amax_epsilon: float = 0.0,
                       rowwise: bool = True, columnwise: bool = False):
    """FP8 with an fp32 scale per (block_rows x block_cols) block: 1x128 rows or 128x128 tiles.

    Returns (row_data [M, K], row_scale_inv, col_data [K, M], col_scale_inv); scale_inv shapes
    are [M, ceil(K/128)] / [K, ceil(M/128)] for 1x128 and [ceil(M/128), ceil(K/128)] / its
    transpose for 128x128, where both orientations share one scale per tile.
    """
    block = (block_rows, block_cols)
    row = row_si = col = col_si = None
    if block_rows == 1:
        if rowwise:
            row, s = _fp8_block_rowwise(x, block, fmt, power_2_scale, amax_epsilon)
            row_si = 1.0 / s
        if columnwise:
            col, s = _fp8_block_rowwise(x.t(), block, fmt, power_2_scale, amax_epsilon)
            col_si = 1.0 / s
        return row, row_si, col, col_si
    scale = compute_fp8_scale(block_amax(x, block), fmt.max, power_2_scale, amax_epsilon)
    xs = x.float() * expand_blocks(scale, block, tuple(x.shape))
    if rowwise:
        row, row_si = cast_satfinite(xs, fmt), 1.0 / scale
    if columnwise:
        col, col_si = cast_satfinite(xs.t(), fmt).contiguous(), (1.0 / scale).t().contiguous()
    return row, row_si, col, col_si


def dequantize_fp8_block(data: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, block_cols: int,
                         dtype=torch.float32):
    s = expand_blocks(scale_inv.float(), (block_rows, block_cols), tuple(data.shape))
    return saturate_to(data.float() * s, dtype)


# ---------------------------------------------------------------- MXFP8 (1x32, E8M0 scales)

def mx_scale_exponent(amax: torch.Tensor, fmt: ElementFormat, scale_mode: ScaleMode) -> torch.Tensor:
    """Unbiased E8M0 exponent b (int32) per block; NaN amax gives 128 (stored as byte 0xFF)."""
    amax = amax.float()
    if scale_mode is ScaleMode.ROUND_UP:
        v = amax / fmt.max
        mant, exp = torch.frexp(v)  # v = mant * 2**exp, mant in [0.5, 1)
        b = torch.where(mant == 0.5, exp - 1, exp)  # smallest k with 2**k >= v
        zero = v == 0
    else:
        mant, exp = torch.frexp(amax)
        b = (exp - 1) - fmt.emax  # floor(log2(amax)) - emax
        zero = amax == 0
        v = amax
    b = torch.where(zero, torch.full_like(b, -127), b)
    b = torch.where(torch.isinf(v), torch.full_like(b, 127), b)
    b = b.clamp(-127, 127)
    return torch.where(torch.isnan(v), torch.full_like(b, E8M0_NAN - E8M0_BIAS), b)


def _mx_rowwise(x: torch.Tensor, fmt, scale_mode, block: int):
    b = mx_scale_exponent(block_amax(x, (1, block)), fmt, scale_mode)
    nan = b == E8M0_NAN - E8M0_BIAS
    inv = torch.exp2(-b.float())  # exact power of two in fp32 for b in [-127, 127]
    inv = torch.where(nan, torch.full_like(inv, float("nan")), inv)
    q = cast_satfinite(x.float() * expand_blocks(inv, (1, block), tuple(x.shape)), fmt)
    scale = (b + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    return q, scale


def quantize_mxfp8(x: torch.Tensor, fmt: ElementFormat, scale_mode: ScaleMode = ScaleMode.ROUND_UP,
                   rowwise: bool = True, columnwise: bool = False, block: int = 32):
    """MXFP8: FP8 codes with an E8M0 scale per 32 consecutive values.

    Returns (row_data [M, K], row_scale [M, ceil(K/32)] e8m0, col_data [K, M], col_scale [K, ceil(M/32)]).
    """
    row = row_s = col = col_s = None
    if rowwise:
        row, row_s = _mx_rowwise(x, fmt, scale_mode, block)
    if columnwise:
        col, col_s = _mx_rowwise(x.t(), fmt, scale_mode, block)
    return row, row_s, col, col_s


def dequantize_mxfp8(data: torch.Tensor, scale: torch.Tensor, dtype=torch.float32, block: int = 32):
    from qmoe.contracts.formats import e8m0_to_float

    s = expand_blocks(e8m0_to_float(scale), (1, block), tuple(data.shape))
    return saturate_to(data.float() * s, dtype)
