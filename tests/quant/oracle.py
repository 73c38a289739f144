"""An independent construction of NUMERICS.md: expected codes and scales, in numpy.

Nothing here calls `qmoe.reference` or `qmoe.quant`; it is the spec written a second time, in
a different way, so a test comparing the two catches a mistake in either:

- element formats are **tables** of every code's value, built from the bit layout, and a
  cast rounds to nearest by searching the table (a tie goes to the even code; values beyond
  the largest finite code saturate to it);
- scales follow NUMERICS.md step by step in numpy float32 (each numpy float32 operation
  rounds to nearest-even, like torch's);
- E8M0 exponents are read off the float32 bit pattern; power-of-two rounding uses frexp;
- blocks are explicit slices, so a partial trailing block takes its amax over what exists;
- the random Hadamard transform is a float64 matrix product with H16[i, j] = (-1)^popcount(i & j).

Arrays are numpy: x is a float32 [M, K] array, codes are uint8 arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                          NVFP4BlockScaling)

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


# ---------------------------------------------------------------- element-format tables

def _fp8_value(code: int, exp_bits: int, man_bits: int, bias: int, has_inf: bool) -> float:
    sign = -1.0 if code >> 7 else 1.0
    e = (code >> man_bits) & ((1 << exp_bits) - 1)
    m = code & ((1 << man_bits) - 1)
    top = (1 << exp_bits) - 1
    if has_inf and e == top:  # IEEE-like E5M2: all-ones exponent is inf (m == 0) or NaN
        return sign * np.inf if m == 0 else np.nan
    if not has_inf and e == top and m == (1 << man_bits) - 1:  # E4M3 "fn": only S.1111.111 is NaN
        return np.nan
    if e == 0:  # subnormal
        return sign * m * 2.0 ** (1 - bias - man_bits)
    return sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)


def fp8_table(name: str) -> np.ndarray:
    """float64 value of each of the 256 codes (NaN codes hold NaN)."""
    layout = {"E4M3": (4, 3, 7, False), "E5M2": (5, 2, 15, True)}[name]
    return np.array([_fp8_value(c, *layout) for c in range(256)], dtype=np.float64)


FP8_VALUES = {name: fp8_table(name) for name in ("E4M3", "E5M2")}
FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}
FP8_EMAX = {"E4M3": 8, "E5M2": 15}


def fp8_positive_grid(name: str) -> np.ndarray:
    """Finite non-negative values in code order: code c (0 <= c <= max code) has value grid[c]."""
    v = FP8_VALUES[name][:128]
    grid = v[np.isfinite(v)]
    assert np.all(np.diff(grid) > 0) and grid[-1] == FP8_MAX[name]
    return grid


FP8_GRID = {name: fp8_positive_grid(name) for name in ("E4M3", "E5M2")}
FP8_NAN_CODE = {"E4M3": 0x7F, "E5M2": 0x7F}

# E2M1 magnitudes by 3-bit code; bit 3 is the sign.
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def round_to_grid(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest to each non-negative `mag` (RNE: a tie goes to the even
    index, which is the code with an even last mantissa bit); beyond grid[-1] saturates to it."""
    mag = np.asarray(mag, dtype=np.float64)
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 0, len(grid) - 1)  # first grid >= mag
    lo = np.maximum(hi - 1, 0)
    mid = (grid[lo] + grid[hi]) / 2  # exact in float64
    idx = np.where(mag > mid, hi, lo)
    tie = mag == mid
    idx = np.where(tie, np.where(lo % 2 == 0, lo, hi), idx)
    idx = np.where(mag == grid[hi], hi, idx)
    return np.where(mag >= grid[-1], len(grid) - 1, idx).astype(np.int64)


def half_step(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Half the distance between the two grid values around `mag` (0 for a grid value or beyond the max)."""
    mag = np.asarray(mag, dtype=np.float64)
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 0, len(grid) - 1)
    lo = np.maximum(hi - 1, 0)
    return np.where(mag >= grid[-1], 0.0, (grid[hi] - grid[lo]) / 2)


def cast_fp8(v: np.ndarray, name: str) -> np.ndarray:
    """Codes (uint8) of float32 values, RNE with saturation; the sign bit follows the input's."""
    v = np.asarray(v, dtype=np.float32)
    nan = np.isnan(v)
    mag = np.where(nan, 0.0, np.abs(v.astype(np.float64)))
    code = round_to_grid(mag, FP8_GRID[name]) | (np.signbit(v).astype(np.int64) << 7)
    return np.where(nan, FP8_NAN_CODE[name], code).astype(np.uint8)


def fp8_decode(codes: np.ndarray, name: str) -> np.ndarray:
    return FP8_VALUES[name][np.asarray(codes, dtype=np.int64)]


def cast_e2m1(y: np.ndarray) -> np.ndarray:
    """4-bit codes (uint8, one per element) of finite float32 values already clamped to [-6, 6];
    -0 (and negatives that round to 0) get the +0 code."""
    y = np.asarray(y, dtype=np.float32)
    mag = round_to_grid(np.abs(y.astype(np.float64)), E2M1_GRID)
    return np.where((y < 0) & (mag != 0), mag | 8, mag).astype(np.uint8)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.int64)
    return np.where(codes & 8, -1.0, 1.0) * E2M1_GRID[codes & 7]


