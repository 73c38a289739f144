"""MXFP8 m-grouped GEMM for sm90, emulated exactly in bf16 with the dequantization inside the
kernel, in Triton's Gluon dialect. Not dispatched: at the benchmark shapes the dequantize-first
route of `qmoe/kernels/grouped_gemm.py` is still faster; benchmarks/sweep_mx_gemm.py times the
two side by side (benchmarks/results/sweeps/mx_gemm.json) and docs/performance.md says where
this kernel's time goes.

Same values as the "fused" route of `m_grouped_gemm_kernel` under MX scaling: every operand
element becomes `bf16(float(code) * 2^(e - 127))` (exact, NUMERICS.md), and the bf16 tensor
cores accumulate the products in fp32.

Why try it: Hopper has no MXFP8 tensor-core instruction, and the dequantize-first route writes
and reads a bf16 copy of both operands (three times the bytes of the codes), which dominates
where the weights outweigh the activations (many small experts). Here the FP8 codes travel by
TMA into a ring of shared-memory stages; each 64-deep step the warps dequantize the B tile into
a bf16 shared buffer and the A tile straight into the register operand of an asynchronous
warpgroup MMA, so the dequantization of step i + 1 runs while the tensor cores multiply step i.
Two steps per loop trip keep consecutive register operands in two register sets (one is still
being read by its MMA while the next is written). Three bf16 B buffers: a warpgroup may write
step i's buffer while the other still multiplies step i - 1, and the CTA barrier of step i - 1
guarantees step i - 3 is done. The scale bytes of a step are loaded one step ahead.

Tiles walk the groups exactly as the block GEMM (`_block_gemm_ws`): device offsets, persistent
programs, the same swizzle. K-steps of consecutive tiles form one stream, so loads run ahead
across tile boundaries. Rows past a group's end are loaded and never stored.
"""
from __future__ import annotations

import torch
import triton

from qmoe.kernels import _block_gemm_ws as ws
from qmoe.kernels._block_gemm_tl import _store, b_group_offsets, kernel_info
from qmoe.kernels._grouped_gemm_jit import _e8m0_to_float
from qmoe.kernels._launch import faking, num_sms

