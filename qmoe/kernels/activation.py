"""Triton expert activation scaled by the routing prob: one launch forward, one launch backward.

Twin of `qmoe/reference/activation.py` (same public names and signatures). Dimensions: R
permuted rows, F output columns, k the GLU interleave block.

    forward:  h [R, 2F] or [R, F], probs [R] | None            -> a = act(h) * probs[:, None]  [R, F]
    backward: h, probs, da [R, F]                                -> dh (h's shape), dprobs [R] fp32

Both are memory-bound elementwise passes computed in fp32 and rounded once to h's dtype: the
forward reads h once and writes a; the backward reads h and da once, recomputes act(h) and
writes dh (nothing is saved from the forward but h). The GLU halves are read in place: with
`glu_interleave_size=k` the gate of output column j sits at physical column (j // k) * 2k + j % k
and its linear part k columns further, so no deinterleaved copy is ever made. Rows take any
stride; columns must be unit-stride (the launchers copy otherwise).

Either launch can also reduce the amax of what it writes per group of rows (`amax_offsets`:
a's for FC2's input, dh's for FC1's grad_output), so a current-scaling quantizer of it only
casts (`RowsWithAmax`): an atomic max of |value|'s float bits per group, exact in any order.

dprobs[r] = sum_j da[r, j] * act(h)[r, j] is a reduction over F. It is done by one program per
row block that loops over all F columns in a fixed order and writes each dprobs entry once: no
atomics, so the result is bit-identical from call to call and in CUDA-graph replays. Because a
reduction's rounding depends on the tile shape, that launch does not autotune (a timing-based
pick could differ between processes); its tile comes from the shape alone (`_reducing_config`).
The purely elementwise launches (forward; backward without dprobs) give the same bits for any
tile, so they autotune.

Tiers (STYLE.md): `_name_kernel` (Triton), launchers registered as torch custom ops
`qmoe::scaled_activation_*` (allocate, grid; under fake tensors they only allocate), and the public
functions below, which validate.

>>> h = torch.randn(4096, 2 * 1536, device="cuda", dtype=torch.bfloat16)
>>> probs = torch.rand(4096, device="cuda")
>>> a = scaled_activation_forward(h, probs, "swiglu")                                  # [4096, 1536]
>>> dh, dprobs = scaled_activation_backward(h, probs, torch.randn_like(a), "swiglu")
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qmoe.kernels._arith import atomic_max_by_group, finite_abs_bits
from qmoe.kernels._launch import kernel_op, launch, wrapped
from qmoe.kernels._layout import group_pow2
from qmoe.contracts.carriers import (ACTIVATIONS, GELU_BETA, GELU_KAPPA, GLU_ACTIVATIONS, QGEGLU_ALPHA, QGEGLU_LIMIT,
                                     RowsWithAmax, glu_block)
from qmoe.contracts.validate import check_scaled_activation_args

# The one place where an activation name becomes a kernel constant: its index in ACTIVATIONS,
# which lists the GLUs first (codes below _FIRST_POINTWISE read a gate and a linear half).
_ACT_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}
_SWIGLU = tl.constexpr(_ACT_CODES["swiglu"])
_GEGLU = tl.constexpr(_ACT_CODES["geglu"])
_QGEGLU = tl.constexpr(_ACT_CODES["clamped_qgeglu"])
_RELU2 = tl.constexpr(_ACT_CODES["relu2"])
_FIRST_POINTWISE = tl.constexpr(len(GLU_ACTIVATIONS))
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_LIMIT = tl.constexpr(QGEGLU_LIMIT)
_ALPHA = tl.constexpr(QGEGLU_ALPHA)
_KAPPA = tl.constexpr(GELU_KAPPA)
_BETA = tl.constexpr(GELU_BETA)
_TWO_BETA = tl.constexpr(2.0 * GELU_BETA)


# ---------------------------------------------------------------- activations on fp32 tiles

@triton.jit
def _gelu_and_grad(x):
    """tanh-approximate gelu and its derivative, in the form and order of torch's (aten's gelu and
    gelu_backward with approximate="tanh"), with tanh(u) = 1 - 2 / (exp(2u) + 1).

    That tanh rounds to exactly -1 where torch's does (up to a narrow band near x = -5.5), so
    gelu's negative tail is 0 on both sides and 0 * inf gives the same NaN; elsewhere the two
    agree to an fp32 rounding of tanh (absolute, since 1 + tanh cancels on the tail).
    """
    x2 = x * x
    t = 1.0 - 2.0 / (tl.exp((x + x2 * x * _KAPPA) * _TWO_BETA) + 1.0)
    half_x = 0.5 * x
    value = half_x * (1.0 + t)
    grad = 0.5 * (1.0 + t) + half_x * (1.0 - t * t) * ((1.0 + x2 * (3.0 * _KAPPA)) * _BETA)
    return value, grad


@triton.jit
def _activation(g, y, dact, ACT: tl.constexpr):
    """(act, d gate, d linear) on fp32 tiles for the output gradient dact: g the gate (or the input
    of a pointwise activation), y the linear part (pointwise activations ignore it and return 0).

    The gradients multiply in the order of torch's autograd (dact times the other factor first,
    then the derivative), so overflow and 0 * inf give the same infinities and NaNs as the
    reference. The forward passes any tile as dact and uses only act: the compiler drops the rest.
    Module constants multiply from the right (under TRITON_INTERPRET a constexpr on the left of a
    tensor would wrap it).
    """
    if ACT == _SWIGLU:
        s = tl.sigmoid(g)
        silu = g * s
        act = silu * y
        dg = (dact * y) * (s * (1.0 + g * (1.0 - s)))
        dy = dact * silu
    elif ACT == _GEGLU:
        gelu, dgelu = _gelu_and_grad(g)
        act = gelu * y
        dg = (dact * y) * dgelu
        dy = dact * gelu
    elif ACT == _QGEGLU:
        # clamps keep NaN (torch.clamp) and pass the gradient inside their range, bounds included
        gc = tl.minimum(g, _LIMIT, propagate_nan=tl.PropagateNan.ALL)
        yc = tl.minimum(tl.maximum(y, -_LIMIT, propagate_nan=tl.PropagateNan.ALL), _LIMIT,
                        propagate_nan=tl.PropagateNan.ALL)
        s = tl.sigmoid(gc * _ALPHA)
        act = (yc + 1.0) * gc * s
        dg = tl.where(g <= _LIMIT, (dact * (yc + 1.0)) * (s * (1.0 + gc * _ALPHA * (1.0 - s))), 0.0)
        dy = tl.where((y >= -_LIMIT) & (y <= _LIMIT), dact * (gc * s), 0.0)
    elif ACT == _RELU2:
        r = tl.where(g < 0.0, 0.0, g)  # relu that keeps NaN, as torch's
        act = r * r
        dg = dact * (2.0 * r)
        dy = tl.zeros_like(r)
    else:  # gelu
        act, dgelu = _gelu_and_grad(g)
        dg = dact * dgelu
        dy = tl.zeros_like(g)
    return act, dg, dy


@triton.jit
def _glu_columns(cols, F, GLU_BLOCK: tl.constexpr):
    """Physical columns of the gate and the linear part of output columns `cols` (GLU_BLOCK 0:
    gate columns first, then linear columns). With a power-of-two block, Triton's axis analysis
    still sees runs of GLU_BLOCK contiguous columns and issues 16-byte accesses."""
    if GLU_BLOCK == 0:
        gate = cols
        linear = cols + F
    else:
        gate = (cols // GLU_BLOCK) * (2 * GLU_BLOCK) + cols % GLU_BLOCK
        linear = gate + GLU_BLOCK
    return gate, linear


# ---------------------------------------------------------------- the activation as a quantizer's prologue

NO_ACTIVATION = -1  # load_rows' ACT for a plain input
GATHER = -2  # load_rows' ACT for rows gathered from a source by an index (a `GatheredRows`)
_GATHER = tl.constexpr(GATHER)


def activation_code(activation: str | None) -> int:
    """The kernels' constant for an activation name (None: NO_ACTIVATION)."""
    return NO_ACTIVATION if activation is None else _ACT_CODES[activation]


