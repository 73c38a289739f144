"""Triton NVFP4 quantization: E2M1 codes, E4M3 block scales, fp32 tensor amax (NUMERICS.md).

Twin of `qmoe/reference/quantize_nvfp4.py`. Two launches, because every code depends on the
tensor amax: `_nvfp4_amax_kernel` (max|x| over finite values, and the same over the Hadamard
transform of the columnwise copy when RHT is on), then `_nvfp4_kernel`, which loads each [BM, BK]
tile of x in the view each copy needs (from DRAM once; the second view hits the cache) and writes
the rowwise codes [M, K/2] and the columnwise codes [K, M/2] (the transpose, packed along M) with
their E4M3 block scales. The tile helpers and views are in `qmoe.kernels._nvfp4_tiles`.

- RHT: `_tiles.rht16`, the exactly rounded transform, in both launches: the columnwise amax and
  codes are the reference's bit for bit whatever the tile shape or launch.
- Stochastic rounding: Philox draws from two seeds drawn on the device from the torch generator
  (no host sync), one stream per copy, each value's draw fixed by its position. Unbiased and
  reproducible, not the reference's random stream.
- Configs (tile, warps, column tiles a program loops over, columns a thread loads for the
  columnwise view) change no bit of any output.
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
from qmoe.kernels._nvfp4_tiles import quantize_16x16, quantize_cols, quantize_rows, tile_rows_order, tile_runs
from qmoe.kernels._tiles import RHT_SIGN_MASK, rht16, tile_rows

_FLT_MAX = tl.constexpr(FLT_MAX)
_TENSOR_MAX = tl.constexpr(NVFP4_TENSOR_MAX)


def _configs(tiles) -> list[triton.Config]:
    """(BM, BK, warps, K_TILES, COL_VEC): a program quantizes rows [BM] x K_TILES tiles of BK columns,
    one at a time. The columnwise view loads COL_VEC columns a thread (narrow vectors, so each
    thread's 16-row runs stay few: BM/16 must cover the lanes and warps along M, here
    BM * BK = 16 * COL_VEC * 32 * warps or more)."""
    return [triton.Config({"BM": bm, "BK": bk, "K_TILES": kt, "COL_VEC": cv}, num_warps=w, num_stages=1)
            for bm, bk, w, kt, cv in tiles]


CAST_CONFIGS = _configs(((32, 128, 4, 1, 2), (64, 64, 4, 1, 2), (32, 256, 8, 1, 2), (32, 128, 4, 4, 2)))
AMAX_CONFIGS = _configs(((32, 128, 4, 1, 2), (32, 256, 8, 1, 2), (32, 128, 4, 4, 2)))
_SMALL = triton.Config({"BM": 32, "BK": 64, "K_TILES": 1, "COL_VEC": 2}, num_warps=4, num_stages=1)
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
        G_P2: tl.constexpr, SIGN_MASK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, K_TILES: tl.constexpr,
        COL_VEC: tl.constexpr):
    """Per group: max|x| over finite values, the same after RHT along M; zero bytes of odd-start groups."""
    g, row0, row_end, _, gstart = tile_rows(splits_ptr, M, G, tl.program_id(0), BM, BM, G_P2, GROUPED)
    if g >= G:
        return
    rows = tile_rows_order(row0, BM)  # any order does for the amaxes; the transform needs this one
    m_ok = rows < row_end
    amax = tl.zeros((), tl.int32)
    rht_amax = tl.zeros((), tl.int32)
    for kt in tl.range(0, K_TILES, loop_unroll_factor=1):
        col0 = (tl.program_id(1) * K_TILES + kt) * BK
        if col0 < K:
            cols = col0 + tl.arange(0, BK)
            k_ok = cols < K
            x = load_rows(x_ptr, probs_ptr, rows, tl.max_contiguous(cols, COL_VEC), m_ok, k_ok, stride_xm, K, ACT,
                          GLU_BLOCK)
            amax = tl.maximum(amax, max_abs_bits(x.to(tl.float32), True))
            if RHT:  # the very transform the quantize launch applies (rht16): the same bits in any launch
                y = rht16(tile_runs(x, BM, BK), BK * BM // 16, SIGN_MASK)
                rht_amax = tl.maximum(rht_amax, max_abs_bits(y, True))
            if ZERO_ODD:
                if gstart % 2 == 1:
                    tl.store(col_ptr + cols[:, None].to(tl.int64) * stride_col + (rows // 2)[None, :],
                             tl.zeros((BK, BM), tl.uint8), mask=k_ok[:, None] & m_ok[None, :])
    atomic_max_bits(amax_ptr + g, amax)
    if RHT:
        atomic_max_bits(rht_amax_ptr + g, rht_amax)


# ---------------------------------------------------------------- quantize launch

def _prune_cast(configs, named_args, **kwargs):
    """Tiles hold whole 16-blocks along K and M."""
    return prune_oversized([c for c in configs if c.kwargs["BK"] % 16 == 0 and c.kwargs["BM"] % 16 == 0],
                           named_args, **kwargs)


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
        BM: tl.constexpr, BK: tl.constexpr, K_TILES: tl.constexpr, COL_VEC: tl.constexpr):
    g, row0, row_end, sblk0, gstart = tile_rows(splits_ptr, M, G, tl.program_id(0), BM, 16, G_P2, GROUPED)
    if g >= G:
        return
    rows = row0 + tl.arange(0, BM)
    rows_t = tile_rows_order(row0, BM)
    s_enc = tensor_scale(tl.load(amax_ptr + g))
    s_col = s_enc
    if COLWISE and not BLOCK_2D:
        s_col = tensor_scale(tl.load(col_amax_ptr + g))
    for kt in tl.range(0, K_TILES, loop_unroll_factor=1):
        col0 = (tl.program_id(1) * K_TILES + kt) * BK
        if col0 < K:
            cols = col0 + tl.arange(0, BK)
            k_ok = cols < K
            if BLOCK_2D or ROWWISE:
                x = load_rows(x_ptr, probs_ptr, rows, cols, rows < row_end, k_ok, stride_xm, K, ACT, GLU_BLOCK)
            if BLOCK_2D or COLWISE:
                xt = load_rows(x_ptr, probs_ptr, rows_t, tl.max_contiguous(cols, COL_VEC), rows_t < row_end, k_ok,
                               stride_xm, K, ACT, GLU_BLOCK)
            if BLOCK_2D:  # one scale per 16x16 block, shared by both copies
                quantize_16x16(x, xt, rows, row0, row_end, gstart, sblk0, col0, cols, M, K, s_enc, seed_ptr, row_ptr,
                               row_s_ptr, col_ptr, col_s_ptr, stride_row, stride_rs, stride_col, stride_cs, ROWWISE,
                               COLWISE, STOCHASTIC, ROW_WORDS, COL_WORDS, GROUPED, BM, BK)
            else:
                if ROWWISE:
                    quantize_rows(x, rows, col0, row_end, K, s_enc, seed_ptr, row_ptr, row_s_ptr, stride_row,
                                  stride_rs, STOCHASTIC, ROW_WORDS, BM, BK)
                if COLWISE:
                    quantize_cols(xt, cols, row0, row_end, gstart, sblk0, M, K, s_col, seed_ptr, col_ptr, col_s_ptr,
                                  stride_col, stride_cs, RHT, STOCHASTIC, COL_WORDS, GROUPED, SIGN_MASK, BM, BK)


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
    """Virtual row tiles (`tile_rows`: a static bound over every split) x runs of K_TILES column tiles."""
    return lambda meta: (triton.cdiv(m, meta["BM"]) + (groups if grouped else 0),
                         triton.cdiv(k, meta["BK"] * meta["K_TILES"]))


def nvfp4_plan(x: torch.Tensor, splits: Optional[torch.Tensor], num_groups: int, block_2d: bool, rowwise: bool,
               columnwise: bool, rht: bool, seeds: Optional[torch.Tensor], probs: Optional[torch.Tensor] = None,
               act: int = NO_ACTIVATION, glu_block: int = 0):
    """(outputs, amax launch, quantize launch): nvfp4_op's output tensors and its two launches as
    closures (benchmarks time them apart; the quantize launch reads the amaxes the first wrote)."""
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
    amax_bits, rht_bits = bits.unbind(0)  # atomic_max runs on the int32 patterns
    rht_col = rht and columnwise
    grid = tile_grid(m, k, num_groups, grouped)
    dummy = splits if grouped else x
    p = probs if probs is not None else x
    common = dict(ACT=act, GLU_BLOCK=glu_block, GROUPED=grouped, G_P2=group_pow2(num_groups), SIGN_MASK=RHT_SIGN_MASK)

    def amax_launch():
        _launch(_nvfp4_amax_kernel, _FORCED.get("amax"), grid,
                (x, p, amax_bits, rht_bits, col, dummy, m, k, num_groups, x.stride(0), m // 2), m * k,
                RHT=rht_col, ZERO_ODD=grouped and columnwise, **common)

    def cast_launch():
        _launch(_nvfp4_kernel, _FORCED.get("cast"), grid,
                (x, p, amax, rht_amax if rht_col else amax, seeds if seeds is not None else x, row,
                 row_s.view(torch.uint8), col, col_s.view(torch.uint8), dummy, m, k, num_groups, x.stride(0), k // 2,
                 m // 2, nkb, width), m * k,
                BLOCK_2D=block_2d, RHT=rht_col, STOCHASTIC=seeds is not None, ROWWISE=rowwise, COLWISE=columnwise,
                ROW_WORDS=k % 8 == 0, COL_WORDS=m % 8 == 0, **common)

    return (row, row_s, amax, col, col_s, rht_amax if rht_col else amax), amax_launch, cast_launch


@kernel_op("qmoe::quantize_nvfp4")
def nvfp4_op(x: torch.Tensor, splits: Optional[torch.Tensor], num_groups: int, block_2d: bool, rowwise: bool,
             columnwise: bool, rht: bool, seeds: Optional[torch.Tensor], probs: Optional[torch.Tensor] = None,
             act: int = NO_ACTIVATION, glu_block: int = 0) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [M, K/2] u8, row_s e4m3, amax [G], col [K, M/2] u8, col_s e4m3, col_amax [G]); empty if unasked.

    seeds: [2] int64 on the device for stochastic rounding (None: round to nearest).
    probs, act, glu_block: the fused activation (kernels.quantize.amax_op).
    """
    (row, row_s, amax, col, col_s, col_amax), amax_launch, cast_launch = nvfp4_plan(
        x, splits, num_groups, block_2d, rowwise, columnwise, rht, seeds, probs, act, glu_block)
    if x.shape[0] * input_width(x, act):
        amax_launch()
        cast_launch()
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
