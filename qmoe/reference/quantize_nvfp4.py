"""Reference NVFP4 quantization: E2M1 codes, E4M3 block scales, fp32 tensor amax (NUMERICS.md).

The executable spec of `qmoe/kernels/quantize_nvfp4.py`. x is [M, K]; data is packed two
codes per byte (even element in the low nibble): rowwise [M, K/2], columnwise [K, M/2].
"""
from __future__ import annotations

import torch

from qmoe.contracts.formats import E2M1, E2M1_GRID, E4M3, FLT_MAX, NVFP4_BLOCK, RHT_SIGNS, RHT_SIZE, \
    e2m1_decode, nvfp4_tensor_scale, pack_e2m1, unpack_e2m1
from qmoe.reference.quantize import block_amax, cast_satfinite, expand_blocks, saturate_to

_GRID = torch.tensor(E2M1_GRID, dtype=torch.float32)
_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # fp32(1/6), as kernels use it
# Round-to-nearest-even decision points between neighbouring grid values: a tie goes to the
# value with an even mantissa (0, 1, 2, 4), so the upper bound is inclusive for those.
_UPPER = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_DOWN = (True, False, True, False, True, False, True)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| over finite values (0-dim fp32): an inf or NaN then affects its own block only."""
    a = x.abs().float()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax() if a.numel() else torch.zeros((), dtype=torch.float32, device=x.device)


def e2m1_round_nearest(a: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 for |y| in [0, 6], RNE on the E2M1 grid."""
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i, (hi, tie_down) in enumerate(zip(_UPPER, _TIES_DOWN)):
        beyond = (a > hi) if tie_down else (a >= hi)
        code = torch.where(beyond, torch.full_like(code, i + 1), code)
    return code


