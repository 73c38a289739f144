"""Exact fp32 arithmetic for Triton kernels, as NUMERICS.md specifies it.

- Divisions are `div_rn` (Triton's `/` on fp32 is an approximate division).
- Powers of two are built from bits (2^-127 is subnormal and must not flush).
- Amaxes are maxima of |x|'s bit patterns: exact, and NaN, whose bits exceed inf's, wins.
- Casts clamp with NaN propagation, then convert with round-to-nearest-even
  (`cvt.rn.satfinite` on sm90).

The elementwise helpers also serve Gluon kernels (`qmoe/kernels/_cast_transpose_gl.py`), which
call them on tensors with explicit layouts: they build constants with `splat_like`, never with a
shape-only `tl.full`.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from qmoe.contracts.formats import FLT_MAX

_FLT_MAX = tl.constexpr(FLT_MAX)
# sm89+ converts fp32 to FP8 with cvt.rn.satfinite (cast_codes); Triton's interpreter casts without saturating.
_HW_SATFINITE = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
INF_BITS = tl.constexpr(0x7F800000)  # bits of +inf: |x|'s bits above it are NaN
_ABS_MASK = tl.constexpr(0x7FFFFFFF)


@triton.jit
def splat_like(x, value):
    """`value` as an fp32 tensor of x's shape (and, in a Gluon kernel, x's layout); folds to a constant."""
    return tl.where(x == x, value, value).to(tl.float32)


@triton.jit
def abs_bits(x):
    """int32 pattern of |x| for fp32 x: orders like |x|, and NaN sorts above inf."""
    return x.to(tl.int32, bitcast=True) & _ABS_MASK


@triton.jit
def bits_to_float(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def max_abs_bits(x, FINITE_ONLY: tl.constexpr):
    """max|x| of a 2-D fp32 tile as int32 bits: over finite values only with FINITE_ONLY (a per-tensor
    amax, NUMERICS.md "Non-finite values"), else with inf and NaN (NaN wins)."""
    b = abs_bits(x)
    if FINITE_ONLY:
        b = tl.where(b >= INF_BITS, 0, b)
    return tl.max(tl.max(b, 1), 0)


@triton.jit
def saturate(y, DMAX: tl.constexpr):
    """Clamp fp32 y to +-DMAX (the output dtype's largest finite value), NaN kept: finite in, finite out."""
    return clamp_nan(y, -DMAX, DMAX)


@triton.jit
def atomic_max_bits(ptr, value):
    """atomic_max of a non-negative float's bits, skipped when the stored maximum is already >= value.

    One atomic per tile on one address serialises thousands of programs; the plain read lets
    all but the few tiles that raise the maximum skip it (a stale read only costs an atomic).
    """
    if value > tl.load(ptr):
        tl.atomic_max(ptr, value)


@triton.jit
def finite_abs_bits(x):
    """|x|'s int32 pattern for fp32 x, 0 where x is inf or NaN: the terms of a per-tensor amax."""
    b = abs_bits(x)
    return tl.where(b >= INF_BITS, 0, b)


@triton.jit
def atomic_max_by_group(amax_ptr, offsets_ptr, G, rows, row_ok, row_bits, G_P2: tl.constexpr):
    """Raise amax[g] (int32 bits) to each row's `row_bits`, g the row's group: rows
    offsets[g]:offsets[g+1] (offsets [G+1] on the device, offsets[0] = 0); rows in no group skipped.

    For a producer that writes whole rows in any order (not tiles of one group): a tile inside
    one group (the common case) takes one atomic, a tile across groups one per row.
    """
    idx = tl.arange(0, G_P2)
    ends = tl.load(offsets_ptr + 1 + idx, mask=idx < G, other=0)
    g = tl.sum(((ends[None, :] <= rows[:, None]) & (idx < G)[None, :]).to(tl.int32), 1)
    ok = row_ok & (g < G)
    g_lo = tl.min(tl.where(ok, g, G), 0)
    g_hi = tl.max(tl.where(ok, g, -1), 0)
    if g_lo == g_hi:
        atomic_max_bits(amax_ptr + g_lo, tl.max(tl.where(ok, row_bits, 0), 0))
    else:
        current = tl.load(amax_ptr + g, mask=ok, other=0)
        tl.atomic_max(amax_ptr + g, row_bits, mask=ok & (row_bits > current))


@triton.jit
def trans8(t):
    """Transpose a small 8-bit tile as uint8 bits through int32 (see cast_bits)."""
    return tl.trans(t.to(tl.uint8, bitcast=True).to(tl.int32)).to(tl.uint8)


@triton.jit
def is_nan(x):
    return abs_bits(x) > INF_BITS


@triton.jit
def is_finite(x):
    return abs_bits(x) < INF_BITS


@triton.jit
def clamp_nan(x, lo, hi):
    """min(max(x, lo), hi) with NaN kept (torch.clamp semantics)."""
    x = tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(x, hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def cast_satfinite(x, MAX: tl.constexpr, DTYPE: tl.constexpr):
    """RNE cast with saturation: clamp to +-MAX (NaN stays NaN), then round to nearest even."""
    return clamp_nan(x, -MAX, MAX).to(DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def cast_bits(x, MAX: tl.constexpr, DTYPE: tl.constexpr):
    """cast_satfinite as raw uint8 bits. Kernels store codes as uint8: with both a tile and its
    transpose stored, fp8-typed tiles come out corrupted on Triton 3.6's bundled ptxas (12.9) on
    sm90 (triton-lang/triton#11111; the same conversion of 8-bit integers is clean)."""
    return cast_satfinite(x, MAX, DTYPE).to(tl.uint8, bitcast=True)


@triton.jit
def cast_codes(x, MAX: tl.constexpr, DTYPE: tl.constexpr):
    """cast_bits, leaving the clamp to the hardware where it has one: the GPU's conversion to FP8
    (cvt.rn.satfinite) takes +-inf and values beyond +-MAX to +-MAX and keeps NaN, which is what
    the clamp does, so the codes are the same bits two instructions per value cheaper."""
    if _HW_SATFINITE:
        return x.to(DTYPE, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        return cast_bits(x, MAX, DTYPE)


@triton.jit
def exp2_int(e):
    """Exact 2^e in fp32 for integer e in [-127, 127] (2^-127 is the subnormal 0x00400000)."""
    bits = tl.where(e >= -126, (e + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale_from_amax(amax, FMT_MAX: tl.constexpr, POW2: tl.constexpr, eps):
    """NUMERICS.md "FP8 scale from amax": fmt_max / max(amax, eps), 1 for 0 or non-finite amax;
    with POW2 rounded down to a power of two (pow2_scale_from_amax: the same bits, no division)."""
    amax = tl.where(eps > 0, tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL), amax)
    if POW2:
        return pow2_scale_from_amax(amax, FMT_MAX)
    scale = tl.math.div_rn(splat_like(amax, FMT_MAX), amax)
    scale = tl.where((amax == 0) | ~is_finite(amax), 1.0, scale)
    return tl.where(abs_bits(scale) == INF_BITS, _FLT_MAX, scale)


@triton.constexpr_function
def _fp32_fields(value):
    """(unbiased exponent, mantissa bits) of a normal positive fp32 constant (exact: halving and
    doubling by two are)."""
    exponent, mantissa = 0, float(value)
    while mantissa >= 2.0:
        exponent, mantissa = exponent + 1, mantissa / 2.0
    while mantissa < 1.0:
        exponent, mantissa = exponent - 1, mantissa * 2.0
    return exponent, int((mantissa - 1.0) * 8388608.0)


@triton.jit
def pow2_scale_from_amax(amax, FMT_MAX: tl.constexpr):
    """The power-of-two FP8 scale of a non-negative amax, exactly as the division rounds it: the
    mantissa of RN(fmt_max / amax) zeroed, 1 for 0 or non-finite amax, 2^127 where the quotient
    overflows. With fmt_max = f * 2^p and amax = a * 2^q (f, a in [1, 2)), the quotient lies in
    binade p - q where a <= f and in p - q - 1 where a > f. Rounding never lifts it into the next
    binade: that would need f within 2^-24 of 2, or an fp32 mantissa a in (f, f * (1 + 2^-25)],
    and fp32 has neither. A subnormal amax (exponent field 0) gives a binade of p + 126 or more,
    2^127 after the clamp, as its quotient does for fmt_max >= 2."""
    P: tl.constexpr = _fp32_fields(FMT_MAX)[0]
    F_MANT: tl.constexpr = _fp32_fields(FMT_MAX)[1]
    tl.static_assert(P >= 1, "pow2_scale_from_amax needs fmt_max >= 2")
    bits = amax.to(tl.int32, bitcast=True)
    e = tl.minimum((P + 127) - ((bits >> 23) & 0xFF) - ((bits & 0x7FFFFF) > F_MANT).to(tl.int32), 127)
    return tl.where((amax == 0) | ~is_finite(amax), 1.0, exp2_int(e))


@triton.jit
def reciprocal(x):
    return tl.math.div_rn(splat_like(x, 1.0), x)


@triton.jit
def pow2_reciprocal(x):
    """1 / x for a power of two x in [2^-126, 2^127], the same bits as `reciprocal` (exact there)
    without a division: 2^-e from x's exponent field. Power-of-two FP8 scales lie in that range."""
    return exp2_int(127 - ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF))


@triton.jit
def scale_inverse(s, POW2: tl.constexpr):
    """The stored inverse of an FP8 scale from fp8_scale_from_amax, 1 / s: exact, and without a
    division for power-of-two scales."""
    if POW2:
        return pow2_reciprocal(s)
    else:
        return reciprocal(s)


@triton.jit
def mx_exponent(amax, FMT_MAX: tl.constexpr, EMAX: tl.constexpr, ROUND_UP: tl.constexpr):
    """Unbiased E8M0 exponent (int32) of each block amax; 128 marks a NaN block (byte 0xFF)."""
    if ROUND_UP:  # smallest k with 2^k >= amax / fmt_max
        v = tl.math.div_rn(amax, splat_like(amax, FMT_MAX))
        bits = v.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        man = bits & 0x7FFFFF
        b = tl.where(field == 0, tl.where(man > 0x400000, -126, -127), field - 127 + (man != 0).to(tl.int32))
    else:  # OCP MX: floor(log2(amax)) - emax; subnormal amax clamps to -127
        bits = amax.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        b = tl.where(field == 0, -127, field - 127 - EMAX)
    b = tl.minimum(tl.maximum(b, -127), 127)
    b = tl.where(abs_bits(amax) == INF_BITS, 127, b)
    return tl.where(is_nan(amax), 128, b)