def input_rows(x: torch.Tensor, probs: torch.Tensor | None, act: int) -> int:
    """Rows load_rows gives: x's own, or with GATHER the index's (probs holds it)."""
    return probs.shape[0] if act == GATHER else x.shape[0]


def input_width(x: torch.Tensor, act: int) -> int:
    """Columns of the rows load_rows gives: x's own, or the activation's output width F."""
    return x.shape[1] // 2 if 0 <= act < len(GLU_ACTIVATIONS) else x.shape[1]


@triton.jit
def _activated(h_rows, cols, mask, width, ACT: tl.constexpr, GLU_BLOCK: tl.constexpr):
    """act(h) in fp32 for output columns `cols` of an activated width `width`; h_rows: [BM, 1]
    row pointers into h (a GLU reads each output's gate and linear columns)."""
    if ACT < _FIRST_POINTWISE:
        gate, linear = _glu_columns(cols, width, GLU_BLOCK)
        g = tl.load(h_rows + gate[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(h_rows + linear[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(h_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = g
    act, _, _ = _activation(g, y, g, ACT)
    return act


@triton.jit
def load_rows(x_ptr, probs_ptr, rows, cols, row_ok, col_ok, stride_x, K, ACT: tl.constexpr,
              GLU_BLOCK: tl.constexpr):
    """A [rows, cols] tile of a quantizer's input, in x's dtype, zeros where masked.

    ACT = NO_ACTIVATION: x itself. ACT = GATHER: row r is x's row probs_ptr[r] (int32; a zero
    row where negative), the permute of FC1's input fused into its quantization. Otherwise x_ptr
    holds h and the input is act(h) * probs[row] for output columns `cols` of width K, computed in
    fp32 exactly as `_forward_kernel` does and rounded to h's dtype: the quantized result is bit
    for bit that of quantizing the unfused activation output, which never goes to memory.
    """
    if ACT == _GATHER:
        src = tl.load(probs_ptr + rows, mask=row_ok, other=-1)
        row_ok = src >= 0
        rows = src
    mask = row_ok[:, None] & col_ok[None, :]
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    if ACT < 0:
        out = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
    else:
        act = _activated(x_rows, cols, mask, K, ACT, GLU_BLOCK)
        act = act * tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        out = act.to(x_ptr.dtype.element_ty)
    return out


# ---------------------------------------------------------------- kernels

def _tile_configs(tiles) -> list[triton.Config]:
    """Configs from (BM rows, BN columns, num_warps).

    Memory-bound and single-pass, so stages do not matter. Tiles hold 2K-8K outputs (16-32 per
    thread per operand: the GLU forward keeps two input tiles and the output live without
    spilling), at least 256 columns wide so each row segment is a run of 16-byte accesses.
    """
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=1) for bm, bn, w in tiles]


_CONFIGS = _tile_configs(((8, 256, 4), (16, 256, 4), (32, 256, 8), (16, 512, 8)))
# R and F set the grid; the activation sets the bytes per output and the arithmetic; the GLU
# block sets how contiguous the accesses are (dtypes join the key on their own).
_KEY = ["R", "F", "ACT", "GLU_BLOCK", "AMAX"]
# Problems below launch()'s autotune threshold: one modest tile, no tuning runs.
_SMALL = triton.Config({"BM": 16, "BN": 128}, num_warps=4, num_stages=1)


@triton.jit
def _row_peaks(t, mask):
    """Per row of a stored tile, max|t| over its finite values as int32 bits (masked entries 0)."""
    return tl.max(tl.where(mask, finite_abs_bits(t.to(tl.float32)), 0), 1)


# Tiles never span groups of rows here (the grid is plain row blocks); an atomic max to each
# row's group (`atomic_max_by_group`) is exact in any order and idempotent, so an autotuner's
# repeated runs leave the same amax and need no reset.
@triton.autotune(configs=_CONFIGS, key=_KEY)
@triton.jit
def _forward_kernel(
        # pointers
        h_ptr, probs_ptr, a_ptr, offsets_ptr, amax_ptr,
        # sizes
        R, F, G,
        # strides (columns are unit-stride)
        stride_h, stride_p, stride_a,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, HAS_PROBS: tl.constexpr, AMAX: tl.constexpr,
        G_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """a = act(h) * probs; AMAX: amax[g] (int32 bits) raised to max|a| over the finite values
    of each group's rows (groups: offsets [G+1])."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    act = _activated(h_ptr + rows64[:, None] * stride_h, cols, mask, F, ACT, GLU_BLOCK)
    if HAS_PROBS:
        act = act * tl.load(probs_ptr + rows64 * stride_p, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    a = act.to(a_ptr.dtype.element_ty)
    tl.store(a_ptr + rows64[:, None] * stride_a + cols[None, :], a, mask=mask)
    if AMAX:
        atomic_max_by_group(amax_ptr, offsets_ptr, G, rows, row_ok, _row_peaks(a, mask), G_P2)


@triton.jit
def _backward_tile(h_ptr, da_ptr, dh_ptr, rows64, row_ok, p, col0, F, stride_h, stride_da, stride_dh,
                   ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, AMAX: tl.constexpr, BN: tl.constexpr):
    """dh of one [BM, BN] tile of output columns from col0; returns (sum_j da * act per row (fp32),
    per row max|dh| over the finite values stored, as int32 bits (zeros without AMAX))."""
    cols = col0 + tl.arange(0, BN)
    mask = row_ok[:, None] & (cols < F)[None, :]
    da = tl.load(da_ptr + rows64[:, None] * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dact = da * p[:, None]
    h_rows = h_ptr + rows64[:, None] * stride_h
    dh_rows = dh_ptr + rows64[:, None] * stride_dh
    peaks = tl.zeros([rows64.shape[0]], tl.int32)
    if ACT < _FIRST_POINTWISE:
        gate, linear = _glu_columns(cols, F, GLU_BLOCK)
        g = tl.load(h_rows + gate[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(h_rows + linear[None, :], mask=mask, other=0.0).to(tl.float32)
        act, dg, dy = _activation(g, y, dact, ACT)
        dg = dg.to(dh_ptr.dtype.element_ty)
        dy = dy.to(dh_ptr.dtype.element_ty)
        tl.store(dh_rows + gate[None, :], dg, mask=mask)
        tl.store(dh_rows + linear[None, :], dy, mask=mask)
        if AMAX:
            peaks = tl.maximum(_row_peaks(dg, mask), _row_peaks(dy, mask))
    else:
        x = tl.load(h_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        act, dx, _ = _activation(x, x, dact, ACT)
        dx = dx.to(dh_ptr.dtype.element_ty)
        tl.store(dh_rows + cols[None, :], dx, mask=mask)
        if AMAX:
            peaks = _row_peaks(dx, mask)
    return tl.sum(tl.where(mask, da * act, 0.0), axis=1), peaks


@triton.autotune(configs=_CONFIGS, key=_KEY)
@triton.jit
def _backward_kernel(
        # pointers
        h_ptr, probs_ptr, da_ptr, dh_ptr, dprobs_ptr, offsets_ptr, amax_ptr,
        # sizes
        R, F, G,
        # strides (columns are unit-stride)
        stride_h, stride_p, stride_da, stride_dh,
        # meta
        ACT: tl.constexpr, GLU_BLOCK: tl.constexpr, HAS_PROBS: tl.constexpr, NEED_DPROBS: tl.constexpr,
        AMAX: tl.constexpr, G_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """NEED_DPROBS: grid (row blocks,), each program loops over all F columns and writes its rows'
    dprobs once. Otherwise: grid (row blocks, column blocks), one tile each. AMAX: amax[g] (int32
    bits) raised to max|dh| over the finite values of each group's rows (groups: offsets [G+1])."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows64 * stride_p, mask=row_ok, other=0.0).to(tl.float32)
    else:
        p = tl.full([BM], 1.0, tl.float32)  # x * 1 == x exactly: the same bits as no scale
    if NEED_DPROBS:
        acc = tl.zeros([BM], dtype=tl.float32)
        peaks = tl.zeros([BM], dtype=tl.int32)
        for col0 in range(0, F, BN):
            dots, tile_peaks = _backward_tile(h_ptr, da_ptr, dh_ptr, rows64, row_ok, p, col0, F, stride_h,
                                              stride_da, stride_dh, ACT, GLU_BLOCK, AMAX, BN)
            acc += dots
            peaks = tl.maximum(peaks, tile_peaks)
        tl.store(dprobs_ptr + rows, acc, mask=row_ok)
    else:
        _, peaks = _backward_tile(h_ptr, da_ptr, dh_ptr, rows64, row_ok, p, tl.program_id(1) * BN, F, stride_h,
                                  stride_da, stride_dh, ACT, GLU_BLOCK, AMAX, BN)
    if AMAX:
        atomic_max_by_group(amax_ptr, offsets_ptr, G, rows, row_ok, peaks, G_P2)


def _reducing_config(rows: int) -> triton.Config:
    """The fixed tile of the dprobs-reducing backward, from the row count alone.

    One program per BM rows: up to 8 rows while that leaves >= 256 programs (a few per SM to
    keep enough loads in flight), 256 columns per step (16-byte accesses, 8-16 values per thread
    per operand, no spills).
    """
    bm = 8
    while bm > 1 and rows < bm * 256:
        bm //= 2
    return triton.Config({"BM": bm, "BN": 256}, num_warps=4, num_stages=1)


# ---------------------------------------------------------------- launchers (custom ops)

def _out_width(h: torch.Tensor, act: int) -> int:
    return h.shape[1] // 2 if act < len(GLU_ACTIVATIONS) else h.shape[1]


def _amax_buffers(offsets: Optional[torch.Tensor], like: torch.Tensor):
    """(zeroed int32 amax bits [G] (G = 0 without offsets), offsets or a dummy pointer, G, G_P2)."""
    g = offsets.shape[0] - 1 if offsets is not None else 0
    bits = torch.zeros(g, dtype=torch.int32, device=like.device)
    return bits, offsets if offsets is not None else bits, g, group_pow2(max(g, 1))


@kernel_op("qmoe::scaled_activation_forward")
def _forward_op(h: torch.Tensor, probs: Optional[torch.Tensor], act: int, glu_block: int,
                amax_offsets: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [R, F] in h's dtype, amax [G] fp32 per group of amax_offsets [G+1], or [0] without them)."""
    r, f = h.shape[0], _out_width(h, act)
    a = torch.empty(r, f, dtype=h.dtype, device=h.device)
    bits, offsets, g, g_p2 = _amax_buffers(amax_offsets, h)
    if a.numel():
        has_probs = probs is not None
        grid = lambda meta: (triton.cdiv(r, meta["BM"]), triton.cdiv(f, meta["BN"]))  # noqa: E731
        launch(_forward_kernel, grid,
               (h, probs if has_probs else h, a, offsets, bits, r, f, g, h.stride(0),
                probs.stride(0) if has_probs else 0, a.stride(0)),
               _SMALL, a.numel(), ACT=act, GLU_BLOCK=glu_block, HAS_PROBS=has_probs, AMAX=amax_offsets is not None,
               G_P2=g_p2)
    return a, bits.view(torch.float32)


@kernel_op("qmoe::scaled_activation_backward")
def _backward_op(h: torch.Tensor, probs: Optional[torch.Tensor], da: torch.Tensor, act: int, glu_block: int,
                 need_dprobs: bool,
                 amax_offsets: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh like h (contiguous), dprobs [R] fp32 | [0] when not needed, amax [G] fp32 | [0] as _forward_op)."""
    r, f = h.shape[0], _out_width(h, act)
    has_probs = probs is not None
    need_dprobs = need_dprobs and has_probs
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    dprobs = torch.empty(r if need_dprobs else 0, dtype=torch.float32, device=h.device)
    bits, offsets, g, g_p2 = _amax_buffers(amax_offsets, h)
    amax = bits.view(torch.float32)
    if r == 0:
        return dh, dprobs, amax
    if f == 0:
        return dh, dprobs.zero_(), amax
    args = (h, probs if has_probs else h, da, dh, dprobs, offsets, bits, r, f, g,
            h.stride(0), probs.stride(0) if has_probs else 0, da.stride(0), dh.stride(0))
    meta = dict(ACT=act, GLU_BLOCK=glu_block, HAS_PROBS=has_probs, NEED_DPROBS=need_dprobs,
                AMAX=amax_offsets is not None, G_P2=g_p2)
    if need_dprobs:
        cfg = _reducing_config(r)
        wrapped(_backward_kernel.fn)[(triton.cdiv(r, cfg.kwargs["BM"]),)](
            *args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        grid = lambda meta: (triton.cdiv(r, meta["BM"]), triton.cdiv(f, meta["BN"]))  # noqa: E731
        launch(_backward_kernel, grid, args, _SMALL, r * f, **meta)
    return dh, dprobs, amax


# ---------------------------------------------------------------- public twins of the reference

def _check(h, probs, activation, glu_interleave_size, da=None) -> None:
    check_scaled_activation_args(h, probs, activation, glu_interleave_size, da)
    if h.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"the activation kernels take float32, bfloat16 or float16 h, got {h.dtype}; "
                        f"float64 runs qmoe.reference.activation")


def _unit_columns(x: torch.Tensor) -> torch.Tensor:
    """x [R, C] with unit column stride (rows keep any stride; copies only when columns have none)."""
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def scaled_activation_forward(h: torch.Tensor, probs: torch.Tensor | None, activation: str,
                              glu_interleave_size: int | None = None, amax_offsets: torch.Tensor | None = None):
    """act(h) * probs[:, None]: h [R, 2F] or [R, F] (fp32 / bf16 / fp16), probs [R] float or None
    -> a [R, F] in h's dtype, computed in fp32. One launch.

    amax_offsets: [G + 1] int row groups on h's device: the launch also reduces each group's
    max|a| over finite values, returned as `RowsWithAmax(a, amax [G] fp32)`.
    """
    _check(h, probs, activation, glu_interleave_size)
    a, amax = _forward_op(_unit_columns(h), probs, _ACT_CODES[activation],
                          glu_block(activation, glu_interleave_size), _offsets(amax_offsets))
    return a if amax_offsets is None else RowsWithAmax(a, amax)


def scaled_activation_backward(h: torch.Tensor, probs: torch.Tensor | None, da: torch.Tensor, activation: str,
                               glu_interleave_size: int | None = None, need_dprobs: bool = True,
                               amax_offsets: torch.Tensor | None = None):
    """(dh in h's shape, dtype and GLU layout, dprobs [R] fp32 or None) for da [R, F]. One launch.

    dprobs is None when probs is None or need_dprobs is False (then the launch is a 2-D grid
    without the reduction). amax_offsets: as in the forward; dh comes as `RowsWithAmax(dh, amax)`.
    """
    _check(h, probs, activation, glu_interleave_size, da)
    dh, dprobs, amax = _backward_op(
        _unit_columns(h), probs, _unit_columns(da), _ACT_CODES[activation],
        glu_block(activation, glu_interleave_size), bool(need_dprobs), _offsets(amax_offsets))
    return dh if amax_offsets is None else RowsWithAmax(dh, amax), (dprobs if probs is not None and need_dprobs
                                                                    else None)


def _offsets(amax_offsets: torch.Tensor | None) -> torch.Tensor | None:
    """Row-group offsets [G+1] as the kernels read them (contiguous), or None."""
    if amax_offsets is None:
        return None
    if not isinstance(amax_offsets, torch.Tensor) or amax_offsets.dim() != 1 or amax_offsets.numel() < 1 \
            or amax_offsets.is_floating_point():
        raise ValueError("amax_offsets must be an int tensor [G + 1] of row-group offsets")
    return amax_offsets.contiguous()