def e2m1_round_stochastic(a: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Magnitude codes for |y| in [0, 6]: up with probability (a - lo) / (hi - lo)."""
    grid = _GRID.to(a.device)
    lo_code = (torch.bucketize(a.contiguous(), grid, right=True) - 1).clamp(0, 7)
    hi_code = (lo_code + 1).clamp(max=7)
    lo, hi = grid[lo_code], grid[hi_code]
    p = torch.where(hi > lo, (a - lo) / (hi - lo), torch.zeros_like(a))
    return torch.where(rand < p, hi_code, lo_code).to(torch.uint8)


def _quantize_1d_or_2d(x: torch.Tensor, s_enc: torch.Tensor, block: tuple[int, int], rand):
    """Codes [M, K] (unpacked) and E4M3 block scales for x [M, K] in fp32."""
    s_dec = 1.0 / s_enc
    sb = cast_satfinite((block_amax(x, block) * (s_enc * _ONE_SIXTH)).clamp(max=FLT_MAX), E4M3)
    enc = (1.0 / (sb.float() * s_dec)).clamp(max=FLT_MAX)  # NaN stays NaN; 1/0 = inf -> FLT_MAX
    y = (x * expand_blocks(enc, block, tuple(x.shape))).clamp(-E2M1.max, E2M1.max)
    return e2m1_codes(y, rand), sb


def e2m1_codes(y: torch.Tensor, rand: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit codes (uint8) of y in [-6, 6] fp32: RNE, or stochastic with uniforms `rand`;
    NaN -> 0, and a negative value that rounds to 0 -> the +0 code."""
    a = y.abs()
    mag = e2m1_round_nearest(a) if rand is None else e2m1_round_stochastic(a, rand)
    mag = torch.where(torch.isnan(y), torch.zeros_like(mag), mag)
    return torch.where((y < 0) & (mag != 0), mag | 0x8, mag)


def hadamard_matrix(n: int = RHT_SIZE, dtype=torch.float64, device=None) -> torch.Tensor:
    """(diag(s) @ H_n) / sqrt(n): the orthonormal random Hadamard transform of NUMERICS.md."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    s = torch.tensor(RHT_SIGNS[:n], dtype=dtype, device=device)
    return s[:, None] * h / n ** 0.5


def random_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Each run of 16 consecutive values along the last dim becomes v @ (diag(s) H16) / 4.

    Computed in float64 and rounded to fp32: the exactly rounded transform wherever a run's exact
    sums fit float64's 53 bits, that is, its nonzero magnitudes lie within about 2^41 of each
    other for bf16 / fp16 input and 2^25 for fp32. A run mixing wider magnitudes (1e-30 beside 6)
    is rounded twice and may differ from the exact transform in its last bit.
    """
    m, k = x.shape
    if k % RHT_SIZE:
        raise ValueError(f"the random Hadamard transform needs the quantized dimension ({k}) to be a "
                         f"multiple of {RHT_SIZE}; pad the rows or use NVFP4BlockScaling(disable_rht=True)")
    h = hadamard_matrix(device=x.device)
    return (x.double().reshape(m, k // RHT_SIZE, RHT_SIZE) @ h).reshape(m, k).float()


def quantize_nvfp4(x: torch.Tensor, block_2d: bool = False, rowwise: bool = True, columnwise: bool = False,
                   rht: bool = False, stochastic: bool = False, generator: torch.Generator | None = None):
    """NVFP4-quantize x [M, K].

    block_2d: 16x16 blocks shared by both orientations (weights); else 1x16 along each copy.
    rht: apply the random Hadamard transform to the columnwise copy (its amax is taken after it).
    stochastic: stochastic rounding from `generator` (both copies).
    Returns (row_data [M, K/2] u8, row_scale [M, ceil(K/16)] e4m3, row_amax 0-dim fp32,
             col_data [K, M/2] u8, col_scale [K, ceil(M/16)] e4m3, col_amax 0-dim fp32); the
    2-D block scales are [ceil(M/16), ceil(K/16)] and its transpose.
    """
    if block_2d and rht:
        raise ValueError("the random Hadamard transform applies to 1x16 (activation/gradient) copies only")
    m, k = x.shape
    if rowwise and k % 2:
        raise ValueError(f"NVFP4 packs two values per byte: the last dimension ({k}) must be even")
    if columnwise and m % 2:
        raise ValueError(f"NVFP4 columnwise data packs two rows per byte: the row count ({m}) must be even")
    xf = x.float()
    block = (NVFP4_BLOCK, NVFP4_BLOCK) if block_2d else (1, NVFP4_BLOCK)

    def rand_like(t):
        if not stochastic:
            return None
        return torch.rand(t.shape, generator=generator, dtype=torch.float32, device=t.device)

    row = row_s = row_amax = col = col_s = col_amax = None
    amax = row_amax = finite_amax(xf)  # the tensor amax, kept whichever copies are made
    if rowwise:
        codes, row_s = _quantize_1d_or_2d(xf, nvfp4_tensor_scale(amax), block, rand_like(xf))
        row = pack_e2m1(codes)
    if columnwise:
        xt = xf.t()
        if block_2d:
            col_amax = amax
            codes, sb = _quantize_1d_or_2d(xt, nvfp4_tensor_scale(amax), block, rand_like(xt))
            col_s = sb
        else:
            if rht:
                xt = random_hadamard_transform(xt)
            col_amax = finite_amax(xt)
            codes, col_s = _quantize_1d_or_2d(xt, nvfp4_tensor_scale(col_amax), block, rand_like(xt))
        col = pack_e2m1(codes.contiguous())
    return row, row_s, row_amax, col, col_s, col_amax


def dequantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, block_2d: bool = False,
                     dtype=torch.float32):
    """float(q) * float(s_b) * S_dec, for packed data [M, K/2] and its block scales."""
    codes = unpack_e2m1(data)
    block = (NVFP4_BLOCK, NVFP4_BLOCK) if block_2d else (1, NVFP4_BLOCK)
    s_dec = 1.0 / nvfp4_tensor_scale(amax)
    sb = expand_blocks(scale.float(), block, tuple(codes.shape))
    return saturate_to(e2m1_decode(codes) * sb * s_dec, dtype)
