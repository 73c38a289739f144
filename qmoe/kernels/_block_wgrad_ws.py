"""FP8 block-scaled k-grouped GEMM (wgrad: dW_g = dy_g^T x_g, both operands 1x128-scaled along
tokens) with warp specialisation, in Triton's Gluon dialect (private helper beside
`qmoe/kernels/_block_gemm_ws.py`; not dispatched: benchmarks/sweep_block_gemm.py times it
against `k_grouped_gemm_kernel`).

Same contract and bits as `k_grouped_gemm_kernel` under BLOCK scaling: each 128-token step of a
group is multiplied by the tensor cores from zero and promoted as
`acc + p * (sa[row, step] * sb[col, step])` (the factor an outer product of the two operands'
scales, then one FMA per element), steps in order; an expert without tokens gets zeros (or
keeps `out` when accumulating).

Structure as in `_block_gemm_ws.py`: a 1-warp producer TMA-loads the [BM, 128] and [BN, 128]
token slices of the two columnwise operands ([N, T] and [K, T]) into a ring of stages; two
4-warp consumers each own 64 rows of the [BM, BN] tile, persistent over all groups' tiles.
TMA reads whole 128-token boxes, so a group's last step also holds the next group's first
tokens: there each consumer zeroes those columns of its own rows of A in place and copies B
with them zeroed into a buffer of its own, so no consumer waits for the other. The bf16 result
of a tile inside the group's rows leaves through a TMA store; fp32, accumulation and edge
tiles through masked stores.

PIPE 0: each consumer promotes a step after its MMA (the two consumers overlap each other);
PIPE 3: the same with a strict ping-pong of the two consumers' MMAs (an mbarrier pair).
"""
from __future__ import annotations

import torch

from qmoe.kernels import _block_gemm_ws as ws
from qmoe.kernels._block_gemm_tl import kernel_info
from qmoe.kernels._launch import faking

gluon = ws.gluon

