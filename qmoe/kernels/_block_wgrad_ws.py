"""FP8 block-scaled k-grouped GEMM (wgrad: both operands 1x128-scaled along the tokens) with warp
specialisation, in Triton's Gluon dialect (private helper of `qmoe/kernels/grouped_gemm.py`, which
dispatches the BLOCK k-grouped GEMM here where `unsupported` returns None).

Same contract and bits as `k_grouped_gemm_kernel` under BLOCK scaling with its 64 x 128 tiles:
out[g] [N, K] = A[:, tokens of g] @ B[:, tokens of g]^T, each 128-token step's FP8 product
accumulated by the tensor cores from zero, then promoted to the fp32 total as
`acc + p * (a_scale[row, step] * b_scale[col, step])`, steps in order, the group's last, partial
step with the tokens past its end read as zeros.

Why a second kernel: the promotion is an outer product (two operations per element, twice the
m-grouped GEMM's), and in the single-partition kernel the tensor cores idle while it runs. Here
one warp streams the full 128-token steps of A and B through a ring of shared-memory stages by
TMA, and two consumer warpgroups each own 64 rows of a 128 x 128 output tile, so one's promotion
runs while the other's MMA holds the tensor cores. PIPE 1 also overlaps within a consumer: it
issues step i's MMA, then promotes step i-1.

Wide tiles (BN = 256): each step's A is read by half as many programs, so a step moves 48 KB of
codes for twice the products of a 128 x 128 tile's 32 KB. A consumer's 64 x 256 sum takes 128
registers per thread, so it computes a step as two 64 x 128 products, each promoted before the
next starts, and in the ping-pong (PIPE 3) the two consumers take turns at the tensor cores.
These tiles need TAIL "desc" and SCALES_TMA; their results leave through the same shared buffer
that holds a group's steps when it starts off 16 bytes (`_block_wgrad_tails`).

The promotion factors: stored as quantized, a step's scales lie one per row of a [rows, steps]
tensor, so each consumer's per-step loads touch a cache line per value. With SCALES_TMA the launch
stores them steps-major (one small copy per call, rows padded to 16 bytes), the producer loads
each step's 128 row scales and 128 column scales with the step's codes into the same stage, and
the consumers read them from shared memory straight into the MMA's row and column layouts.

A group's last step may be partial, and a group may start off 16 bytes: TAIL picks how such
steps read zeros past the group's end (`_block_wgrad_tails`).
"""
from __future__ import annotations

import torch

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.kernels._block_gemm_tl import kernel_info
from qmoe.kernels._block_wgrad_tails import TAILS
from qmoe.kernels._gluon_sm90 import gluon
from qmoe.kernels._launch import faking, num_sms

