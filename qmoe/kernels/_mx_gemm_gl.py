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

Two routes per tile, both exact. The f16 route converts each code pair with one instruction
(E4M3 -> f16) and multiplies it by one f16 power of two per row and block, 2^(e - 127 - r), where
r is the row's offset (mx_row_offsets, a pre-pass over the scale bytes); the accumulator gets
2^(r_a + r_b) back in the epilogue. A tile with any row the f16 range cannot hold exactly takes
the bf16 route (float conversion, multiply, round). ws_regs selects a warp-specialised schedule
(the block GEMM's TMA producer warp, two consumer warpgroups sharing the B conversion).

Tiles walk the groups exactly as the block GEMM (`_block_gemm_ws`): device offsets, persistent
programs, the same swizzle. K-steps of consecutive tiles form one stream, so loads run ahead
across tile boundaries. Rows past a group's end are loaded and never stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.kernels import _block_gemm_ws as ws
from qmoe.kernels._block_gemm_tl import _store, b_group_offsets, kernel_info
from qmoe.kernels._grouped_gemm_jit import _e8m0_to_float
from qmoe.kernels._launch import faking, num_sms

# Row offsets of the f16 route. A row's E8M0 bytes e (one per 32-wide block along K) become f16
# factors 2^(e - 127 - r): exact for every E4M3 code when e - 127 - r lies in [-15, 7]; with
# r = max(e) - 134 that holds for blocks within 22 binades of the row's largest. The accumulator
# gets 2^(r_a + r_b) back in fp32, so r stays in [-63, 63]. A row with only zero blocks (byte 0:
# the quantizer's all-zero block) takes r = 0 and its codes count as zeros.
R_MAX = tl.constexpr(63)
R_ROW_SPAN = tl.constexpr(22)
NOT_F16 = tl.constexpr(1 << 20)  # a row the f16 route cannot take exactly: its tile takes the bf16 route


@triton.jit
def mx_row_offsets_kernel(s_ptr, out_ptr, rows, inner, kb, s_stride_outer, s_stride_inner, s_stride_k,
                          BR: tl.constexpr, BKB: tl.constexpr):
    """out[row] = r of the row (see above) or NOT_F16; row = o * inner + i has its bytes at
    s_ptr + o * s_stride_outer + i * s_stride_inner + blk * s_stride_k."""
    row = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = row < rows
    base = s_ptr + (row // inner).to(tl.int64) * s_stride_outer + (row % inner).to(tl.int64) * s_stride_inner
    hi = tl.zeros([BR], tl.int32)
    lo = tl.full([BR], 255, tl.int32)
    for k0 in range(0, kb, BKB):
        blk = k0 + tl.arange(0, BKB)
        m = ok[:, None] & (blk < kb)[None, :]
        e = tl.load(base[:, None] + blk[None, :].to(tl.int64) * s_stride_k, mask=m, other=0).to(tl.int32)
        hi = tl.maximum(hi, tl.max(e, 1))
        lo = tl.minimum(lo, tl.min(tl.where(m, e, 255), 1))
    r = hi - (127 + 7)
    fits = (hi < 255) & (r >= -R_MAX) & (r <= R_MAX) & (lo >= hi - R_ROW_SPAN)
    tl.store(out_ptr + row, tl.where(hi == 0, 0, tl.where(fits, r, NOT_F16)), mask=ok)


def mx_row_offsets(scale: torch.Tensor, outer: int, inner: int, kb: int, s_stride_outer: int, s_stride_inner: int,
                   s_stride_k: int) -> torch.Tensor:
    """int32 [outer * inner] row offsets (mx_row_offsets_kernel) of an E8M0 scale tensor."""
    rows = outer * inner
    out = torch.empty(rows, dtype=torch.int32, device=scale.device)
    if rows and not faking():
        mx_row_offsets_kernel[(triton.cdiv(rows, 64),)](scale, out, rows, max(inner, 1), kb, s_stride_outer,
                                                        s_stride_inner, s_stride_k, BR=64, BKB=32)
    return out


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
    def _scale_pairs(s_rows, row_ok, kb0, s_stride_k, layout: gl.constexpr):
        """_scales as one [R, 2] tensor in `layout` (s_rows, row_ok in its SliceLayout(1))."""
        blk = gl.expand_dims(kb0 + gl.arange(0, 2, layout=gl.SliceLayout(0, layout)), 0)
        ptrs = gl.expand_dims(s_rows, 1) + blk * s_stride_k
        return gl.load(ptrs, mask=gl.expand_dims(row_ok, 1) & (blk >= 0), other=127).to(gl.int32)

    @gluon.jit
    def _f16_factor(e, r):
        """f16 2^(e - 127 - r) (e - 127 - r <= 7 by the choice of r; below 2^-24: zero)."""
        d = e - 127 - r
        bits = gl.where(d >= -14, (d + 15) << 10, gl.where(d >= -24, 1 << gl.maximum(d + 24, 0), 0))
        return bits.to(gl.int16).to(gl.float16, bitcast=True)

    @gluon.jit
    def _exact(q, e, r, F16: gl.constexpr):
        """The MMA operand of FP8 codes q [R, 32] (one E8M0 block along K, bytes e per row): on the
        f16 route 2^-r times their values, else their bf16 values (both exact)."""
        if F16:
            return q.to(gl.float16) * gl.expand_dims(_f16_factor(e, r), 1)
        else:
            return (q.to(gl.float32) * gl.expand_dims(_e8m0_to_float(e), 1)).to(gl.bfloat16)

    @gluon.jit
    def _exact_pairs(q, e, r, F16: gl.constexpr, pairs_l: gl.constexpr):
        """_exact of codes q [R, 64] whose two blocks have bytes e [R, 2] (in SliceLayout(2, pairs_l)):
        the blocks become a middle axis of length 2, so each thread's elements share one factor."""
        R: gl.constexpr = q.shape[0]
        q = gl.convert_layout(gl.reshape(q, [R, 2, 32]), pairs_l)
        if F16:
            x = q.to(gl.float16) * gl.expand_dims(_f16_factor(e, gl.expand_dims(r, 1)), 2)
        else:
            x = (q.to(gl.float32) * gl.expand_dims(_e8m0_to_float(e), 2)).to(gl.bfloat16)
        return gl.reshape(x, [R, 64])

    @gluon.jit
    def _step(j, ki, acc, a_prev, t, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, b16_bufs, ready,
              gi, starts, ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols,
              a_srows, a_ok, b_srows, b_ok, s_stride_ak, s_stride_bk, ea, eb, ra, rb, a_l: gl.constexpr,
              b_l: gl.constexpr, pairs_l: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, F16: gl.constexpr):
        """Step j (K-step ki of its tile): make its operands exact in 16 bits, one 32-wide E8M0 block
        at a time (B into shared buffer j % 3, A into registers), issue their MMAs, refill stage
        j % STAGES with step j + STAGES (t: the TMA coordinates of that step's tile). a_prev, the
        previous step's register operands, stay alive until the wait that retires their MMAs. ea, eb:
        this step's scale bytes, loaded a step ahead (their latency hides behind this step); returns
        the next step's."""
        ki_next = gl.minimum(ki + 1, nk - 1)
        ea_next = _scales(a_srows, a_ok, ki_next * 2, s_stride_ak)
        eb_next = _scale_pairs(b_srows, b_ok, ki_next * 2, s_stride_bk, gl.SliceLayout(2, pairs_l))
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        a_st = a_bufs.index(s)
        b16 = b16_bufs.index(j % 3)
        b16.store(_exact_pairs(b_bufs.index(s).load(b_l), eb, rb, F16, pairs_l))
        a0 = _exact(a_st.slice(0, 32, 1).load(a_l), ea[0], ra, F16)
        a1 = _exact(a_st.slice(32, 32, 1).load(a_l), ea[1], ra, F16)
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
        acc = warpgroup_mma(a0, b16.slice(0, 32, 1).permute((1, 0)), acc, use_acc=ki > 0, is_async=True)
        acc = warpgroup_mma(a1, b16.slice(32, 32, 1).permute((1, 0)), acc, is_async=True)
        acc, p0, p1 = warpgroup_mma_wait(2, deps=(acc, a_prev[0], a_prev[1]))
        return acc, (a0, a1), (t_row0, t_brow, t_bcol), ea_next, eb_next

    @gluon.jit
    def _tile(j, t, acc, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, b16_bufs, ready,
              gi, starts, ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols,
              a_srows, a_ok, b_srows, b_ok, s_stride_ak, s_stride_bk, ra, rb, a_l: gl.constexpr,
              b_l: gl.constexpr, pairs_l: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, F16: gl.constexpr):
        """One tile's K loop on one route, two steps per trip (their register operands alternate
        between two sets); returns the retired accumulator and the stream position after it."""
        dtype: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        if F16:
            bufs = b16_bufs
        else:
            bufs = b16_bufs._reinterpret(dtype, [3, BN, BK], b16_bufs.layout)
        a_prev = (gl.zeros([BM, 32], dtype, a_l), gl.zeros([BM, 32], dtype, a_l))
        ea = _scales(a_srows, a_ok, 0, s_stride_ak)
        eb = _scale_pairs(b_srows, b_ok, 0, s_stride_bk, gl.SliceLayout(2, pairs_l))
        for kp in range(0, nk, 2):
            acc, a_prev, t, ea, eb = _step(
                j, kp, acc, a_prev, t, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, bufs, ready, gi, starts,
                ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols, a_srows, a_ok, b_srows,
                b_ok, s_stride_ak, s_stride_bk, ea, eb, ra, rb, a_l, b_l, pairs_l, BM, BN, BK, GROUP_M, STAGES,
                NUM_PROGRAMS, F16)
            acc, a_prev, t, ea, eb = _step(
                j + 1, kp + 1, acc, a_prev, t, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, bufs, ready, gi,
                starts, ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols, a_srows, a_ok,
                b_srows, b_ok, s_stride_ak, s_stride_bk, ea, eb, ra, rb, a_l, b_l, pairs_l, BM, BN, BK, GROUP_M, STAGES,
                NUM_PROGRAMS, F16)
            j += 2
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        return acc, j, t

    # sizes and strides that only index are not specialised (one compile for every shape)
    _SIZES = ["total_rows", "K", "num_groups", "b_group_rows", "b_group_cols", "s_stride_am",
              "s_stride_bn", "sb_group_stride"]

    @gluon.jit(do_not_specialize=_SIZES)
    def mx_gemm_kernel(a_desc, b_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr, ra_ptr, rb_ptr,
                       total_rows, N, K, num_groups, b_group_rows, b_group_cols, stride_om,
                       s_stride_am, s_stride_ak, s_stride_bn, s_stride_bk, sb_group_stride,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                       GP: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
        """out[T, N] = dequant(A_g) @ dequant(B_g)^T per group, MXFP8 codes and E8M0 scales (uint8).

        a_desc: [T, K] codes, blocks [BM, BK]; b_desc: B's 2-D codes, blocks [BN, BK], group g's B
        g * b_group_rows rows down and g * b_group_cols columns in; K % (2 * BK) == 0 (two steps per
        loop trip). ra_ptr [T], rb_ptr [G * N]: the rows' offsets (mx_row_offsets).
        """
        WARPS: gl.constexpr = gl.num_warps()
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BN, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
        pairs_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 2, 2], [WARPS, 1, 1], [2, 1, 0])  # b_l as [BN, 2, 32]
        brow_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, pairs_l))
        b16_bufs = gl.allocate_shared_memory(gl.float16, [3, BN, BK],
                                             gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float16))
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
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
        j = zero
        for tile in range(pid, total_tiles, NUM_PROGRAMS):
            g, m_start, m_end, pm, pn = ws._locate(tile, gi, starts, ends, tiles, tile_end, num_n, BM, GROUP_M)
            row0 = m_start + pm * BM
            gb = gl.minimum(g, num_groups - 1)
            a_rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, a_l))
            a_srows = sa_ptr + a_rows.to(gl.int64) * s_stride_am
            a_ok = a_rows < m_end
            ra = gl.load(ra_ptr + a_rows, mask=a_ok, other=0)
            b_rows = pn * BN + gl.arange(0, BN, layout=brow_l)
            b_srows = sb_ptr + gb.to(gl.int64) * sb_group_stride + b_rows.to(gl.int64) * s_stride_bn
            b_ok = b_rows < N
            rb = gl.load(rb_ptr + gb * N + b_rows, mask=b_ok, other=0)
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
            cols = pn * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            rows_ok = rows < m_end
            if (gl.max(ra, 0) < NOT_F16) & (gl.max(rb, 0) < NOT_F16):
                acc, j, t = _tile(j, t, acc, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, b16_bufs, ready, gi,
                                  starts, ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols,
                                  a_srows, a_ok, b_srows, b_ok, s_stride_ak, s_stride_bk, ra, rb, a_l, b_l, pairs_l,
                                  BM, BN,
                                  BK, GROUP_M, STAGES, NUM_PROGRAMS, True)
                # the f16 route's accumulator is 2^-(r_a + r_b) times the product: give the power back
                back = (gl.expand_dims(gl.load(ra_ptr + rows, mask=rows_ok, other=0), 1)
                        + gl.expand_dims(gl.load(rb_ptr + gb * N + cols, mask=cols < N, other=0), 0))
                acc = acc * ((back + 127) << 23).to(gl.float32, bitcast=True)
            else:
                acc, j, t = _tile(j, t, acc, nk, steps, pid, a_desc, b_desc, a_bufs, b_bufs, b16_bufs, ready, gi,
                                  starts, ends, tiles, tile_end, num_n, num_groups, b_group_rows, b_group_cols,
                                  a_srows, a_ok, b_srows, b_ok, s_stride_ak, s_stride_bk, ra, rb, a_l, b_l, pairs_l,
                                  BM, BN,
                                  BK, GROUP_M, STAGES, NUM_PROGRAMS, False)
            _store(out_ptr, gl.where(g < num_groups, acc, 0.0), rows, rows_ok, cols, N, stride_om)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


    @gluon.jit
    def _ws_step(j, ki, acc, a_prev, a_bufs, b_bufs, b16_bufs, full, empty, b16_ready, a_srows, a_ok, b_srows, b_ok,
                 s_stride_ak, s_stride_bk, ea, eb, ra, rb, nk, a_l: gl.constexpr, b_l: gl.constexpr,
                 pairs_l: gl.constexpr, HALF: gl.constexpr, HM: gl.constexpr, HN: gl.constexpr,
                 STAGES: gl.constexpr, F16: gl.constexpr):
        """One consumer's step j: its B half into b16 buffer j % 3 and its A rows into registers,
        release the stage, wait for the other consumer's B half, issue the MMAs (see _step)."""
        ki_next = gl.minimum(ki + 1, nk - 1)
        ea_next = _scales(a_srows, a_ok, ki_next * 2, s_stride_ak)
        eb_next = _scale_pairs(b_srows, b_ok, ki_next * 2, s_stride_bk, gl.SliceLayout(2, pairs_l))
        s = j % STAGES
        mbarrier.wait(full.index(s), (j // STAGES) & 1)
        a_st = a_bufs.index(s).slice(HALF * HM, HM)
        b16 = b16_bufs.index(j % 3)
        b16.slice(HALF * HN, HN).store(_exact_pairs(b_bufs.index(s).slice(HALF * HN, HN).load(b_l), eb, rb, F16,
                                                    pairs_l))
        a0 = _exact(a_st.slice(0, 32, 1).load(a_l), ea[0], ra, F16)
        a1 = _exact(a_st.slice(32, 32, 1).load(a_l), ea[1], ra, F16)
        fence_async_shared()
        gl.thread_barrier()  # this consumer's B half is written, its reads of stage s are done
        mbarrier.arrive(empty.index(s), count=1)
        mbarrier.arrive(b16_ready.index(j % 3), count=1)
        mbarrier.wait(b16_ready.index(j % 3), (j // 3) & 1)
        acc = warpgroup_mma(a0, b16.slice(0, 32, 1).permute((1, 0)), acc, use_acc=ki > 0, is_async=True)
        acc = warpgroup_mma(a1, b16.slice(32, 32, 1).permute((1, 0)), acc, is_async=True)
        acc, p0, p1 = warpgroup_mma_wait(2, deps=(acc, a_prev[0], a_prev[1]))
        return acc, (a0, a1), ea_next, eb_next

    @gluon.jit
    def _ws_tile(j, acc, nk, a_bufs, b_bufs, b16_bufs, full, empty, b16_ready, a_srows, a_ok, b_srows, b_ok,
                 s_stride_ak, s_stride_bk, ra, rb, a_l: gl.constexpr, b_l: gl.constexpr, pairs_l: gl.constexpr,
                 HALF: gl.constexpr, HM: gl.constexpr, HN: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr, F16: gl.constexpr):
        """One consumer's K loop of a tile on one route, two steps per trip."""
        dtype: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        if F16:
            bufs = b16_bufs
        else:
            bufs = b16_bufs._reinterpret(dtype, [3, BN, BK], b16_bufs.layout)
        a_prev = (gl.zeros([HM, 32], dtype, a_l), gl.zeros([HM, 32], dtype, a_l))
        ea = _scales(a_srows, a_ok, 0, s_stride_ak)
        eb = _scale_pairs(b_srows, b_ok, 0, s_stride_bk, gl.SliceLayout(2, pairs_l))
        for kp in range(0, nk, 2):
            acc, a_prev, ea, eb = _ws_step(j, kp, acc, a_prev, a_bufs, b_bufs, bufs, full, empty, b16_ready, a_srows,
                                           a_ok, b_srows, b_ok, s_stride_ak, s_stride_bk, ea, eb, ra, rb, nk, a_l,
                                           b_l, pairs_l, HALF, HM, HN, STAGES, F16)
            acc, a_prev, ea, eb = _ws_step(j + 1, kp + 1, acc, a_prev, a_bufs, b_bufs, bufs, full, empty, b16_ready,
                                           a_srows, a_ok, b_srows, b_ok, s_stride_ak, s_stride_bk, ea, eb, ra, rb, nk,
                                           a_l, b_l, pairs_l, HALF, HM, HN, STAGES, F16)
            j += 2
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        return acc, j

    @gluon.jit
    def _ws_consumer(a_bufs, b_bufs, b16_bufs, full, empty, b16_ready, out_ptr, offs_ptr, sa_ptr, sb_ptr, ra_ptr,
                     rb_ptr, total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak, s_stride_bn,
                     s_stride_bk, sb_group_stride, HALF: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                     BK: gl.constexpr, GROUP_M: gl.constexpr, GP: gl.constexpr, STAGES: gl.constexpr,
                     NUM_PROGRAMS: gl.constexpr):
        """One warpgroup: rows HALF * BM / 2.. of each tile against all BN columns; it makes rows
        HALF * BN / 2.. of the shared 16-bit B exact, the other consumer the rest."""
        HM: gl.constexpr = BM // 2
        HN: gl.constexpr = BN // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        pairs_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 2, 2], [4, 1, 1], [2, 1, 0])  # b_l as [HN, 2, 32]
        brow_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, pairs_l))
        tile_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        num_n = gl.cdiv(N, BN)
        gi, starts, ends, tiles, tile_end = ws._group_table(offs_ptr, total_rows, num_groups, num_n, BM, GP, 4)
        total_tiles = gl.sum(tiles, 0)
        acc = gl.zeros([HM, BN], gl.float32, mma)
        j = 0
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, m_start, m_end, pm, pn = ws._locate(t, gi, starts, ends, tiles, tile_end, num_n, BM, GROUP_M)
            gb = gl.minimum(g, num_groups - 1)
            nk = gl.where(g < num_groups, K // BK, 0)  # the producer loads nothing for rows past the last group
            tile_row0 = m_start + pm * BM
            row0 = tile_row0 + HALF * HM
            a_rows = row0 + gl.arange(0, HM, layout=gl.SliceLayout(1, a_l))
            a_ok = a_rows < m_end
            a_srows = sa_ptr + a_rows.to(gl.int64) * s_stride_am
            ra = gl.load(ra_ptr + a_rows, mask=a_ok, other=0)
            b_rows = pn * BN + HALF * HN + gl.arange(0, HN, layout=brow_l)
            b_ok = b_rows < N
            b_srows = sb_ptr + gb.to(gl.int64) * sb_group_stride + b_rows.to(gl.int64) * s_stride_bn
            rb = gl.load(rb_ptr + gb * N + b_rows, mask=b_ok, other=0)
            # the tile's route, the same in both consumers (they share B): every row of A and B
            ta = tile_row0 + gl.arange(0, BM, layout=tile_l)
            tb = pn * BN + gl.arange(0, BN, layout=tile_l)
            worst = gl.maximum(gl.max(gl.load(ra_ptr + ta, mask=ta < m_end, other=0), 0),
                               gl.max(gl.load(rb_ptr + gb * N + tb, mask=tb < N, other=0), 0))
            rows = row0 + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
            cols = pn * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            rows_ok = rows < m_end
            if worst < NOT_F16:
                acc, j = _ws_tile(j, acc, nk, a_bufs, b_bufs, b16_bufs, full, empty, b16_ready, a_srows, a_ok,
                                  b_srows, b_ok, s_stride_ak, s_stride_bk, ra, rb, a_l, b_l, pairs_l, HALF, HM, HN,
                                  BN, BK, STAGES, True)
                back = (gl.expand_dims(gl.load(ra_ptr + rows, mask=rows_ok, other=0), 1)
                        + gl.expand_dims(gl.load(rb_ptr + gb * N + cols, mask=cols < N, other=0), 0))
                acc = acc * ((back + 127) << 23).to(gl.float32, bitcast=True)
            else:
                acc, j = _ws_tile(j, acc, nk, a_bufs, b_bufs, b16_bufs, full, empty, b16_ready, a_srows, a_ok,
                                  b_srows, b_ok, s_stride_ak, s_stride_bk, ra, rb, a_l, b_l, pairs_l, HALF, HM, HN,
                                  BN, BK, STAGES, False)
            _store(out_ptr, gl.where(g < num_groups, acc, 0.0), rows, rows_ok, cols, N, stride_om)

    @gluon.jit(do_not_specialize=_SIZES)
    def mx_gemm_ws_kernel(a_desc, b_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr, ra_ptr, rb_ptr,
                          total_rows, N, K, num_groups, b_group_rows, b_group_cols, stride_om,
                          s_stride_am, s_stride_ak, s_stride_bn, s_stride_bk, sb_group_stride,
                          BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                          GP: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """mx_gemm_kernel with warp specialisation: one warp loads (the block GEMM's producer), two
        consumer warpgroups take a tile's two row halves and each makes half of its B exact."""
        b16_bufs = gl.allocate_shared_memory(gl.float16, [3, BN, BK],
                                             gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float16))
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        b16_ready = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(3):
            mbarrier.init(b16_ready.index(i), count=2)
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_bufs, b16_bufs, full, empty, b16_ready, out_ptr, offs_ptr, sa_ptr, sb_ptr,
                            ra_ptr, rb_ptr, total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak,
                            s_stride_bn, s_stride_bk, sb_group_stride, 0, BM, BN, BK, GROUP_M, GP, STAGES,
                            NUM_PROGRAMS)),
            (_ws_consumer, (a_bufs, b_bufs, b16_bufs, full, empty, b16_ready, out_ptr, offs_ptr, sa_ptr, sb_ptr,
                            ra_ptr, rb_ptr, total_rows, N, K, num_groups, stride_om, s_stride_am, s_stride_ak,
                            s_stride_bn, s_stride_bk, sb_group_stride, 1, BM, BN, BK, GROUP_M, GP, STAGES,
                            NUM_PROGRAMS)),
            (ws._producer, (a_desc, b_desc, a_bufs, b_bufs, full, empty, offs_ptr, total_rows, N, K, num_groups,
                            b_group_rows, b_group_cols, BM, BN, BK, GROUP_M, GP, STAGES, NUM_PROGRAMS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _smem(bm: int, bn: int, bk: int, stages: int) -> int:
    return stages * (bm + bn) * bk + 3 * bn * bk * 2


def launch_mx_gemm(a, b, offsets: torch.Tensor, total_rows: int, n_out: int, k: int, groups: int,
                   out_dtype=torch.bfloat16, *, b_columnwise: bool = False, bm: int = 128, bn: int = 256,
                   bk: int = 64, stages: int = 4, warps: int = 8, group_m: int = 8, programs: int | None = None,
                   f16: bool = True, ws_regs: tuple[int, int] | None = None, info: dict | None = None) -> torch.Tensor:
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
    ra = mx_row_offsets(a.scale, 1, total_rows, k // 32, 0, a.s_stride_r, a.s_stride_k)
    rb = mx_row_offsets(b.scale, groups, n_out, k // 32, b.s_group_stride, b.s_stride_r, b.s_stride_k)
    if not f16:
        ra.fill_(NOT_F16.value)
    args = (ws._desc(a.data, [bm, bk]), ws._desc(b.data, [bn, bk]), out, offsets, a.scale, b.scale, ra, rb,
            total_rows, n_out, k, groups, g_rows, g_cols, out.stride(0),
            a.s_stride_r, a.s_stride_k, b.s_stride_r, b.s_stride_k, b.s_group_stride)
    meta = dict(BM=bm, BN=bn, BK=bk, GROUP_M=group_m, GP=triton.next_power_of_2(groups + 1), STAGES=stages,
                NUM_PROGRAMS=programs)
    if ws_regs is None:
        compiled = mx_gemm_kernel[(programs,)](*args, **meta, num_warps=warps)
    else:
        compiled = mx_gemm_ws_kernel[(programs,)](*args, **meta, CONSUMER_REGS=ws_regs[0],
                                                  PRODUCER_REGS=ws_regs[1], num_warps=4)
    kernel_info(compiled, info)
    return out