def e2m1_codes_of(packed: np.ndarray) -> np.ndarray:
    """4-bit codes [M, 2n] of packed bytes [M, n] (low nibble first)."""
    return np.stack((packed & 0xF, packed >> 4), axis=-1).reshape(packed.shape[0], -1)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte, the even element in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


# ---------------------------------------------------------------- blocks

def block_slices(shape: tuple[int, int], rows: int, cols: int):
    """((block_row, block_col), (row slice, col slice)) over a 2-D shape; trailing blocks are partial."""
    m, k = shape
    for i in range(-(-m // rows)):
        for j in range(-(-k // cols)):
            yield (i, j), (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))


def num_blocks(shape: tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    return -(-shape[0] // rows), -(-shape[1] // cols)


def expand(per_block: np.ndarray, rows: int, cols: int, shape: tuple[int, int]) -> np.ndarray:
    """Each block's value repeated over the block's elements, cropped to `shape`."""
    return np.repeat(np.repeat(per_block, rows, 0), cols, 1)[: shape[0], : shape[1]]


def amax(a: np.ndarray) -> F32:
    """max|a| of one block (NaN if any NaN; 0 for an empty array), float32."""
    return F32(np.max(np.abs(a))) if a.size else F32(0)


def tensor_amax(a: np.ndarray) -> F32:
    """A per-tensor amax (current scaling, NVFP4's amax_tensor): max|a| over the finite values,
    0 if there is none (NUMERICS.md "Non-finite values")."""
    finite = np.abs(a[np.isfinite(a)])
    return F32(np.max(finite)) if finite.size else F32(0)


# ---------------------------------------------------------------- FP8 scales (per tensor and per block)

def pow2_floor(s: F32) -> F32:
    """Largest power of two <= s (s finite, > 0): s = m * 2**e with m in [0.5, 1)."""
    _, e = np.frexp(np.float64(s))
    return F32(np.ldexp(1.0, int(e) - 1))


def fp8_scale(a: F32, fmt_max: float, power_2_scale: bool = False, amax_epsilon: float = 0.0) -> F32:
    """NUMERICS.md "FP8 scale from amax", in float32."""
    a = F32(max(F32(a), F32(amax_epsilon))) if not np.isnan(a) else F32(a)
    if a == 0 or not np.isfinite(a):
        return F32(1)
    with np.errstate(over="ignore"):
        s = F32(F32(fmt_max) / a)
    if np.isinf(s):
        s = FLT_MAX
    return pow2_floor(s) if power_2_scale else s


def fp8_quantize_with_scale(x: np.ndarray, scale: F32, name: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return cast_fp8(x.astype(np.float32) * F32(scale), name)


def fp8_tensorwise(x: np.ndarray, name: str, power_2_scale=False, amax_epsilon=0.0):
    """Current scaling: (codes [M, K], scale_inv) for rowwise; columnwise is the same of x.T."""
    s = fp8_scale(tensor_amax(x), FP8_MAX[name], power_2_scale, amax_epsilon)
    return fp8_quantize_with_scale(x, s, name), F32(F32(1) / s)


def fp8_blockwise(x: np.ndarray, name: str, rows: int, cols: int, power_2_scale=True, amax_epsilon=0.0):
    """FP8 with a scale per (rows x cols) block: (codes [M, K], scale_inv [ceil(M/rows), ceil(K/cols)])."""
    scale = np.ones(num_blocks(x.shape, rows, cols), dtype=np.float32)
    for (i, j), sl in block_slices(x.shape, rows, cols):
        scale[i, j] = fp8_scale(amax(x[sl]), FP8_MAX[name], power_2_scale, amax_epsilon)
    codes = fp8_quantize_with_scale(x, expand(scale, rows, cols, x.shape), name)
    return codes, (F32(1) / scale).astype(np.float32)


# ---------------------------------------------------------------- MXFP8

def e8m0_exponent(a: F32, name: str, scale_mode: str = "round_up") -> int:
    """Unbiased E8M0 exponent b of a block (NUMERICS.md), from float32 bit patterns; None for NaN."""
    if np.isnan(a):
        return None
    if scale_mode == "round_up":
        v = F32(F32(a) / F32(FP8_MAX[name]))  # smallest k with 2**k >= v
        bits = int(np.array(v, dtype=np.float32).view(np.uint32))
        field, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        if v == 0:
            b = -127
        elif field == 0xFF:  # inf
            b = 127
        elif field == 0:  # subnormal: v = man * 2**-149
            b = (man - 1).bit_length() - 149
        else:
            b = field - 127 + (man != 0)
    else:  # "floor": floor(log2(amax)) - emax
        bits = int(np.array(F32(a), dtype=np.float32).view(np.uint32))
        field, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        if a == 0:
            b = -127
        elif field == 0xFF:
            b = 127
        elif field == 0:
            b = man.bit_length() - 1 - 149 - FP8_EMAX[name]
        else:
            b = field - 127 - FP8_EMAX[name]
    return min(max(b, -127), 127)


def mxfp8(x: np.ndarray, name: str, scale_mode: str = "round_up", block: int = 32):
    """(codes [M, K], scale bytes [M, ceil(K/32)] as uint8 = b + 127, 0xFF for a NaN block)."""
    scale_bytes = np.zeros(num_blocks(x.shape, 1, block), dtype=np.uint8)
    multiplier = np.zeros(scale_bytes.shape, dtype=np.float32)  # 2**-b, NaN for a NaN block
    for (i, j), sl in block_slices(x.shape, 1, block):
        b = e8m0_exponent(amax(x[sl]), name, scale_mode)
        scale_bytes[i, j] = 0xFF if b is None else b + 127
        multiplier[i, j] = np.nan if b is None else np.ldexp(F32(1), -b)
    return fp8_quantize_with_scale(x, expand(multiplier, 1, block, x.shape), name), scale_bytes


# ---------------------------------------------------------------- NVFP4

def nvfp4_tensor_scale(amax_tensor: F32) -> F32:
    """S_enc = min(448*6 / amax, FLT_MAX); 1 where that is 0."""
    with np.errstate(divide="ignore"):
        s = F32(F32(448.0 * 6.0) / F32(amax_tensor))
    s = min(s, FLT_MAX)
    return F32(1) if s == 0 else F32(s)


def nvfp4(x: np.ndarray, block_2d: bool = False, amax_tensor: F32 | None = None):
    """NVFP4 of finite x [M, K] (K even), NUMERICS.md step by step.

    Returns (packed bytes [M, K/2], E4M3 scale codes [ceil(M/b), ceil(K/16)] uint8, amax_tensor).
    """
    if amax_tensor is None:
        amax_tensor = tensor_amax(x)
    s_enc = nvfp4_tensor_scale(amax_tensor)
    s_dec = F32(F32(1) / s_enc)
    one_sixth = F32(1.0 / 6.0)
    rows = 16 if block_2d else 1
    scales = np.zeros(num_blocks(x.shape, rows, 16), dtype=np.uint8)  # E4M3 codes of s_b
    enc = np.zeros(scales.shape, dtype=np.float32)
    with np.errstate(over="ignore", divide="ignore"):
        for (i, j), sl in block_slices(x.shape, rows, 16):
            s_b_code = cast_fp8(min(F32(amax(x[sl]) * F32(s_enc * one_sixth)), FLT_MAX), "E4M3")
            s_b = F32(fp8_decode(s_b_code, "E4M3"))
            enc[i, j] = min(F32(F32(1) / F32(s_b * s_dec)), FLT_MAX)
            scales[i, j] = s_b_code
        y = np.clip(x.astype(np.float32) * expand(enc, rows, 16, x.shape), F32(-6), F32(6))
    codes = cast_e2m1(y)
    return pack_nibbles(codes), scales, F32(amax_tensor)


def nvfp4_dequantize(packed: np.ndarray, scale_codes: np.ndarray, amax_tensor: F32, block_2d=False) -> np.ndarray:
    """float(q) * float(s_b) * S_dec in float32, for packed bytes [M, K/2]."""
    codes = e2m1_codes_of(packed)
    rows = 16 if block_2d else 1
    sb = expand(fp8_decode(scale_codes, "E4M3").astype(np.float32), rows, 16, codes.shape)
    s_dec = F32(F32(1) / nvfp4_tensor_scale(amax_tensor))
    return (e2m1_decode(codes).astype(np.float32) * sb) * s_dec


RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float64)


def hadamard16() -> np.ndarray:
    """Sylvester H16: H[i, j] = (-1)**popcount(i & j)."""
    i = np.arange(16)
    parity = np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0)


def rht_float64(x: np.ndarray) -> np.ndarray:
    """Each run of 16 values along the last dim becomes v @ (diag(s) H16) / 4, in float64."""
    r, c = x.shape
    assert c % 16 == 0
    m = (RHT_SIGNS[:, None] * hadamard16()) / 4.0
    return (x.astype(np.float64).reshape(r, c // 16, 16) @ m).reshape(r, c)


# ---------------------------------------------------------------- what NUMERICS.md gives each (recipe, role)

@dataclass(frozen=True)
class Spec:
    """What NUMERICS.md's recipe table gives one (recipe, role): format, block and scale rule.

    DelayedScaling maps to kind "tensor" for its layout; its scale is the slot's, not the amax's.
    """

    kind: str  # "tensor" | "block" | "mx" | "nvfp4"
    fmt: str  # "E4M3" | "E5M2" | "E2M1"
    rows: int = 1  # block rows (1 for 1-D blocks)
    cols: int = 1  # block cols
    pow2: bool = False
    eps: float = 0.0
    mode: str = "round_up"
    rht: bool = False


def fp8_name(fmt: Format, role: str) -> str:
    """HYBRID is E4M3 forward (input, weight) and E5M2 backward (grad_output)."""
    return "E5M2" if fmt is Format.HYBRID and role == "grad_output" else "E4M3"


def spec_for(recipe, role: str) -> Spec:
    if isinstance(recipe, (Float8CurrentScaling, DelayedScaling)):
        pow2 = getattr(recipe, "power_2_scale", False)
        return Spec("tensor", fp8_name(recipe.fp8_format, role), pow2=pow2, eps=getattr(recipe, "amax_epsilon", 0.0))
    if isinstance(recipe, Float8BlockScaling):
        return Spec("block", fp8_name(recipe.fp8_format, role), 128 if role == "weight" else 1, 128,
                    pow2=not recipe.use_f32_scales, eps=recipe.amax_epsilon)
    if isinstance(recipe, MXFP8BlockScaling):
        return Spec("mx", fp8_name(recipe.fp8_format, role), 1, 32, mode=recipe.scale_mode.value)
    if isinstance(recipe, NVFP4BlockScaling):
        two_d = role == "weight" and not recipe.disable_2d_quantization
        return Spec("nvfp4", "E2M1", 16 if two_d else 1, 16, rht=role != "weight" and not recipe.disable_rht)
    raise AssertionError(recipe)


def expected(spec: Spec, x: np.ndarray) -> dict:
    """Oracle output for one orientation of x [M, K]: data bytes, scale bits, amax."""
    if spec.kind == "tensor":
        codes, si = fp8_tensorwise(x, spec.fmt, spec.pow2, spec.eps)
        return dict(data=codes, scale=np.array(si, dtype=np.float32), amax=None)
    if spec.kind == "block":
        codes, si = fp8_blockwise(x, spec.fmt, spec.rows, spec.cols, spec.pow2, spec.eps)
        return dict(data=codes, scale=si, amax=None)
    if spec.kind == "mx":
        codes, sb = mxfp8(x, spec.fmt, spec.mode)
        return dict(data=codes, scale=sb, amax=None)
    packed, sb, a = nvfp4(x, block_2d=spec.rows == 16)
    return dict(data=packed, scale=sb, amax=np.array(a, dtype=np.float32))


def expected_dequantized(spec: Spec, x: np.ndarray) -> np.ndarray:
    """float32 dequantized values of the rowwise copy, from the oracle's codes and scales."""
    e = expected(spec, x)
    if spec.kind == "nvfp4":
        return nvfp4_dequantize(e["data"], e["scale"], e["amax"], block_2d=spec.rows == 16)
    values = fp8_decode(e["data"], spec.fmt).astype(np.float32)
    if spec.kind == "tensor":
        return values * e["scale"]
    if spec.kind == "block":
        return values * expand(e["scale"], spec.rows, spec.cols, x.shape)
    mult = np.ldexp(np.float32(1), e["scale"].astype(np.int32) - 127).astype(np.float32)
    return values * expand(mult, 1, 32, x.shape)