if gluon is not None:
    from qmoe.kernels._block_wgrad_tails import (TAIL_DESC, group_descs, landed, lead, tail_to_smem,
                                                  tma_steps)
    from qmoe.kernels._gluon_sm90 import fence_async_shared, gl, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def _tile_of(t, offs_ptr, per_group, num_m, num_n, GROUP_M: gl.constexpr):
        """Tile t -> (group, row tile, column tile, the group's first token, its token count)."""
        g = t // per_group
        local = t - g * per_group
        width = GROUP_M * num_n
        first_m = (local // width) * GROUP_M
        size_m = gl.minimum(num_m - first_m, GROUP_M)
        pm = first_m + (local % width) % size_m
        pn = (local % width) // size_m
        start = gl.load(offs_ptr + g).to(gl.int32)
        end = gl.load(offs_ptr + g + 1).to(gl.int32)
        return g, pm, pn, start, end - start

    @gluon.jit
    def _producer(a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, full, empty, offs_ptr,
                  soffs_a_ptr, soffs_b_ptr, a_ptr, b_ptr, total_tiles, per_group, num_m, num_n, N, K, stride_an,
                  stride_bk, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, TAIL: gl.constexpr, SCALES_TMA: gl.constexpr,
                  LEAD: gl.constexpr = 16):
        """One warp: TMA loads of every tile's 128-token steps into the stage ring (with
        SCALES_TMA, each step's row of both operands' step-major scales too); under TAIL_DESC a
        group's partial step through the group's own descriptors, two pairs in turn, and with
        LEAD > 16 every step of a group starting off LEAD tokens, from the boundary before it
        (`_block_wgrad_tails`)."""
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        s_nbytes: gl.constexpr = sa_desc.block_type.nbytes + sb_desc.block_type.nbytes if SCALES_TMA else 0
        it = 0
        ga0 = a_desc  # pair 0 and pair 1 of group descriptors (the operands' own until first made)
        gb0 = b_desc
        ga1 = a_desc
        gb1 = b_desc
        cur = -1  # the group the newer pair was made for
        pair = 1
        last0 = -1  # the last load through each pair
        last1 = -1
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, pm, pn, start, length = _tile_of(t, offs_ptr, per_group, num_m, num_n, GROUP_M)
            if SCALES_TMA:
                step_a = gl.load(soffs_a_ptr + g).to(gl.int32)
                step_b = gl.load(soffs_b_ptr + g).to(gl.int32)
            zeros = lead(start, length, TAIL, LEAD)
            nk = tma_steps(start, length, BK, TAIL, LEAD)
            if TAIL == TAIL_DESC and nk * BK > length and g != cur:  # a new group with a partial step or a lead
                pair = 1 - pair
                cur = g
                if pair == 0:
                    landed(full, last0, it, STAGES)
                    ga0, gb0 = group_descs(a_ptr, b_ptr, start, length, N, K, stride_an, stride_bk, a_desc,
                                            b_desc)
                else:
                    landed(full, last1, it, STAGES)
                    ga1, gb1 = group_descs(a_ptr, b_ptr, start, length, N, K, stride_an, stride_bk, a_desc,
                                            b_desc)
            for ki in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(full.index(s), nbytes + s_nbytes)
                if TAIL == TAIL_DESC and (zeros > 0 or (ki + 1) * BK > length):  # zeros before or past the group
                    if pair == 0:
                        sm90.tma_load(ga0, [pm * BM, ki * BK - zeros], full.index(s), a_bufs.index(s))
                        sm90.tma_load(gb0, [pn * BN, ki * BK - zeros], full.index(s), b_bufs.index(s))
                        last0 = it
                    else:
                        sm90.tma_load(ga1, [pm * BM, ki * BK - zeros], full.index(s), a_bufs.index(s))
                        sm90.tma_load(gb1, [pn * BN, ki * BK - zeros], full.index(s), b_bufs.index(s))
                        last1 = it
                else:
                    sm90.tma_load(a_desc, [pm * BM, start + ki * BK], full.index(s), a_bufs.index(s))
                    sm90.tma_load(b_desc, [pn * BN, start + ki * BK], full.index(s), b_bufs.index(s))
                if SCALES_TMA:
                    sm90.tma_load(sa_desc, [step_a + ki, pm * BM], full.index(s), sa_bufs.index(s))
                    sm90.tma_load(sb_desc, [step_b + ki, pn * BN], full.index(s), sb_bufs.index(s))
                it += 1

    @gluon.jit
    def _half_rows(pm, N, HALF: gl.constexpr, BM: gl.constexpr, row_l: gl.constexpr):
        """A consumer's output rows in row tile pm: the first, all of them, which lie inside N."""
        row0 = pm * BM + HALF * (BM // 2)
        rows = row0 + gl.arange(0, BM // 2, layout=row_l)
        return row0, rows, rows < N

    @gluon.jit
    def _factor(sa_tile, sb_tile, n_rows, n_cols, ki, s_stride_an, s_stride_at, s_stride_bk, s_stride_bt,
                HM: gl.constexpr, BN: gl.constexpr, row_l: gl.constexpr, col_l: gl.constexpr):
        """Step ki's promotion factors: a_scale[row, ki] and b_scale[col, ki] (zero past N, K).

        One base pointer per operand and 32-bit offsets keep addresses out of registers; the
        column scales are read one per thread, then spread over the MMA layout.
        """
        r = gl.arange(0, HM, layout=row_l)
        fa = gl.load(sa_tile + ki * s_stride_at + r * s_stride_an, mask=r < n_rows, other=0.0)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        c = gl.arange(0, BN, layout=one)
        fb = gl.load(sb_tile + ki * s_stride_bt + c * s_stride_bk, mask=c < n_cols, other=0.0)
        return fa, gl.convert_layout(fb, col_l)

    @gluon.jit
    def _promote(acc, p, fa, fb):
        return acc + p * (gl.expand_dims(fa, 1) * gl.expand_dims(fb, 0))

    @gluon.jit
    def _staged_factor(sa_rows, sb_rows, s, HALF: gl.constexpr, HM: gl.constexpr, row_l: gl.constexpr,
                       col_l: gl.constexpr):
        """Stage s's promotion factors from the scale rows the producer loaded with its codes (zero
        past N, K: TMA fills them)."""
        return sa_rows.index(s).slice(HALF * HM, HM).load(row_l), sb_rows.index(s).load(col_l)

    # PINGPONG: how the two consumers take turns at the tensor cores
    TURNS_NONE = gl.constexpr(0)
    TURNS_MBARRIER = gl.constexpr(1)  # the `turn` mbarrier pair

    @gluon.jit
    def _issue(a_s, b_s, zero, turn, u, HALF: gl.constexpr, PINGPONG: gl.constexpr):
        """Start the product a_s @ b_s^T of one step; when taking turns (PINGPONG) only after the
        other half started its product u - 1 (half 0 first), so the tensor cores hold one half's
        MMA while the other half promotes."""
        if PINGPONG == TURNS_MBARRIER:
            mbarrier.wait(turn.index(HALF), (u & 1) ^ (1 - HALF))
        tok = warpgroup_mma(a_s, b_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        if PINGPONG == TURNS_MBARRIER:
            mbarrier.arrive(turn.index(1 - HALF), count=1)
        return tok

    @gluon.jit
    def _own_free():
        """Before this consumer's threads write its own buffers: every warp is done with them (its part
        of the last MMA, and the wait for the last TMA store, which only the issuing thread makes)."""
        sm90.thread_barrier()

    @gluon.jit
    def _own_step(acc, a_mine, b_mine, zero, turn, u, sa_tile, sb_tile, n_rows, n_cols, ki, s_stride_an,
                  s_stride_at, s_stride_bk, s_stride_bt, HALF: gl.constexpr, PINGPONG: gl.constexpr, HM: gl.constexpr,
                  BN: gl.constexpr, row_l: gl.constexpr, col_l: gl.constexpr):
        """Step ki from this consumer's own buffers (just written by its threads, after `_own_free`):
        MMA, then promotion."""
        fence_async_shared()
        sm90.thread_barrier()  # every warp's part of the step is written before the MMA reads it
        tok = _issue(a_mine, b_mine, zero, turn, u, HALF, PINGPONG)
        fa, fb = _factor(sa_tile, sb_tile, n_rows, n_cols, ki, s_stride_an, s_stride_at, s_stride_bk, s_stride_bt,
                         HM, BN, row_l, col_l)
        p = warpgroup_mma_wait(0, deps=(tok, ))
        return _promote(acc, p, fa, fb)

    @gluon.jit
    def _store_result(acc, c_smem, c_desc, out_ptr, g, rows, row_ok, row0, col0, N, K, stride_og, stride_on,
                      HM: gl.constexpr, col_l: gl.constexpr, ACCUMULATE: gl.constexpr, TMA_OUT: gl.constexpr,
                      WAIT: gl.constexpr):
        """A [HM, W] block of out[g] at (row0, col0): with ACCUMULATE added to what out held (the
        Triton kernel's order: the new sum, then the old); through a TMA store from c_smem where
        it lies whole inside out[g] (WAIT: first wait for this partition's earlier stores, which
        may still read c_smem), else a masked store."""
        W: gl.constexpr = acc.shape[1]
        cols = col0 + gl.arange(0, W, layout=col_l)
        ptrs = (out_ptr + g.to(gl.int64) * stride_og + gl.expand_dims(rows.to(gl.int64) * stride_on, 1)
                + gl.expand_dims(cols, 0))
        mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < K, 0)
        if ACCUMULATE:
            acc = acc + gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)
        out = acc.to(out_ptr.dtype.element_ty)
        if TMA_OUT and row0 + HM <= N and col0 + W <= K:
            if WAIT:
                tma.store_wait(0)
            c_smem.store(out)
            fence_async_shared()
            sm90.tma_store(c_desc, [g * N + row0, col0], c_smem)
        else:
            gl.store(ptrs, out, mask=mask)

    @gluon.jit
    def _consumer(a_bufs, b_bufs, sa_rows, sb_rows, c_bufs, a_tail, b_tail, full, empty, turn, c_desc, a_ptr, b_ptr,
                  out_ptr, offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr, total_tiles, per_group, num_m, num_n,
                  N, K, stride_an, stride_bk, stride_og, stride_on, s_stride_an, s_stride_at, s_stride_bk,
                  s_stride_bt, HALF: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, PIPE: gl.constexpr,
                  ACCUMULATE: gl.constexpr, TMA_OUT: gl.constexpr, TAIL: gl.constexpr, SCALES_TMA: gl.constexpr):
        """One warpgroup: rows HALF*BM/2.. of each output tile; MMA per step, promotion, epilogue."""
        HM: gl.constexpr = BM // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        zero = gl.zeros([HM, BN], gl.float32, mma)
        a_mine = a_tail.index(HALF)
        b_mine = b_tail.index(HALF)
        it = 0
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, pm, pn, start, length = _tile_of(t, offs_ptr, per_group, num_m, num_n, GROUP_M)
            row0, rows, row_ok = _half_rows(pm, N, HALF, BM, row_l)
            col0 = pn * BN
            sa_tile = sa_ptr + row0.to(gl.int64) * s_stride_an + gl.load(soffs_a_ptr + g) * s_stride_at
            sb_tile = sb_ptr + col0.to(gl.int64) * s_stride_bk + gl.load(soffs_b_ptr + g) * s_stride_bt
            aligned = start % 16 == 0
            nk = tma_steps(start, length, BK, TAIL)
            acc = zero
            if PIPE == 0:  # promote each step after its MMA (the two consumers overlap each other)
                for ki in range(nk):
                    s = it % STAGES
                    mbarrier.wait(full.index(s), (it // STAGES) & 1)
                    tok = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                                        use_acc=False, is_async=True)
                    if SCALES_TMA:
                        fa, fb = _staged_factor(sa_rows, sb_rows, s, HALF, HM, row_l, col_l)
                    else:
                        fa, fb = _factor(sa_tile, sb_tile, N - row0, K - col0, ki, s_stride_an, s_stride_at,
                                         s_stride_bk, s_stride_bt, HM, BN, row_l, col_l)
                    p = warpgroup_mma_wait(0, deps=(tok, ))
                    acc = _promote(acc, p, fa, fb)
                    mbarrier.arrive(empty.index(s), count=1)
                    it += 1
            else:  # promote step i-1 while step i's MMA runs
                p = zero
                fa = gl.zeros([HM], gl.float32, row_l)
                fb = gl.zeros([BN], gl.float32, col_l)
                for ki in range(nk):
                    s = it % STAGES
                    mbarrier.wait(full.index(s), (it // STAGES) & 1)
                    tok = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), zero,
                                        use_acc=False, is_async=True)
                    acc = _promote(acc, p, fa, fb)
                    if SCALES_TMA:
                        fa, fb = _staged_factor(sa_rows, sb_rows, s, HALF, HM, row_l, col_l)
                    else:
                        fa, fb = _factor(sa_tile, sb_tile, N - row0, K - col0, ki, s_stride_an, s_stride_at,
                                         s_stride_bk, s_stride_bt, HM, BN, row_l, col_l)
                    p, acc = warpgroup_mma_wait(0, deps=(tok, acc))  # the promotion stays before the wait
                    mbarrier.arrive(empty.index(s), count=1)
                    it += 1
                acc = _promote(acc, p, fa, fb)
            if aligned:
                tail = length - nk * BK  # none left unless TAIL_LOADS
                if tail > 0:  # the group's partial last step: masked loads into this consumer's own buffers
                    t16 = (start // 16) * 16 + nk * BK  # visibly a multiple of 16 to the compiler: vector loads
                    _own_free()
                    tail_to_smem(a_ptr, a_mine, row0, N, t16, tail, stride_an, ld)
                    tail_to_smem(b_ptr, b_mine, col0, K, t16, tail, stride_bk, ld)
                    acc = _own_step(acc, a_mine, b_mine, zero, turn, 0, sa_tile, sb_tile, N - row0, K - col0, nk,
                                    s_stride_an, s_stride_at, s_stride_bk, s_stride_bt, HALF, TURNS_NONE, HM, BN, row_l,
                                    col_l)
            else:  # TMA cannot start off a 16-byte boundary: every step through masked byte loads
                for ki in range(gl.cdiv(length, BK)):
                    t0 = start + ki * BK
                    _own_free()
                    tail_to_smem(a_ptr, a_mine, row0, N, t0, length - ki * BK, stride_an, ld)
                    tail_to_smem(b_ptr, b_mine, col0, K, t0, length - ki * BK, stride_bk, ld)
                    acc = _own_step(acc, a_mine, b_mine, zero, turn, 0, sa_tile, sb_tile, N - row0, K - col0, ki,
                                    s_stride_an, s_stride_at, s_stride_bk, s_stride_bt, HALF, TURNS_NONE, HM, BN, row_l,
                                    col_l)
            _store_result(acc, c_bufs.index(HALF), c_desc, out_ptr, g, rows, row_ok, row0, col0, N, K, stride_og,
                          stride_on, HM, col_l, ACCUMULATE, TMA_OUT, True)
        if TMA_OUT:
            tma.store_wait(0)

    @gluon.jit
    def _consumer_wide(a_bufs, b_bufs, sa_rows, sb_rows, own, c_view, full, empty, turn, c_desc, a_ptr, b_ptr,
                       out_ptr, offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr, total_tiles, per_group, num_m,
                       num_n, N, K, stride_an, stride_bk, stride_og, stride_on, s_stride_an, s_stride_at, s_stride_bk,
                       s_stride_bt, HALF: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, PIPE: gl.constexpr,
                       ACCUMULATE: gl.constexpr, TMA_OUT: gl.constexpr, C_SLOTS: gl.constexpr):
        """BN = 2 * 128: rows HALF*BM/2.. of each output tile as two 128-column sums. A step's two
        products are each promoted before the next is started: the fp32 sums (128 registers per
        thread) leave room for one 64-register product and its column factors, not two. PIPE 3
        takes turns with the other half through mbarriers (`_issue`), PIPE 0 does not. Steps come
        through the TMA ring with their scale rows (TAIL_DESC, SCALES_TMA); a group starting off
        16 bytes goes through `own`, this half's 64 rows of A and 128 columns of B at a time,
        which also holds its results on their way to a TMA store (`c_view`, C_SLOTS 128-column
        blocks)."""
        HM: gl.constexpr = BM // 2
        SUB: gl.constexpr = BN // 2
        PINGPONG: gl.constexpr = TURNS_MBARRIER if PIPE == 3 else TURNS_NONE
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        zero = gl.zeros([HM, SUB], gl.float32, mma)
        a_mine = own.index(HALF).slice(0, HM)
        b_mine = own.index(HALF).slice(SUB, SUB)  # a slice starts at a multiple of its length
        c_mine = c_view.index(HALF)
        it = 0
        u = 0  # products started (two per step): the ping-pong's turn count
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, pm, pn, start, length = _tile_of(t, offs_ptr, per_group, num_m, num_n, GROUP_M)
            row0, rows, row_ok = _half_rows(pm, N, HALF, BM, row_l)
            col0 = pn * BN
            if start % 16 == 0:
                acc0 = zero
                acc1 = zero
                for ki in range(tma_steps(start, length, BK, TAIL_DESC)):
                    s = it % STAGES
                    mbarrier.wait(full.index(s), (it // STAGES) & 1)
                    a_s = a_bufs.index(s).slice(HALF * HM, HM)
                    tok = _issue(a_s, b_bufs.index(s).slice(0, SUB), zero, turn, u, HALF, PINGPONG)
                    fa = sa_rows.index(s).slice(HALF * HM, HM).load(row_l)
                    fb = sb_rows.index(s).slice(0, SUB).load(col_l)
                    p = warpgroup_mma_wait(0, deps=(tok, ))
                    acc0 = _promote(acc0, p, fa, fb)
                    tok = _issue(a_s, b_bufs.index(s).slice(SUB, SUB), zero, turn, u + 1, HALF, PINGPONG)
                    fb = sb_rows.index(s).slice(SUB, SUB).load(col_l)
                    p = warpgroup_mma_wait(0, deps=(tok, ))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc1 = _promote(acc1, p, fa, fb)
                    it += 1
                    u += 2
                _store_result(acc0, c_mine.slice(0, HM), c_desc, out_ptr, g, rows, row_ok, row0, col0, N, K,
                              stride_og, stride_on, HM, col_l, ACCUMULATE, TMA_OUT, True)
                _store_result(acc1, c_mine.slice((C_SLOTS - 1) * HM, HM), c_desc, out_ptr, g, rows, row_ok, row0,
                              col0 + SUB, N, K, stride_og, stride_on, HM, col_l, ACCUMULATE, TMA_OUT, C_SLOTS == 1)
            else:  # TMA cannot start off a 16-byte boundary: every step through masked byte loads, a half at a time
                sa_tile = sa_ptr + row0.to(gl.int64) * s_stride_an + gl.load(soffs_a_ptr + g) * s_stride_at
                sb_group = sb_ptr + gl.load(soffs_b_ptr + g) * s_stride_bt
                for h in gl.static_range(2):
                    sb_tile = sb_group + (col0 + h * SUB).to(gl.int64) * s_stride_bk
                    if TMA_OUT:
                        tma.store_wait(0)  # `own` may still feed this half's last TMA store
                    acc = zero
                    for ki in range(gl.cdiv(length, BK)):
                        t0 = start + ki * BK
                        _own_free()
                        tail_to_smem(a_ptr, a_mine, row0, N, t0, length - ki * BK, stride_an, ld)
                        tail_to_smem(b_ptr, b_mine, col0 + h * SUB, K, t0, length - ki * BK, stride_bk, ld)
                        acc = _own_step(acc, a_mine, b_mine, zero, turn, u, sa_tile, sb_tile, N - row0,
                                        K - col0 - h * SUB, ki, s_stride_an, s_stride_at, s_stride_bk, s_stride_bt,
                                        HALF, PINGPONG, HM, SUB, row_l, col_l)
                        u += 1
                    _store_result(acc, c_mine.slice(0, HM), c_desc, out_ptr, g, rows, row_ok, row0, col0 + h * SUB,
                                  N, K, stride_og, stride_on, HM, col_l, ACCUMULATE, TMA_OUT, True)
        if TMA_OUT:
            tma.store_wait(0)

    # sizes that only index are not specialised (one compile for every shape); the operands' row
    # strides are (multiples of 16, as TMA needs: the tail's loads are vectors)
    _SIZES = ["total_tiles", "per_group", "num_m", "num_n", "stride_og", "s_stride_an", "s_stride_bk"]

    @gluon.jit(do_not_specialize=_SIZES)
    def block_wgrad_ws_kernel(a_desc, b_desc, c_desc, sa_desc, sb_desc, a_ptr, b_ptr, out_ptr,
                              offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr, total_tiles, per_group, num_m, num_n,
                              N, K, stride_an, stride_bk, stride_og, stride_on,
                              s_stride_an, s_stride_at, s_stride_bk, s_stride_bt,
                              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                              STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, PIPE: gl.constexpr,
                              ACCUMULATE: gl.constexpr, TMA_OUT: gl.constexpr, TAIL: gl.constexpr,
                              SCALES_TMA: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """out[g] = A[:, tokens of g] @ B[:, tokens of g]^T (see k_grouped_gemm_kernel), FP8 block scaling.

        Partitions: the default one (4 warps) and a 4-warp worker consume the two 64-row halves of
        each tile; a 1-warp worker produces. `empty` counts both consumers' releases.
        """
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        # each stage's scale rows ([1, BM] and [1, BN] TMA boxes), read back as 1-d rows
        SR: gl.constexpr = STAGES if SCALES_TMA else 1
        sa_bufs = gl.allocate_shared_memory(gl.float32, [SR, 1, BM], sa_desc.layout)
        sb_bufs = gl.allocate_shared_memory(gl.float32, [SR, 1, BN], sb_desc.layout)
        rows_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # rank 1: .index() keeps it
        sa_rows = sm90.reinterpret(sa_bufs, gl.float32, [SR, BM], rows_l)
        sb_rows = sm90.reinterpret(sb_bufs, gl.float32, [SR, BN], rows_l)
        full, empty = sm90.stage_barriers(STAGES)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        if BN > 128:
            # per half: its 64 rows of A and 128 columns of B (a group off 16 bytes, rows 0 and 128 on),
            # or its results: 64 x 128 fp32 values fill 256 rows of 128 codes
            OWN_ROWS: gl.constexpr = (BM // 2) * (BN // 2) * 4 // BK
            own = gl.allocate_shared_memory(a_desc.dtype, [2, OWN_ROWS, BK], a_desc.layout)
            C_DTYPE: gl.constexpr = c_desc.dtype
            C_LAYOUT: gl.constexpr = c_desc.layout
            C_SLOTS: gl.constexpr = 2 if C_DTYPE.primitive_bitwidth <= 16 else 1
            c_view = sm90.reinterpret(own, C_DTYPE, [2, C_SLOTS * BM // 2, BN // 2], C_LAYOUT)
            gl.warp_specialize([
                (_consumer_wide, (a_bufs, b_bufs, sa_rows, sb_rows, own, c_view, full, empty, turn, c_desc, a_ptr,
                                  b_ptr, out_ptr, offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr, total_tiles,
                                  per_group, num_m, num_n, N, K, stride_an, stride_bk, stride_og, stride_on,
                                  s_stride_an, s_stride_at, s_stride_bk, s_stride_bt, 0, BM, BN, BK, GROUP_M, STAGES,
                                  NUM_PROGRAMS, PIPE, ACCUMULATE, TMA_OUT, C_SLOTS)),
                (_consumer_wide, (a_bufs, b_bufs, sa_rows, sb_rows, own, c_view, full, empty, turn, c_desc, a_ptr,
                                  b_ptr, out_ptr, offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr, total_tiles,
                                  per_group, num_m, num_n, N, K, stride_an, stride_bk, stride_og, stride_on,
                                  s_stride_an, s_stride_at, s_stride_bk, s_stride_bt, 1, BM, BN, BK, GROUP_M, STAGES,
                                  NUM_PROGRAMS, PIPE, ACCUMULATE, TMA_OUT, C_SLOTS)),
                (_producer, (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, full, empty,
                             offs_ptr, soffs_a_ptr, soffs_b_ptr, a_ptr, b_ptr, total_tiles, per_group, num_m, num_n,
                             N, K, stride_an, stride_bk, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS, TAIL, SCALES_TMA)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 if TMA_OUT else 1, BM // 2, BN], c_desc.layout)
            a_tail = gl.allocate_shared_memory(a_desc.dtype, [2, BM // 2, BK], a_desc.layout)
            b_tail = gl.allocate_shared_memory(b_desc.dtype, [2, BN, BK], b_desc.layout)
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, sa_rows, sb_rows, c_bufs, a_tail, b_tail, full, empty, turn, c_desc,
                             a_ptr, b_ptr, out_ptr, offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr, total_tiles,
                             per_group, num_m, num_n, N, K, stride_an, stride_bk, stride_og, stride_on, s_stride_an,
                             s_stride_at, s_stride_bk, s_stride_bt, 0, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS,
                             PIPE, ACCUMULATE, TMA_OUT, TAIL, SCALES_TMA)),
                (_consumer, (a_bufs, b_bufs, sa_rows, sb_rows, c_bufs, a_tail, b_tail, full, empty, turn, c_desc,
                             a_ptr, b_ptr, out_ptr, offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr, total_tiles,
                             per_group, num_m, num_n, N, K, stride_an, stride_bk, stride_og, stride_on, s_stride_an,
                             s_stride_at, s_stride_bk, s_stride_bt, 1, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS,
                             PIPE, ACCUMULATE, TMA_OUT, TAIL, SCALES_TMA)),
                (_producer, (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, full, empty,
                             offs_ptr, soffs_a_ptr, soffs_b_ptr, a_ptr, b_ptr, total_tiles, per_group, num_m, num_n,
                             N, K, stride_an, stride_bk, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS, TAIL, SCALES_TMA)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# What the k-grouped FP8 block GEMM dispatches to (launch_block_wgrad_ws's keywords): 128 x 256
# tiles in the ping-pong where the output's columns allow them (each step's A is read by half as
# many programs), else 128 x 128; the benchmark sweep (benchmarks/sweep_block_gemm.py --wgrad)
# times the other schedules against them.
DISPATCH_WIDE = dict(bn=256, pipe=3, stages=3, group_m=8, tail="desc", scales_tma=True, consumer_regs=240,
                     producer_regs=24)  # the registers: 240 for each consumer's two sums and product
DISPATCH = dict(bn=128, pipe=0, stages=4, group_m=8, tail="desc", scales_tma=True)
# Calls whose kernel failed to compile (a Triton without this Gluon API): they take the Triton kernel.
FAILED: dict[tuple, str] = {}


def _smem(stages: int, out_dtype, tma_out: bool, bn: int = 128) -> int:
    """Shared-memory bytes: the stage ring (codes and scale rows), the result buffers and each
    consumer's tail buffers (bn = 256: one buffer per consumer for both)."""
    ring = stages * (128 + bn) * (128 + 4)
    if bn > 128:
        return ring + 2 * 64 * 128 * 4
    c = (2 if tma_out else 1) * 64 * 128 * torch.finfo(out_dtype).bits // 8
    return ring + c + 2 * (64 + 128) * 128


def fit_stages(stages: int, out_dtype, tma_out: bool = True, bn: int = 128) -> int:
    """At most `stages` stages such that everything fits in sm90's shared memory."""
    while stages > 1 and _smem(stages, out_dtype, tma_out, bn) > sm90.SMEM_BYTES - sm90.SMEM_SPARE:
        stages -= 1
    return stages


def _tma_out(out: torch.Tensor, n: int, k: int, accumulate: bool) -> bool:
    """Whether results leave by TMA: a contiguous [G, N, K] output, 16-byte rows, no read-back."""
    return (not accumulate and out.is_contiguous() and (k * out.element_size()) % 16 == 0
            and out.data_ptr() % 16 == 0)


def unsupported(a, b, out: torch.Tensor) -> str | None:
    """Why the dispatched Gluon kernel cannot run this k-grouped BLOCK call (None: it can).

    It needs Gluon's Hopper API, an sm90 device, 1x128 token blocks on both operands with their
    group scale offsets, tokens contiguous and TMA-aligned, and a 16-bit or fp32 output.
    QMOE_BLOCK_GEMM=triton turns it off.
    """
    why = sm90.gluon_unavailable(a.data.device, sm90.BLOCK_GEMM_SWITCH)
    if why is not None:
        return why
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32) or out.stride(2) != 1:
        return f"output dtype {out.dtype}, strides {out.stride()} (contiguous rows needed)"
    if a.block != (1, 128) or b.block != (1, 128) or a.soffs is None or b.soffs is None:
        return f"blocks {a.block} x {b.block} (1x128 token blocks with group scale offsets)"
    if a.stride_k != 1 or b.stride_k != 1 or not (sm90.tma_aligned(a.data) and sm90.tma_aligned(b.data)):
        return "tokens not contiguous or rows not 16-byte aligned (TMA)"
    return None


def launch_dispatched(a, b, offsets, n: int, k: int, groups: int, out: torch.Tensor, accumulate: bool):
    """The dispatched configuration into `out`; None, launching nothing, where `unsupported` says
    so or its compile failed (recorded in FAILED, with a warning once): the caller then runs the
    Triton kernel."""
    if unsupported(a, b, out) is not None:
        return None
    cfg = dict(DISPATCH_WIDE if k % DISPATCH_WIDE["bn"] == 0 else DISPATCH)
    cfg["stages"] = fit_stages(cfg["stages"], out.dtype, _tma_out(out, n, k, accumulate), cfg["bn"])
    key = (out.dtype, accumulate, *sorted(cfg.items()))
    return sm90.launch_once(FAILED, key, "FP8 block wgrad GEMM",
                          lambda: launch_block_wgrad_ws(a, b, offsets, n, k, groups, out, accumulate, **cfg))


def launch_block_wgrad_ws(a, b, offsets: torch.Tensor, n: int, k: int, groups: int, out: torch.Tensor,
                          accumulate: bool = False, *, bn: int = 128, stages: int = 4, pipe: int = 0,
                          group_m: int = 8, tail: str = "loads", scales_tma: bool = False,
                          programs: int | None = None, consumer_regs: int = 232, producer_regs: int = 40,
                          info: dict | None = None) -> torch.Tensor:
    """out [groups, n, k] (+= with accumulate) of the FP8 block k-grouped GEMM; a [n, T], b [k, T]:
    grouped_gemm._Operand (BLOCK scaling, 1x128 token blocks). Host-sync-free: the grid is the SM
    count, the tile count depends on host sizes only."""
    if gluon is None:
        raise RuntimeError(sm90.GLUON_ERROR)
    if a.block != (1, 128) or b.block != (1, 128) or a.stride_k != 1 or b.stride_k != 1:
        raise ValueError(f"the TMA block wgrad needs 1x128 token blocks and contiguous tokens "
                         f"(blocks {a.block} x {b.block}, token strides {a.stride_k}, {b.stride_k})")
    if bn == 128 and (pipe not in (0, 1) or tail not in TAILS):
        raise ValueError(f"pipe={pipe}, tail={tail!r}: 128-column tiles take pipe 0 or 1 and a tail in "
                         f"{sorted(TAILS)}")
    if bn == 256 and (pipe not in (0, 3) or tail != "desc" or not scales_tma):
        raise ValueError(f"pipe={pipe}, tail={tail!r}, scales_tma={scales_tma}: 256-column tiles take pipe 0 or 3, "
                         f"tail 'desc' and scales_tma=True")
    if bn not in (128, 256):
        raise ValueError(f"bn={bn}: the wgrad kernel's tiles are 128 or 256 columns wide")
    tma_out = _tma_out(out, n, k, accumulate)
    if fit_stages(stages, out.dtype, tma_out, bn) < stages:
        raise ValueError(f"{stages} stages with {out.dtype} results exceed shared memory: take fit_stages(...)")
    if n == 0 or k == 0 or groups == 0 or faking():
        return out
    num_m, num_n = -(-n // 128), -(-k // bn)
    per_group = num_m * num_n
    if programs is None:
        programs = num_sms(a.data.device)
    flat = out.view(groups * n, k) if tma_out else out.new_empty((64, 128))  # a stand-in the kernel never stores to
    if scales_tma:  # steps-major (a step's scales: one TMA box); the kernel's own loads take these strides
        (sa, sa_desc), (sb, sb_desc) = sm90.steps_major_scales(a.scale), sm90.steps_major_scales(b.scale, bn)
        s_strides = (1, sa.stride(0), 1, sb.stride(0))
    else:
        sa, sb = a.scale, b.scale
        sa_desc, sb_desc = sm90.stand_in_scale_desc(out), sm90.stand_in_scale_desc(out, bn)
        s_strides = (a.s_stride_r, a.s_stride_k, b.s_stride_r, b.s_stride_k)
    compiled = sm90.with_scratch(a.data.device, lambda: block_wgrad_ws_kernel[(programs,)](
        sm90.desc(a.data, [128, 128]), sm90.desc(b.data, [bn, 128]), sm90.desc(flat, [64, 128]), sa_desc, sb_desc,
        a.data.view(torch.uint8), b.data.view(torch.uint8), out,
        offsets, sa, sb, a.soffs, b.soffs, groups * per_group, per_group, num_m, num_n, n, k,
        a.stride_r, b.stride_r, out.stride(0), out.stride(1), *s_strides,
        BM=128, BN=bn, BK=128, GROUP_M=group_m, STAGES=stages, NUM_PROGRAMS=programs, PIPE=pipe,
        ACCUMULATE=accumulate, TMA_OUT=tma_out, TAIL=TAILS[tail], SCALES_TMA=scales_tma, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, num_warps=4))  # the device-made descriptors (tail="desc") live in its scratch
    kernel_info(compiled, info)
    return out
