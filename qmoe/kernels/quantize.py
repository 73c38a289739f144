"""Triton FP8 quantization (per tensor, 1x128 / 128x128 blocks, MXFP8) and its dequantization.

Twin of `qmoe/reference/quantize.py`: same public names and signatures, same codes and scales
bit for bit. Shapes: x [M, K]; rowwise data [M, K], columnwise data [K, M] (the quantized
transpose). Every kernel reads one [BM, BK] tile of x once and writes both orientations from
it (the columnwise copy through `tl.trans`), so asking for both costs one pass over x. The cast
kernels' autotune configs include variants (row quads, grid order, chunks, register caps) that
give the same bits: `qmoe/kernels/_cast_variants.py`.

The same kernels serve `qmoe/kernels/grouped_quantize.py`: with GROUPED, the row tiles follow
the device split sizes (see `tiles.tile_rows`) and per-group values index by group. The FP8
per-tensor cast's kernel, whose grouped tiles find their group another way, lives in
`qmoe/kernels/_cast_tensorwise.py`.

Tiers (STYLE.md): `_name_kernel` (Triton), the launchers registered as torch custom ops
`qmoe::quantize_*` (validate, allocate, grid; their fake implementation is the launcher run on
fake tensors, which only allocates), and the public functions below that match the reference.

>>> from qmoe.contracts.formats import E4M3
>>> row, row_si, col, col_si = quantize_fp8_block(torch.randn(256, 512, device="cuda"), 1, 128, E4M3,
...                                               rowwise=True, columnwise=True)
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qmoe.contracts.errors import UnsupportedError
from qmoe.contracts.formats import ElementFormat, ScaleMode, ceil_div
from qmoe.kernels import _cast_transpose_gl as _block_cast_gl
from qmoe.kernels.activation import NO_ACTIVATION, input_rows, input_width, load_rows
from qmoe.kernels._arith import (atomic_max_bits, cast_codes, exp2_int, fp8_scale_from_amax, max_abs_bits,
                                reciprocal, saturate)
from qmoe.kernels._cast_variants import prune_blocks  # noqa: F401 (the NVFP4 kernels prune with it too)
from qmoe.kernels._cast_tensorwise import MAX_TENSORWISE_GROUPS, _fp8_tensorwise_kernel
from qmoe.kernels._cast_variants import (BLOCK128_CONFIGS, CAST_CONFIGS, ORIENTED_KEY, TILE_KEY, block_quads, is_forced,
                                         launch_cast, mx_multiplier, mx_quads, mx_rows, prune_variants)
from qmoe.kernels._launch import kernel_op, launch, prune_oversized, tile_configs, wrapped
from qmoe.kernels._layout import as_rows, group_pow2, steps_major
from qmoe.kernels._tiles import (block_amax_2d, block_amax_first, block_amax_last, scale_2d, scale_last,
                                store8, tile_pids, tile_rows, tile_span)

_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


def fp8_meta(fmt: ElementFormat):
    """Triton's dtype for an FP8 format (ValueError for any other format)."""
    if fmt.dtype not in _TL_FP8:
        raise ValueError(f"{fmt} is not an FP8 format (E4M3 or E5M2)")
    return _TL_FP8[fmt.dtype]


_TILE_CONFIGS = tile_configs(((32, 64, 4), (32, 128, 4), (64, 128, 8), (128, 128, 8)))


# ---------------------------------------------------------------- amax

@triton.autotune(configs=_TILE_CONFIGS, key=TILE_KEY, reset_to_zero=["amax_ptr"],
                 prune_configs_by={"early_config_prune": prune_oversized})
@triton.jit
def _amax_kernel(
        # pointers
        x_ptr, probs_ptr, amax_ptr, splits_ptr,
        # sizes
        M, K, G,
        # strides
        stride_xm,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, GROUPED: tl.constexpr, G_P2: tl.constexpr, BM: tl.constexpr,
        BK: tl.constexpr):
    """max|x| over finite values per group into amax_ptr.

    Stored as the int32 bits of non-negative floats, so atomic_max orders them.
    """
    g, row0, row_end, _, _ = tile_rows(splits_ptr, M, G, tl.program_id(0), BM, BM, G_P2, GROUPED)
    if g >= G:
        return
    rows, _, cols, m_ok, k_ok = tile_span(row0, row_end, K, BM, BK)
    x = load_rows(x_ptr, probs_ptr, rows, cols, m_ok, k_ok, stride_xm, K, ACT, GLU_BLOCK)
    atomic_max_bits(amax_ptr + g, max_abs_bits(x.to(tl.float32), True))


