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
    """NUMERICS.md "FP8 scale from amax": fmt_max / max(amax, eps), 1 for 0 or non-finite amax."""
    amax = tl.where(eps > 0, tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL), amax)
    scale = tl.math.div_rn(splat_like(amax, FMT_MAX), amax)
    scale = tl.where((amax == 0) | ~is_finite(amax), 1.0, scale)
    scale = tl.where(abs_bits(scale) == INF_BITS, _FLT_MAX, scale)
    if POW2:  # zero the mantissa: round down to a power of two
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def reciprocal(x):
    return tl.math.div_rn(splat_like(x, 1.0), x)


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