if ws.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _tile_coords(t, gi, starts, ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols,
                     BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        """Tile t's TMA coordinates: (first A row, first B row, first B column)."""
        g, m_start, m_end, pm, pn = ws._locate(t, gi, starts, ends, tiles, tile_end, num_n, BM, GROUP_M)
        gb = gl.minimum(g, num_groups - 1)
        return m_start + pm * BM, gb * b_group_rows + pn * BN, gb * b_group_cols

    @gluon.jit
    def _issue(j, nk, row0, brow, bcol, a_desc, b_desc, a_bufs, b_bufs, ready,
               BK: gl.constexpr, STAGES: gl.constexpr):
        """TMA loads of step j (K-step j % nk of the tile at row0 / brow, bcol) into stage j % STAGES."""
        s = j % STAGES
        kk = (j % nk) * BK
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        ws._tma_load(a_desc, [row0, kk], ready.index(s), a_bufs.index(s))
        ws._tma_load(b_desc, [brow, bcol + kk], ready.index(s), b_bufs.index(s))

    @gluon.jit
    def _scales(s_rows, row_ok, kb0, s_stride_k):
        """The E8M0 bytes (int32) of blocks kb0 and kb0 + 1 of each row (rows masked off: 127, scale 1)."""
        return (gl.load(s_rows + kb0 * s_stride_k, mask=row_ok, other=127).to(gl.int32),
                gl.load(s_rows + (kb0 + 1) * s_stride_k, mask=row_ok, other=127).to(gl.int32))

    @gluon.jit
    def _dequantized(q, e):
        """bf16 values of FP8 codes q [R, 64] (any layout) whose two 32-wide blocks along K have the
        E8M0 scale bytes e (from _scales)."""
        layout: gl.constexpr = q.type.layout
        k = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, layout)), 0)
        scale = gl.where(k < 32, gl.expand_dims(_e8m0_to_float(e[0]), 1), gl.expand_dims(_e8m0_to_float(e[1]), 1))
        return (q.to(gl.float32) * scale).to(gl.bfloat16)

    @gluon.jit
    def _step(j, ki, acc, a_prev, t, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, b16_bufs, ready,
              gi, starts, ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols,
              a_srows, a_ok, b_srows, b_ok, s_stride_ak, s_stride_bk, ea, eb, a_l: gl.constexpr, b_l: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
        """Step j (K-step ki of its tile): dequantize its tiles, issue its MMA, refill its stage with
        step j + STAGES (t: the TMA coordinates of that step's tile). a_prev, the previous step's
        register operand, stays alive until the wait that retires its MMA. ea, eb: this step's scale
        bytes, loaded a step ahead (their latency hides behind this step); returns the next step's."""
        ki_next = gl.minimum(ki + 1, nk - 1)
        ea_next = _scales(a_srows, a_ok, ki_next * 2, s_stride_ak)
        eb_next = _scales(b_srows, b_ok, ki_next * 2, s_stride_bk)
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        b16 = _dequantized(b_bufs.index(s).load(b_l), eb)
        a16 = _dequantized(a_bufs.index(s).load(a_l), ea)
        b16_smem = b16_bufs.index(j % 3)
        b16_smem.store(b16)
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of B is written, stage s is read
        jn = j + STAGES
        t_row0, t_brow, t_bcol = t
        if jn < steps:
            if jn % nk == 0:
                t_row0, t_brow, t_bcol = _tile_coords(pid + (jn // nk) * NUM_PROGRAMS, gi, starts, ends, tiles,
                                                      tile_end, num_n, num_groups, b_group_rows, b_group_cols,
                                                      BM, BN, GROUP_M)
            _issue(jn, nk, t_row0, t_brow, t_bcol, a_desc, b_desc, a_bufs, b_bufs, ready, BK, STAGES)
        acc = warpgroup_mma(a16, b16_smem.permute((1, 0)), acc, use_acc=ki > 0, is_async=True)
        acc, a_prev = warpgroup_mma_wait(1, deps=(acc, a_prev))
        return acc, a16, (t_row0, t_brow, t_bcol), ea_next, eb_next

    # sizes and strides that only index are not specialised (one compile for every shape)
    _SIZES = ["total_rows", "K", "num_groups", "b_group_rows", "b_group_cols", "s_stride_am",
              "s_stride_bn", "sb_group_stride"]

    @gluon.jit(do_not_specialize=_SIZES)
    def mx_gemm_kernel(a_desc, b_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr,
                       total_rows, N, K, num_groups, b_group_rows, b_group_cols, stride_om,
                       s_stride_am, s_stride_ak, s_stride_bn, s_stride_bk, sb_group_stride,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                       GP: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
        """out[T, N] = dequant(A_g) @ dequant(B_g)^T per group, MXFP8 codes and E8M0 scales (uint8).

        a_desc: [T, K] codes, blocks [BM, BK]; b_desc: B's 2-D codes, blocks [BN, BK], group g's B
        g * b_group_rows rows down and g * b_group_cols columns in; K % (2 * BK) == 0 (two steps per
        loop trip).
        """
        WARPS: gl.constexpr = gl.num_warps()
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BN, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BK // 16), BK // 16], [WARPS, 1], [1, 0])
        b16_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        b16_bufs = gl.allocate_shared_memory(gl.bfloat16, [3, BN, BK], b16_l)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)

        pid = gl.program_id(0)
        num_n = gl.cdiv(N, BN)
        gi, starts, ends, tiles, tile_end = ws._group_table(offs_ptr, total_rows, num_groups, num_n, BM, GP, WARPS)
        total_tiles = gl.sum(tiles, 0)
        nk = K // BK
        steps = gl.where(pid < total_tiles, (total_tiles - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS, 0) * nk
        zero = pid * 0
        t = (zero, zero, zero)
        for i in gl.static_range(STAGES):
            if i < steps:
                t = _tile_coords(pid + (i // nk) * NUM_PROGRAMS, gi, starts, ends, tiles, tile_end, num_n,
                                 num_groups, b_group_rows, b_group_cols, BM, BN, GROUP_M)
                _issue(i, nk, t[0], t[1], t[2], a_desc, b_desc, a_bufs, b_bufs, ready, BK, STAGES)

        acc = gl.zeros([BM, BN], gl.float32, mma)
        a_prev = gl.zeros([BM, BK], gl.bfloat16, a_l)
        j = zero
        for tile in range(pid, total_tiles, NUM_PROGRAMS):
            g, m_start, m_end, pm, pn = ws._locate(tile, gi, starts, ends, tiles, tile_end, num_n, BM, GROUP_M)
            row0 = m_start + pm * BM
            a_rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, a_l))
            a_srows = sa_ptr + a_rows.to(gl.int64) * s_stride_am
            b_rows = pn * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, b_l))
            gb = gl.minimum(g, num_groups - 1).to(gl.int64)
            b_srows = sb_ptr + gb * sb_group_stride + b_rows.to(gl.int64) * s_stride_bn
            a_ok = a_rows < m_end
            b_ok = b_rows < N
            ea = _scales(a_srows, a_ok, 0, s_stride_ak)
            eb = _scales(b_srows, b_ok, 0, s_stride_bk)
            for kp in range(0, nk, 2):  # two steps per trip: their register operands alternate between two sets
                acc, a_prev, t, ea, eb = _step(
                    j, kp, acc, a_prev, t, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, b16_bufs, ready, gi, starts,
                    ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols, a_srows, a_ok, b_srows,
                    b_ok, s_stride_ak, s_stride_bk, ea, eb, a_l, b_l, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS)
                acc, a_prev, t, ea, eb = _step(
                    j + 1, kp + 1, acc, a_prev, t, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, b16_bufs, ready, gi,
                    starts, ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols, a_srows, a_ok,
                    b_srows, b_ok, s_stride_ak, s_stride_bk, ea, eb, a_l, b_l, BM, BN, BK, GROUP_M, STAGES,
                    NUM_PROGRAMS)
                j += 2
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
            cols = pn * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            _store(out_ptr, gl.where(g < num_groups, acc, 0.0), rows, rows < m_end, cols, N, stride_om)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


