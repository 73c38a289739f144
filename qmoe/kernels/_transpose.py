"""Dense transposed copies of small 2-D tensors (private helper of `_gluon_sm90`): block scales
stored row-major (from a user, or unpacked after an expert-parallel all-to-all) moved to the
steps-major layout the block GEMMs stream; the casts store theirs that way already.
Its spec is torch's `src.t()`, which the tests hold it to bit for bit.

torch's `copy_` from a transposed view reads one side a row apart per element; this kernel
loads a tile along the source's rows, transposes it in registers and stores it along the
output's rows, so both sides move whole lines. Bits are copied as integers of the same width,
whatever the dtype (fp32 scales, E8M0 bytes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.kernels._layout import raw_bits


@triton.jit
def _transpose_kernel(src_ptr, out_ptr, R, C, stride_src, stride_out, BR: tl.constexpr, BC: tl.constexpr):
    """out[c, r] = src[r, c] for src [R, C] and out [C, R], each with unit column stride and the
    given row stride; program (i, j) moves columns i * BC.. and rows j * BR.. (columns first: the
    long side takes the grid's large first dimension)."""
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    ok = (r < R)[:, None] & (c < C)[None, :]
    tile = tl.load(src_ptr + r.to(tl.int64)[:, None] * stride_src + c[None, :], mask=ok)
    tl.store(out_ptr + c.to(tl.int64)[:, None] * stride_out + r[None, :], tl.trans(tile), mask=tl.trans(ok))


def _rows(t: torch.Tensor) -> bool:
    """Whether t's rows are dense runs that do not overlap (unit column stride)."""
    return (t.shape[1] <= 1 or t.stride(1) == 1) and (t.shape[0] <= 1 or t.stride(0) >= max(t.shape[1], 1))


def transpose_into(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """out <- src.t() for src [R, C] and out [C, R] of the same dtype (bits copied), each with
    dense rows (a row stride of its own, e.g. rows padded for TMA); returns out."""
    if src.dim() != 2 or out.shape != src.shape[::-1] or out.dtype != src.dtype or out.device != src.device:
        raise ValueError(f"transpose_into: out {tuple(out.shape)} {out.dtype} must be src's "
                         f"{tuple(src.shape)} {src.dtype} transposed, on its device")
    if not (_rows(src) and _rows(out)):
        raise ValueError("transpose_into takes tensors whose rows are dense (unit column stride; "
                         "call .contiguous() first)")
    r, c = src.shape
    if r * c == 0:
        return out
    tile = 128 if src.element_size() == 1 else 64  # a 128-byte line of bytes, 256 bytes of words
    _transpose_kernel[(triton.cdiv(c, tile), triton.cdiv(r, tile))](
        raw_bits(src), raw_bits(out), r, c, src.stride(0) if r > 1 else c, out.stride(0) if c > 1 else r,
        BR=tile, BC=tile, num_warps=4)
    return out
