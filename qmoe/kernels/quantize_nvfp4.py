"""Triton NVFP4 quantization: E2M1 codes, E4M3 block scales, fp32 tensor amax (NUMERICS.md).

Twin of `qmoe/reference/quantize_nvfp4.py`. Two launches, because every code depends on the
tensor amax: `_nvfp4_amax_kernel` (max|x| over finite values, and the amax of the Hadamard-transformed
columnwise copy when RHT is on), then `_nvfp4_kernel`, which reads each [BM, BK] tile of x once
and writes the rowwise codes [M, K/2] and the columnwise codes [K, M/2] (the transpose, packed
along M) with their E4M3 block scales.

- RHT: each run of 16 rows of the tile goes through one [16, 16] tensor-core product with the
  signed Hadamard matrix (fp32 accumulation), so it matches the float64 reference to fp32
  rounding, not bit for bit; inputs whose transform is exact in fp32 match exactly.
- Stochastic rounding: `tl.rand` (Philox) from two seeds drawn on the device from the torch
  generator (no host sync), one stream per copy; unbiased and reproducible, not the
  reference's random stream.
- Values (ROW_VALUES / COL_VALUES): a copy held as its exact values q * s_b in bf16, for the
  emulated GEMMs, rounded onto the E2M1 grid directly (`e2m1_round`), in place of codes.
- Grouped columnwise data is packed over all groups, so a group may start in the middle of a
  byte. Bytes shared by two groups (odd group starts or ends) are written with int32
  `atomic_or` of nibbles into bytes the amax launch zeroed; all others with plain stores.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qmoe.contracts.formats import NVFP4_BLOCK, RHT_SIZE, ceil_div
from qmoe.kernels.activation import NO_ACTIVATION, input_rows, input_width, load_rows
from qmoe.kernels._arith import atomic_max_bits, clamp_nan, max_abs_bits, reciprocal, saturate, trans8
from qmoe.kernels._e2m1 import (E2M1_MAX, block_scale, e2m1_codes, e2m1_quantize, e2m1_round, e2m1_value,
                                tensor_scale)
from qmoe.kernels._launch import kernel_op, launch, prune_oversized, tile_configs
from qmoe.kernels._layout import as_rows, group_pow2
from qmoe.kernels.quantize import ORIENTED_KEY, prune_blocks, scale_width, tile_grid
from qmoe.kernels._tiles import (RHT_SIGN_MASK, block_amax_2d, block_amax_first, block_amax_last, rht_last, scale_2d,
                                scale_first, scale_last, store8, tile_rows, tile_span, uniform_tile)

# Tiles: BM a multiple of the 16-row blocks and RHT runs; 16-32 elements per thread keep the
# two copies, the Hadamard product and Philox in registers (ptxas -v on sm_90a).
_CONFIGS = tile_configs(((32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8)))
_SMALL = triton.Config({"BM": 32, "BK": 64}, num_warps=4, num_stages=1)
_KEY = ["M", "K", "G", "ACT"]  # as in kernels/quantize.py


# ---------------------------------------------------------------- exact values

@triton.jit
def store_values(ptr, grid, scales, r_idx, c_idx, r_ok, c_ok, stride, R: tl.constexpr, C: tl.constexpr,
                 SHAPE: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Store the exact values q * s_b (bf16; NVFP4's tensor factor is not in them) of the grid
    values q [R, C] (e2m1_round) and their E4M3 block scales at ptr[r * stride + c] for r in
    r_idx, c in c_idx (transposed first with TRANSPOSE). SHAPE: how the scales lie over the
    values (0: runs along the last axis, 1: along the first, 2: 16 x 16 blocks)."""
    s = scales.to(tl.float32)
    if SHAPE == 0:
        v = scale_last(grid, s, R, C, 16)
    elif SHAPE == 1:
        v = scale_first(grid, s, R, C, 16)
    else:
        v = scale_2d(grid, s, R, C, 16)
    v = v.to(tl.bfloat16)
    if TRANSPOSE:
        v = tl.trans(v)
    tl.store(ptr + r_idx[:, None].to(tl.int64) * stride + c_idx[None, :], v, mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def quantize_runs_last(x, s_enc, R: tl.constexpr, C: tl.constexpr, STOCHASTIC: tl.constexpr, u,
                       VALUES: tl.constexpr = False):
    """1x16 NVFP4 of x [R, C] fp32 in runs along the last axis -> (codes [R, C], or with VALUES
    their grid values (e2m1_round), scales [R, C/16] e4m3)."""
    sb, enc = block_scale(block_amax_last(x, R, C, 16, False), s_enc, reciprocal(s_enc))
    return e2m1_quantize(scale_last(x, enc, R, C, 16), STOCHASTIC, u, VALUES), sb


@triton.jit
def quantize_runs_first(x, s_enc, R: tl.constexpr, C: tl.constexpr, STOCHASTIC: tl.constexpr, u,
                        VALUES: tl.constexpr = False):
    """1x16 NVFP4 in runs along the first axis -> (codes [R, C] or their grid values, scales [R/16, C] e4m3)."""
    sb, enc = block_scale(block_amax_first(x, R, C, 16, False), s_enc, reciprocal(s_enc))
    return e2m1_quantize(scale_first(x, enc, R, C, 16), STOCHASTIC, u, VALUES), sb


@triton.jit
def pack_pairs(codes, R: tl.constexpr, C: tl.constexpr):
    """[R, C] codes -> [R, C/2] bytes, even element in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def or_nibbles(col_ptr, codes_t, cols, rows, stride_col, mask):
    """OR codes_t [BK, BM] into their nibbles of col (bytes [K, M/2]) with int32 atomics (zeroed bytes)."""
    addr = cols[:, None].to(tl.int64) * stride_col + (rows // 2)[None, :]
    shift = ((addr & 3) * 8).to(tl.int32) + (rows % 2)[None, :] * 4
    words = col_ptr.to(tl.pointer_type(tl.int32)) + (addr >> 2)
    tl.atomic_or(words, codes_t << shift, mask=mask & (codes_t != 0))


@triton.jit
def store_col_codes(col_ptr, codes_t, col0, row0, row_end, gstart, K, stride_col,
                    BK: tl.constexpr, BM: tl.constexpr, GROUPED: tl.constexpr):
    """Store codes_t [BK, BM] (rows row0.. of the tile) into packed columnwise data [K, M/2]."""
    packed = pack_pairs(codes_t, BK, BM)
    if GROUPED:  # whole bytes: both rows in this group, which starts byte-aligned
        limit = tl.where(gstart % 2 == 0, row_end // 2, 0)
        store8(col_ptr, packed, col0, row0 // 2, stride_col, K, limit, BK, BM // 2)
        odd_start = gstart % 2 == 1
        if odd_start | ((row_end % 2 == 1) & (row0 + BM >= row_end)):  # bytes shared with a neighbour group
            rows = row0 + tl.arange(0, BM)
            cols = col0 + tl.arange(0, BK)
            shared = (rows < row_end) & (((rows * 0 + gstart) % 2 == 1) | (rows == row_end - 1))
            or_nibbles(col_ptr, codes_t, cols, rows, stride_col, (cols < K)[:, None] & shared[None, :])
    else:
        store8(col_ptr, packed, col0, row0 // 2, stride_col, K, row_end // 2, BK, BM // 2)


# ---------------------------------------------------------------- amax launch

@triton.autotune(configs=_CONFIGS, key=_KEY, reset_to_zero=["amax_ptr", "rht_amax_ptr"],
                 prune_configs_by={"early_config_prune": prune_oversized})
@triton.jit
def _nvfp4_amax_kernel(
        # pointers
        x_ptr, probs_ptr, amax_ptr, rht_amax_ptr, col_ptr, splits_ptr,
        # sizes
        M, K, G,
        # strides
        stride_xm, stride_col,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, RHT: tl.constexpr, ZERO_ODD: tl.constexpr, GROUPED: tl.constexpr,
        G_P2: tl.constexpr,
        SIGN_MASK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Per group: max|x| over finite values, the same after RHT along M; zero bytes of odd-start groups."""
    g, row0, row_end, _, gstart = tile_rows(splits_ptr, M, G, tl.program_id(0), BM, BM, G_P2, GROUPED)
    if g >= G:
        return
    rows, _, cols, m_ok, k_ok = tile_span(row0, row_end, K, BM, BK)
    x = load_rows(x_ptr, probs_ptr, rows, cols, m_ok, k_ok, stride_xm, K, ACT, GLU_BLOCK)
    atomic_max_bits(amax_ptr + g, max_abs_bits(x.to(tl.float32), True))
    if RHT:
        atomic_max_bits(rht_amax_ptr + g, max_abs_bits(rht_last(tl.trans(x), BK, BM, SIGN_MASK), True))
    if ZERO_ODD:
        if gstart % 2 == 1:
            tl.store(col_ptr + cols[:, None].to(tl.int64) * stride_col + (rows // 2)[None, :],
                     tl.zeros((BK, BM), tl.uint8), mask=k_ok[:, None] & m_ok[None, :])


# ---------------------------------------------------------------- quantize launch

@triton.autotune(configs=_CONFIGS, key=ORIENTED_KEY + ["BLOCK_2D", "ROW_VALUES", "COL_VALUES"],
                 prune_configs_by={"early_config_prune": prune_blocks})
@triton.jit
def _nvfp4_kernel(
        # pointers
        x_ptr, probs_ptr, amax_ptr, col_amax_ptr, seed_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, splits_ptr,
        # sizes
        M, K, G,
        # strides (packed data: K/2 and M/2 bytes per row; scales: row [*, stride_rs], columnwise [*, stride_cs])
        stride_xm, stride_row, stride_col, stride_rs, stride_cs,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, B: tl.constexpr, BLOCK_2D: tl.constexpr, RHT: tl.constexpr,
        STOCHASTIC: tl.constexpr,
        ROWWISE: tl.constexpr, COLWISE: tl.constexpr, GROUPED: tl.constexpr, G_P2: tl.constexpr,
        SIGN_MASK: tl.constexpr, ROW_VALUES: tl.constexpr, COL_VALUES: tl.constexpr, BM: tl.constexpr,
        BK: tl.constexpr):
    """ROW_VALUES / COL_VALUES: that copy as its exact bf16 values at row_ptr / col_ptr, with no
    scales, in place of its packed codes and scales: [M, K], or [K, M] for 1 x 16 columnwise copies
    (nvfp4_op)."""
    pid_k = tl.program_id(1)
    g, row0, row_end, sblk0, gstart = tile_rows(splits_ptr, M, G, tl.program_id(0), BM, B, G_P2, GROUPED)
    if g >= G:
        return
    rows, col0, cols, m_ok, k_ok = tile_span(row0, row_end, K, BM, BK)
    x_raw = load_rows(x_ptr, probs_ptr, rows, cols, m_ok, k_ok, stride_xm, K, ACT, GLU_BLOCK)
    x = x_raw.to(tl.float32)
    s_enc = tensor_scale(tl.load(amax_ptr + g))
    quads = pid_k * BK + 4 * tl.arange(0, BK // 4)  # Philox counters: one per 4 values (uniform_tile)
    u_row = 0.0
    if STOCHASTIC:
        u_row = uniform_tile(tl.load(seed_ptr), rows[:, None].to(tl.int64) * K + quads[None, :], BM, BK)
    kb = pid_k * (BK // B) + tl.arange(0, BK // B)
    kb_ok = kb * B < K
    mb = sblk0 + tl.arange(0, BM // B)
    mb_ok = row0 + tl.arange(0, BM // B) * B < row_end
    if BLOCK_2D:  # one scale per 16x16 block, shared by both copies
        sb, enc = block_scale(block_amax_2d(x, BM, BK, B), s_enc, reciprocal(s_enc))
        y = clamp_nan(scale_2d(x, enc, BM, BK, B), -E2M1_MAX, E2M1_MAX)
        if ROW_VALUES or (COL_VALUES and not STOCHASTIC):  # the rowwise rounding, as values
            grid = e2m1_round(y, STOCHASTIC, u_row)
        if (ROWWISE and not ROW_VALUES) or (COLWISE and not COL_VALUES and not STOCHASTIC):  # as codes
            codes = e2m1_codes(y, STOCHASTIC, u_row)
        if ROW_VALUES:
            store_values(row_ptr, grid, sb, rows, cols, m_ok, k_ok, K, BM, BK, 2, False)
        elif ROWWISE:
            store8(row_ptr, pack_pairs(codes, BM, BK), row0, col0 // 2, stride_row, row_end, stride_row, BM, BK // 2)
            tl.store(row_s_ptr + mb[:, None] * stride_rs + kb[None, :], sb.to(tl.uint8, bitcast=True),
                     mask=mb_ok[:, None] & kb_ok[None, :])
        if COLWISE:
            if STOCHASTIC:  # the columnwise copy draws its own random stream
                u_col = uniform_tile(tl.load(seed_ptr + 1), cols[:, None].to(tl.int64) * M
                                     + (row0 + 4 * tl.arange(0, BM // 4))[None, :], BK, BM)
                if COL_VALUES:
                    store_values(col_ptr, e2m1_round(tl.trans(y), STOCHASTIC, u_col), tl.trans(sb.to(tl.float32)),
                                 rows, cols, m_ok, k_ok, K, BK, BM, 2, True)
                else:
                    codes_t = e2m1_codes(tl.trans(y), STOCHASTIC, u_col)
            elif COL_VALUES:  # the same codes and scales as the rowwise copy: the same values
                store_values(col_ptr, grid, sb, rows, cols, m_ok, k_ok, K, BM, BK, 2, False)
            else:
                codes_t = tl.trans(codes)
            if not COL_VALUES:
                store_col_codes(col_ptr, codes_t, col0, row0, row_end, gstart, K, stride_col, BK, BM, GROUPED)
                tl.store(col_s_ptr + kb[:, None] * stride_cs + mb[None, :], trans8(sb),
                         mask=kb_ok[:, None] & mb_ok[None, :])
    else:
        if ROWWISE:
            q, sb = quantize_runs_last(x, s_enc, BM, BK, STOCHASTIC, u_row, ROW_VALUES)  # codes or grid values
            if ROW_VALUES:
                store_values(row_ptr, q, sb, rows, cols, m_ok, k_ok, K, BM, BK, 0, False)
            else:
                store8(row_ptr, pack_pairs(q, BM, BK), row0, col0 // 2, stride_row, row_end, stride_row, BM,
                       BK // 2)
                tl.store(row_s_ptr + rows[:, None].to(tl.int64) * stride_rs + kb[None, :],
                         sb.to(tl.uint8, bitcast=True), mask=m_ok[:, None] & kb_ok[None, :])
        if COLWISE:
            if RHT:  # transform runs of 16 rows on tensor cores; quantize the [BK, BM] result along M
                xt = rht_last(tl.trans(x_raw), BK, BM, SIGN_MASK)
                u_col = 0.0
                if STOCHASTIC:
                    u_col = uniform_tile(tl.load(seed_ptr + 1), cols[:, None].to(tl.int64) * M
                                         + (row0 + 4 * tl.arange(0, BM // 4))[None, :], BK, BM)
                q_t, sb_t = quantize_runs_last(xt, tensor_scale(tl.load(col_amax_ptr + g)), BK, BM,
                                               STOCHASTIC, u_col, COL_VALUES)
                if COL_VALUES:  # [K, M], in the Hadamard domain as the codes
                    store_values(col_ptr, q_t, sb_t, cols, rows, k_ok, m_ok, M, BK, BM, 0, False)
                else:
                    codes_t = q_t
            else:  # runs along M quantized in the loaded layout, then transposed
                u_col = 0.0
                if STOCHASTIC:
                    u_col = uniform_tile(tl.load(seed_ptr + 1), quads[None, :].to(tl.int64) * M + rows[:, None],
                                         BM, BK)
                q, sb_c = quantize_runs_first(x, s_enc, BM, BK, STOCHASTIC, u_col, COL_VALUES)
                if COL_VALUES:  # [K, M]
                    store_values(col_ptr, q, sb_c, cols, rows, k_ok, m_ok, M, BM, BK, 1, True)
                else:
                    codes_t = tl.trans(q)  # 32-bit: see trans8
                    sb_t = trans8(sb_c)
            if not COL_VALUES:
                store_col_codes(col_ptr, codes_t, col0, row0, row_end, gstart, K, stride_col, BK, BM, GROUPED)
                tl.store(col_s_ptr + cols[:, None].to(tl.int64) * stride_cs + mb[None, :],
                         sb_t.to(tl.uint8, bitcast=True), mask=k_ok[:, None] & mb_ok[None, :])


@kernel_op("qmoe::quantize_nvfp4")
def nvfp4_op(x: torch.Tensor, splits: Optional[torch.Tensor], num_groups: int, block_2d: bool, rowwise: bool,
             columnwise: bool, rht: bool, seeds: Optional[torch.Tensor], probs: Optional[torch.Tensor] = None,
             act: int = NO_ACTIVATION, glu_block: int = 0, row_values: bool = False, col_values: bool = False) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [M, K/2] u8, row_s e4m3, amax [G], col [K, M/2] u8, col_s e4m3, col_amax [G]); empty if unasked.

    seeds: [2] int64 on the device for stochastic rounding (None: round to nearest).
    probs, act, glu_block: the fused activation (kernels.quantize.amax_op).
    row_values / col_values: that copy as its exact values q * s_b in bf16, and an empty scale:
    what the emulated GEMMs multiply, with the amax's tensor factor applied to their accumulators.
    Rows [M, K]; 1 x 16 columns [K, M], tokens contiguous as wgrad reads them (in the Hadamard
    domain with rht); 16 x 16 columns [M, K], the rows' values (the two copies share every scale).
    """
    m, k = input_rows(x, probs, act), input_width(x, act)
    b, grouped, dev = NVFP4_BLOCK, splits is not None, x.device
    nkb, width = ceil_div(k, b), scale_width(m, b, num_groups, grouped)
    alloc = torch.zeros if grouped else torch.empty  # grouped scale entries no group uses are zero
    e4m3, u8, bf16 = torch.float8_e4m3fn, torch.uint8, torch.bfloat16
    row_values, col_values = row_values and rowwise, col_values and columnwise
    row = torch.empty((m, k) if row_values else (m, k // 2) if rowwise else (0,), dtype=bf16 if row_values else u8,
                      device=dev)
    col_shape = ((m, k) if block_2d else (k, m)) if col_values else (k, m // 2) if columnwise else (0,)
    col = torch.empty(col_shape, dtype=bf16 if col_values else u8, device=dev)
    rows_s, cols_s = rowwise and not row_values, columnwise and not col_values
    if block_2d:
        row_s = alloc((width, nkb) if rows_s else (0,), dtype=e4m3, device=dev)
        col_s = alloc((nkb, width) if cols_s else (0,), dtype=e4m3, device=dev)
    else:
        row_s = torch.empty((m, nkb) if rows_s else (0,), dtype=e4m3, device=dev)
        col_s = alloc((k, width) if cols_s else (0,), dtype=e4m3, device=dev)
    bits = torch.zeros((2, num_groups), dtype=torch.int32, device=dev)  # amax, amax after RHT
    amax, rht_amax = bits.view(torch.float32).unbind(0)
    if m * k:
        amax_bits, rht_bits = bits.unbind(0)  # atomic_max runs on the int32 patterns
        rht_col = rht and columnwise
        grid = tile_grid(m, k, num_groups, grouped)
        dummy = splits if grouped else x
        p = probs if probs is not None else x
        launch(_nvfp4_amax_kernel, grid, (x, p, amax_bits, rht_bits, col, dummy, m, k, num_groups, x.stride(0), m // 2),
               _SMALL, m * k, ACT=act, GLU_BLOCK=glu_block, RHT=rht_col, ZERO_ODD=grouped and cols_s,
               GROUPED=grouped,
               G_P2=group_pow2(num_groups), SIGN_MASK=RHT_SIGN_MASK)
        launch(_nvfp4_kernel, grid,
               (x, p, amax, rht_amax if rht_col else amax, seeds if seeds is not None else x, row,
                row_s.view(torch.uint8), col, col_s.view(torch.uint8), dummy, m, k, num_groups, x.stride(0), k // 2,
                m // 2, nkb, width),
               _SMALL, m * k, ACT=act, GLU_BLOCK=glu_block, B=b, BLOCK_2D=block_2d, RHT=rht_col,
               STOCHASTIC=seeds is not None,
               ROWWISE=rowwise, COLWISE=columnwise, GROUPED=grouped, G_P2=group_pow2(num_groups),
               SIGN_MASK=RHT_SIGN_MASK, ROW_VALUES=row_values, COL_VALUES=col_values)
    col_amax = rht_amax if rht and columnwise else amax
    return row, row_s, amax.clone(), col, col_s, col_amax.clone()


def check_nvfp4_shape(m: int, k: int, rowwise: bool, columnwise: bool, rht: bool, block_2d: bool) -> None:
    if block_2d and rht:
        raise ValueError("the random Hadamard transform applies to 1x16 (activation/gradient) copies only")
    if rowwise and k % 2:
        raise ValueError(f"NVFP4 packs two values per byte: the last dimension ({k}) must be even")
    if columnwise and m % 2:
        raise ValueError(f"NVFP4 columnwise data packs two rows per byte: the row count ({m}) must be even")
    if columnwise and rht and m % RHT_SIZE:
        raise ValueError(f"the random Hadamard transform needs the quantized dimension ({m}) to be a multiple of "
                         f"{RHT_SIZE}; pad the rows or use NVFP4BlockScaling(disable_rht=True)")


def draw_seeds(stochastic: bool, generator: torch.Generator | None, device: torch.device):
    """Two Philox seeds as a device tensor, drawn from `generator` without a host sync."""
    if not stochastic:
        return None
    return torch.randint(0, 2 ** 62, (2,), generator=generator, dtype=torch.int64, device=device)


def quantize_nvfp4(x: torch.Tensor, block_2d: bool = False, rowwise: bool = True, columnwise: bool = False,
                   rht: bool = False, stochastic: bool = False, generator: torch.Generator | None = None):
    """NVFP4-quantize x [M, K]; returns the reference's 6-tuple (None for copies not asked for)."""
    x = as_rows(x)
    check_nvfp4_shape(*x.shape, rowwise, columnwise, rht, block_2d)
    row, rs, amax, col, cs, camax = nvfp4_op(
        x, None, 1, block_2d, rowwise, columnwise, rht, draw_seeds(stochastic, generator, x.device))
    return (row if rowwise else None, rs if rowwise else None, amax.reshape(()),
            col if columnwise else None, cs if columnwise else None, camax.reshape(()) if columnwise else None)


# ---------------------------------------------------------------- dequantization

@triton.autotune(configs=tile_configs(((32, 128, 4), (64, 128, 4))), key=["R", "C"],
                 prune_configs_by={"early_config_prune": prune_oversized})
@triton.jit
def _dequantize_nvfp4_kernel(
        # pointers
        data_ptr, s_ptr, amax_ptr, out_ptr,
        # sizes (C: unpacked columns)
        R, C,
        # strides
        stride_dr, stride_sr, stride_sc,
        # meta
        BR: tl.constexpr, DMAX: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """out [R, C] = e2m1(code) * float(s_b) * S_dec for packed codes [R, C/2], saturated to +-DMAX."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    byte = tl.load(data_ptr + rows[:, None].to(tl.int64) * stride_dr + (cols // 2)[None, :], mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((cols % 2) * 4)[None, :]) & 0xF
    v = e2m1_value(code & 7)
    v = tl.where((code & 8) != 0, -v, v)
    sb = tl.load(s_ptr + (rows // BR)[:, None].to(tl.int64) * stride_sr + (cols // 16)[None, :] * stride_sc,
                 mask=mask, other=0.0).to(tl.float32)
    s_dec = reciprocal(tensor_scale(tl.load(amax_ptr)))
    y = saturate(v * sb * s_dec, DMAX)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@kernel_op("qmoe::dequantize_nvfp4")
def dequantize_nvfp4_op(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, block_rows: int,
                        out_dtype: torch.dtype) -> torch.Tensor:
    r, c = data.shape[0], data.shape[1] * 2
    out = torch.empty((r, c), dtype=out_dtype, device=data.device)
    if out.numel():
        grid = lambda meta: (triton.cdiv(r, meta["BM"]), triton.cdiv(c, meta["BK"]))  # noqa: E731
        launch(_dequantize_nvfp4_kernel, grid,
               (data, scale, amax.float().reshape(1), out, r, c, data.stride(0), scale.stride(0), scale.stride(1)),
               _SMALL, out.numel(), BR=block_rows, DMAX=torch.finfo(out_dtype).max)
    return out


def dequantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, block_2d: bool = False,
                     dtype=torch.float32):
    """float(q) * float(s_b) * S_dec, for packed data [M, K/2] and its block scales."""
    if data.dim() != 2 or data.dtype != torch.uint8 or data.stride(1) != 1:
        raise ValueError(f"dequantize_nvfp4 takes packed uint8 data [M, K/2] with unit column stride, got "
                         f"{data.dtype} of shape {tuple(data.shape)}")
    return dequantize_nvfp4_op(data, scale, amax, NVFP4_BLOCK if block_2d else 1, dtype)
