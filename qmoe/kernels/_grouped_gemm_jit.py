"""Triton bodies of the grouped GEMMs (launchers: `qmoe/kernels/grouped_gemm.py`).

Every GEMM is NT: out = A @ B^T with both operands stored contraction-contiguous
(rowwise [rows, K] or a columnwise copy [features, tokens]), the layout Hopper's tensor
cores want for FP8. One body per GEMM shape, specialised at compile time by SCALING:

  0 NONE    plain bf16/fp16/fp32 operands
  1 TENSOR  FP8 codes straight into tl.dot; per-group scale_inv product in the epilogue
  2 BLOCK   FP8 codes; each BK = 128 step is its own dot, promoted to the fp32 accumulator
            times the A-row and B-row block scales (DeepSeek-V3's "promotion")
  3 MX      FP8 codes times E8M0 2^k, exact in bf16, dequantized in registers, bf16 tl.dot
  4 NVFP4   E2M1 codes times the E4M3 block scale, exact in bf16, bf16 tl.dot; the two
            tensor-amax factors scale the fp32 accumulator in the epilogue (HAS_FACTOR)

Tiles never read across a group boundary: rows past a group's end and contraction steps
past its length load as zeros, so padding rows produce zero rows and empty groups zeros.
"""
import os

import torch
import triton
import triton.language as tl

from qmoe.kernels._arith import cast_satfinite

_NONE = tl.constexpr(0)
_TENSOR = tl.constexpr(1)
_BLOCK = tl.constexpr(2)
_MX = tl.constexpr(3)
_NVFP4 = tl.constexpr(4)
# Triton's CPU interpreter runs no inline PTX and multiplies bf16 tiles in tl.dot as raw bits;
# under it the E2M1 decode takes the arithmetic path and bf16 tiles go to tl.dot as fp32 (the
# same values). Compiled kernels never see these branches.
_INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_BF16_MAX = tl.constexpr(torch.finfo(torch.bfloat16).max)  # exact in fp32

# Four packed bytes ($4) -> bf16 values of their low nibbles ($0, $1) and high nibbles ($2, $3),
# two per register, element i of the pack from byte i. `prmt` looks up 8-entry byte tables
# indexed by the codes' magnitude bits: the low and high bytes of the bf16 encodings of
# 0, 0.5, 1, 1.5, 2, 3, 4, 6 (exact); a second permute pairs them into bf16x2 words, and the
# sign (bit 3 of a code) comes from prmt's sign-replicate mode (selector bit 3) on the byte
# whose top bit holds it (x << 4 for low nibbles, x for high ones), masked into bit 15 / 31.
_E2M1_PAIRS_TO_BF16 = tl.constexpr("""
{
.reg .b32 c0, c1, l01, h01, l23, h23, xs, w, s;
and.b32 c0, $4, 0x7777;
shr.b32 c1, $4, 16;
and.b32 c1, c1, 0x7777;
shl.b32 xs, $4, 4;
prmt.b32 l01, 0xC0800000, 0xC0804000, c0;
prmt.b32 h01, 0x3F3F3F00, 0x40404040, c0;
prmt.b32 l23, 0xC0800000, 0xC0804000, c1;
prmt.b32 h23, 0x3F3F3F00, 0x40404040, c1;
prmt.b32 w, l01, h01, 0x6240;
prmt.b32 s, xs, 0, 0x9080;
lop3.b32 $0, w, s, 0x80008000, 0xF8;
prmt.b32 w, l23, h23, 0x6240;
prmt.b32 s, xs, 0, 0xB0A0;
lop3.b32 $1, w, s, 0x80008000, 0xF8;
prmt.b32 w, l01, h01, 0x7351;
prmt.b32 s, $4, 0, 0x9080;
lop3.b32 $2, w, s, 0x80008000, 0xF8;
prmt.b32 w, l23, h23, 0x7351;
prmt.b32 s, $4, 0, 0xB0A0;
lop3.b32 $3, w, s, 0x80008000, 0xF8;
}
""")


# ---------------------------------------------------------------- operand tiles