def _smem(bm: int, bn: int, bk: int, stages: int) -> int:
    return stages * (bm + bn) * bk + 3 * bn * bk * 2


def launch_mx_gemm(a, b, offsets: torch.Tensor, total_rows: int, n_out: int, k: int, groups: int,
                   out_dtype=torch.bfloat16, *, b_columnwise: bool = False, bm: int = 128, bn: int = 256,
                   bk: int = 64, stages: int = 4, warps: int = 8, group_m: int = 8, programs: int | None = None,
                   info: dict | None = None) -> torch.Tensor:
    """out [total_rows, n_out] of the MXFP8 m-grouped GEMM; a, b: grouped_gemm._Operand (MX scaling).

    Host-sync-free: the descriptors hold pointers and shapes only, the grid is the SM count.
    """
    if ws.gluon is None:
        raise RuntimeError(ws.GLUON_ERROR)
    if bk != 64 or bn not in (64, 128, 256):
        raise ValueError(f"tiles N {bn} x K {bk}: the kernel takes N in (64, 128, 256) and a 64-deep K-step")
    if k % (2 * bk) or a.block != (1, 32) or b.block != (1, 32):
        raise ValueError(f"K={k} must be a multiple of twice the step {bk}, blocks 1x32 (got {a.block} x {b.block})")
    if bm != 16 * warps:
        raise ValueError(f"bm={bm} with {warps} warps: the warps stack along M, 16 rows each (bm = 16 * warps)")
    if _smem(bm, bn, bk, stages) > ws.SMEM_BYTES - 1024:
        raise ValueError(f"{stages} stages of {bm} x {bn} x {bk} exceed shared memory")
    out = torch.empty((total_rows, n_out), dtype=out_dtype, device=a.data.device)
    if total_rows == 0 or n_out == 0 or faking():
        return out
    if groups == 0:
        return out.zero_()
    g_rows, g_cols = b_group_offsets(b, b_columnwise)
    if programs is None:
        programs = num_sms(a.data.device)
    compiled = mx_gemm_kernel[(programs,)](
        ws._desc(a.data, [bm, bk]), ws._desc(b.data, [bn, bk]), out, offsets, a.scale, b.scale,
        total_rows, n_out, k, groups, g_rows, g_cols, out.stride(0),
        a.s_stride_r, a.s_stride_k, b.s_stride_r, b.s_stride_k, b.s_group_stride,
        BM=bm, BN=bn, BK=bk, GROUP_M=group_m, GP=triton.next_power_of_2(groups + 1), STAGES=stages,
        NUM_PROGRAMS=programs, num_warps=warps)
    kernel_info(compiled, info)
    return out
