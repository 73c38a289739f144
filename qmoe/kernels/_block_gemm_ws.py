"""FP8 block-scaled m-grouped GEMM (1x128 activations x 128x128 weights) with warp specialisation,
in Triton's Gluon dialect (private helper of `qmoe/kernels/grouped_gemm.py`, which dispatches the
BLOCK m-grouped GEMM here where `unsupported` returns None; benchmarks/sweep_block_gemm.py times
the schedules and tiles side by side).

Same contract and bits as `m_grouped_gemm_kernel` under BLOCK scaling with one weight scale per
tile and step: each 128-deep step's FP8 product is accumulated by the tensor cores from zero,
then promoted to the fp32 total as `acc + p * (a_scale[row, step] * b_scale[col block, step])`
(one FMA per element), steps in order.

Why a second kernel: in the single-partition kernel every warp waits for its product and then
promotes it on the CUDA cores while the tensor cores idle, and the pipeline's CTA-wide barriers
keep both warpgroups in lockstep, so the promotion never overlaps an MMA. Here one warp issues
TMA loads into a ring of shared-memory stages (mbarriers, no CTA-wide barrier), and each half of
the 128-row tile belongs to its own consumer warpgroup, which runs free of the other, so one's
promotion can run while the other's MMA occupies the tensor cores. PIPE picks the schedule:

  0  each consumer promotes a step right after its MMA (overlap only across the consumers)
  1  a consumer issues step i's MMA, then promotes step i-1 (overlap within a consumer too;
     the product is copied between registers once per step)
  2  as 1 with two steps per loop trip, so the two products alternate between register sets
  3  0 with a strict ping-pong: half 1 issues a step's MMA after half 0, half 0 the next step's
     after half 1 (an mbarrier pair), so the tensor cores always hold one half's MMA while the
     other half promotes

BN = 256 (wide tiles: half the A traffic per output of 128-column tiles) runs schedules 0 and 3
only: each half owns a 64 x 256 sum as two 64 x 128 accumulators and computes a step as two
128-column products, each promoted before the next is issued, because the fp32 sum (128
registers per thread) leaves room for one 64-register product, not two.

SCALES_TMA: the activations' scales lie [rows, K/128], steps minor, so a step's per-row loads
touch a cache line per row once a row's scales fill one. The launch then stores them steps-major
(one small copy per call) and the producer loads each step's row of them with the step's codes,
for the consumers to read from shared memory; a tile whose first scale is off 16 bytes (a group
starting off a multiple of 4 rows) loads them itself, as without SCALES_TMA.

Tiles walk the groups exactly as `m_grouped_gemm_kernel` does (device offsets, persistent
programs, the same swizzle); every partition derives the same tile sequence. Full 64-row
halves leave through a TMA store; a half that crosses its group's end is stored with a mask.
"""
from __future__ import annotations

import torch
import triton

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.kernels._block_gemm_tl import b_group_offsets, check_block_operands, kernel_info
from qmoe.kernels._gluon_sm90 import gluon
from qmoe.kernels._launch import faking, num_sms
from qmoe.kernels._layout import gemm_steps_major

if gluon is not None:
    from qmoe.kernels._gluon_sm90 import fence_async_shared, gl, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


