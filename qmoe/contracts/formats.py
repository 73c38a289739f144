"""Element formats: the one home of every maximum, block size and scale-format helper.

Everything here is plain torch and follows NUMERICS.md; kernels mirror these constants
through their launchers, never by repeating literals.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

FLT_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class ElementFormat:
    """A low-precision element format: its name, storage dtype, largest finite value."""

    name: str
    dtype: torch.dtype  # dtype of the stored data (uint8 for packed E2M1)
    max: float
    emax: int  # exponent of the largest power of two in the format (OCP MX rule)
    bits: int

    def __str__(self) -> str:
        return self.name


E4M3 = ElementFormat("E4M3", torch.float8_e4m3fn, 448.0, 8, 8)
E5M2 = ElementFormat("E5M2", torch.float8_e5m2, 57344.0, 15, 8)
E2M1 = ElementFormat("E2M1", torch.uint8, 6.0, 2, 4)

# E2M1 magnitudes by code (bits 0..2); bit 3 is the sign.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# NVFP4's per-tensor encoding maps amax onto the product of both maxima (E4M3 scale x E2M1 value).
NVFP4_TENSOR_MAX = E4M3.max * E2M1.max

# Block sizes, by recipe role (NUMERICS.md).
FP8_BLOCK = 128
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
RHT_SIZE = 16
# Sign vector of the random Hadamard transform (NUMERICS.md).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

E8M0_BIAS = 127
E8M0_NAN = 0xFF


class ScaleMode(enum.Enum):
    """How an MXFP8 block exponent is chosen from the block amax."""

    ROUND_UP = "round_up"  # smallest 2^k with amax / fmt_max <= 2^k: never saturates (TE default)
    FLOOR = "floor"  # OCP MX v1.0: floor(log2(amax)) - emax, may saturate the largest values


def fp8_format(dtype: torch.dtype) -> ElementFormat:
    """The ElementFormat of an FP8 torch dtype."""
    for f in (E4M3, E5M2):
        if f.dtype == dtype:
            return f
    raise ValueError(f"{dtype} is not an FP8 element dtype (float8_e4m3fn or float8_e5m2)")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Value 2^(b-127) of E8M0 scales (float8_e8m0fnu or raw uint8 bytes); 0xFF is NaN."""
    b = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    out = torch.exp2(b.to(torch.float32) - E8M0_BIAS)
    return torch.where(b == E8M0_NAN, torch.full_like(out, float("nan")), out)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of 4-bit E2M1 codes held one per uint8 (low nibble)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    mag = grid[c & 0x7]
    return torch.where((c & 0x8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [..., 2n] (uint8) into bytes [..., n], even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing E2M1 needs an even last dimension, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_e2m1: bytes [..., n] -> codes [..., 2n] (uint8)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor encode scale S_enc = min(448*6 / amax, FLT_MAX), 1 where that is 0.

    Shared by the quantizer, the GEMM (which divides by it) and their reference twins, so one
    definition fixes the bits of every path.
    """
    s = torch.full((), NVFP4_TENSOR_MAX, dtype=torch.float32, device=amax.device) / amax.float()  # true division
    s = torch.where(torch.isnan(s) | (s > FLT_MAX), torch.full_like(s, FLT_MAX), s)
    return torch.where(s == 0, torch.ones_like(s), s)