def tile_grid(m: int, k: int, groups: int, grouped: bool):
    """The launch grid of a tile kernel: virtual row tiles (`tiles.tile_rows`) x column tiles, as
    a 2-D grid, or a 1-D one walking along K first for configs with K_MAJOR (`tiles.tile_pids`)."""
    def grid(meta):
        rows, cols = triton.cdiv(m, meta["BM"]) + (groups if grouped else 0), triton.cdiv(k, meta["BK"])
        return (rows * cols,) if meta.get("K_MAJOR") else (rows, cols)
    return grid


_SMALL_TILE = triton.Config({"BM": 32, "BK": 64}, num_warps=4, num_stages=1)
# Small problems' config for the cast kernels (launch's `small`): a plain 32x64 tile.
_SMALL_CAST = triton.Config({"BM": 32, "BK": 64, "QUAD": 0, "K_MAJOR": 0}, num_warps=4, num_stages=1)


@kernel_op("qmoe::quantize_amax")
def amax_op(x: torch.Tensor, splits: Optional[torch.Tensor], num_groups: int, probs: Optional[torch.Tensor] = None,
            act: int = NO_ACTIVATION, glu_block: int = 0) -> torch.Tensor:
    """max|x| over finite values per group -> [G] fp32 (G = 1 without splits; 0 if none is finite).

    probs, act, glu_block (here and in every quantize op): x is h and the input is
    act(h) * probs (kernels.activation.load_rows); probs [R] contiguous fp32 when act is set.
    """
    m, k = input_rows(x, probs, act), input_width(x, act)
    bits = torch.zeros(num_groups, dtype=torch.int32, device=x.device)
    if m * k:
        grouped = splits is not None
        launch(_amax_kernel, tile_grid(m, k, num_groups, grouped),
               (x, probs if probs is not None else x, bits, splits if grouped else x, m, k, num_groups, x.stride(0)),
               _SMALL_TILE, m * k, ACT=act, GLU_BLOCK=glu_block, GROUPED=grouped, G_P2=group_pow2(num_groups))
    return bits.view(torch.float32)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x.reshape(1, -1)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| over the finite values of a tensor, 0-dim fp32 (0 if empty or none is finite)."""
    return amax_op(as_rows(_as_2d(x)), None, 1).reshape(())


# ---------------------------------------------------------------- FP8 scale from amax

@triton.jit
def _fp8_scale_kernel(amax_ptr, scale_ptr, n, eps, FMT_MAX: tl.constexpr, POW2: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    amax = tl.load(amax_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(scale_ptr + offs, fp8_scale_from_amax(amax, FMT_MAX, POW2, eps), mask=offs < n)


@kernel_op("qmoe::quantize_fp8_scale")
def fp8_scale_op(amax: torch.Tensor, fmt_max: float, power_2_scale: bool, amax_epsilon: float) -> torch.Tensor:
    a = amax.reshape(-1).contiguous()
    out = torch.empty(a.shape, dtype=torch.float32, device=amax.device)
    if a.numel():
        wrapped(_fp8_scale_kernel)[(1,)](a, out, a.numel(), amax_epsilon, FMT_MAX=fmt_max,
                                             POW2=power_2_scale, BLOCK=max(16, triton.next_power_of_2(a.numel())))
    return out.reshape(amax.shape)


def fp8_scale_supported(amax: torch.Tensor) -> bool:
    """One program holds every value: up to 4096 amaxes (a quantizer's are far fewer)."""
    return amax.numel() <= 4096


def compute_fp8_scale(amax: torch.Tensor, fmt_max: float, power_2_scale: bool = False,
                      amax_epsilon: float = 0.0) -> torch.Tensor:
    """FP8 scale from amax (NUMERICS.md): fmt_max / max(amax, eps), 1 where amax is 0 or not finite."""
    if not fp8_scale_supported(amax):
        raise UnsupportedError("the compute_fp8_scale kernel", why=f"{amax.numel()} amaxes exceed its 4096",
                               fix="qmoe.dispatch.QUANTIZE runs the reference for these")
    return fp8_scale_op(amax, float(fmt_max), bool(power_2_scale), float(amax_epsilon))


# ---------------------------------------------------------------- FP8 per tensor (device code: _cast_tensorwise)

@kernel_op("qmoe::quantize_fp8_tensorwise")
def fp8_tensorwise_op(x: torch.Tensor, scale: torch.Tensor, splits: Optional[torch.Tensor], num_groups: int,
                      out_dtype: torch.dtype, fmt_max: float, rowwise: bool, columnwise: bool,
                      probs: Optional[torch.Tensor] = None, act: int = NO_ACTIVATION,
                      glu_block: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [M, K] | empty, col [K, M] | empty, amax [G] fp32); rows past the splits' sum stay unwritten."""
    m, k = input_rows(x, probs, act), input_width(x, act)
    if num_groups >= MAX_TENSORWISE_GROUPS:
        raise UnsupportedError("the grouped FP8 per-tensor cast", why=f"{num_groups} groups",
                               fix=f"split the tensor into calls of fewer than {MAX_TENSORWISE_GROUPS} groups")
    row = torch.empty((m, k) if rowwise else (0,), dtype=out_dtype, device=x.device)
    col = torch.empty((k, m) if columnwise else (0,), dtype=out_dtype, device=x.device)
    bits = torch.zeros(num_groups, dtype=torch.int32, device=x.device)
    if m * k:
        grouped = splits is not None
        ends = torch.cumsum(splits, 0, dtype=torch.int32) if grouped else x
        launch_cast(_fp8_tensorwise_kernel, tile_grid(m, k, num_groups, False),
                    (x, probs if probs is not None else x, scale.reshape(-1), row.view(torch.uint8),
                     col.view(torch.uint8), bits, ends, m, k, num_groups, x.stride(0)),
                    _SMALL_CAST, m * k, ACT=act, GLU_BLOCK=glu_block, FMT_MAX=fmt_max, OUT_DTYPE=_TL_FP8[out_dtype],
                    ROWWISE=rowwise, COLWISE=columnwise, GROUPED=grouped, G_P2=group_pow2(num_groups))
    return row, col, bits.view(torch.float32)


def quantize_fp8_tensorwise(x: torch.Tensor, scale: torch.Tensor, fmt: ElementFormat,
                            rowwise: bool = True, columnwise: bool = False):
    """Cast x [M, K] with one fp32 scale (0-dim) and record its amax.

    Returns (rowwise_data [M, K] | None, columnwise_data [K, M] | None, amax 0-dim fp32).
    """
    fp8_meta(fmt)
    row, col, amax = fp8_tensorwise_op(as_rows(x), scale.float(), None, 1, fmt.dtype,
                                       fmt.max, rowwise, columnwise)
    return row if rowwise else None, col if columnwise else None, amax.reshape(())


# ---------------------------------------------------------------- FP8 blocks (1x128, 128x128)

@triton.autotune(configs=BLOCK128_CONFIGS, key=ORIENTED_KEY + ["BLOCK_2D"],
                 prune_configs_by={"early_config_prune": prune_variants})
@triton.jit
def _fp8_block_kernel(
        # pointers
        x_ptr, probs_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, splits_ptr,
        # sizes
        M, K, G, eps,
        # strides (scales: both of each scale tensor, any layout)
        stride_xm, stride_rs, stride_rsk, stride_cs, stride_csm,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, FMT_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr,
        POW2: tl.constexpr, B: tl.constexpr,
        BLOCK_2D: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, GROUPED: tl.constexpr,
        G_P2: tl.constexpr, QUAD: tl.constexpr, K_MAJOR: tl.constexpr, BKC: tl.constexpr, BM: tl.constexpr,
        BK: tl.constexpr):
    """FP8 with an fp32 scale per 1 x B run (each orientation) or per B x B tile (shared).

    QUAD: one B x B block per program as a row quad, in chunks of BKC columns (`_block_quads`).
    Otherwise one [BM, BK] tile: 2-D blocks cast once for both orientations; 1 x B columnwise
    runs cast from the transposed input.
    """
    pid_m, pid_k = tile_pids(K, BK, K_MAJOR)
    g, row0, row_end, sblk0, _ = tile_rows(splits_ptr, M, G, pid_m, BM, B, G_P2, GROUPED)
    if g >= G:
        return
    col0 = pid_k * BK
    if QUAD:
        block_quads(x_ptr, probs_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, sblk0, col0, M, K, eps,
                     stride_xm, stride_rs, stride_rsk, stride_cs, stride_csm, ACT, GLU_BLOCK, FMT_MAX, OUT_DTYPE,
                     POW2, B, BLOCK_2D, ROWWISE, COLWISE, BKC)
        return
    rows = row0 + tl.arange(0, BM)
    cols = col0 + tl.arange(0, BK)
    m_ok, k_ok = rows < row_end, cols < K
    x = load_rows(x_ptr, probs_ptr, rows, cols, m_ok, k_ok, stride_xm, K, ACT, GLU_BLOCK).to(tl.float32)
    kb = pid_k * (BK // B) + tl.arange(0, BK // B)
    kb_ok = kb * B < K
    if BLOCK_2D:
        mb = sblk0 + tl.arange(0, BM // B)
        mb_ok = row0 + tl.arange(0, BM // B) * B < row_end
        scale = fp8_scale_from_amax(block_amax_2d(x, BM, BK, B), FMT_MAX, POW2, eps)
        inv = reciprocal(scale)
        q = cast_codes(scale_2d(x, scale, BM, BK, B), FMT_MAX, OUT_DTYPE)
        if ROWWISE:
            store8(row_ptr, q, row0, col0, K, row_end, K, BM, BK)
            tl.store(row_s_ptr + mb[:, None] * stride_rs + kb[None, :] * stride_rsk, inv,
                     mask=mb_ok[:, None] & kb_ok[None, :])
        if COLWISE:  # the same scales, so the same codes, transposed
            store8(col_ptr, tl.trans(q), col0, row0, M, K, row_end, BK, BM)
            tl.store(col_s_ptr + kb[None, :] * stride_cs + mb[:, None] * stride_csm, inv,
                     mask=mb_ok[:, None] & kb_ok[None, :])
    else:
        if ROWWISE:
            scale = fp8_scale_from_amax(block_amax_last(x, BM, BK, B, False), FMT_MAX, POW2, eps)
            store8(row_ptr, cast_codes(scale_last(x, scale, BM, BK, B), FMT_MAX, OUT_DTYPE), row0, col0, K, row_end,
                   K, BM, BK)
            tl.store(row_s_ptr + rows[:, None].to(tl.int64) * stride_rs + kb[None, :] * stride_rsk, reciprocal(scale),
                     mask=m_ok[:, None] & kb_ok[None, :])
        if COLWISE:  # scales of runs along M from the loaded tile; codes cast from the transposed input
            mb = sblk0 + tl.arange(0, BM // B)
            mb_ok = row0 + tl.arange(0, BM // B) * B < row_end
            scale_t = tl.trans(fp8_scale_from_amax(block_amax_first(x, BM, BK, B, False), FMT_MAX, POW2, eps))
            q_t = cast_codes(scale_last(tl.trans(x), scale_t, BK, BM, B), FMT_MAX, OUT_DTYPE)
            store8(col_ptr, q_t, col0, row0, M, K, row_end, BK, BM)
            tl.store(col_s_ptr + cols[:, None].to(tl.int64) * stride_cs + mb[None, :] * stride_csm, reciprocal(scale_t),
                     mask=k_ok[:, None] & mb_ok[None, :])


def _strides(scale: torch.Tensor) -> tuple[int, int]:
    """A scale output's two strides (an unrequested, empty one: any)."""
    return tuple(scale.stride()) if scale.dim() == 2 else (0, 0)


def scale_width(m: int, block: int, num_groups: int, grouped: bool) -> int:
    """Scale blocks along M: ceil(M/b), or the grouped static capacity M // b + G."""
    return m // block + num_groups if grouped else ceil_div(m, block)


@kernel_op("qmoe::quantize_fp8_block")
def fp8_block_op(x: torch.Tensor, splits: Optional[torch.Tensor], num_groups: int, block_rows: int,
                 block_cols: int, out_dtype: torch.dtype, fmt_max: float, power_2_scale: bool, amax_epsilon: float,
                 rowwise: bool, columnwise: bool, probs: Optional[torch.Tensor] = None, act: int = NO_ACTIVATION,
                 glu_block: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [M, K], row_si, col [K, M], col_si); unrequested outputs are empty. Shapes: reference;
    1 x B scales are stored steps-major (`steps_major`), 2-D block scales row-major.

    Calls with a columnwise copy run the Gluon kernel of `_cast_transpose_gl` where it applies
    (same bits; rowwise codes alone stay with the Triton kernel, which runs them near the copy
    bandwidth: quantize.json).
    """
    m, k = input_rows(x, probs, act), input_width(x, act)
    b, two_d, grouped = block_cols, block_rows > 1, splits is not None
    nkb, width = ceil_div(k, b), scale_width(m, b, num_groups, grouped)
    dev, f32 = x.device, torch.float32
    zeros = grouped  # scale entries no group uses are zero
    alloc = torch.zeros if zeros else torch.empty
    row = torch.empty((m, k) if rowwise else (0,), dtype=out_dtype, device=dev)
    col = torch.empty((k, m) if columnwise else (0,), dtype=out_dtype, device=dev)
    if two_d:
        row_s = alloc((width, nkb) if rowwise else (0,), dtype=f32, device=dev)
        col_s = alloc((nkb, width) if columnwise else (0,), dtype=f32, device=dev)
    else:  # steps-major (`steps_major`): the block GEMMs' layout, read canonically through ScaleSlot
        row_s = steps_major(m, nkb, f32, dev) if rowwise else torch.empty((0,), dtype=f32, device=dev)
        col_s = steps_major(k, width, f32, dev, zeros) if columnwise else torch.empty((0,), dtype=f32, device=dev)
    gluon_cast = m * k and columnwise and not is_forced(_fp8_block_kernel)
    if gluon_cast and _block_cast_gl.launch_dispatched(x, splits, num_groups, two_d, b, act, glu_block, probs,
                                                       _TL_FP8[out_dtype], fmt_max, power_2_scale, amax_epsilon,
                                                       rowwise, row, row_s, col, col_s):
        return row, row_s, col, col_s
    if m * k:
        small = triton.Config({"BM": b if (columnwise or two_d) else 32, "BK": b, "QUAD": 0, "K_MAJOR": 0, "BKC": b},
                              num_warps=4, num_stages=1)
        launch_cast(_fp8_block_kernel, tile_grid(m, k, num_groups, grouped),
                    (x, probs if probs is not None else x, row.view(torch.uint8), row_s, col.view(torch.uint8), col_s,
                     splits if grouped else x, m, k, num_groups, amax_epsilon,
                     x.stride(0), *_strides(row_s), *_strides(col_s)),
                    small, m * k, ACT=act, GLU_BLOCK=glu_block, FMT_MAX=fmt_max, OUT_DTYPE=_TL_FP8[out_dtype],
                    POW2=power_2_scale, B=b,
                    BLOCK_2D=two_d, ROWWISE=rowwise, COLWISE=columnwise, GROUPED=grouped, G_P2=group_pow2(num_groups))
    return row, row_s, col, col_s


def fp8_block_supported(block_rows: int, block_cols: int) -> bool:
    return block_cols in (32, 64, 128) and block_rows in (1, block_cols)


def quantize_fp8_block(x: torch.Tensor, block_rows: int, block_cols: int, fmt: ElementFormat,
                       power_2_scale: bool = True, amax_epsilon: float = 0.0,
                       rowwise: bool = True, columnwise: bool = False):
    """FP8 with an fp32 scale per (block_rows x block_cols) block: 1x128 rows or 128x128 tiles.

    Returns (row_data [M, K], row_scale_inv, col_data [K, M], col_scale_inv) as the reference.
    """
    fp8_meta(fmt)
    if not fp8_block_supported(block_rows, block_cols):
        raise UnsupportedError("the quantize_fp8_block kernel", why=f"{block_rows}x{block_cols} blocks",
                               fix="qmoe.dispatch.QUANTIZE runs the reference for these")
    row, rs, col, cs = fp8_block_op(as_rows(x), None, 1, block_rows, block_cols, fmt.dtype,
                                    fmt.max, power_2_scale, float(amax_epsilon), rowwise,
                                    columnwise)
    return (row if rowwise else None, rs if rowwise else None, col if columnwise else None,
            cs if columnwise else None)


# ---------------------------------------------------------------- MXFP8 (1x32, E8M0 scales)

@triton.autotune(configs=CAST_CONFIGS, key=ORIENTED_KEY, prune_configs_by={"early_config_prune": prune_variants})
@triton.jit
def _mxfp8_kernel(
        # pointers
        x_ptr, probs_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, splits_ptr,
        # sizes
        M, K, G,
        # strides (scales: both of each scale tensor, any layout)
        stride_xm, stride_rs, stride_rsk, stride_cs, stride_csm,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, FMT_MAX: tl.constexpr, EMAX: tl.constexpr, ROUND_UP: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
        B: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, GROUPED: tl.constexpr,
        G_P2: tl.constexpr, QUAD: tl.constexpr, K_MAJOR: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """MXFP8: codes cast(x * 2^-b) with an E8M0 byte b + 127 per 1 x B run, in each orientation.

    QUAD: the tile as a row quad (runs along M are runs of B / 4 quad rows); else one tile whose
    columnwise codes are cast from the transposed input.
    """
    pid_m, pid_k = tile_pids(K, BK, K_MAJOR)
    g, row0, row_end, sblk0, _ = tile_rows(splits_ptr, M, G, pid_m, BM, B, G_P2, GROUPED)
    if g >= G:
        return
    col0 = pid_k * BK
    cols = col0 + tl.arange(0, BK)
    k_ok = cols < K
    kb = pid_k * (BK // B) + tl.arange(0, BK // B)
    mb = sblk0 + tl.arange(0, BM // B)
    mb_ok = row0 + tl.arange(0, BM // B) * B < row_end
    if QUAD:
        mx_quads(x_ptr, probs_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, col0, cols, kb, mb, mb_ok, M,
                 K, stride_xm, stride_rs, stride_rsk, stride_cs, stride_csm, ACT, GLU_BLOCK, FMT_MAX, EMAX, ROUND_UP,
                 OUT_DTYPE, B, ROWWISE, COLWISE, BM // 4, BK)
    else:
        rows = row0 + tl.arange(0, BM)
        x = load_rows(x_ptr, probs_ptr, rows, cols, rows < row_end, k_ok, stride_xm, K, ACT, GLU_BLOCK).to(tl.float32)
        if ROWWISE:
            y = mx_rows(x, row_s_ptr, rows, row_end, kb, K, stride_rs, stride_rsk, FMT_MAX, EMAX, ROUND_UP, B, BM, BK)
            store8(row_ptr, cast_codes(y, FMT_MAX, OUT_DTYPE), row0, col0, K, row_end, K, BM, BK)
        if COLWISE:  # exponents of runs along M from the loaded tile; codes cast from the transposed input
            mult, e = mx_multiplier(tl.trans(block_amax_first(x, BM, BK, B, False)), FMT_MAX, EMAX, ROUND_UP)
            store8(col_ptr, cast_codes(scale_last(tl.trans(x), mult, BK, BM, B), FMT_MAX, OUT_DTYPE), col0, row0, M, K,
                   row_end, BK, BM)
            tl.store(col_s_ptr + cols[:, None].to(tl.int64) * stride_cs + mb[None, :] * stride_csm, e,
                     mask=k_ok[:, None] & mb_ok[None, :])


@kernel_op("qmoe::quantize_mxfp8")
def mxfp8_op(x: torch.Tensor, splits: Optional[torch.Tensor], num_groups: int, out_dtype: torch.dtype,
             fmt_max: float, emax: int, round_up: bool, block: int, rowwise: bool, columnwise: bool,
             probs: Optional[torch.Tensor] = None, act: int = NO_ACTIVATION, glu_block: int = 0,
             row_values: bool = False,
             col_values: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [M, K], row_s [M, ceil(K/b)] e8m0, col [K, M], col_s [K, width] e8m0); unrequested: empty.
    The scales are stored steps-major (`steps_major`), as fp8_block_op's 1 x B scales are.

    row_values / col_values: that copy as its exact bf16 values, [M, K] both (dequantize(codes),
    bit for bit), with an empty scale, where the Gluon kernel runs (`writes_values`); elsewhere
    codes as usual: a bf16 result is values, an FP8 one codes.

    Calls with a columnwise copy of bf16, or values, run the Gluon kernel of `_cast_transpose_gl`
    where it applies (same bits; rowwise codes alone stay with the Triton kernel)."""
    m, k = input_rows(x, probs, act), input_width(x, act)
    grouped = splits is not None
    asked = (row_values and rowwise) or (col_values and columnwise)
    values = ((row_values and rowwise, col_values and columnwise)
              if asked and m * k and not is_forced(_mxfp8_kernel) and _block_cast_gl.writes_values(x, act, glu_block)
              else (False, False))

    def outputs(values):
        nkb, width = ceil_div(k, block), scale_width(m, block, num_groups, grouped)
        dev, u8, none = x.device, torch.uint8, torch.empty((0,), dtype=torch.uint8, device=x.device)
        row = torch.empty((m, k) if rowwise else (0,), dtype=torch.bfloat16 if values[0] else out_dtype, device=dev)
        col = torch.empty(((m, k) if values[1] else (k, m)) if columnwise else (0,),
                          dtype=torch.bfloat16 if values[1] else out_dtype, device=dev)
        row_s = steps_major(m, nkb, u8, dev) if rowwise and not values[0] else none
        col_s = steps_major(k, width, u8, dev, grouped) if columnwise and not values[1] else none
        return row, row_s, col, col_s

    row, row_s, col, col_s = outputs(values)
    gluon_cast = m * k and (columnwise or values[0]) and not is_forced(_mxfp8_kernel)
    if gluon_cast and _block_cast_gl.launch_dispatched_mx(x, splits, num_groups, block, act, glu_block, probs,
                                                          _TL_FP8[out_dtype], fmt_max, emax, round_up, rowwise,
                                                          columnwise, row, row_s, col, col_s, values):
        return row, row_s.view(torch.float8_e8m0fnu), col, col_s.view(torch.float8_e8m0fnu)
    if any(values):  # the Gluon kernel did not compile: codes, from the Triton kernel
        row, row_s, col, col_s = outputs((False, False))
    if m * k:
        launch_cast(_mxfp8_kernel, tile_grid(m, k, num_groups, grouped),
                    (x, probs if probs is not None else x, row.view(torch.uint8), row_s, col.view(torch.uint8), col_s,
                     splits if grouped else x, m, k, num_groups, x.stride(0), *_strides(row_s), *_strides(col_s)),
                    _SMALL_CAST, m * k, ACT=act, GLU_BLOCK=glu_block, FMT_MAX=fmt_max, EMAX=emax, ROUND_UP=round_up,
                    OUT_DTYPE=_TL_FP8[out_dtype], B=block, ROWWISE=rowwise, COLWISE=columnwise, GROUPED=grouped,
                    G_P2=group_pow2(num_groups))
    return row, row_s.view(torch.float8_e8m0fnu), col, col_s.view(torch.float8_e8m0fnu)


def mxfp8_block_supported(block: int) -> bool:
    return block == 32  # the kernels' tiles assume 32-value blocks


def quantize_mxfp8(x: torch.Tensor, fmt: ElementFormat, scale_mode: ScaleMode = ScaleMode.ROUND_UP,
                   rowwise: bool = True, columnwise: bool = False, block: int = 32):
    """MXFP8: FP8 codes with an E8M0 scale per 32 consecutive values (layouts as the reference)."""
    fp8_meta(fmt)
    if not mxfp8_block_supported(block):
        raise UnsupportedError("the quantize_mxfp8 kernel", why=f"{block}-value blocks",
                               fix="qmoe.dispatch.QUANTIZE runs the reference for these")
    row, rs, col, cs = mxfp8_op(as_rows(x), None, 1, fmt.dtype, fmt.max, fmt.emax,
                                scale_mode is ScaleMode.ROUND_UP, block, rowwise, columnwise)
    return (row if rowwise else None, rs if rowwise else None, col if columnwise else None,
            cs if columnwise else None)


# ---------------------------------------------------------------- dequantization

@triton.autotune(configs=tile_configs(((32, 128, 4), (64, 128, 4))), key=["R", "C"],
                 prune_configs_by={"early_config_prune": prune_oversized})
@triton.jit
def _dequantize_kernel(
        # pointers
        data_ptr, s_ptr, out_ptr,
        # sizes
        R, C,
        # strides
        stride_dr, stride_dc, stride_sr, stride_sc,
        # meta
        BR: tl.constexpr, BC: tl.constexpr, E8M0: tl.constexpr, DMAX: tl.constexpr, BM: tl.constexpr,
        BK: tl.constexpr):
    """out [R, C] = float(data) * scale[r // BR, c // BC] (fp32 scale, or E8M0 bytes 2^(b-127)),
    saturated to the output dtype's range (DMAX)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    d = tl.load(data_ptr + rows[:, None].to(tl.int64) * stride_dr + cols[None, :] * stride_dc, mask=mask, other=0.0)
    s_off = (rows // BR)[:, None].to(tl.int64) * stride_sr + (cols // BC)[None, :] * stride_sc
    if E8M0:
        b = tl.load(s_ptr + s_off, mask=mask, other=127).to(tl.int32)
        nan = tl.full(b.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
        s = tl.where(b == 255, nan, exp2_int(b - 127))  # E8M0: 2^(byte - 127)
    else:
        s = tl.load(s_ptr + s_off, mask=mask, other=1.0)
    y = saturate(d.to(tl.float32) * s, DMAX)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@kernel_op("qmoe::dequantize_scaled")
def dequantize_op(data: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int, e8m0: bool,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """float(data) * scale expanded over (block_rows x block_cols) blocks; a 0-dim scale is per tensor."""
    r, c = data.shape
    out = torch.empty((r, c), dtype=out_dtype, device=data.device)
    if data.numel():
        s = scale.view(torch.uint8) if e8m0 else scale
        ssr, ssc = (0, 0) if s.dim() == 0 else (s.stride(0), s.stride(1))
        grid = lambda meta: (triton.cdiv(r, meta["BM"]), triton.cdiv(c, meta["BK"]))  # noqa: E731
        launch(_dequantize_kernel, grid, (data, s, out, r, c, data.stride(0), data.stride(1), ssr, ssc),
               _SMALL_TILE, data.numel(), BR=block_rows, BC=block_cols, E8M0=e8m0,
               DMAX=torch.finfo(out_dtype).max)
    return out


def _check_2d(data: torch.Tensor, what: str):
    if data.dim() != 2:
        raise ValueError(f"{what} takes 2-D data, got shape {tuple(data.shape)}")


def dequantize_fp8_tensorwise(data: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32):
    _check_2d(data, "dequantize_fp8_tensorwise")
    return dequantize_op(data, scale_inv.float().reshape(()), 1, 1, False, dtype)


def dequantize_fp8_block(data: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, block_cols: int,
                         dtype=torch.float32):
    _check_2d(data, "dequantize_fp8_block")
    return dequantize_op(data, scale_inv.float(), block_rows, block_cols, False, dtype)


def dequantize_mxfp8(data: torch.Tensor, scale: torch.Tensor, dtype=torch.float32, block: int = 32):
    _check_2d(data, "dequantize_mxfp8")
    return dequantize_op(data, scale, 1, block, True, dtype)
