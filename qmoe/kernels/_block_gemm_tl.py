"""FP8 block-scaled m-grouped GEMM, persistent Triton variants that try to overlap the per-128
promotion with the tensor cores (private helper of `qmoe/kernels/grouped_gemm.py`; not
dispatched: the warp-specialised Gluon kernel of `qmoe/kernels/_block_gemm_ws.py` is).

Same contract and bits as `m_grouped_gemm_kernel` under BLOCK scaling with one weight scale per
tile and step (`acc + p * (a_scale * b_scale)` per 128-deep step, in order). Operands arrive
through TMA tensor descriptors; rows past a group's end are loaded (they belong to the next
group or are zero-filled past the tensor) and never stored. Knobs:

  LAG    promote step i-1's product after issuing step i's, so the compiler may run the
         promotion while the tensor cores work on the next step
  WS     ask Triton to warp-specialise the K loop (a TMA producer partition and consumers);
         it deadlocked on an sm90 GPU, so the launcher takes it under the interpreter only
  SPLIT  two half-width products per step, the first promoted while the second is computed
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.kernels._launch import num_sms

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton without host-side descriptors
    TensorDescriptor = None


@triton.jit
def _scale_factor(sa_rows, sb_tile, row_ok, ki, s_stride_ak, s_stride_bk):
    return tl.load(sa_rows + ki * s_stride_ak, mask=row_ok, other=0.0) * tl.load(sb_tile + ki * s_stride_bk)


@triton.jit
def _store(out_ptr, acc, rows, row_ok, cols, N, stride_om):
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


# sizes and strides that only index are not specialised (one compile for every shape); N and the
# output stride (vectorised masked stores) and the scales' step strides (1) are
_SIZES = ["total_rows", "K", "num_groups", "b_group_rows", "b_group_cols", "s_stride_am",
          "s_stride_bn", "sb_group_stride"]


@triton.jit(do_not_specialize=_SIZES)
def block_gemm_tl_kernel(
        a_desc, b_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr,
        total_rows, N, K, num_groups, b_group_rows, b_group_cols, stride_om,
        s_stride_am, s_stride_ak, s_stride_bn, s_stride_bk, sb_group_stride,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_BR: tl.constexpr, GROUP_M: tl.constexpr,
        GP: tl.constexpr, NUM_PROGRAMS: tl.constexpr, LAG: tl.constexpr, WS: tl.constexpr, SPLIT: tl.constexpr):
    """out[T, N] = A_g @ B_g^T per group (the tile walk of m_grouped_gemm_kernel), FP8 block scaling.

    b_desc is [*, K] with blocks [BN, BK] ([BN // 2, BK] with SPLIT); group g's B starts
    g * b_group_rows rows down and g * b_group_cols columns in.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    gi = tl.arange(0, GP)
    starts = tl.load(offs_ptr + gi, mask=gi <= num_groups, other=0).to(tl.int32)
    ends = tl.load(offs_ptr + gi + 1, mask=gi < num_groups, other=0).to(tl.int32)
    ends = tl.where(gi == num_groups, total_rows, ends)
    tiles = tl.cdiv(tl.maximum(ends - starts, 0), BM) * num_n
    if WS:  # inclusive prefix sum as a masked reduction: Triton's Hopper warp specialisation rejects tt.scan
        tile_end = tl.sum(tl.where(gi[None, :] <= gi[:, None], tiles[None, :], 0), 1)
    else:
        tile_end = tl.cumsum(tiles, 0)
    total_tiles = tl.sum(tiles, 0)
    for t in range(pid, total_tiles, NUM_PROGRAMS):
        g = tl.sum((tile_end <= t).to(tl.int32), 0)
        sel = gi == g
        m_start = tl.sum(tl.where(sel, starts, 0), 0)
        m_end = tl.sum(tl.where(sel, ends, 0), 0)
        local = t - tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
        num_m = tl.cdiv(m_end - m_start, BM)
        width = GROUP_M * num_n
        first_m = (local // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pm = first_m + (local % width) % size_m
        pn = (local % width) // size_m
        row0 = m_start + pm * BM
        rows = row0 + tl.arange(0, BM)
        row_ok = rows < m_end
        gb = tl.minimum(g, num_groups - 1)
        brow = gb * b_group_rows + pn * BN
        bcol = gb * b_group_cols
        sa_rows = sa_ptr + rows.to(tl.int64) * s_stride_am
        sb_tile = sb_ptr + gb.to(tl.int64) * sb_group_stride + (pn * BN // B_BR) * s_stride_bn
        nk = tl.where(g < num_groups, tl.cdiv(K, BK), 0)
        if SPLIT:  # each half-width product is stored on its own
            acc0 = tl.zeros((BM, BN // 2), dtype=tl.float32)
            acc1 = tl.zeros((BM, BN // 2), dtype=tl.float32)
            for ki in tl.range(0, nk, warp_specialize=WS):
                a = a_desc.load([row0, ki * BK])
                b0 = b_desc.load([brow, bcol + ki * BK])
                b1 = b_desc.load([brow + BN // 2, bcol + ki * BK])
                f = _scale_factor(sa_rows, sb_tile, row_ok, ki, s_stride_ak, s_stride_bk)[:, None]
                acc0 += tl.dot(a, b0.T) * f
                acc1 += tl.dot(a, b1.T) * f
            _store(out_ptr, acc0, rows, row_ok, pn * BN + tl.arange(0, BN // 2), N, stride_om)
            _store(out_ptr, acc1, rows, row_ok, pn * BN + BN // 2 + tl.arange(0, BN // 2), N, stride_om)
        elif LAG:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            p = tl.zeros((BM, BN), dtype=tl.float32)
            f = tl.zeros((BM, ), dtype=tl.float32)
            for ki in tl.range(0, nk, warp_specialize=WS):
                a = a_desc.load([row0, ki * BK])
                b = b_desc.load([brow, bcol + ki * BK])
                q = tl.dot(a, b.T)
                acc += p * f[:, None]
                f = _scale_factor(sa_rows, sb_tile, row_ok, ki, s_stride_ak, s_stride_bk)
                p = q
            acc += p * f[:, None]
            _store(out_ptr, acc, rows, row_ok, pn * BN + tl.arange(0, BN), N, stride_om)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in tl.range(0, nk, warp_specialize=WS):
                a = a_desc.load([row0, ki * BK])
                b = b_desc.load([brow, bcol + ki * BK])
                f = _scale_factor(sa_rows, sb_tile, row_ok, ki, s_stride_ak, s_stride_bk)
                acc += tl.dot(a, b.T) * f[:, None]
            _store(out_ptr, acc, rows, row_ok, pn * BN + tl.arange(0, BN), N, stride_om)


def kernel_info(compiled, info: dict | None) -> None:
    """Registers, spills and shared memory of a launched kernel into `info` (benchmarks record them)."""
    if info is not None and compiled is not None and hasattr(compiled, "metadata"):
        info.update(n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None),
                    shared=getattr(compiled.metadata, "shared", None))


def b_group_offsets(b, b_columnwise: bool) -> tuple[int, int]:
    """(rows, columns) from group g's B to group g+1's in the 2-D data (grouped_gemm._Operand b)."""
    if b_columnwise:  # columnwise copy [K, E*N]: group g's contraction starts g*N columns in
        return 0, b.group_stride // b.stride_k
    return b.group_stride // b.stride_r, 0  # weights [E*N, K]: group g's rows start g*N rows down


def check_block_operands(a, b, k: int, bn: int) -> None:
    """ValueError unless the operands fit the TMA kernels: K % 128 == 0, 1x128 x 128x128 blocks
    (weight blocks at least one tile wide), contiguous contraction."""
    if k % 128 or a.block != (1, 128) or b.block[1] != 128 or b.block[0] % bn or a.stride_k != 1 or b.stride_k != 1:
        raise ValueError(f"the TMA block GEMMs need K % 128 == 0, 1x128 x 128x128 blocks and contiguous rows "
                         f"(K={k}, blocks {a.block} x {b.block}, tile N {bn})")


def launch_block_gemm_tl(a, b, offsets: torch.Tensor, total_rows: int, n_out: int, k: int, groups: int,
                         out_dtype=torch.bfloat16, *, b_columnwise: bool = False, bm: int = 128, bn: int = 128,
                         warps: int = 8, stages: int = 4, lag: bool = False, ws: bool = False, split: bool = False,
                         group_m: int = 8, programs: int | None = None, info: dict | None = None) -> torch.Tensor:
    """out [total_rows, n_out] of the FP8 block m-grouped GEMM; a, b: grouped_gemm._Operand (BLOCK scaling).

    ws=True (Triton's own Hopper warp specialisation) runs under the interpreter only: on an sm90
    GPU its compiled partitions deadlocked, so it is refused there.
    """
    if ws and a.data.is_cuda:
        raise ValueError("launch_block_gemm_tl(ws=True) deadlocks on sm90 GPUs: it runs under the interpreter only")
    check_block_operands(a, b, k, bn)
    out = torch.empty((total_rows, n_out), dtype=out_dtype, device=a.data.device)
    if total_rows == 0 or n_out == 0:
        return out
    g_rows, g_cols = b_group_offsets(b, b_columnwise)
    if programs is None:
        programs = num_sms(a.data.device)
    b_block = [bn // 2 if split else bn, 128]
    compiled = block_gemm_tl_kernel[(programs,)](
        TensorDescriptor.from_tensor(a.data, [bm, 128]), TensorDescriptor.from_tensor(b.data, b_block), out, offsets,
        a.scale, b.scale, total_rows, n_out, k, groups, g_rows, g_cols, out.stride(0),
        a.s_stride_r, a.s_stride_k, b.s_stride_r, b.s_stride_k, b.s_group_stride,
        BM=bm, BN=bn, BK=128, B_BR=b.block[0], GROUP_M=group_m, GP=triton.next_power_of_2(groups + 1),
        NUM_PROGRAMS=programs, LAG=lag, WS=ws, SPLIT=split, num_warps=warps, num_stages=stages)
    kernel_info(compiled, info)
    return out