@triton.jit
def _swizzle(local, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile index -> (pm, pn), GROUP_M row tiles at a time so neighbours share B tiles in L2."""
    width = GROUP_M * num_n
    first_m = (local // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pm = first_m + (local % width) % size_m
    pn = (local % width) // size_m
    return pm, pn


@triton.jit
def _e8m0_to_float(e):
    """E8M0 bytes (int32 0..255) -> exact fp32 2^(e-127); 0 -> 2^-127 (subnormal); 255 -> NaN."""
    bits = (e << 23) | ((e == 255).to(tl.int32) << 22)
    bits = tl.where(e == 0, 0x400000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_float(codes):
    """E2M1 codes (int32 0..15) -> fp32 value * 2^-14, exactly, via the fp16 bit layout.

    Magnitude bits go to fp16's two lowest exponent bits and top mantissa bit; the code's
    subnormal (0.5) lands on fp16's subnormal, so one factor 2^14 (folded into the block
    scale by the caller) restores every value.
    """
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_pairs_to_bf16(packed):
    """Bytes [R, C] of two E2M1 codes (element 2j in the low nibble) -> exact bf16 values [R, 2C]."""
    lo, hi = tl.inline_asm_elementwise(_E2M1_PAIRS_TO_BF16, "=r,=r,=r,=r,r", [packed],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.interleave(lo, hi)


@triton.jit
def _scale_tile(s_ptr, srows, row_ok, kk, k_len, s_stride_r, s_stride_k,
                BC: tl.constexpr, BK: tl.constexpr, MASK_K: tl.constexpr, OTHER: tl.constexpr):
    """Block scales [R, BK // BC] of contraction steps kk..kk+BK (kk a multiple of BC)."""
    sk = kk // BC + tl.arange(0, BK // BC)
    m = row_ok[:, None]
    if MASK_K:
        m = m & (sk[None, :] * BC < k_len)
    return tl.load(s_ptr + srows.to(tl.int64)[:, None] * s_stride_r + sk[None, :] * s_stride_k, mask=m, other=OTHER)


@triton.jit
def _times_blocks(x, s, R: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """x [R, BK] times s [R, BK // BC], each scale over BC consecutive values."""
    y = tl.reshape(x, (R, BK // BC, BC)) * s[:, :, None]
    return tl.reshape(y, (R, BK))


@triton.jit
def _tile(ptr, s_ptr, rows, srows, row_ok, kk, k_len, elem0, stride_r, stride_k, s_stride_r, s_stride_k,
          SCALING: tl.constexpr, BC: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
          MASK_K: tl.constexpr, PAIRED: tl.constexpr):
    """One [R, BK] operand tile at contraction steps kk..kk+BK, ready for tl.dot.

    rows: [R] data rows (relative to ptr); srows: their scale rows; row_ok: [R] mask.
    NVFP4 data is bytes: PAIRED reads code pairs (ptr at an even element); otherwise element
    elem0 + kk + j is read from byte (elem0 + kk + j) // 2 (a group starting mid-byte).
    Returns fp8 codes (TENSOR, BLOCK), exact bf16 values (MX, NVFP4; NVFP4 without its tensor
    factor; MX saturated at bf16's range: finite codes give finite values) or the plain values (NONE). Masked
    elements are zero.
    """
    r64 = rows.to(tl.int64)
    ks = kk + tl.arange(0, BK)
    m = row_ok[:, None]
    if MASK_K:
        m = m & (ks[None, :] < k_len)
    if SCALING == _NVFP4:
        if PAIRED:
            kb = kk // 2 + tl.arange(0, BK // 2)
            mp = row_ok[:, None]
            if MASK_K:
                mp = mp & (kb[None, :] * 2 < k_len)
            packed = tl.load(ptr + r64[:, None] * stride_r + kb[None, :] * stride_k, mask=mp, other=0)
            if not _INTERPRETING:  # exact bf16 values times the E4M3 scale: <= 6 significant bits, exact in bf16
                sb = _scale_tile(s_ptr, srows, row_ok, kk, k_len, s_stride_r, s_stride_k, BC, BK, MASK_K, 0.0)
                return _times_blocks(_e2m1_pairs_to_bf16(packed.to(tl.uint8, bitcast=True)), sb.to(tl.bfloat16),
                                     R, BK, BC)
            packed = packed.to(tl.int32)
            codes = tl.interleave(packed & 15, packed >> 4)
        else:
            e = elem0 + ks
            byte = tl.load(ptr + r64[:, None] * stride_r + (e // 2)[None, :] * stride_k, mask=m, other=0).to(tl.int32)
            codes = (byte >> ((e & 1) * 4)[None, :]) & 15
        sb = _scale_tile(s_ptr, srows, row_ok, kk, k_len, s_stride_r, s_stride_k, BC, BK, MASK_K, 0.0)
        x = _times_blocks(_e2m1_to_float(codes), sb.to(tl.float32) * 16384.0, R, BK, BC).to(tl.bfloat16)
    elif SCALING == _MX:
        x = tl.load(ptr + r64[:, None] * stride_r + ks[None, :] * stride_k, mask=m, other=0.0)
        e = _scale_tile(s_ptr, srows, row_ok, kk, k_len, s_stride_r, s_stride_k, BC, BK, MASK_K, 127)
        x = cast_satfinite(_times_blocks(x.to(tl.float32), _e8m0_to_float(e.to(tl.int32)), R, BK, BC), _BF16_MAX,
                           tl.bfloat16)
    else:
        x = tl.load(ptr + r64[:, None] * stride_r + ks[None, :] * stride_k, mask=m, other=0.0)
    return x


@triton.jit
def _block_scale(s_ptr, srows, row_ok, kk, s_stride_r, s_stride_k, BC: tl.constexpr):
    """The fp32 block scale of each row at contraction step kk (BLOCK scaling: BK == BC)."""
    return tl.load(s_ptr + srows.to(tl.int64) * s_stride_r + (kk // BC) * s_stride_k, mask=row_ok, other=0.0)


@triton.jit
def _mma(acc, a, b, SCALING: tl.constexpr, PRECISE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BK: tl.constexpr):
    """acc += a @ b^T (all scalings but BLOCK)."""
    if SCALING == _TENSOR:
        if PRECISE:  # promote each BK step to fp32: Hopper's FP8 accumulator keeps ~14 bits
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BK)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    elif _INTERPRETING:
        acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _promote(acc, a, b, s_rows, s_cols, VECTOR_AXIS: tl.constexpr):
    """BLOCK: one fresh dot per 128-K step, added to the fp32 accumulator times its block scales.

    s_rows scales the product's rows, s_cols its columns. VECTOR_AXIS -1: both are vectors (an
    outer product, two operations per element). 0 or 1: the other one is a single number (a
    128 x 128 weight block spans the tile), so the factor is one vector along that axis and the
    promotion one FMA per element. The CUDA cores do this while the tensor cores idle: it is
    what BLOCK pays over plain FP8 (benchmarks/results/sweeps/block_gemm_variants.json).
    """
    p = tl.dot(a, tl.trans(b))
    if VECTOR_AXIS == 0:
        acc += p * (s_rows * s_cols)[:, None]
    elif VECTOR_AXIS == 1:
        acc += p * (s_rows * s_cols)[None, :]
    else:
        acc += p * (s_rows[:, None] * s_cols[None, :])
    return acc


# ---------------------------------------------------------------- m-grouped: fprop and dgrad

@triton.jit
def m_grouped_gemm_kernel(
        # pointers
        a_ptr, b_ptr, out_ptr, offs_ptr, sa_ptr, sb_ptr, fa_ptr, fb_ptr,
        # sizes
        total_rows, N, K, num_groups,
        # strides (elements of storage: bytes for NVFP4 data)
        stride_am, stride_ak, stride_bn, stride_bk, b_group_stride, stride_om, stride_on,
        s_stride_am, s_stride_ak, s_stride_bn, s_stride_bk, sb_group_stride,
        # meta
        SCALING: tl.constexpr, A_BC: tl.constexpr, B_BR: tl.constexpr, B_BC: tl.constexpr,
        HAS_FACTOR: tl.constexpr, PRECISE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, GP: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr, MASK_K: tl.constexpr, SWAP: tl.constexpr, TILE_SCALE_B: tl.constexpr):
    """out[T, N] = A_g [M_g, K] @ B_g [N, K]^T per group, persistent over a static grid.

    Group g owns rows offs[g]:offs[g+1] of A and out; B_g starts g * b_group_stride into b.
    Rows offs[G]:total_rows belong to no group (a pseudo-group G) and are written as zeros.
    Each program walks tiles pid, pid + NUM_PROGRAMS, ... of all groups' tiles, which it
    locates from the device offsets alone: no host sync, graph-capturable.

    SWAP computes each tile transposed, out^T = B_g @ A_g^T, for few rows per group: the
    weight tile fills the tensor cores' 64-row side (the token tile BM may be 16) and, when
    dequantized in registers, feeds them from registers instead of a round trip to shared memory.

    TILE_SCALE_B (BLOCK, BN divides B_BR): a tile's columns share one weight block row, so each
    step's promotion factor is a vector over the tile's token rows, not a [BM, BN] outer product.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    gi = tl.arange(0, GP)
    starts = tl.load(offs_ptr + gi, mask=gi <= num_groups, other=0).to(tl.int32)
    ends = tl.load(offs_ptr + gi + 1, mask=gi < num_groups, other=0).to(tl.int32)
    ends = tl.where(gi == num_groups, total_rows, ends)
    tiles = tl.cdiv(tl.maximum(ends - starts, 0), BM) * num_n
    tile_end = tl.cumsum(tiles, 0)
    total_tiles = tl.sum(tiles, 0)
    for t in range(pid, total_tiles, NUM_PROGRAMS):
        g = tl.sum((tile_end <= t).to(tl.int32), 0)
        sel = gi == g
        m_start = tl.sum(tl.where(sel, starts, 0), 0)
        m_end = tl.sum(tl.where(sel, ends, 0), 0)
        local = t - tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
        pm, pn = _swizzle(local, tl.cdiv(m_end - m_start, BM), num_n, GROUP_M)
        rows = m_start + pm * BM + tl.arange(0, BM)
        row_ok = rows < m_end
        cols = pn * BN + tl.arange(0, BN)
        col_ok = cols < N
        gb = tl.minimum(g, num_groups - 1).to(tl.int64)
        b_base = b_ptr + gb * b_group_stride
        sb_base = sb_ptr + gb * sb_group_stride
        k_end = tl.where(g < num_groups, K, 0)
        if SWAP:  # tiles [BN, BM]: lhs = B, rhs = A
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(0, k_end, BK):
            a = _tile(a_ptr, sa_ptr, rows, rows, row_ok, kk, K, 0, stride_am, stride_ak, s_stride_am, s_stride_ak,
                      SCALING, A_BC, BM, BK, MASK_K, True)
            b = _tile(b_base, sb_base, cols, cols // B_BR, col_ok, kk, K, 0, stride_bn, stride_bk,
                      s_stride_bn, s_stride_bk, SCALING, B_BC, BN, BK, MASK_K, True)
            if SCALING == _BLOCK:
                sa = _block_scale(sa_ptr, rows, row_ok, kk, s_stride_am, s_stride_ak, A_BC)
                if TILE_SCALE_B:  # one weight block spans the tile's columns: one scale per step
                    sb = tl.load(sb_base + (pn * BN // B_BR) * s_stride_bn + (kk // B_BC) * s_stride_bk)
                else:
                    sb = _block_scale(sb_base, cols // B_BR, col_ok, kk, s_stride_bn, s_stride_bk, B_BC)
                if SWAP:
                    acc = _promote(acc, b, a, sb, sa, 1 if TILE_SCALE_B else -1)
                else:
                    acc = _promote(acc, a, b, sa, sb, 0 if TILE_SCALE_B else -1)
            elif SWAP:
                acc = _mma(acc, b, a, SCALING, PRECISE, INPUT_PRECISION, BK)
            else:
                acc = _mma(acc, a, b, SCALING, PRECISE, INPUT_PRECISION, BK)
        if SWAP:
            acc = tl.trans(acc)
        if HAS_FACTOR:
            acc = acc * (tl.load(fa_ptr + gb) * tl.load(fb_ptr + gb))
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------- k-grouped: wgrad

@triton.jit
def _k_loop(a_ptr, b_ptr, sa_ptr, sb_ptr, rows, row_ok, cols, col_ok, start, end,
            stride_an, stride_at, stride_bk, stride_bt, s_stride_an, s_stride_at, s_stride_bk, s_stride_bt,
            SCALING: tl.constexpr, A_BC: tl.constexpr, B_BC: tl.constexpr, PRECISE: tl.constexpr,
            INPUT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            ALIGNED: tl.constexpr):
    """Sum over the group's tokens start..end of A[rows, t] * B[cols, t] (fp32 [BM, BN])."""
    length = end - start
    a_base = a_ptr
    b_base = b_ptr
    elem0 = start
    if SCALING == _NVFP4:
        if ALIGNED:  # the group starts on a byte: read code pairs from its first byte
            a_base = a_ptr + (start // 2).to(tl.int64) * stride_at
            b_base = b_ptr + (start // 2).to(tl.int64) * stride_bt
            elem0 = start * 0
    else:
        a_base = a_ptr + start.to(tl.int64) * stride_at
        b_base = b_ptr + start.to(tl.int64) * stride_bt
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, length, BK):
        a = _tile(a_base, sa_ptr, rows, rows, row_ok, kk, length, elem0, stride_an, stride_at, s_stride_an,
                  s_stride_at, SCALING, A_BC, BM, BK, True, ALIGNED)
        b = _tile(b_base, sb_ptr, cols, cols, col_ok, kk, length, elem0, stride_bk, stride_bt, s_stride_bk,
                  s_stride_bt, SCALING, B_BC, BN, BK, True, ALIGNED)
        if SCALING == _BLOCK:
            sa = _block_scale(sa_ptr, rows, row_ok, kk, s_stride_an, s_stride_at, A_BC)
            sb = _block_scale(sb_ptr, cols, col_ok, kk, s_stride_bk, s_stride_bt, B_BC)
            acc = _promote(acc, a, b, sa, sb, -1)
        else:
            acc = _mma(acc, a, b, SCALING, PRECISE, INPUT_PRECISION, BK)
    return acc


@triton.jit
def k_grouped_gemm_kernel(
        # pointers
        a_ptr, b_ptr, out_ptr, offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr, fa_ptr, fb_ptr,
        # sizes
        N, K,
        # strides (elements of storage: bytes for NVFP4 data)
        stride_an, stride_at, stride_bk, stride_bt, stride_og, stride_on, stride_ok,
        s_stride_an, s_stride_at, s_stride_bk, s_stride_bt,
        # meta
        SCALING: tl.constexpr, A_BC: tl.constexpr, B_BC: tl.constexpr, HAS_SOFFS: tl.constexpr,
        HAS_FACTOR: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        GROUP_M: tl.constexpr, ALIGN: tl.constexpr):
    """out[g] [N, K] = A[:, tokens of g] @ B[:, tokens of g]^T; one program per output tile.

    A is [N, T] and B [K, T] (columnwise copies: tokens contiguous). Groups whose start and
    end are multiples of ALIGN (16 bytes of data; 1 when tokens are not contiguous) take a
    loop the compiler can vectorise; others take the general one. An empty group loops zero times and writes zeros.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BM)
    num_n = tl.cdiv(K, BN)
    per_group = num_m * num_n
    g = pid // per_group
    pm, pn = _swizzle(pid % per_group, num_m, num_n, GROUP_M)
    rows = pm * BM + tl.arange(0, BM)
    row_ok = rows < N
    cols = pn * BN + tl.arange(0, BN)
    col_ok = cols < K
    start = tl.load(offs_ptr + g).to(tl.int32)
    end = tl.load(offs_ptr + g + 1).to(tl.int32)
    sa_base = sa_ptr
    sb_base = sb_ptr
    if HAS_SOFFS:  # 1-D block scales: the group's first scale column
        sa_base = sa_ptr + tl.load(soffs_a_ptr + g) * s_stride_at
        sb_base = sb_ptr + tl.load(soffs_b_ptr + g) * s_stride_bt
    if ALIGN > 1:  # tokens contiguous: aligned groups take the vectorisable loop
        if (start % ALIGN == 0) & (end % ALIGN == 0):
            acc = _k_loop(a_ptr, b_ptr, sa_base, sb_base, rows, row_ok, cols, col_ok,
                          start // ALIGN * ALIGN, end // ALIGN * ALIGN, stride_an, stride_at, stride_bk, stride_bt,
                          s_stride_an, s_stride_at, s_stride_bk, s_stride_bt,
                          SCALING, A_BC, B_BC, PRECISE, INPUT_PRECISION, BM, BN, BK, True)
        else:
            acc = _k_loop(a_ptr, b_ptr, sa_base, sb_base, rows, row_ok, cols, col_ok, start, end,
                          stride_an, stride_at, stride_bk, stride_bt, s_stride_an, s_stride_at, s_stride_bk,
                          s_stride_bt,
                          SCALING, A_BC, B_BC, PRECISE, INPUT_PRECISION, BM, BN, BK, False)
    else:
        acc = _k_loop(a_ptr, b_ptr, sa_base, sb_base, rows, row_ok, cols, col_ok, start, end,
                      stride_an, stride_at, stride_bk, stride_bt, s_stride_an, s_stride_at, s_stride_bk, s_stride_bt,
                      SCALING, A_BC, B_BC, PRECISE, INPUT_PRECISION, BM, BN, BK, False)
    if HAS_FACTOR:
        acc = acc * (tl.load(fa_ptr + g) * tl.load(fb_ptr + g))
    out = out_ptr + g.to(tl.int64) * stride_og + rows.to(tl.int64)[:, None] * stride_on + cols[None, :] * stride_ok
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- exact dequantize to bf16, zero rows

@triton.jit
def dequantize_kernel(
        # pointers
        x_ptr, s_ptr, out_ptr, cidx_ptr,
        # sizes: R x C elements; rows in groups of GR sharing GSR scale rows; columns in groups of GC
        R, C, GR, GSR, GC, GSC,
        # strides
        stride_xr, stride_xc, s_stride_r, s_stride_c, stride_or, stride_oc,
        # meta
        SCALING: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, GATHER: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out = codes * block scale in bf16, exactly (MX: q * 2^k, saturated at bf16's range; NVFP4:
    q * s_b, no tensor factor).

    Scale row of data row r: (r // GR) * GSR + (r % GR) // BR. Columns: with GATHER, element c's
    scale column is cidx[c] (column groups whose width is not a multiple of BLOCK_C); otherwise
    a tile lies in one column group of width GC with GSC scale columns. Token-grouped operands
    take `dequantize_tokens_kernel`.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    srows = (rows // GR) * GSR + (rows % GR) // BR
    c0 = pid_c * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    if GATHER:
        col_ok = cols < C
        m = row_ok[:, None] & col_ok[None, :]
        sc = tl.load(cidx_ptr + cols, mask=col_ok, other=0)
        sp = s_ptr + srows.to(tl.int64)[:, None] * s_stride_r + sc[None, :] * s_stride_c
        r64 = rows.to(tl.int64)[:, None] * stride_xr
        if SCALING == _NVFP4:
            s = tl.load(sp, mask=m, other=0.0)
            byte = tl.load(x_ptr + r64 + (cols // 2)[None, :] * stride_xc, mask=m, other=0).to(tl.int32)
            codes = (byte >> ((cols & 1) * 4)[None, :]) & 15
            x = _e2m1_to_float(codes) * (s.to(tl.float32) * 16384.0)
        else:
            s = tl.load(sp, mask=m, other=127)
            x = tl.load(x_ptr + r64 + cols[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
            x = cast_satfinite(x * _e8m0_to_float(s.to(tl.int32)), _BF16_MAX, tl.bfloat16)
    else:
        col_ok = cols < C
        m = row_ok[:, None]
        base = (c0 // GC).to(tl.int64)
        kk = c0 % GC
        if SCALING == _NVFP4:
            xb = x_ptr + base * (GC // 2) * stride_xc
        else:
            xb = x_ptr + base * GC * stride_xc
        sbase = s_ptr + base * GSC * s_stride_c
        x = _tile(xb, sbase, rows, srows, row_ok, kk, GC, 0, stride_xr, stride_xc, s_stride_r, s_stride_c,
                  SCALING, BC, BLOCK_R, BLOCK_C, False, True)
        m = m & col_ok[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols.to(tl.int64)[None, :] * stride_oc
    tl.store(out, x.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def dequantize_tokens_kernel(
        # pointers
        x_ptr, s_ptr, soffs_ptr, offs_ptr, out_ptr,
        # sizes
        R, num_groups,
        # strides (storage elements: bytes for NVFP4 data)
        stride_xr, stride_xt, s_stride_r, s_stride_t, stride_or, stride_ot,
        # meta
        SCALING: tl.constexpr, BC: tl.constexpr, GP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """Exact bf16 values (MX: q * 2^k; NVFP4: q * s_b) of a token-grouped columnwise copy [R, T].

    wgrad's operands: tokens along columns in groups offs[g]:offs[g+1], each group's scale
    columns from soffs[g] on. Column program t is the t-th BLOCK_T-token tile of all groups
    (each group starts its tiles afresh, located from the device offsets), so a tile never
    crosses a group: its scales are a contiguous block, not a per-element gather, and NVFP4
    groups that start on an even token decode code pairs. Tiles past the last are idle;
    columns past offs[G] are left unwritten (no group reads them).
    """
    pid_r = tl.program_id(0)
    t = tl.program_id(1)
    gi = tl.arange(0, GP)
    starts = tl.load(offs_ptr + gi, mask=gi < num_groups, other=0).to(tl.int32)
    ends = tl.load(offs_ptr + gi + 1, mask=gi < num_groups, other=0).to(tl.int32)
    tiles = tl.cdiv(ends - starts, BLOCK_T)
    tile_end = tl.cumsum(tiles, 0)
    if t < tl.sum(tiles, 0):
        g = tl.sum((tile_end <= t).to(tl.int32), 0)
        sel = gi == g
        start = tl.sum(tl.where(sel, starts, 0), 0)
        length = tl.sum(tl.where(sel, ends, 0), 0) - start
        kk = (t - tl.sum(tl.where(sel, tile_end - tiles, 0), 0)) * BLOCK_T
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        s_base = s_ptr + tl.load(soffs_ptr + g) * s_stride_t
        if SCALING == _NVFP4:
            if start % 2 == 0:  # the group starts on a byte: code pairs
                x = _tile(x_ptr + (start // 2).to(tl.int64) * stride_xt, s_base, rows, rows, row_ok, kk, length, 0,
                          stride_xr, stride_xt, s_stride_r, s_stride_t, SCALING, BC, BLOCK_R, BLOCK_T, True, True)
            else:
                x = _tile(x_ptr, s_base, rows, rows, row_ok, kk, length, start,
                          stride_xr, stride_xt, s_stride_r, s_stride_t, SCALING, BC, BLOCK_R, BLOCK_T, True, False)
        else:
            x = _tile(x_ptr + start.to(tl.int64) * stride_xt, s_base, rows, rows, row_ok, kk, length, 0,
                      stride_xr, stride_xt, s_stride_r, s_stride_t, SCALING, BC, BLOCK_R, BLOCK_T, True, True)
        local = kk + tl.arange(0, BLOCK_T)
        cols = (start + local).to(tl.int64)
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :] * stride_ot
        tl.store(out, x.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (local < length)[None, :])


@triton.jit
def zero_rows_from_kernel(out_ptr, end_ptr, R, C, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[end:R] = 0 with `end` read on the device (rows a library grouped GEMM leaves unwritten)."""
    pid = tl.program_id(0)
    end = tl.load(end_ptr).to(tl.int32)
    if pid * BLOCK_R + BLOCK_R > end:
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = (rows >= end) & (rows < R)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_r + cols[None, :] * stride_c
            tl.store(ptrs, tl.zeros((BLOCK_R, BLOCK_C), out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (cols < C)[None, :])
