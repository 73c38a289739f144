"""Triton NVFP4 quantization: E2M1 codes, E4M3 block scales, fp32 tensor amax (NUMERICS.md).

Twin of `qmoe/reference/quantize_nvfp4.py`. Two launches, because every code depends on the
tensor amax: `_nvfp4_amax_kernel` (max|x| over finite values, and the same over the Hadamard
transform of the columnwise copy when RHT is on), then `_nvfp4_kernel`, which reads each [BM, BK]
tile of x once and writes the rowwise codes [M, K/2] and the columnwise codes [K, M/2] (the
transpose, packed along M) with their E4M3 block scales. The tile helpers, and the tile order
that keeps every 16-row run in one thread, are in `qmoe.kernels._nvfp4_tiles`.

- RHT: `_tiles.rht16`, the exactly rounded transform, in both launches: the columnwise amax and
  codes are the reference's bit for bit whatever the tile shape, chunking or launch.
- Stochastic rounding: Philox draws from two seeds drawn on the device from the torch generator
  (no host sync), one stream per copy, each value's draw fixed by its position. Unbiased and
  reproducible, not the reference's random stream.
- Configs (tile, warps, ROW_CHUNKS / COL_CHUNKS: how many pieces a thread's rows / columns are
  quantized in, which bounds the values live at once) change no bit of any output.
- Grouped columnwise data is packed over all groups, so a group may start in the middle of a
  byte. Bytes shared by two groups (odd group starts or ends) are written with int32
  `atomic_or` of nibbles into bytes the amax launch zeroed; all others with plain stores.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from qmoe.contracts.formats import FLT_MAX, NVFP4_BLOCK, NVFP4_TENSOR_MAX, RHT_SIZE, ceil_div
from qmoe.kernels.activation import NO_ACTIVATION, input_width, load_rows
from qmoe.kernels._arith import atomic_max_bits, is_nan, max_abs_bits, reciprocal, saturate
from qmoe.kernels._launch import kernel_op, launch, prune_oversized, tile_configs, wrapped
from qmoe.kernels._layout import as_rows, group_pow2
from qmoe.kernels._nvfp4_tiles import (blocks_16x16, quantize_cols, quantize_rows, split_cols, split_rows,
                                       store_col, store_row, tile_rows_order, tile_runs)
from qmoe.kernels._tiles import RHT_SIGN_MASK, rht16, tile_rows

_FLT_MAX = tl.constexpr(FLT_MAX)
_TENSOR_MAX = tl.constexpr(NVFP4_TENSOR_MAX)


def _configs(tiles) -> list[triton.Config]:
    """(BM, BK, warps, ROW_CHUNKS, COL_CHUNKS). A thread holds 16 rows x 8 columns (bf16) when BM/16
    covers the warp's lanes and warps along M (BK/8 lanes along K): BM * BK = 16 * 8 * 32 * warps."""
    return [triton.Config({"BM": bm, "BK": bk, "ROW_CHUNKS": rc, "COL_CHUNKS": cc}, num_warps=w, num_stages=1)
            for bm, bk, w, rc, cc in tiles]


CAST_CONFIGS = _configs(((128, 128, 4, 2, 2), (64, 256, 4, 2, 2), (128, 128, 4, 4, 4), (256, 128, 8, 2, 2)))
AMAX_CONFIGS = _configs(((128, 128, 4, 1, 2), (64, 256, 4, 1, 2), (256, 128, 8, 1, 2), (128, 128, 4, 1, 4)))
_SMALL = triton.Config({"BM": 32, "BK": 64, "ROW_CHUNKS": 1, "COL_CHUNKS": 1}, num_warps=4, num_stages=1)
_KEY = ["M", "K", "G", "ACT"]


@triton.jit
def tensor_scale(amax):
    """S_enc = min(448*6 / amax, FLT_MAX) (NaN -> FLT_MAX), 1 where that is 0."""
    s = tl.math.div_rn(tl.full(amax.shape, _TENSOR_MAX, tl.float32), amax)
    s = tl.where(is_nan(s) | (s > _FLT_MAX), _FLT_MAX, s)
    return tl.where(s == 0, 1.0, s)