if gluon is not None:

    @gluon.jit
    def _group_table(offs_ptr, total_rows, num_groups, num_n, BM: gl.constexpr, GP: gl.constexpr,
                     WARPS: gl.constexpr):
        """Per group (the pseudo-group G holds rows offs[G]:total_rows): start, end, tiles, cumulative tiles."""
        # each warp holds every group (replicated over warps): reductions stay inside a warp, no barrier
        SPT: gl.constexpr = GP // 32 if GP >= 32 else 1
        layout: gl.constexpr = gl.BlockedLayout([SPT], [32], [WARPS], [0])
        gi = gl.arange(0, GP, layout=layout)
        starts = gl.load(offs_ptr + gi, mask=gi <= num_groups, other=0).to(gl.int32)
        ends = gl.load(offs_ptr + gi + 1, mask=gi < num_groups, other=0).to(gl.int32)
        ends = gl.where(gi == num_groups, total_rows, ends)
        tiles = gl.cdiv(gl.maximum(ends - starts, 0), BM) * num_n
        tile_end = gl.associative_scan(tiles, 0, sm90.add)
        return gi, starts, ends, tiles, tile_end

    @gluon.jit
    def _locate(t, gi, starts, ends, tiles, tile_end, num_n, BM: gl.constexpr, GROUP_M: gl.constexpr):
        """Tile t -> (group, first row of the group, its end, row tile, column tile)."""
        g = gl.sum((tile_end <= t).to(gl.int32), 0)
        sel = gi == g
        m_start = gl.sum(gl.where(sel, starts, 0), 0)
        m_end = gl.sum(gl.where(sel, ends, 0), 0)
        local = t - gl.sum(gl.where(sel, tile_end - tiles, 0), 0)
        num_m = gl.cdiv(m_end - m_start, BM)
        width = GROUP_M * num_n
        first_m = (local // width) * GROUP_M
        size_m = gl.minimum(num_m - first_m, GROUP_M)
        pm = first_m + (local % width) % size_m
        pn = (local % width) // size_m
        return g, m_start, m_end, pm, pn

    @gluon.jit
    def _scales_aligned(m_start):
        """Whether a tile of the group starting at row m_start has its step-major scale box on 16
        bytes, as TMA needs (its first row, m_start + 128 * pm, a multiple of 4): with SCALES_TMA
        the producer then loads the scales with the codes and the consumers read them from there."""
        return m_start % 4 == 0

    @gluon.jit
    def _producer(a_desc, b_desc, sa_desc, a_bufs, b_bufs, sa_bufs, full, empty, offs_ptr, total_rows, N, K,
                  num_groups, b_group_rows, b_group_cols,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, GP: gl.constexpr,
                  STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, SCALES_TMA: gl.constexpr):
        """One warp: TMA loads of every tile's A and B steps into the stage ring (with SCALES_TMA,
        each step's row of the steps-major activation scales too)."""
        num_n = gl.cdiv(N, BN)
        gi, starts, ends, tiles, tile_end = _group_table(offs_ptr, total_rows, num_groups, num_n, BM, GP, 1)
        total_tiles = gl.sum(tiles, 0)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        s_nbytes: gl.constexpr = sa_desc.block_type.nbytes
        it = 0
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, m_start, m_end, pm, pn = _locate(t, gi, starts, ends, tiles, tile_end, num_n, BM, GROUP_M)
            row0 = m_start + pm * BM
            gb = gl.minimum(g, num_groups - 1)
            brow = gb * b_group_rows + pn * BN
            bcol = gb * b_group_cols
            nk = gl.where(g < num_groups, gl.cdiv(K, BK), 0)
            staged = _scales_aligned(m_start)
            for ki in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                if SCALES_TMA and staged:
                    mbarrier.expect(full.index(s), nbytes + s_nbytes)
                else:
                    mbarrier.expect(full.index(s), nbytes)
                sm90.tma_load(a_desc, [row0, ki * BK], full.index(s), a_bufs.index(s))
                sm90.tma_load(b_desc, [brow, bcol + ki * BK], full.index(s), b_bufs.index(s))
                if SCALES_TMA:
                    sm90.tma_load(sa_desc, [ki, row0], full.index(s), sa_bufs.index(s), pred=staged)
                it += 1

    @gluon.jit
    def _row_scales(sa_rows, sa_staged, s, row_ok, ki, s_stride_ak, staged, HALF: gl.constexpr, HM: gl.constexpr,
                    row_l: gl.constexpr, SCALES_TMA: gl.constexpr):
        """Step ki's activation scales of this half's rows: from stage s's scale row where the
        producer loaded it with the codes (SCALES_TMA and a tile starting on 16 bytes of scales:
        `staged`), else from global memory."""
        if SCALES_TMA and staged:
            f = sa_staged.index(s).slice(HALF * HM, HM).load(row_l)
        else:
            f = gl.load(sa_rows + ki * s_stride_ak, mask=row_ok, other=0.0)
        return f

    @gluon.jit
    def _step(acc, p, f, a_bufs, b_bufs, sa_staged, full, empty, it, ki, sa_rows, sb_tile, row_ok, s_stride_ak,
              s_stride_bk, zero, staged, HALF: gl.constexpr, HM: gl.constexpr, STAGES: gl.constexpr,
              row_l: gl.constexpr, SCALES_TMA: gl.constexpr):
        """Issue step ki's MMA, promote the previous step's product p (factor f) meanwhile, wait for ki's."""
        s = it % STAGES
        mbarrier.wait(full.index(s), (it // STAGES) & 1)
        tok = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                            use_acc=False, is_async=True)
        acc = acc + p * gl.expand_dims(f, 1)
        f = _row_scales(sa_rows, sa_staged, s, row_ok, ki, s_stride_ak, staged, HALF, HM, row_l,
                        SCALES_TMA) * gl.load(sb_tile + ki * s_stride_bk)
        p, acc = warpgroup_mma_wait(0, deps=(tok, acc))  # acc as a dep: the promotion stays before the wait
        mbarrier.arrive(empty.index(s), count=1)
        return acc, p, f

    @gluon.jit
    def _consumer(a_bufs, b_bufs, sa_staged, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr,
                  total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak, s_stride_bn, s_stride_bk,
                  sb_group_stride, HALF: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, B_BR: gl.constexpr, GROUP_M: gl.constexpr,
                  GP: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, PIPE: gl.constexpr,
                  SCALES_TMA: gl.constexpr):
        """One warpgroup: rows HALF*BM/2.. of each tile; MMA per step, promotion, epilogue."""
        HM: gl.constexpr = BM // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        num_n = gl.cdiv(N, BN)
        gi, starts, ends, tiles, tile_end = _group_table(offs_ptr, total_rows, num_groups, num_n, BM, GP, 4)
        total_tiles = gl.sum(tiles, 0)
        zero = gl.zeros([HM, BN], gl.float32, mma)
        c_smem = c_bufs.index(HALF)
        it = 0
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, m_start, m_end, pm, pn = _locate(t, gi, starts, ends, tiles, tile_end, num_n, BM, GROUP_M)
            row0 = m_start + pm * BM + HALF * HM
            rows = row0 + gl.arange(0, HM, layout=row_l)
            row_ok = rows < m_end
            gb = gl.minimum(g, num_groups - 1).to(gl.int64)
            sa_rows = sa_ptr + rows.to(gl.int64) * s_stride_am
            staged = _scales_aligned(m_start)
            sb_tile = sb_ptr + gb * sb_group_stride + (pn * BN // B_BR) * s_stride_bn
            nk = gl.where(g < num_groups, gl.cdiv(K, BK), 0)
            acc = zero
            if PIPE == 0 or PIPE == 3:  # promote each step after its MMA (the two consumers overlap each other)
                for ki in range(nk):
                    s = it % STAGES
                    mbarrier.wait(full.index(s), (it // STAGES) & 1)
                    if PIPE == 3:  # ping-pong: step it's MMA after the other half's (half 0 first)
                        mbarrier.wait(turn.index(HALF), (it & 1) ^ (1 - HALF))
                    tok = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                                        use_acc=False, is_async=True)
                    if PIPE == 3:
                        mbarrier.arrive(turn.index(1 - HALF), count=1)
                    f = _row_scales(sa_rows, sa_staged, s, row_ok, ki, s_stride_ak, staged, HALF, HM, row_l,
                                    SCALES_TMA) * gl.load(sb_tile + ki * s_stride_bk)
                    p = warpgroup_mma_wait(0, deps=(tok, ))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc = acc + p * gl.expand_dims(f, 1)
                    it += 1
            else:  # promote step i-1 while step i's MMA runs
                p = zero
                f = gl.zeros([HM], gl.float32, row_l)
                if PIPE == 1:
                    for ki in range(nk):
                        acc, p, f = _step(acc, p, f, a_bufs, b_bufs, sa_staged, full, empty, it, ki, sa_rows, sb_tile,
                                          row_ok, s_stride_ak, s_stride_bk, zero, staged, HALF, HM, STAGES,
                                          row_l, SCALES_TMA)
                        it += 1
                else:  # two steps per trip: the products alternate between two register sets, no copies
                    for kp in range(nk // 2):
                        acc, p, f = _step(acc, p, f, a_bufs, b_bufs, sa_staged, full, empty, it, 2 * kp, sa_rows,
                                          sb_tile, row_ok, s_stride_ak, s_stride_bk, zero, staged, HALF, HM, STAGES,
                                          row_l, SCALES_TMA)
                        acc, p, f = _step(acc, p, f, a_bufs, b_bufs, sa_staged, full, empty, it + 1, 2 * kp + 1,
                                          sa_rows, sb_tile, row_ok, s_stride_ak, s_stride_bk, zero, staged, HALF, HM,
                                          STAGES, row_l, SCALES_TMA)
                        it += 2
                    if nk % 2 == 1:
                        acc, p, f = _step(acc, p, f, a_bufs, b_bufs, sa_staged, full, empty, it, nk - 1, sa_rows,
                                          sb_tile, row_ok, s_stride_ak, s_stride_bk, zero, staged, HALF, HM, STAGES,
                                          row_l, SCALES_TMA)
                        it += 1
                acc = acc + p * gl.expand_dims(f, 1)
            out = acc.to(c_desc.dtype)
            col0 = pn * BN
            if row0 + HM <= m_end:
                tma.store_wait(0)
                c_smem.store(out)
                fence_async_shared()
                sm90.tma_store(c_desc, [row0, col0], c_smem)
            else:
                cols = col0 + gl.arange(0, BN, layout=col_l)
                ptrs = out_ptr + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
                gl.store(ptrs, out, mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0))
        tma.store_wait(0)

    @gluon.jit
    def _store_half(acc, c_smem, c_desc, out_ptr, rows, row_ok, row0, col0, m_end, N, stride_om, HM: gl.constexpr,
                    col_l: gl.constexpr, WAIT: gl.constexpr):
        """A [HM, W] result: a TMA store when all its rows belong to the group, else a masked store.
        WAIT: first wait for this partition's earlier TMA stores (c_smem is being reused)."""
        W: gl.constexpr = acc.shape[1]
        out = acc.to(c_desc.dtype)
        if row0 + HM <= m_end:
            if WAIT:
                tma.store_wait(0)
            c_smem.store(out)
            fence_async_shared()
            sm90.tma_store(c_desc, [row0, col0], c_smem)
        else:
            cols = col0 + gl.arange(0, W, layout=col_l)
            ptrs = out_ptr + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, out, mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0))

    @gluon.jit
    def _consumer_wide(a_bufs, b_bufs, sa_staged, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr, sa_ptr,
                       sb_ptr, total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak, s_stride_bn,
                       s_stride_bk, sb_group_stride, HALF: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, B_BR: gl.constexpr, GROUP_M: gl.constexpr,
                       GP: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, PIPE: gl.constexpr,
                       C_BUFS: gl.constexpr, SCALES_TMA: gl.constexpr):
        """BN = 2 * 128: rows HALF*BM/2.. of each tile as two 128-column sums (schedules 0 and 3)."""
        HM: gl.constexpr = BM // 2
        SUB: gl.constexpr = BN // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        num_n = gl.cdiv(N, BN)
        gi, starts, ends, tiles, tile_end = _group_table(offs_ptr, total_rows, num_groups, num_n, BM, GP, 4)
        total_tiles = gl.sum(tiles, 0)
        zero = gl.zeros([HM, SUB], gl.float32, mma)
        it = 0
        u = 0  # products issued (two per step): the ping-pong's turn count
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, m_start, m_end, pm, pn = _locate(t, gi, starts, ends, tiles, tile_end, num_n, BM, GROUP_M)
            row0 = m_start + pm * BM + HALF * HM
            rows = row0 + gl.arange(0, HM, layout=row_l)
            row_ok = rows < m_end
            gb = gl.minimum(g, num_groups - 1).to(gl.int64)
            sa_rows = sa_ptr + rows.to(gl.int64) * s_stride_am
            staged = _scales_aligned(m_start)
            sb_lo = sb_ptr + gb * sb_group_stride + (pn * BN // B_BR) * s_stride_bn
            sb_hi = sb_ptr + gb * sb_group_stride + ((pn * BN + SUB) // B_BR) * s_stride_bn
            nk = gl.where(g < num_groups, gl.cdiv(K, BK), 0)
            acc0 = zero
            acc1 = zero
            for ki in range(nk):
                s = it % STAGES
                mbarrier.wait(full.index(s), (it // STAGES) & 1)
                a_s = a_bufs.index(s).slice(HALF * HM, HM)
                if PIPE == 3:
                    mbarrier.wait(turn.index(HALF), (u & 1) ^ (1 - HALF))
                tok = warpgroup_mma(a_s, b_bufs.index(s).slice(0, SUB).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                if PIPE == 3:
                    mbarrier.arrive(turn.index(1 - HALF), count=1)
                sa_k = _row_scales(sa_rows, sa_staged, s, row_ok, ki, s_stride_ak, staged, HALF, HM, row_l,
                                   SCALES_TMA)
                f = sa_k * gl.load(sb_lo + ki * s_stride_bk)
                p = warpgroup_mma_wait(0, deps=(tok, ))
                acc0 = acc0 + p * gl.expand_dims(f, 1)
                if PIPE == 3:
                    mbarrier.wait(turn.index(HALF), ((u + 1) & 1) ^ (1 - HALF))
                tok = warpgroup_mma(a_s, b_bufs.index(s).slice(SUB, SUB).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                if PIPE == 3:
                    mbarrier.arrive(turn.index(1 - HALF), count=1)
                f = sa_k * gl.load(sb_hi + ki * s_stride_bk)
                p = warpgroup_mma_wait(0, deps=(tok, ))
                mbarrier.arrive(empty.index(s), count=1)
                acc1 = acc1 + p * gl.expand_dims(f, 1)
                it += 1
                u += 2
            col0 = pn * BN
            _store_half(acc0, c_bufs.index(HALF * C_BUFS), c_desc, out_ptr, rows, row_ok, row0, col0, m_end, N,
                        stride_om, HM, col_l, True)
            _store_half(acc1, c_bufs.index(HALF * C_BUFS + C_BUFS - 1), c_desc, out_ptr, rows, row_ok, row0,
                        col0 + SUB, m_end, N, stride_om, HM, col_l, C_BUFS == 1)
        tma.store_wait(0)

    # sizes and strides that only index are not specialised (one compile for every shape); N and the
    # output stride (vectorised masked stores) and the scales' step strides (1) are
    _SIZES = ["total_rows", "K", "num_groups", "b_group_rows", "b_group_cols", "s_stride_am",
              "s_stride_bn", "sb_group_stride"]

    @gluon.jit(do_not_specialize=_SIZES)
    def block_gemm_ws_kernel(a_desc, b_desc, c_desc, sa_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr,
                             total_rows, N, K, num_groups, b_group_rows, b_group_cols, stride_om,
                             s_stride_am, s_stride_ak, s_stride_bn, s_stride_bk, sb_group_stride,
                             BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, B_BR: gl.constexpr,
                             GROUP_M: gl.constexpr, GP: gl.constexpr, STAGES: gl.constexpr,
                             NUM_PROGRAMS: gl.constexpr, PIPE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr, C_BUFS: gl.constexpr, SCALES_TMA: gl.constexpr):
        """out[T, N] = A_g @ B_g^T per group (see m_grouped_gemm_kernel), FP8 block scaling.

        Partitions: the default one (4 warps) and a 4-warp worker consume the two 64-row halves of
        each tile; a 1-warp worker produces. `empty` counts both consumers' releases. Each
        consumer stages its results in C_BUFS shared buffers of [BM/2, min(BN, 128)] (BN = 256).
        """
        SUB: gl.constexpr = BN if BN <= 128 else BN // 2
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 * C_BUFS, BM // 2, SUB], c_desc.layout)
        full, empty = sm90.stage_barriers(STAGES)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # each stage's activation-scale row (a [1, BM] TMA box), read back as a 1-d row
        sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES if SCALES_TMA else 1, 1, BM], sa_desc.layout)
        sa_staged = sm90.reinterpret(sa_bufs, gl.float32, [STAGES if SCALES_TMA else 1, BM],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # rank 1: .index() keeps it
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        if BN > 128:
            gl.warp_specialize([
                (_consumer_wide, (a_bufs, b_bufs, sa_staged, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr,
                                  sa_ptr, sb_ptr, total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak,
                                  s_stride_bn, s_stride_bk, sb_group_stride, 0, BM, BN, BK, B_BR, GROUP_M, GP,
                                  STAGES, NUM_PROGRAMS, PIPE, C_BUFS, SCALES_TMA)),
                (_consumer_wide, (a_bufs, b_bufs, sa_staged, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr,
                                  sa_ptr, sb_ptr, total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak,
                                  s_stride_bn, s_stride_bk, sb_group_stride, 1, BM, BN, BK, B_BR, GROUP_M, GP,
                                  STAGES, NUM_PROGRAMS, PIPE, C_BUFS, SCALES_TMA)),
                (_producer, (a_desc, b_desc, sa_desc, a_bufs, b_bufs, sa_bufs, full, empty, offs_ptr, total_rows, N,
                             K, num_groups, b_group_rows, b_group_cols, BM, BN, BK, GROUP_M, GP, STAGES, NUM_PROGRAMS,
                             SCALES_TMA)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, sa_staged, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr,
                             sa_ptr, sb_ptr, total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak,
                             s_stride_bn, s_stride_bk, sb_group_stride, 0, BM, BN, BK, B_BR, GROUP_M, GP,
                             STAGES, NUM_PROGRAMS, PIPE, SCALES_TMA)),
                (_consumer, (a_bufs, b_bufs, sa_staged, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr,
                             sa_ptr, sb_ptr, total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak,
                             s_stride_bn, s_stride_bk, sb_group_stride, 1, BM, BN, BK, B_BR, GROUP_M, GP,
                             STAGES, NUM_PROGRAMS, PIPE, SCALES_TMA)),
                (_producer, (a_desc, b_desc, sa_desc, a_bufs, b_bufs, sa_bufs, full, empty, offs_ptr, total_rows, N,
                             K, num_groups, b_group_rows, b_group_cols, BM, BN, BK, GROUP_M, GP, STAGES, NUM_PROGRAMS,
                             SCALES_TMA)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# What qmoe's m-grouped FP8 block GEMM dispatches to (launch_block_gemm_ws's keywords): 128x256
# tiles where N allows them (each weight tile is read by half as many programs) in the strict
# ping-pong with two result buffers per consumer (a tile's second half is stored without waiting
# for its first) where they leave room for its stages, else one; else 128x128 with the promotion
# of one step overlapping the next step's MMA. Both take each step's activation scales with its
# codes through the TMA ring (scales_tma) where the cast stored them steps-major (a step's scales
# of a tile are then one box, and a per-step load from global memory would wait on L2 every step)
# or, stored row-major, where a row's scales span a cache line or more (K >= SCALES_TMA_MIN_K), so
# that each per-step load would touch a line per row; below that, row-major rows of a line share
# it across the tile's steps, and a steps-major copy would cost more than it saves. The benchmark
# sweep (benchmarks/sweep_block_gemm.py) times the other schedules and tiles against them
# (benchmarks/results/sweeps/block_gemm_pingpong.json).
DISPATCH_WIDE = dict(bn=256, stages=3, pipe=3, group_m=8, c_bufs=2)
DISPATCH = dict(bn=128, stages=5, pipe=2, group_m=8)
SCALES_TMA_MIN_K = 4096  # 32 steps of 4-byte scales: a 128-byte line per row


def dispatch_config(n_out: int, k: int, out_dtype=torch.bfloat16, steps_major: bool = False) -> dict:
    """The dispatched keywords for an output of n_out columns of out_dtype over a contraction of k
    (steps_major: the activation scales are stored steps-major), its stages fitted to shared
    memory: wide tiles drop their second result buffer where it would cost a stage (fp32)."""
    scales_tma = steps_major or k >= SCALES_TMA_MIN_K
    if n_out % DISPATCH_WIDE["bn"]:
        cfg = dict(DISPATCH, scales_tma=scales_tma)
    else:
        cfg = dict(DISPATCH_WIDE, scales_tma=scales_tma)
        if fit_stages(cfg["stages"], 128, cfg["bn"], out_dtype, cfg["c_bufs"], cfg["scales_tma"]) < cfg["stages"]:
            cfg["c_bufs"] = 1
    cfg["stages"] = fit_stages(cfg["stages"], 128, cfg["bn"], out_dtype, cfg.get("c_bufs", 1), cfg["scales_tma"])
    return cfg


# Calls whose kernel failed to compile (a Triton without this Gluon API): they take the Triton kernel.
FAILED: dict[tuple, str] = {}


def unsupported(a, b, n_out: int, k: int, out_dtype, total_rows: int, groups: int) -> str | None:
    """Why the dispatched Gluon kernel cannot run this m-grouped BLOCK call (None: it can).

    It needs Gluon's Hopper API, an sm90 device, K % 128 == 0 with 1x128 x 128x128 blocks,
    TMA-aligned operands and output rows, and enough rows per group for 128-row tiles (fewer
    go to the current kernel's small-M tiles). QMOE_BLOCK_GEMM=triton turns it off.
    """
    why = sm90.gluon_unavailable(a.data.device, sm90.BLOCK_GEMM_SWITCH)
    if why is not None:
        return why
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"output dtype {out_dtype}"
    if k % 128 or a.block != (1, 128) or b.block != (128, 128) or a.stride_k != 1 or b.stride_k != 1:
        return f"K={k}, blocks {a.block} x {b.block}, contraction strides {a.stride_k}, {b.stride_k}"
    aligned = sm90.tma_aligned(a.data) and sm90.tma_aligned(b.data)
    if (n_out * torch.finfo(out_dtype).bits // 8) % 16 or not aligned:
        return "operands or output rows not 16-byte aligned (TMA)"
    if total_rows <= 96 * groups:
        return "few rows per group (the current kernel's 64-row tiles)"
    return None


def _smem(bm: int, bn: int, out_dtype, c_bufs: int, scales_tma: bool) -> tuple[int, int]:
    """(bytes per stage: codes, and with scales_tma a row of activation scales; bytes of the result
    buffers) in shared memory."""
    results = 2 * c_bufs * (bm // 2) * min(bn, 128) * torch.finfo(out_dtype).bits // 8
    return (bm + bn) * 128 + (bm * 4 if scales_tma else 0), results


def fit_stages(stages: int, bm: int, bn: int, out_dtype, c_bufs: int = 1, scales_tma: bool = False) -> int:
    """At most `stages` stages such that the stages and the result buffers fit in shared memory."""
    stage, c = _smem(bm, bn, out_dtype, c_bufs, scales_tma)
    return max(1, min(stages, (sm90.SMEM_BYTES - sm90.SMEM_SPARE - c) // stage))


def launch_dispatched(a, b, offsets, total_rows: int, n_out: int, k: int, groups: int, out_dtype, out):
    """The dispatched configuration into `out`; None, launching nothing, where `unsupported` says
    so or its compile failed (recorded in FAILED, with a warning once): the caller then runs the
    current kernel.

    b is either weights [E*N, K] (group g g*N rows down: group stride N*K >= the row stride) or
    their columnwise copy [K, E*N] (g*N columns in: group stride N < the row stride E*N); with
    one group the offset is never used.
    """
    if unsupported(a, b, n_out, k, out_dtype, total_rows, groups) is not None:
        return None
    b_columnwise = b.group_stride < b.stride_r
    steps_major = a.scale is not None and gemm_steps_major(a.scale) is not None
    cfg = dispatch_config(n_out, k, out_dtype, steps_major)
    key = (out_dtype, b_columnwise, *sorted(cfg.items()))
    return sm90.launch_once(FAILED, key, "FP8 block GEMM", lambda: launch_block_gemm_ws(
        a, b, offsets, total_rows, n_out, k, groups, out_dtype, out=out, b_columnwise=b_columnwise, **cfg))


def launch_block_gemm_ws(a, b, offsets: torch.Tensor, total_rows: int, n_out: int, k: int, groups: int,
                         out_dtype=torch.bfloat16, *, out: torch.Tensor | None = None, b_columnwise: bool = False,
                         bm: int = 128, bn: int = 128, stages: int = 5, pipe: int = 1, group_m: int = 8,
                         c_bufs: int = 1, scales_tma: bool = False, programs: int | None = None,
                         consumer_regs: int = 232, producer_regs: int = 40, info: dict | None = None) -> torch.Tensor:
    """out [total_rows, n_out] of the FP8 block m-grouped GEMM; a, b: grouped_gemm._Operand (BLOCK scaling).

    pipe: the consumers' schedule (0-3, see the module docstring; bn = 256 takes 0 and 3).
    c_bufs: result buffers per consumer (bn = 256: 2 stores a tile's halves without waiting).
    scales_tma: the producer streams each step's activation scales (stored steps-major here, one
    small copy per call) with the codes, and the consumers read them from shared memory.
    Host-sync-free: the descriptors hold pointers and shapes only, the grid is the SM count.
    """
    if gluon is None:
        raise RuntimeError(sm90.GLUON_ERROR)
    check_block_operands(a, b, k, min(bn, 128))
    if bn not in (128, 256) or bm != 128 or (bn == 256 and (pipe not in (0, 3) or n_out % bn)):
        raise ValueError(f"tiles {bm} x {bn} (pipe {pipe}, N={n_out}): the kernel takes 128 x 128 with pipe 0-3 "
                         f"and 128 x 256 with pipe 0 or 3 and N % 256 == 0")
    if c_bufs not in (1, 2) or (bn == 128 and c_bufs != 1):
        raise ValueError(f"c_bufs={c_bufs}: 1, or 2 with bn = 256")
    if fit_stages(stages, bm, bn, out_dtype, c_bufs, scales_tma) < stages:
        raise ValueError(f"{stages} stages of {bm} x {bn} tiles and {c_bufs} result buffers of {out_dtype} per "
                         f"consumer exceed shared memory ({sm90.SMEM_BYTES} bytes): take fit_stages(...)")
    if out is None:
        out = torch.empty((total_rows, n_out), dtype=out_dtype, device=a.data.device)
    if total_rows == 0 or n_out == 0 or faking():
        return out
    g_rows, g_cols = b_group_offsets(b, b_columnwise)
    if programs is None:
        programs = num_sms(a.data.device)
    sub = min(bn, 128)
    if scales_tma:
        sa, sa_desc = sm90.steps_major_scales(a.scale)
    else:
        sa, sa_desc = a.scale, sm90.stand_in_scale_desc(out)
    compiled = block_gemm_ws_kernel[(programs,)](
        sm90.desc(a.data, [bm, 128]), sm90.desc(b.data, [bn, 128]), sm90.desc(out, [bm // 2, sub]), sa_desc, out,
        offsets, sa, b.scale, total_rows, n_out, k, groups, g_rows, g_cols, out.stride(0),
        sa.stride(1) if scales_tma else a.s_stride_r, sa.stride(0) if scales_tma else a.s_stride_k, b.s_stride_r,
        b.s_stride_k, b.s_group_stride,
        BM=bm, BN=bn, BK=128, B_BR=b.block[0], GROUP_M=group_m, GP=triton.next_power_of_2(groups + 1),
        STAGES=stages, NUM_PROGRAMS=programs, PIPE=pipe, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        C_BUFS=c_bufs, SCALES_TMA=scales_tma, num_warps=4)
    kernel_info(compiled, info)
    return out
