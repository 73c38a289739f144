"""NVFP4's elementwise arithmetic (private helper of `qmoe/kernels/quantize_nvfp4.py`): the tensor
scale from the amax, E4M3 block scales and their encode multipliers, and E2M1 codes or their grid
values (NUMERICS.md). Elementwise only, so a Gluon kernel can call it as well (`_arith`'s rule).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.contracts.formats import E2M1, E4M3, FLT_MAX, NVFP4_TENSOR_MAX
from qmoe.kernels._arith import cast_satfinite, clamp_nan, is_nan, reciprocal, splat_like

_FLT_MAX = tl.constexpr(FLT_MAX)
_ONE_SIXTH = tl.constexpr(float(torch.tensor(1.0 / 6.0, dtype=torch.float32)))  # fp32(1/6), as the reference
_TENSOR_MAX = tl.constexpr(NVFP4_TENSOR_MAX)
_E4M3_MAX = tl.constexpr(E4M3.max)
E2M1_MAX = tl.constexpr(E2M1.max)


@triton.jit
def tensor_scale(amax):
    """S_enc = min(448*6 / amax, FLT_MAX) (NaN -> FLT_MAX), 1 where that is 0."""
    s = tl.math.div_rn(splat_like(amax, _TENSOR_MAX), amax)
    s = tl.where(is_nan(s) | (s > _FLT_MAX), _FLT_MAX, s)
    return tl.where(s == 0, 1.0, s)


@triton.jit
def e2m1_value(c):
    """Magnitude of codes 0..7: {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    big = tl.where(c == 4, 2.0, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0)))
    return tl.where(c < 4, c.to(tl.float32) * 0.5, big)


@triton.jit
def _magnitude(y):
    """(y's bits, |y|'s bits, |y|, 2|y|, 2|y| truncated: 0 or 1 under 1), what both roundings start from."""
    bits = y.to(tl.int32, bitcast=True)
    a_bits = bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    twice = a * 2.0
    return bits, a_bits, a, twice, twice.to(tl.int32)


@triton.jit
def e2m1_codes(y, STOCHASTIC: tl.constexpr, u):
    """4-bit E2M1 codes (int32) of y in [-6, 6]: RNE on the grid, or up with probability
    (|y| - lo) / (hi - lo) when u < p (u uniform in [0, 1)); NaN -> 0, -0 -> +0.

    From |y|'s bits rather than by comparing with the grid: from 1 up, a code is the exponent
    and the first mantissa bit (1.0 is code 2), so keeping one mantissa bit rounds onto the
    grid, and the 22 bits dropped are p exactly; below 1 the codes 0, 1, 2 are 2|y| rounded,
    and p its fraction. Same codes as the reference's comparisons with far fewer instructions,
    which bound the cast."""
    bits, a_bits, a, twice, below = _magnitude(y)
    if STOCHASTIC:
        lo = tl.where(a < 1.0, below, (a_bits >> 22) - 252)
        p = tl.where(a < 1.0, twice - below.to(tl.float32), (a_bits & 0x3FFFFF).to(tl.float32) * (1.0 / 4194304.0))
        mag = lo + (u < p).to(tl.int32)
    else:  # RNE: add just under half of the dropped bits' unit, plus the kept bit (ties to even)
        above = (a_bits + (0x1FFFFF - (252 << 22)) + ((a_bits >> 22) & 1)) >> 22
        below = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # 2^23 rounds to an integer
        mag = tl.where(a < 1.0, below, above)
    # NaN's magnitude comes out above 7 (its exponent field is all ones): 0, as is -0
    keep = (mag - 1).to(tl.uint32, bitcast=True) < 7
    return tl.where(keep, mag | ((bits >> 28) & 8), 0)


@triton.jit
def e2m1_round(y, STOCHASTIC: tl.constexpr, u):
    """The value (fp32) of e2m1_codes(y, STOCHASTIC, u), rounded onto the grid directly for
    copies held as values: from 1 up the kept bits themselves (the dropped ones added in, or
    one unit of the kept bit with probability p), below 1 |y| rounded to a multiple of 0.5
    (by 2^22, whose unit is 0.5); NaN and -0 give +0 as their codes do (y is within [-6, 6])."""
    bits, a_bits, a, twice, below = _magnitude(y)
    if STOCHASTIC:
        small = (below + (u < twice - below.to(tl.float32)).to(tl.int32)).to(tl.float32) * 0.5
        up = u < (a_bits & 0x3FFFFF).to(tl.float32) * (1.0 / 4194304.0)
        big = ((a_bits & -4194304) + (up.to(tl.int32) << 22)).to(tl.float32, bitcast=True)
    else:
        small = (a + 4194304.0) - 4194304.0
        big = ((a_bits + 0x1FFFFF + ((a_bits >> 22) & 1)) & -4194304).to(tl.float32, bitcast=True)
    mag = tl.where(a < 1.0, small, big)
    keep = (mag > 0) & (mag <= 6.0)  # a NaN's bits round to inf or NaN: 0, as its code
    return tl.where(keep, tl.where(bits < 0, -mag, mag), 0.0)


@triton.jit
def e2m1_quantize(y, STOCHASTIC: tl.constexpr, u, VALUES: tl.constexpr):
    """y (x times its block's encode multiplier) clamped to E2M1's range (NaN kept), then its codes,
    or with VALUES their grid values (e2m1_round)."""
    y = clamp_nan(y, -E2M1_MAX, E2M1_MAX)
    if VALUES:
        q = e2m1_round(y, STOCHASTIC, u)
    else:
        q = e2m1_codes(y, STOCHASTIC, u)
    return q


@triton.jit
def block_scale(amax_b, s_enc, s_dec):
    """(E4M3 block scale s_b, encode multiplier min(1 / (s_b * S_dec), FLT_MAX)) from block amaxes."""
    sb = cast_satfinite(tl.minimum(amax_b * (s_enc * _ONE_SIXTH), _FLT_MAX, propagate_nan=tl.PropagateNan.ALL),
                        _E4M3_MAX, tl.float8e4nv)
    enc = tl.minimum(reciprocal(sb.to(tl.float32) * s_dec), _FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
    return sb, enc