@triton.jit
def e2m1_value(c):
    """Magnitude of codes 0..7: {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    big = tl.where(c == 4, 2.0, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0)))
    return tl.where(c < 4, c.to(tl.float32) * 0.5, big)


# ---------------------------------------------------------------- amax launch

@triton.jit
def _rht_amax_bits(x, SIGN_MASK: tl.constexpr, CHUNKS: tl.constexpr, BM: tl.constexpr, C: tl.constexpr):
    """max|RHT| over finite values of columns x [BM, C] (tile order) as int32 bits, in CHUNKS pieces."""
    if CHUNKS == 1:
        m = max_abs_bits(rht16(tile_runs(x, BM, C), C * BM // 16, SIGN_MASK), True)
    else:
        xa, xb = split_cols(x, BM, C)
        m = tl.maximum(_rht_amax_bits(xa, SIGN_MASK, CHUNKS // 2, BM, C // 2),
                       _rht_amax_bits(xb, SIGN_MASK, CHUNKS // 2, BM, C // 2))
    return m


@triton.autotune(configs=AMAX_CONFIGS, key=_KEY, reset_to_zero=["amax_ptr", "rht_amax_ptr"],
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
        G_P2: tl.constexpr, SIGN_MASK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ROW_CHUNKS: tl.constexpr,
        COL_CHUNKS: tl.constexpr):
    """Per group: max|x| over finite values, the same after RHT along M; zero bytes of odd-start groups."""
    g, row0, row_end, _, gstart = tile_rows(splits_ptr, M, G, tl.program_id(0), BM, BM, G_P2, GROUPED)
    if g >= G:
        return
    rows = tile_rows_order(row0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    m_ok, k_ok = rows < row_end, cols < K
    x = load_rows(x_ptr, probs_ptr, rows, cols, m_ok, k_ok, stride_xm, K, ACT, GLU_BLOCK)
    atomic_max_bits(amax_ptr + g, max_abs_bits(x.to(tl.float32), True))
    if RHT:  # the very transform the quantize launch applies (rht16): the same bits in any tile
        atomic_max_bits(rht_amax_ptr + g, _rht_amax_bits(x, SIGN_MASK, COL_CHUNKS, BM, BK))
    if ZERO_ODD:
        if gstart % 2 == 1:
            tl.store(col_ptr + cols[:, None].to(tl.int64) * stride_col + (rows // 2)[None, :],
                     tl.zeros((BK, BM), tl.uint8), mask=k_ok[:, None] & m_ok[None, :])


# ---------------------------------------------------------------- quantize launch

def _prune_cast(configs, named_args, **kwargs):
    """Tiles hold whole 16-blocks along K and M."""
    return prune_oversized([c for c in configs if c.kwargs["BK"] % 16 == 0 and c.kwargs["BM"] % 16 == 0],
                           named_args, **kwargs)


@triton.jit
def _rows_in_chunks(x, rows, col0, row_end, K, s_enc, seed_ptr, row_ptr, row_s_ptr, stride_row, stride_rs,
                    STOCHASTIC: tl.constexpr, ROW_WORDS: tl.constexpr, CHUNKS: tl.constexpr, R: tl.constexpr,
                    BK: tl.constexpr):
    """quantize_rows on the tile's rows in CHUNKS pieces (halves of the in-register row index)."""
    if CHUNKS == 1:
        quantize_rows(x, rows, col0, row_end, K, s_enc, seed_ptr, row_ptr, row_s_ptr, stride_row, stride_rs,
                      STOCHASTIC, ROW_WORDS, R, BK)
    else:
        xa, xb = split_rows(x, R, BK)
        ra, rb = split_rows(tl.broadcast_to(rows[:, None], (R, 2)), R, 2)  # split along with the rows
        _rows_in_chunks(xa, tl.max(ra, 1), col0, row_end, K, s_enc, seed_ptr, row_ptr, row_s_ptr, stride_row,
                        stride_rs, STOCHASTIC, ROW_WORDS, CHUNKS // 2, R // 2, BK)
        _rows_in_chunks(xb, tl.max(rb, 1), col0, row_end, K, s_enc, seed_ptr, row_ptr, row_s_ptr, stride_row,
                        stride_rs, STOCHASTIC, ROW_WORDS, CHUNKS // 2, R // 2, BK)


@triton.jit
def _cols_in_chunks(x, cols, row0, row_end, gstart, sblk0, M, K, s_enc, seed_ptr, col_ptr, col_s_ptr, stride_col,
                    stride_cs, RHT: tl.constexpr, STOCHASTIC: tl.constexpr, COL_WORDS: tl.constexpr,
                    GROUPED: tl.constexpr, SIGN_MASK: tl.constexpr, CHUNKS: tl.constexpr, BM: tl.constexpr,
                    C: tl.constexpr):
    """quantize_cols on the tile's columns in CHUNKS pieces (halves of a thread's in-register columns)."""
    if CHUNKS == 1:
        quantize_cols(x, cols, row0, row_end, gstart, sblk0, M, K, s_enc, seed_ptr, col_ptr, col_s_ptr, stride_col,
                      stride_cs, RHT, STOCHASTIC, COL_WORDS, GROUPED, SIGN_MASK, BM, C)
    else:
        xa, xb = split_cols(x, BM, C)
        ca, cb = split_cols(tl.broadcast_to(cols[None, :], (2, C)), 2, C)  # split along with the columns
        _cols_in_chunks(xa, tl.max(ca, 0), row0, row_end, gstart, sblk0, M, K, s_enc, seed_ptr, col_ptr, col_s_ptr,
                        stride_col, stride_cs, RHT, STOCHASTIC, COL_WORDS, GROUPED, SIGN_MASK, CHUNKS // 2, BM, C // 2)
        _cols_in_chunks(xb, tl.max(cb, 0), row0, row_end, gstart, sblk0, M, K, s_enc, seed_ptr, col_ptr, col_s_ptr,
                        stride_col, stride_cs, RHT, STOCHASTIC, COL_WORDS, GROUPED, SIGN_MASK, CHUNKS // 2, BM, C // 2)


@triton.autotune(configs=CAST_CONFIGS, key=_KEY + ["BLOCK_2D", "RHT", "STOCHASTIC", "ROWWISE", "COLWISE"],
                 prune_configs_by={"early_config_prune": _prune_cast})
@triton.jit
def _nvfp4_kernel(
        # pointers
        x_ptr, probs_ptr, amax_ptr, col_amax_ptr, seed_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, splits_ptr,
        # sizes
        M, K, G,
        # strides (packed data: K/2 and M/2 bytes per row; scales: row [*, stride_rs], columnwise [*, stride_cs])
        stride_xm, stride_row, stride_col, stride_rs, stride_cs,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, BLOCK_2D: tl.constexpr, RHT: tl.constexpr,
        STOCHASTIC: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, ROW_WORDS: tl.constexpr,
        COL_WORDS: tl.constexpr, GROUPED: tl.constexpr, G_P2: tl.constexpr, SIGN_MASK: tl.constexpr,
        BM: tl.constexpr, BK: tl.constexpr, ROW_CHUNKS: tl.constexpr, COL_CHUNKS: tl.constexpr):
    g, row0, row_end, sblk0, gstart = tile_rows(splits_ptr, M, G, tl.program_id(0), BM, 16, G_P2, GROUPED)
    if g >= G:
        return
    rows = tile_rows_order(row0, BM)
    col0 = tl.program_id(1) * BK
    cols = col0 + tl.arange(0, BK)
    m_ok, k_ok = rows < row_end, cols < K
    x = load_rows(x_ptr, probs_ptr, rows, cols, m_ok, k_ok, stride_xm, K, ACT, GLU_BLOCK)
    s_enc = tensor_scale(tl.load(amax_ptr + g))
    if BLOCK_2D:  # one scale per 16x16 block, shared by both copies
        row_words, col_words, sb = blocks_16x16(x, s_enc, seed_ptr, rows, row0, cols, col0, M, K, COLWISE,
                                                STOCHASTIC, BM, BK)
        mb = sblk0 + tl.arange(0, BM // 16)
        mb_ok = row0 + 16 * tl.arange(0, BM // 16) < row_end
        kb = col0 // 16 + tl.arange(0, BK // 16)
        kb_ok = kb * 16 < K
        if ROWWISE:
            store_row(row_ptr, row_words, rows, col0, m_ok, K, stride_row, ROW_WORDS, BM, BK)
            tl.store(row_s_ptr + mb[:, None] * stride_rs + kb[None, :], sb, mask=mb_ok[:, None] & kb_ok[None, :])
        if COLWISE:
            store_col(col_ptr, col_words, cols, k_ok, row0, row_end, gstart, stride_col, COL_WORDS, GROUPED, BM, BK)
            tl.store(col_s_ptr + kb[:, None] * stride_cs + mb[None, :], tl.trans(sb.to(tl.int32)).to(tl.uint8),
                     mask=kb_ok[:, None] & mb_ok[None, :])
    else:
        if ROWWISE:
            _rows_in_chunks(x, rows, col0, row_end, K, s_enc, seed_ptr, row_ptr, row_s_ptr, stride_row, stride_rs,
                            STOCHASTIC, ROW_WORDS, ROW_CHUNKS, BM, BK)
        if COLWISE:
            _cols_in_chunks(x, cols, row0, row_end, gstart, sblk0, M, K, tensor_scale(tl.load(col_amax_ptr + g)),
                            seed_ptr, col_ptr, col_s_ptr, stride_col, stride_cs, RHT, STOCHASTIC, COL_WORDS, GROUPED,
                            SIGN_MASK, COL_CHUNKS, BM, BK)


# ---------------------------------------------------------------- the op

_FORCED: dict = {}


@contextlib.contextmanager
def forced_configs(cast: Optional[triton.Config] = None, amax: Optional[triton.Config] = None):
    """Launch the quantize and amax kernels with these configs whatever the size (tests and sweeps
    run every config this way; the configs change no bit of the output)."""
    saved = dict(_FORCED)
    _FORCED.update(cast=cast, amax=amax)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


def _launch(kernel, forced, grid, args, numel, **meta):
    if forced is None:
        launch(kernel, grid, args, _SMALL, numel, **meta)
    else:
        wrapped(kernel.fn)[grid](*args, **meta, **forced.kwargs, num_warps=forced.num_warps,
                                 num_stages=forced.num_stages)


def tile_grid(m: int, k: int, groups: int, grouped: bool):
    """Virtual row tiles (`tile_rows`: a static bound over every split) x column tiles."""
    return lambda meta: (triton.cdiv(m, meta["BM"]) + (groups if grouped else 0), triton.cdiv(k, meta["BK"]))


@kernel_op("qmoe::quantize_nvfp4")
def nvfp4_op(x: torch.Tensor, splits: Optional[torch.Tensor], num_groups: int, block_2d: bool, rowwise: bool,
             columnwise: bool, rht: bool, seeds: Optional[torch.Tensor], probs: Optional[torch.Tensor] = None,
             act: int = NO_ACTIVATION, glu_block: int = 0) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [M, K/2] u8, row_s e4m3, amax [G], col [K, M/2] u8, col_s e4m3, col_amax [G]); empty if unasked.

    seeds: [2] int64 on the device for stochastic rounding (None: round to nearest).
    probs, act, glu_block: the fused activation (kernels.quantize.amax_op).
    """
    m, k = x.shape[0], input_width(x, act)
    b, grouped, dev = NVFP4_BLOCK, splits is not None, x.device
    nkb = ceil_div(k, b)
    width = m // b + num_groups if grouped else ceil_div(m, b)  # scale blocks along M (grouped: static bound)
    alloc = torch.zeros if grouped else torch.empty  # grouped scale entries no group uses are zero
    e4m3, u8 = torch.float8_e4m3fn, torch.uint8
    row = torch.empty((m, k // 2) if rowwise else (0,), dtype=u8, device=dev)
    col = torch.empty((k, m // 2) if columnwise else (0,), dtype=u8, device=dev)
    if block_2d:
        row_s = alloc((width, nkb) if rowwise else (0,), dtype=e4m3, device=dev)
        col_s = alloc((nkb, width) if columnwise else (0,), dtype=e4m3, device=dev)
    else:
        row_s = torch.empty((m, nkb) if rowwise else (0,), dtype=e4m3, device=dev)
        col_s = alloc((k, width) if columnwise else (0,), dtype=e4m3, device=dev)
    bits = torch.zeros((2, num_groups), dtype=torch.int32, device=dev)  # amax, amax after RHT
    amax, rht_amax = bits.view(torch.float32).unbind(0)
    rht_col = rht and columnwise
    if m * k:
        amax_bits, rht_bits = bits.unbind(0)  # atomic_max runs on the int32 patterns
        grid = tile_grid(m, k, num_groups, grouped)
        dummy = splits if grouped else x
        p = probs if probs is not None else x
        common = dict(ACT=act, GLU_BLOCK=glu_block, GROUPED=grouped, G_P2=group_pow2(num_groups),
                      SIGN_MASK=RHT_SIGN_MASK)
        _launch(_nvfp4_amax_kernel, _FORCED.get("amax"), grid,
                (x, p, amax_bits, rht_bits, col, dummy, m, k, num_groups, x.stride(0), m // 2), m * k,
                RHT=rht_col, ZERO_ODD=grouped and columnwise, **common)
        _launch(_nvfp4_kernel, _FORCED.get("cast"), grid,
                (x, p, amax, rht_amax if rht_col else amax, seeds if seeds is not None else x, row,
                 row_s.view(torch.uint8), col, col_s.view(torch.uint8), dummy, m, k, num_groups, x.stride(0), k // 2,
                 m // 2, nkb, width), m * k,
                BLOCK_2D=block_2d, RHT=rht_col, STOCHASTIC=seeds is not None, ROWWISE=rowwise, COLWISE=columnwise,
                ROW_WORDS=k % 8 == 0, COL_WORDS=m % 8 == 0, **common)
    col_amax = rht_amax if rht_col else amax
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
