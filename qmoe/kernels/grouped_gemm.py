"""Grouped GEMM launchers for sm90+: the twins of `qmoe/reference/grouped_gemm.py` (same names,
signatures and contracts; read its docstring for the operand conventions).

Each call turns GroupedTensors into flat operand descriptions (pointers, strides, per-group
strides, scale layouts; nothing read from the device) and launches one static grid, so the
whole call is host-sync-free and CUDA-graph capturable. Routes:

  bf16 m-grouped               torch._grouped_mm, rows past the last group zeroed on device
  bf16 k-grouped, bf16 out     torch._grouped_mm, tokens as its grouped contraction (features contiguous)
  fp16/fp32, and other k-grouped plain GEMMs    Triton, SCALING NONE
  FP8 tensor / block           Triton, FP8 codes into the tensor cores (sm90: block m- and k-grouped in
                               _block_gemm_ws / _block_wgrad_ws, tensor in _tensor_gemm_ws)
  MXFP8 / NVFP4 (sm90: exact emulation) two exact routes:
      "fused"    dequantize in registers inside the GEMM (weights stay 8/4-bit in memory:
                 the memory-bound, few-rows-per-expert route)
      "dequant"  one exact bf16 dequantize pass per operand, then a bf16 grouped GEMM
                 (torch._grouped_mm for MXFP8 with bf16 out, m- and k-grouped, else Triton
                 with the NVFP4 tensor factors in its epilogue): the compute-bound route.
                 Weights kept across calls (`bf16_copies`) are dequantized once, on their first call
  "auto" picks "dequant" from DEQUANT_MIN_ROWS rows per group on: with many rows per expert
  the GEMM is compute-bound and the bf16 tensor-core GEMM after one dequantize pass outruns
  in-register dequantization; with few rows it is memory-bound and the fused kernel, which
  reads the 8/4-bit weights, wins (benchmarks/results/gemm.json, "other_route").

sm100+ has native MXFP8/NVFP4 grouped GEMMs in torch; qmoe keeps them behind
`native_block_scaled_gemm`, which raises qmoe.UnsupportedError until they are wired and tested
(on sm90, torch's MXFP8/NVFP4 scaled GEMMs kill the process: they are never called).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton

from qmoe.contracts.errors import UnsupportedError
from qmoe.contracts.formats import ceil_div
from qmoe.contracts.scales import gemm_scale, tensor_factor
from qmoe.kernels import _block_gemm_ws, _block_wgrad_ws, _tensor_gemm_ws
from qmoe.kernels import _grouped_gemm_jit as jit
from qmoe.kernels._launch import capability, kernel_op, num_sms, wrapped
from qmoe.kernels._layout import group_pow2
from qmoe.contracts.enums import GemmRoute, Scaling, is_grouped, parse_gemm_route, scaling_of

_CODE = {Scaling.NONE: 0, Scaling.TENSOR: 1, Scaling.BLOCK: 2, Scaling.MX: 3, Scaling.NVFP4: 4}
# Rows per group from which the exact dequantize-then-bf16-GEMM route beats in-register
# dequantization (compute-bound); below it the fused kernel reads 8/4-bit weights directly.
# The crossover lies between 64 rows (fused ahead) and 512 (dequant ahead): benchmarks/results/gemm.json.
DEQUANT_MIN_ROWS = 256


# ---------------------------------------------------------------- tile configurations

@dataclass(frozen=True)
class TileConfig:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    group_m: int = 8
    ctas_per_sm: int = 1  # persistent programs per SM (m-grouped): more hide memory latency
    swap: bool = False  # m-grouped: compute tiles transposed (weights on the 64-row MMA side)
    dq: tuple[int, int, int] | None = None  # "dequant" route: rows, columns, warps per program
    tile_scale: bool = True  # BLOCK: one weight scale per tile and step where a weight block spans the tile


# Dequantize-pass tiles (rows, columns, warps), by what the pass writes: rows as it reads them,
# rows written transposed (the weights' columnwise copy, for dgrad), or token-grouped columns
# (wgrad's operands). The same for MXFP8 and NVFP4 (benchmarks/results/sweeps/dequantize.json).
DEQUANT_TILES = {"rows": (16, 512, 4), "transposed": (32, 256, 4), "tokens": (32, 256, 4)}


def reads_values(scaling: Scaling, rows: int, groups: int) -> bool:
    """Whether the auto route multiplies operands of `scaling` with `rows` tokens over `groups`
    experts from their exact bf16 values (the "dequant" route): a cast may then write those values
    in place of codes (GroupedTensor.quantize's values) and save the GEMM its dequantize pass."""
    return scaling in (Scaling.MX, Scaling.NVFP4) and rows >= DEQUANT_MIN_ROWS * groups


def tile_configs(scaling: Scaling, small_m: bool, rows_per_group: int = 64) -> list[TileConfig]:
    """Candidate tiles per scaling, the default first (the benchmark's --sweep times the rest).

    sm90: 228 KB shared memory, 64-row wgmma per warpgroup. Compute-bound groups take 128-row
    tiles with 8 warps; FP8 takes BK = 128 (one BLOCK scale step, 128-byte rows), the bodies
    that dequantize in registers BK = 64 to keep their bf16 tiles small. Few rows per group
    (small_m, memory-bound) take 64-row tiles and several programs per SM, so more weight bytes
    are in flight. At <= 16 rows per group the emulated formats take swapped tiles first (weights
    on the MMA's 64-row side, a 16-row token tile), which keep the tensor cores busier than a
    64-row tile that is mostly padding; from 32 rows on the unswapped tiles are as fast or faster
    (benchmarks/results/sweeps/gemm_small_m_sweep.json, gemm_nvfp4.json).
    """
    if small_m:
        tok = min(64, max(16, triton.next_power_of_2(max(rows_per_group, 1))))
        plain = [TileConfig(64, 128, 128, 4, 3, ctas_per_sm=2), TileConfig(64, 64, 128, 4, 4, ctas_per_sm=4),
                 TileConfig(64, 128, 64, 4, 4, ctas_per_sm=2), TileConfig(64, 256, 128, 8, 3),
                 TileConfig(64, 128, 256, 4, 2, ctas_per_sm=2)]
        swapped = [TileConfig(tok, 64, 128, 4, 4, ctas_per_sm=4, swap=True),
                   TileConfig(tok, 128, 128, 4, 4, ctas_per_sm=2, swap=True),
                   TileConfig(tok, 256, 128, 8, 3, swap=True)]
        swap_first = rows_per_group <= 16 and scaling in (Scaling.MX, Scaling.NVFP4)  # ahead there only
        configs = swapped + plain if swap_first else plain + swapped
        return [c for c in configs if c.bk == 128] if scaling is Scaling.BLOCK else configs
    if scaling is Scaling.NONE:
        return [TileConfig(128, 256, 64, 8, 3), TileConfig(128, 128, 64, 8, 4), TileConfig(128, 256, 64, 8, 4)]
    if scaling is Scaling.TENSOR:
        return [TileConfig(128, 256, 128, 8, 3), TileConfig(128, 128, 128, 8, 4)]
    if scaling is Scaling.BLOCK:  # two fp32 accumulators (the sum, each step's product): 128 x 128 per 8 warps
        return [TileConfig(128, 128, 128, 8, 4), TileConfig(128, 128, 128, 8, 3),
                TileConfig(64, 128, 128, 4, 4, ctas_per_sm=2)]
    return [TileConfig(128, 128, 64, 8, 3), TileConfig(128, 256, 64, 8, 3)]


def k_tile_config(scaling: Scaling) -> TileConfig:
    """wgrad tiles (one program per output tile, no persistence). FP8 block wgrad, whose two
    token-scaled operands need the outer-product promotion, runs faster in 64-row tiles of 4
    warps than in the forward's 128 x 128 tiles (DeepSeek-V3 shapes:
    benchmarks/results/sweeps/gemm_block_sweep.json)."""
    if scaling is Scaling.BLOCK:
        return TileConfig(64, 128, 128, 4, 3)
    return tile_configs(scaling, small_m=False)[0]


def _fp32_config(cfg: TileConfig) -> TileConfig:
    return replace(cfg, bn=min(cfg.bn, 128), bk=32, stages=2)  # fp32 tiles are 2x the bytes


# ---------------------------------------------------------------- operands

@dataclass
class _Operand:
    """One GEMM operand as the kernels read it: group g's [rows, contraction] matrix."""

    data: torch.Tensor
    stride_r: int
    stride_k: int
    group_stride: int = 0  # storage elements from one group's matrix to the next (weights)
    scale: torch.Tensor | None = None
    s_stride_r: int = 0
    s_stride_k: int = 0
    s_group_stride: int = 0
    block: tuple[int, int] = (1, 1)  # values per scale: (rows, contraction)
    factor: torch.Tensor | None = None  # [G] fp32, multiplies the accumulator
    soffs: torch.Tensor | None = None  # [G+1] first scale column of each token group

    def scale_or_data(self) -> torch.Tensor:
        return self.scale if self.scale is not None else self.data


def _flat(op: _Operand) -> tuple:
    """An operand as custom-op arguments: its tensors, then its layout as ints."""
    return (op.data, op.scale, op.factor, op.soffs,
            [op.stride_r, op.stride_k, op.group_stride, op.s_stride_r, op.s_stride_k, op.s_group_stride, *op.block])


def _unflat(data, scale, factor, soffs, meta) -> _Operand:
    return _Operand(data, meta[0], meta[1], meta[2], scale, meta[3], meta[4], meta[5], (meta[6], meta[7]), factor,
                    soffs)


def _scale_tensor(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def _factor(gt, scaling: Scaling, columnwise: bool) -> torch.Tensor | None:
    if scaling is Scaling.TENSOR:
        return gemm_scale(gt, columnwise).float().contiguous()
    if scaling is Scaling.NVFP4:
        return tensor_factor(gt, columnwise).contiguous()
    return None


def _with_scales(op: _Operand, gt, scaling: Scaling, columnwise: bool) -> _Operand:
    op.factor = _factor(gt, scaling, columnwise)
    if scaling in (Scaling.BLOCK, Scaling.MX, Scaling.NVFP4):
        s = _scale_tensor(gemm_scale(gt, columnwise))
        op.scale, op.s_stride_r, op.s_stride_k = s, s.stride(0), s.stride(1)
        op.block = tuple(gt.quantizer.block)
    return op


def activation_operand(a, scaling: Scaling) -> _Operand:
    """Rowwise [T, K] activations (fprop x, dgrad dy): rows are global, 1-D scales per row."""
    d = a.rowwise_data
    return _with_scales(_Operand(d, d.stride(0), d.stride(1)), a, scaling, False)


def weight_operand(b, scaling: Scaling, columnwise: bool) -> tuple[_Operand | None, int, int]:
    """Weights from quantize_weights (E groups of N rows): (operand, out features, contraction); the
    operand is None where the copy is held as exact values."""
    e = b.num_groups
    n, k = b.shape[0] // e, b.shape[1]
    packed = 2 if scaling is Scaling.NVFP4 else 1
    if (b.columnwise_data if columnwise else b.rowwise_data) is None:  # held as values (b.exact_values)
        return (None, k, n) if columnwise else (None, n, k)
    if not columnwise:  # W_g [N, K]: rows g*N.. of the rowwise data
        d = b.rowwise_data
        op = _with_scales(_Operand(d, d.stride(0), d.stride(1), n * d.stride(0)), b, scaling, False)
        if op.scale is not None:
            op.s_group_stride = ceil_div(n, op.block[0]) * op.s_stride_r
        return op, n, k
    d = b.columnwise_data  # W_g^T [K, N]: columns g*N.. of the [K, E*N] copy
    op = _with_scales(_Operand(d, d.stride(0), d.stride(1), (n // packed) * d.stride(1)), b, scaling, True)
    if op.scale is not None:
        op.s_group_stride = ceil_div(n, op.block[1]) * op.s_stride_k
    return op, k, n


def tokens_operand(x, scaling: Scaling) -> _Operand | None:
    """Columnwise [F, T] copy for wgrad: contraction along tokens, 1-D scales from group offsets;
    None where the copy is held as exact values."""
    d = x.columnwise_data
    if d is None:
        return None
    op = _with_scales(_Operand(d, d.stride(0), d.stride(1)), x, scaling, True)
    if scaling in (Scaling.BLOCK, Scaling.MX, Scaling.NVFP4):
        op.soffs = x.columnwise_scale_offsets
    return op


def _device_offsets(split_sizes, device) -> torch.Tensor:
    s = torch.as_tensor(split_sizes, device=device).to(torch.int64)
    return torch.cat((s.new_zeros(1), s.cumsum(0)))


# ---------------------------------------------------------------- m-grouped

def _launch_m(a: _Operand, b: _Operand, offsets, total_rows, n_out, k, groups, scaling, out_dtype, cfg=None):
    if cfg is not None:  # tile sweeps (benchmarks, tests) launch their own tiles eagerly
        return _launch_m_tiles(a, b, offsets, total_rows, n_out, k, groups, scaling, out_dtype, cfg)
    return _m_op(*_flat(a), *_flat(b), offsets, [total_rows, n_out, k, groups], scaling.value, out_dtype)


@kernel_op("qmoe::m_grouped_gemm")
def _m_op(a_data: torch.Tensor, a_scale: Optional[torch.Tensor], a_factor: Optional[torch.Tensor],
          a_soffs: Optional[torch.Tensor], a_meta: list[int], b_data: torch.Tensor, b_scale: Optional[torch.Tensor],
          b_factor: Optional[torch.Tensor], b_soffs: Optional[torch.Tensor], b_meta: list[int], offsets: torch.Tensor,
          sizes: list[int], scaling: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The m-grouped launch as one opaque op (kernels/launch.KernelOp)."""
    total_rows, n_out, k, groups = sizes
    return _launch_m_tiles(_unflat(a_data, a_scale, a_factor, a_soffs, a_meta),
                           _unflat(b_data, b_scale, b_factor, b_soffs, b_meta), offsets, total_rows, n_out, k, groups,
                           Scaling(scaling), out_dtype, None)


def _launch_m_tiles(a: _Operand, b: _Operand, offsets, total_rows, n_out, k, groups, scaling, out_dtype, cfg):
    device = a.data.device
    out = torch.empty((total_rows, n_out), dtype=out_dtype, device=device)
    if total_rows == 0 or n_out == 0:
        return out
    if cfg is None and scaling is Scaling.BLOCK and _block_gemm_ws.launch_dispatched(  # Gluon, where it applies
            a, b, offsets, total_rows, n_out, k, groups, out_dtype, out) is not None:
        return out
    if cfg is None and scaling is Scaling.TENSOR and _tensor_gemm_ws.launch_m_dispatched(  # Gluon, where it applies
            a, b, offsets, total_rows, n_out, k, groups, out_dtype, out) is not None:
        return out
    plain_fp32 = scaling is Scaling.NONE and a.data.dtype == torch.float32
    if cfg is None:
        cfg = tile_configs(scaling, small_m=total_rows <= 96 * groups, rows_per_group=total_rows // max(groups, 1))[0]
        cfg = _fp32_config(cfg) if plain_fp32 else cfg
    if scaling is Scaling.BLOCK and cfg.bk != 128:
        raise ValueError(f"FP8 block scaling promotes once per 128-deep step: tile bk must be 128, got {cfg.bk}")
    upper = (ceil_div(total_rows, cfg.bm) + groups + 1) * ceil_div(n_out, cfg.bn)
    programs = max(1, min(num_sms(device) * cfg.ctas_per_sm, upper))
    fa = a.factor if a.factor is not None else a.data
    fb = b.factor if b.factor is not None else b.data
    wrapped(jit.m_grouped_gemm_kernel)[(programs,)](
        a.data, b.data, out, offsets, a.scale_or_data(), b.scale_or_data(), fa, fb,
        total_rows, n_out, k, groups,
        a.stride_r, a.stride_k, b.stride_r, b.stride_k, b.group_stride, out.stride(0), out.stride(1),
        a.s_stride_r, a.s_stride_k, b.s_stride_r, b.s_stride_k, b.s_group_stride,
        SCALING=_CODE[scaling], A_BC=a.block[1], B_BR=b.block[0], B_BC=b.block[1],
        HAS_FACTOR=a.factor is not None, PRECISE=out_dtype == torch.float32,
        INPUT_PRECISION="tf32x3" if plain_fp32 else None,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, GP=triton.next_power_of_2(groups + 1),
        NUM_PROGRAMS=programs, MASK_K=k % cfg.bk != 0, SWAP=cfg.swap,
        TILE_SCALE_B=scaling is Scaling.BLOCK and cfg.tile_scale and b.block[0] % cfg.bn == 0,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return out


def _grouped_mm_runs(mat_a: torch.Tensor, mat_b: torch.Tensor, out_dtype) -> bool:
    """torch._grouped_mm (its bf16 CUTLASS kernel) can multiply these: bf16 in and out on sm90+."""
    return (hasattr(torch, "_grouped_mm") and mat_a.is_cuda and out_dtype == torch.bfloat16
            and mat_a.dtype == mat_b.dtype == torch.bfloat16 and capability(mat_a.device) >= (9, 0))


def _torch_grouped_mm_ok(a16: torch.Tensor, mat_b: torch.Tensor, out_dtype) -> bool:
    return (_grouped_mm_runs(a16, mat_b, out_dtype) and a16.shape[1] % 8 == 0 and mat_b.shape[2] % 8 == 0
            and a16.shape[0] > 0)


def _torch_grouped_mm(a16, mat_b, offsets, total_rows):
    return _torch_grouped_mm_op(a16, mat_b, offsets, total_rows)


@kernel_op("qmoe::grouped_mm_bf16")
def _torch_grouped_mm_op(a16: torch.Tensor, mat_b: torch.Tensor, offsets: torch.Tensor,
                         total_rows: int) -> torch.Tensor:
    """torch._grouped_mm (bf16, CUTLASS) with the rows past the last group zeroed on the device."""
    out = torch._grouped_mm(a16, mat_b, offs=offsets[1:].to(torch.int32))
    n = out.shape[1]
    wrapped(jit.zero_rows_from_kernel)[(ceil_div(total_rows, 64),)](
        out, offsets[-1:], total_rows, n, out.stride(0), out.stride(1), BLOCK_R=64, BLOCK_C=128)
    return out


def _tokens_grouped_mm_ok(mat_a: torch.Tensor, mat_b: torch.Tensor, offsets, out, out_dtype) -> bool:
    """torch._grouped_mm takes wgrad's [n, tokens] @ [tokens, k]: it runs them, a new output,
    at least one group and one token, features contiguous in both operands with 16-byte aligned
    strides (its CUTLASS kernel's TMA). With tokens contiguous it would instead assert, on the
    device, that every group's token count is a multiple of 8. Like the m-grouped route it reads
    only metadata that torch.compile traces; a base off 16 bytes gets torch's own error."""
    return (out is None and _grouped_mm_runs(mat_a, mat_b, out_dtype) and mat_a.shape[1] > 0
            and offsets.numel() > 1 and mat_a.stride(0) == 1 and mat_b.stride(1) == 1
            and mat_a.stride(1) % 8 == 0 and mat_b.stride(0) % 8 == 0)


@kernel_op("qmoe::k_grouped_mm_bf16")
def _tokens_grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dW [G, n, k] = mat_a[:, tokens of g] @ mat_b[tokens of g, :] by torch._grouped_mm (bf16,
    CUTLASS): an expert without tokens gets zeros, tokens past offsets[-1] are not read."""
    return torch._grouped_mm(mat_a, mat_b, offs=offsets[1:].to(torch.int32))


def _dequantized(op: _Operand, scaling: Scaling, rows: int, cols: int, row_group: int, col_group: int,
                 out_shape: tuple, out_strides: tuple[int, int],
                 tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Exact bf16 values (MX: q*2^k; NVFP4: q*s_b) of an [rows, cols] operand: a new contiguous
    bf16 tensor of `out_shape`, element (r, c) at storage offset r * out_strides[0] + c * out_strides[1].

    Rows come in groups of `row_group` rows, columns in groups of `col_group` (weights: one
    expert each). Token-grouped operands take `_dequantized_tokens`.
    """
    kind = "transposed" if out_strides[0] == 1 and out_strides[1] != 1 else "rows"
    return _dequantize_op(*_flat(op), scaling.value, [rows, cols, row_group, col_group], list(out_shape),
                          list(out_strides), list(tile or DEQUANT_TILES[kind]))


@kernel_op("qmoe::grouped_gemm_dequantize")
def _dequantize_op(data: torch.Tensor, scale: Optional[torch.Tensor], factor: Optional[torch.Tensor],
                   soffs: Optional[torch.Tensor], meta: list[int], scaling: str, sizes: list[int],
                   out_shape: list[int], out_strides: list[int], tile: list[int]) -> torch.Tensor:
    op = _unflat(data, scale, factor, soffs, meta)
    rows, cols, row_group, col_group = sizes
    out = torch.empty(out_shape, dtype=torch.bfloat16, device=data.device)
    br, bc = op.block
    block_r, block_c, warps = tile
    if rows == 0 or cols == 0:
        return out
    gather = col_group % block_c != 0 or cols % block_c != 0  # a tile would straddle two experts
    cidx = None
    if gather:
        c = torch.arange(cols, device=op.data.device, dtype=torch.int32)
        cidx = (c // col_group) * ceil_div(col_group, bc) + (c % col_group) // bc
    wrapped(jit.dequantize_kernel)[(ceil_div(rows, block_r), ceil_div(cols, block_c))](
        op.data, op.scale, out, cidx if gather else op.data,
        rows, cols, row_group, ceil_div(row_group, br), col_group, ceil_div(col_group, bc),
        op.stride_r, op.stride_k, op.s_stride_r, op.s_stride_k, out_strides[0], out_strides[1],
        SCALING=_CODE[Scaling(scaling)], BR=br, BC=bc, GATHER=gather, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=warps)
    return out


def _weights16(b, b_op: _Operand, scaling: Scaling, b_columnwise: bool, dq) -> torch.Tensor:
    """The weights' exact bf16 values as [E, N, K] (contiguous), from the copy the GEMM reads.

    b.bf16_copies, when the caller keeps b across calls (`GroupedTensor.bf16_copies`), holds them
    from the first call on: they depend on b's data and scales only. With 2-D weight blocks the
    rowwise and columnwise copies share every scale and dequantize to the same values (NUMERICS.md),
    so fprop and dgrad share one bf16 copy; with 1-D blocks each copy has its own values.
    """
    e = b.num_groups
    n_w, k_w = b.shape[0] // e, b.shape[1]
    held = b.exact_values(b_columnwise)
    if held is not None:  # the cast wrote them: [E*N, K] (a 1 x 16 NVFP4 columnwise copy's transposed: copied)
        return held.reshape(e, n_w, k_w)
    copies = getattr(b, "bf16_copies", None)
    slot = "2d" if b_op.block[0] > 1 else ("columnwise" if b_columnwise else "rowwise")
    if copies is not None and slot in copies:
        return copies[slot]
    if b_columnwise:  # W_g [N, K] from [K, E*N]: element (r, c) lands at c*K + r
        w16 = _dequantized(b_op, scaling, k_w, e * n_w, k_w, n_w, (e, n_w, k_w), (1, k_w), tile=dq)
    else:
        w16 = _dequantized(b_op, scaling, e * n_w, k_w, n_w, k_w, (e, n_w, k_w), (k_w, 1), tile=dq)
    if copies is not None:
        copies[slot] = w16
    return w16


def _m_dequant_route(a, b, a_op, b_op, scaling, b_columnwise, out_dtype, cfg=None):
    e = b.num_groups
    n_w, k_w = b.shape[0] // e, b.shape[1]
    total_rows, k = a.shape[0], a.shape[1]
    dq = cfg.dq if cfg is not None else None
    a16 = a.exact_values(False)
    if a16 is None:
        a16 = _dequantized(a_op, scaling, total_rows, k, max(total_rows, 1), k, (total_rows, k), (k, 1), tile=dq)
    w16 = _weights16(b, b_op, scaling, b_columnwise, dq)
    if b_columnwise:
        mat_b, plain = w16, _Operand(w16, 1, k_w, n_w * k_w)
    else:
        mat_b, plain = w16.transpose(1, 2), _Operand(w16, k_w, 1, n_w * k_w)
    n_out = mat_b.shape[2]
    if scaling is Scaling.MX and _torch_grouped_mm_ok(a16, mat_b, out_dtype):
        return _torch_grouped_mm(a16, mat_b, a.offsets, total_rows)
    # codes or values: the amaxes' factor (a codes operand has it already)
    a_plain = _Operand(a16, k, 1, factor=a_op.factor if a_op is not None else _factor(a, scaling, False))
    plain.factor = b_op.factor if b_op is not None else _factor(b, scaling, b_columnwise)
    gemm_cfg = cfg if cfg is not None and cfg.bm >= 128 else None
    return _launch_m(a_plain, plain, a.offsets, total_rows, n_out, k, e, Scaling.NONE, out_dtype, gemm_cfg)


def m_grouped_gemm(a, b, split_sizes=None, *, b_columnwise: bool = False, out_dtype=torch.bfloat16):
    """Kernel twin of qmoe.reference.grouped_gemm.m_grouped_gemm."""
    return m_grouped_gemm_with(a, b, split_sizes, b_columnwise=b_columnwise, out_dtype=out_dtype)


def m_grouped_gemm_with(a, b, split_sizes=None, *, b_columnwise=False, out_dtype=torch.bfloat16,
                        route: str = "auto", config: TileConfig | None = None):
    """m_grouped_gemm with the route ("auto", "fused", "dequant") and tiles chosen by the caller."""
    route = parse_gemm_route(route)
    if not is_grouped(a):
        offsets = _device_offsets(split_sizes, a.device)
        e, n, k = b.shape
        n_out, contraction = (k, n) if b_columnwise else (n, k)
        mat_b = b if b_columnwise else b.transpose(1, 2)
        if route is not GemmRoute.FUSED and config is None and _torch_grouped_mm_ok(a, mat_b, out_dtype):
            return _torch_grouped_mm(a, mat_b, offsets, a.shape[0])
        bop = (_Operand(b, b.stride(2), b.stride(1), b.stride(0)) if b_columnwise
               else _Operand(b, b.stride(1), b.stride(2), b.stride(0)))
        return _launch_m(_Operand(a, a.stride(0), a.stride(1)), bop, offsets, a.shape[0], n_out, contraction, e,
                         Scaling.NONE, out_dtype, config)
    scaling = scaling_of(a)
    a_op = activation_operand(a, scaling) if a.rowwise_data is not None else None
    b_op, n_out, contraction = weight_operand(b, scaling, b_columnwise)
    if route is GemmRoute.AUTO:
        route = GemmRoute.DEQUANT if reads_values(scaling, a.shape[0], b.num_groups) else GemmRoute.FUSED
    if a_op is None or b_op is None:  # a copy held as exact values: multiplied as such
        route = GemmRoute.DEQUANT
    if route is GemmRoute.DEQUANT and scaling in (Scaling.MX, Scaling.NVFP4):
        return _m_dequant_route(a, b, a_op, b_op, scaling, b_columnwise, out_dtype, config)
    return _launch_m(a_op, b_op, a.offsets, a.shape[0], n_out, contraction, b.num_groups, scaling, out_dtype,
                     config)


# ---------------------------------------------------------------- k-grouped

def _launch_k(a: _Operand, b: _Operand, offsets, n, k, groups, scaling, out, accumulate, cfg=None,
              out_dtype=torch.bfloat16):
    """dW [groups, n, k] into `out`, or a new tensor of out_dtype when out is None."""
    if out is None and cfg is None:
        return _k_op(*_flat(a), *_flat(b), offsets, [n, k, groups], scaling.value, out_dtype)
    if out is None:
        out = torch.empty((groups, n, k), dtype=out_dtype, device=a.data.device)
    return _launch_k_into(a, b, offsets, n, k, groups, scaling, out, accumulate, cfg)


@kernel_op("qmoe::k_grouped_gemm")
def _k_op(a_data: torch.Tensor, a_scale: Optional[torch.Tensor], a_factor: Optional[torch.Tensor],
          a_soffs: Optional[torch.Tensor], a_meta: list[int], b_data: torch.Tensor, b_scale: Optional[torch.Tensor],
          b_factor: Optional[torch.Tensor], b_soffs: Optional[torch.Tensor], b_meta: list[int], offsets: torch.Tensor,
          sizes: list[int], scaling: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The k-grouped launch into a new tensor, as one opaque op (kernels/launch.KernelOp)."""
    n, k, groups = sizes
    out = torch.empty((groups, n, k), dtype=out_dtype, device=a_data.device)
    return _launch_k_into(_unflat(a_data, a_scale, a_factor, a_soffs, a_meta),
                          _unflat(b_data, b_scale, b_factor, b_soffs, b_meta), offsets, n, k, groups,
                          Scaling(scaling), out, False, None)


def _launch_k_into(a: _Operand, b: _Operand, offsets, n, k, groups, scaling, out, accumulate, cfg):
    if n == 0 or k == 0 or groups == 0:
        return out
    if cfg is None and scaling is Scaling.BLOCK and _block_wgrad_ws.launch_dispatched(  # Gluon, where it applies
            a, b, offsets, n, k, groups, out, accumulate) is not None:
        return out
    if cfg is None and scaling is Scaling.TENSOR and _tensor_gemm_ws.launch_k_dispatched(  # Gluon, where it applies
            a, b, offsets, n, k, groups, out, accumulate) is not None:
        return out
    plain_fp32 = scaling is Scaling.NONE and a.data.dtype == torch.float32
    tokens_contiguous = a.stride_k == 1 and b.stride_k == 1
    if cfg is None:
        cfg = k_tile_config(scaling)
        cfg = _fp32_config(cfg) if plain_fp32 else cfg
    align = 16 // a.data.element_size() * (2 if scaling is Scaling.NVFP4 else 1) if tokens_contiguous else 1
    grid = (groups * ceil_div(n, cfg.bm) * ceil_div(k, cfg.bn),)
    wrapped(jit.k_grouped_gemm_kernel)[grid](
        a.data, b.data, out, offsets, a.scale_or_data(), b.scale_or_data(),
        a.soffs if a.soffs is not None else offsets, b.soffs if b.soffs is not None else offsets,
        a.factor if a.factor is not None else a.data, b.factor if b.factor is not None else b.data,
        n, k,
        a.stride_r, a.stride_k, b.stride_r, b.stride_k, out.stride(0), out.stride(1), out.stride(2),
        a.s_stride_r, a.s_stride_k, b.s_stride_r, b.s_stride_k,
        SCALING=_CODE[scaling], A_BC=a.block[1], B_BC=b.block[1], HAS_SOFFS=a.soffs is not None,
        HAS_FACTOR=a.factor is not None, ACCUMULATE=accumulate, PRECISE=out.dtype == torch.float32,
        INPUT_PRECISION="tf32x3" if plain_fp32 else None,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, ALIGN=align,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return out


def _dequantized_tokens(x, op: _Operand, scaling: Scaling, tile: tuple[int, int, int] | None = None,
                        token_major: bool = False) -> torch.Tensor:
    """Exact bf16 values of x's token-grouped columnwise copy (wgrad's operands): [features, tokens],
    tokens contiguous, or with `token_major` features contiguous (the transpose of a contiguous
    [tokens, features]: the layout torch._grouped_mm takes at any group sizes)."""
    out = _dequantize_tokens_op(*_flat(op), x.offsets, scaling.value, [x.shape[1], x.shape[0], x.num_groups],
                                list(tile or DEQUANT_TILES["tokens"]), token_major)
    return out.t() if token_major else out


@kernel_op("qmoe::grouped_gemm_dequantize_tokens")
def _dequantize_tokens_op(data: torch.Tensor, scale: Optional[torch.Tensor], factor: Optional[torch.Tensor],
                          soffs: Optional[torch.Tensor], meta: list[int], offsets: torch.Tensor, scaling: str,
                          sizes: list[int], tile: list[int], token_major: bool) -> torch.Tensor:
    """[features, tokens], or [tokens, features] with token_major (the caller transposes it)."""
    op = _unflat(data, scale, factor, soffs, meta)
    features, total, groups = sizes
    shape = (total, features) if token_major else (features, total)
    out = torch.empty(shape, dtype=torch.bfloat16, device=data.device)
    stride_r, stride_t = (out.stride(1), out.stride(0)) if token_major else out.stride()
    block_r, block_t, warps = tile
    if features == 0 or total == 0 or groups == 0:
        return out
    wrapped(jit.dequantize_tokens_kernel)[(ceil_div(features, block_r), ceil_div(total, block_t) + groups)](
        op.data, op.scale, op.soffs, offsets, out, features, groups,
        op.stride_r, op.stride_k, op.s_stride_r, op.s_stride_k, stride_r, stride_t,
        SCALING=_CODE[Scaling(scaling)], BC=op.block[1], GP=group_pow2(groups),  # reads offs[g], offs[g + 1] for g < G
        BLOCK_R=block_r, BLOCK_T=block_t, num_warps=warps)
    return out


def k_grouped_gemm(a, b, split_sizes=None, *, out_dtype=torch.bfloat16, out=None, accumulate: bool = False):
    """Kernel twin of qmoe.reference.grouped_gemm.k_grouped_gemm."""
    return k_grouped_gemm_with(a, b, split_sizes, out_dtype=out_dtype, out=out, accumulate=accumulate)


def k_grouped_gemm_with(a, b, split_sizes=None, *, out_dtype=torch.bfloat16, out=None, accumulate=False,
                        route: str = "auto", config: TileConfig | None = None):
    """k_grouped_gemm with the route ("auto", "fused", "dequant") and tiles chosen by the caller."""
    route = parse_gemm_route(route)
    if accumulate and out is None:
        raise ValueError("k_grouped_gemm(accumulate=True) adds into `out`: pass out=[E, N, K] tensor")
    if not is_grouped(a):
        offsets = _device_offsets(split_sizes, a.device)
        groups, n, k = offsets.numel() - 1, a.shape[1], b.shape[1]
        if config is None and _tokens_grouped_mm_ok(a.t(), b, offsets, out, out_dtype):
            return _tokens_grouped_mm(a.t(), b, offsets)
        a_op, b_op = _Operand(a, a.stride(1), a.stride(0)), _Operand(b, b.stride(1), b.stride(0))
        return _launch_k(a_op, b_op, offsets, n, k, groups, Scaling.NONE, out, accumulate, config, out_dtype)
    scaling = scaling_of(a)
    groups, total = a.num_groups, a.shape[0]
    n, k = a.shape[1], b.shape[1]
    a_op, b_op = tokens_operand(a, scaling), tokens_operand(b, scaling)
    if route is GemmRoute.AUTO:
        route = GemmRoute.DEQUANT if reads_values(scaling, total, groups) else GemmRoute.FUSED
    a_held, b_held = a.exact_values(True), b.exact_values(True)
    if a_held is not None or b_held is not None:  # held as values only
        route = GemmRoute.DEQUANT
    if route is GemmRoute.DEQUANT and scaling in (Scaling.MX, Scaling.NVFP4) and total > 0:
        on_torch = scaling is Scaling.MX and config is None and out is None and out_dtype == torch.bfloat16
        tile = config.dq if config is not None else None
        a16, b16 = (held.t() if held is not None  # [features, tokens] views of the values
                    else _dequantized_tokens(x, op, scaling, tile=tile, token_major=on_torch)
                    for x, op, held in ((a, a_op, a_held), (b, b_op, b_held)))
        if on_torch and _tokens_grouped_mm_ok(a16, b16.t(), a.offsets, out, out_dtype):
            return _tokens_grouped_mm(a16, b16.t(), a.offsets)
        a_plain, b_plain = (_Operand(x16, x16.stride(0), x16.stride(1),
                                     factor=op.factor if op is not None else _factor(x, scaling, True))
                            for x16, x, op in ((a16, a, a_op), (b16, b, b_op)))
        gemm_cfg = config if config is not None and config.bm >= 128 else None
        return _launch_k(a_plain, b_plain, a.offsets, n, k, groups, Scaling.NONE, out, accumulate, gemm_cfg,
                         out_dtype)
    return _launch_k(a_op, b_op, a.offsets, n, k, groups, scaling, out, accumulate, config, out_dtype)


def native_block_scaled_gemm(scaling: Scaling, device: torch.device):
    """sm100+ native MXFP8/NVFP4 grouped GEMMs: not wired yet; never reachable below sm100."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if cap is None or cap < (10, 0):
        raise UnsupportedError("native block-scaled grouped GEMM", recipe=scaling.value, device=device,
                               why=f"it needs sm100+ (this device is {cap}); torch's MXFP8/NVFP4 scaled GEMMs "
                                   f"abort the process below sm100",
                               fix="use the exact sm90 emulation (the default route)")
    raise UnsupportedError("native block-scaled grouped GEMM", recipe=scaling.value, device=device,
                           why="the sm100 torch path is not wired into qmoe yet",
                           fix="use the exact emulation routes, which also run on sm100")