if gluon is not None:
    from qmoe.kernels._block_gemm_ws import (_tma_load, _tma_store, fence_async_shared, gl, mbarrier, tma,
                                             warpgroup_mma, warpgroup_mma_wait)

    @gluon.jit
    def _wg_tile(t, num_m, num_n, GROUP_M: gl.constexpr):
        """Tile t of the static walk over groups -> (group, row tile, column tile)."""
        per_group = num_m * num_n
        g = t // per_group
        local = t % per_group
        width = GROUP_M * num_n
        first_m = (local // width) * GROUP_M
        size_m = gl.minimum(num_m - first_m, GROUP_M)
        return g, first_m + (local % width) % size_m, (local % width) // size_m

    @gluon.jit
    def _wg_producer(a_desc, b_desc, a_bufs, b_bufs, full, empty, offs_ptr, N, K, num_groups,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
        """One warp: TMA loads of every tile's token steps into the stage ring."""
        num_m = gl.cdiv(N, BM)
        num_n = gl.cdiv(K, BN)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        it = 0
        for t in range(gl.program_id(0), num_groups * num_m * num_n, NUM_PROGRAMS):
            g, pm, pn = _wg_tile(t, num_m, num_n, GROUP_M)
            start = gl.load(offs_ptr + g).to(gl.int32)
            end = gl.load(offs_ptr + g + 1).to(gl.int32)
            for ki in range(gl.cdiv(end - start, BK)):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(full.index(s), nbytes)
                _tma_load(a_desc, [pm * BM, start + ki * BK], full.index(s), a_bufs.index(s))
                _tma_load(b_desc, [pn * BN, start + ki * BK], full.index(s), b_bufs.index(s))
                it += 1

    @gluon.jit
    def _masked_copy(src, dst, valid, BK: gl.constexpr):
        """dst = src with the token columns >= valid zeroed ([R, BK] FP8 tiles in shared memory, R =
        64 or 128); each thread copies whole row segments, so it holds one row address."""
        R: gl.constexpr = src.shape[0]
        TC: gl.constexpr = 128 // R  # threads per row
        lay: gl.constexpr = gl.BlockedLayout([1, BK // TC], [32 // TC, TC], [4, 1], [1, 0])
        x = src.load(lay)
        cols = gl.arange(0, BK, layout=gl.SliceLayout(0, lay))
        dst.store(gl.where(gl.expand_dims(cols < valid, 0), x, gl.zeros([R, BK], x.dtype, lay)))

    @gluon.jit
    def _wg_store(acc, out_ptr, g, row0, col0, N, K, stride_og, stride_on, row_l: gl.constexpr,
                  col_l: gl.constexpr, ACCUMULATE: gl.constexpr):
        """The [HM, BN] result at (row0, col0) of out[g] through masked stores (added to out with
        ACCUMULATE); 32-bit offsets from one base pointer keep the addresses out of registers."""
        HM: gl.constexpr = acc.shape[0]
        BN: gl.constexpr = acc.shape[1]
        r = gl.arange(0, HM, layout=row_l)
        c = gl.arange(0, BN, layout=col_l)
        base = out_ptr + g.to(gl.int64) * stride_og + row0.to(gl.int64) * stride_on + col0
        offs = gl.expand_dims(r * stride_on, 1) + gl.expand_dims(c, 0)
        mask = gl.expand_dims(r < N - row0, 1) & gl.expand_dims(c < K - col0, 0)
        if ACCUMULATE:
            acc = acc + gl.load(base + offs, mask=mask, other=0.0).to(gl.float32)
        gl.store(base + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _wg_consumer(a_bufs, b_bufs, b_tail, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr,
                     soffs_a_ptr, soffs_b_ptr, N, K, num_groups, stride_og, stride_on,
                     s_stride_an, s_stride_at, s_stride_bk, s_stride_bt, HALF: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, PIPE: gl.constexpr,
                     ACCUMULATE: gl.constexpr, TMA_OUT: gl.constexpr):
        """One warpgroup: rows HALF*BM/2.. of each [BM, BN] dW tile."""
        HM: gl.constexpr = BM // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        num_m = gl.cdiv(N, BM)
        num_n = gl.cdiv(K, BN)
        zero = gl.zeros([HM, BN], gl.float32, mma)
        my_b = b_tail.index(HALF)
        c_smem = c_bufs.index(HALF)
        it = 0
        for t in range(gl.program_id(0), num_groups * num_m * num_n, NUM_PROGRAMS):
            g, pm, pn = _wg_tile(t, num_m, num_n, GROUP_M)
            start = gl.load(offs_ptr + g).to(gl.int32)
            length = gl.load(offs_ptr + g + 1).to(gl.int32) - start
            nk = gl.cdiv(length, BK)
            row0 = pm * BM + HALF * HM
            col0 = pn * BN
            # the scales of the tile's rows and columns at step 0: one base pointer each, 32-bit offsets
            sa_tile = sa_ptr + gl.load(soffs_a_ptr + g) * s_stride_at + row0.to(gl.int64) * s_stride_an
            sb_tile = sb_ptr + gl.load(soffs_b_ptr + g) * s_stride_bt + col0.to(gl.int64) * s_stride_bk
            acc = zero
            for ki in range(nk):
                s = it % STAGES
                mbarrier.wait(full.index(s), (it // STAGES) & 1)
                a_s = a_bufs.index(s).slice(HALF * HM, HM)
                b_s = b_bufs.index(s)
                valid = length - ki * BK
                if valid < BK:  # the group's last, partial step: the next group's tokens count as zeros
                    _masked_copy(a_s, a_s, valid, BK)  # this consumer's rows only
                    _masked_copy(b_s, my_b, valid, BK)  # B is shared: a copy of its own
                    fence_async_shared()
                    b_s = my_b
                if PIPE == 3:
                    mbarrier.wait(turn.index(HALF), (it & 1) ^ (1 - HALF))
                tok = warpgroup_mma(a_s, b_s.permute((1, 0)), zero, use_acc=False, is_async=True)
                if PIPE == 3:
                    mbarrier.arrive(turn.index(1 - HALF), count=1)
                r = gl.arange(0, HM, layout=row_l)
                sa = gl.load(sa_tile + ki * s_stride_at + r * s_stride_an, mask=r < N - row0, other=0.0)
                c = gl.arange(0, BN, layout=one_l)  # one column scale per thread, then spread over the MMA layout
                sb = gl.convert_layout(gl.load(sb_tile + ki * s_stride_bt + c * s_stride_bk, mask=c < K - col0,
                                               other=0.0), col_l)
                p = warpgroup_mma_wait(0, deps=(tok, ))
                mbarrier.arrive(empty.index(s), count=1)
                acc = acc + p * (gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0))
                it += 1
            if TMA_OUT:
                if row0 + HM <= N:
                    tma.store_wait(0)
                    c_smem.store(acc.to(c_desc.dtype))
                    fence_async_shared()
                    _tma_store(c_desc, [g * N + row0, col0], c_smem)
                else:
                    _wg_store(acc, out_ptr, g, row0, col0, N, K, stride_og, stride_on, row_l, col_l, ACCUMULATE)
            else:
                _wg_store(acc, out_ptr, g, row0, col0, N, K, stride_og, stride_on, row_l, col_l, ACCUMULATE)
        tma.store_wait(0)

    _SIZES = ["N", "K", "num_groups", "s_stride_an", "s_stride_bk"]

    @gluon.jit(do_not_specialize=_SIZES)
    def block_wgrad_ws_kernel(a_desc, b_desc, c_desc, out_ptr, offs_ptr, sa_ptr, sb_ptr, soffs_a_ptr, soffs_b_ptr,
                              N, K, num_groups, stride_og, stride_on, s_stride_an, s_stride_at, s_stride_bk,
                              s_stride_bt, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                              PIPE: gl.constexpr, ACCUMULATE: gl.constexpr, TMA_OUT: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """out[g] [N, K] (+)= A[:, tokens of g] @ B[:, tokens of g]^T (see k_grouped_gemm_kernel), FP8 block."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        b_tail = gl.allocate_shared_memory(b_desc.dtype, [2, BN, BK], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BM // 2, BN], c_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_wg_consumer, (a_bufs, b_bufs, b_tail, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr, sa_ptr,
                            sb_ptr, soffs_a_ptr, soffs_b_ptr, N, K, num_groups, stride_og, stride_on, s_stride_an,
                            s_stride_at, s_stride_bk, s_stride_bt, 0, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS,
                            PIPE, ACCUMULATE, TMA_OUT)),
            (_wg_consumer, (a_bufs, b_bufs, b_tail, c_bufs, full, empty, turn, c_desc, out_ptr, offs_ptr, sa_ptr,
                            sb_ptr, soffs_a_ptr, soffs_b_ptr, N, K, num_groups, stride_og, stride_on, s_stride_an,
                            s_stride_at, s_stride_bk, s_stride_bt, 1, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS,
                            PIPE, ACCUMULATE, TMA_OUT)),
            (_wg_producer, (a_desc, b_desc, a_bufs, b_bufs, full, empty, offs_ptr, N, K, num_groups,
                            BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def check_wgrad_operands(a, b, total: int) -> None:
    """ValueError unless the token-grouped operands fit the kernel: 1x128 blocks along tokens,
    contiguous tokens, TMA-aligned rows."""
    if a.block != (1, 128) or b.block != (1, 128) or a.soffs is None or b.soffs is None:
        raise ValueError(f"the Gluon wgrad needs 1x128 token blocks on both operands, got {a.block} x {b.block}")
    for op in (a, b):
        if op.stride_k != 1 or op.data.data_ptr() % 16 or op.stride_r % 16:
            raise ValueError(f"the Gluon wgrad needs contiguous tokens and 16-byte aligned rows (TMA); the "
                             f"operand has strides ({op.stride_r}, {op.stride_k}) over {total} tokens")


def launch_block_wgrad_ws(a, b, offsets: torch.Tensor, n: int, k: int, groups: int, out_dtype=torch.bfloat16, *,
                          out: torch.Tensor | None = None, accumulate: bool = False, stages: int = 5, pipe: int = 0,
                          group_m: int = 8, programs: int | None = None, consumer_regs: int = 232,
                          producer_regs: int = 40, info: dict | None = None) -> torch.Tensor:
    """dW [groups, n, k] (into `out`, added to it with `accumulate`) of the FP8 block k-grouped GEMM;
    a, b: grouped_gemm._Operand from tokens_operand (dy and x, columnwise)."""
    if gluon is None:
        raise RuntimeError(ws.GLUON_ERROR)
    if pipe not in (0, 3):
        raise ValueError(f"pipe={pipe}: the wgrad kernel runs schedules 0 and 3")
    total = a.data.shape[1]
    check_wgrad_operands(a, b, total)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds into `out`: pass it")
        out = torch.empty((groups, n, k), dtype=out_dtype, device=a.data.device)
    if out.shape != (groups, n, k) or out.stride(2) != 1:
        raise ValueError(f"out must be [{groups}, {n}, {k}] with contiguous rows, got {tuple(out.shape)}, "
                         f"strides {out.stride()}")
    bm = bn = 128
    if stages * (bm + bn) * 128 + 2 * (bm // 2) * bn * 2 + 2 * bn * 128 + 1024 > ws.SMEM_BYTES:
        raise ValueError(f"{stages} stages, the tail copies and the result buffers exceed shared memory")
    if n == 0 or k == 0 or groups == 0 or faking():
        return out
    if programs is None:
        programs = torch.cuda.get_device_properties(a.data.device).multi_processor_count
    # bf16/fp16 results of tiles inside the groups' rows leave through TMA stores from [G*N, K]
    tma_out = (not accumulate and out.element_size() == 2 and out.is_contiguous() and (k * 2) % 16 == 0
               and out.data_ptr() % 16 == 0)
    flat = (out.view(groups * n, k) if tma_out
            else torch.empty((bm // 2, bn), dtype=torch.bfloat16, device=out.device))  # unused descriptor
    compiled = block_wgrad_ws_kernel[(programs,)](
        ws._desc(a.data, [bm, 128]), ws._desc(b.data, [bn, 128]), ws._desc(flat, [bm // 2, bn]), out, offsets,
        a.scale, b.scale, a.soffs, b.soffs, n, k, groups, out.stride(0), out.stride(1),
        a.s_stride_r, a.s_stride_k, b.s_stride_r, b.s_stride_k,
        BM=bm, BN=bn, BK=128, GROUP_M=group_m, STAGES=stages, NUM_PROGRAMS=programs, PIPE=pipe,
        ACCUMULATE=accumulate, TMA_OUT=tma_out, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        num_warps=4)
    kernel_info(compiled, info)
    return out
