"""FP8 per-tensor-scaled grouped GEMMs (delayed and current scaling) with warp specialisation, in
Triton's Gluon dialect: the m-grouped fprop / dgrad and the k-grouped wgrad (private helper of
`qmoe/kernels/grouped_gemm.py`, which dispatches TENSOR calls here where `unsupported_m` /
`unsupported_k` return None).

Same contract as `m_grouped_gemm_kernel` / `k_grouped_gemm_kernel` under TENSOR scaling with a
16-bit output, and the same bits where the steps fall as theirs (the wgrad's lead, below): the FP8
codes go straight into the tensor cores, which accumulate every 128-deep step of a tile into one
fp32 sum in K order (Hopper's FP8 accumulation, no promotion), and the epilogue multiplies it by
the group's two scale_inv factors.

Why a second kernel: the Triton kernels compute a tile's epilogue (and, in the k-grouped one, its
prologue) with the tensor cores idle, which costs most where a tile has few steps (FC2's fprop at
K = 2048, the wgrad of fine-grained experts with a few hundred tokens each). Here one warp streams
every tile's steps through a ring of shared-memory stages by TMA (the block-scaled kernels'
producers, `_block_gemm_ws` and `_block_wgrad_ws`, without scales), running ahead into the next
tile while two consumer warpgroups, one per 64-row half of a tile, finish the last; each consumer
keeps one MMA in flight and releases a step's stage when the next step's MMA has started.

In the k-grouped kernel a group that starts off 16 bytes (which TMA cannot load) goes through each
consumer's own buffers by masked loads (`_block_wgrad_tails`); a group's partial last step comes
through the group's own descriptors, zero past its end. Dispatched with a lead of 32, a group that
starts on 16 tokens but off 32 (as a layer pads groups to 16) starts its steps 16 tokens early, with
zeros from its own descriptors, so that each box row loads whole 32-byte sectors: its 128-token
steps fall 16 tokens earlier than the Triton kernel's, whose bits the kernel then gives on the same
tokens laid out with those zeros (the GEMM contract of NUMERICS.md fixes no summation order).
"""
from __future__ import annotations

import torch
import triton

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.kernels._block_gemm_tl import b_group_offsets, kernel_info
from qmoe.kernels._gluon_sm90 import gluon
from qmoe.kernels._launch import faking, num_sms

if gluon is not None:
    from qmoe.kernels import _block_gemm_ws as bg
    from qmoe.kernels import _block_wgrad_ws as bw
    from qmoe.kernels._block_wgrad_tails import TAIL_DESC, tail_to_smem, tma_steps
    from qmoe.kernels._gluon_sm90 import fence_async_shared, gl, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def _release(empty, it, STAGES: gl.constexpr):
        """Give stage `it % STAGES` back to the producer (this consumer's half of its count)."""
        mbarrier.arrive(empty.index(it % STAGES), count=1)

    @gluon.jit
    def _steps(a_bufs, b_bufs, full, empty, acc, it, nk, HALF: gl.constexpr, HM: gl.constexpr,
               STAGES: gl.constexpr):
        """acc plus this half's products of the nk steps from ring slot `it` on: each step's MMA issued
        before the previous one is waited for, whose stage then goes back to the producer."""
        for ki in range(nk):
            s = (it + ki) % STAGES
            mbarrier.wait(full.index(s), ((it + ki) // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            if ki > 0:
                _release(empty, it + ki - 1, STAGES)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if nk > 0:
            _release(empty, it + nk - 1, STAGES)
        return acc

    @gluon.jit
    def _m_consumer(a_bufs, b_bufs, c_bufs, full, empty, c_desc, out_ptr, offs_ptr, fa_ptr, fb_ptr, total_rows, N, K,
                    num_groups, stride_om, HALF: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                    BK: gl.constexpr, GROUP_M: gl.constexpr, GP: gl.constexpr, STAGES: gl.constexpr,
                    NUM_PROGRAMS: gl.constexpr, TMA_STORE: gl.constexpr):
        """One warpgroup: rows HALF*BM/2.. of each tile (`_steps`), then the factor and the store
        (TMA_STORE: through c_bufs, else straight from registers)."""
        HM: gl.constexpr = BM // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        num_n = gl.cdiv(N, BN)
        gi, starts, ends, tiles, tile_end = bg._group_table(offs_ptr, total_rows, num_groups, num_n, BM, GP, 4)
        total_tiles = gl.sum(tiles, 0)
        zero = gl.zeros([HM, BN], gl.float32, mma)
        c_smem = c_bufs.index(HALF)
        it = 0
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, m_start, m_end, pm, pn = bg._locate(t, gi, starts, ends, tiles, tile_end, num_n, BM, GROUP_M)
            row0 = m_start + pm * BM + HALF * HM
            rows = row0 + gl.arange(0, HM, layout=row_l)
            gb = gl.minimum(g, num_groups - 1)
            nk = gl.where(g < num_groups, gl.cdiv(K, BK), 0)
            acc = _steps(a_bufs, b_bufs, full, empty, zero, it, nk, HALF, HM, STAGES)
            it += nk
            acc = acc * (gl.load(fa_ptr + gb) * gl.load(fb_ptr + gb))
            if TMA_STORE:
                bg._store_half(acc, c_smem, c_desc, out_ptr, rows, rows < m_end, row0, pn * BN, m_end, N, stride_om,
                               HM, col_l, True)
            else:
                cols = pn * BN + gl.arange(0, BN, layout=col_l)
                ptrs = out_ptr + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
                gl.store(ptrs, acc.to(out_ptr.dtype.element_ty),
                         mask=gl.expand_dims(rows < m_end, 1) & gl.expand_dims(cols < N, 0))
        if TMA_STORE:
            tma.store_wait(0)

    # sizes and strides that only index are not specialised (one compile for every shape)
    _M_SIZES = ["total_rows", "K", "num_groups", "b_group_rows", "b_group_cols"]

    @gluon.jit(do_not_specialize=_M_SIZES)
    def tensor_gemm_ws_kernel(a_desc, b_desc, c_desc, sa_desc, out_ptr, offs_ptr, fa_ptr, fb_ptr, total_rows, N, K,
                              num_groups, b_group_rows, b_group_cols, stride_om,
                              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                              GP: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                              TMA_STORE: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """out[T, N] = (A_g @ B_g^T) * fa[g] * fb[g] per group (see m_grouped_gemm_kernel), FP8
        tensor scaling. Partitions: two 4-warp consumers (the 64-row halves of each tile), a
        1-warp producer; `empty` counts both consumers' releases. sa_desc: a stand-in (no scales)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        if TMA_STORE:
            c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BM // 2, BN], c_desc.layout)
        else:
            c_bufs = a_bufs  # unused: the results leave straight from registers
        sa_bufs = gl.allocate_shared_memory(gl.float32, [1, 1, BM], sa_desc.layout)
        full, empty = sm90.stage_barriers(STAGES)
        gl.warp_specialize([
            (_m_consumer, (a_bufs, b_bufs, c_bufs, full, empty, c_desc, out_ptr, offs_ptr, fa_ptr, fb_ptr, total_rows,
                           N, K, num_groups, stride_om, 0, BM, BN, BK, GROUP_M, GP, STAGES, NUM_PROGRAMS, TMA_STORE)),
            (_m_consumer, (a_bufs, b_bufs, c_bufs, full, empty, c_desc, out_ptr, offs_ptr, fa_ptr, fb_ptr, total_rows,
                           N, K, num_groups, stride_om, 1, BM, BN, BK, GROUP_M, GP, STAGES, NUM_PROGRAMS, TMA_STORE)),
            (bg._producer, (a_desc, b_desc, sa_desc, a_bufs, b_bufs, sa_bufs, full, empty, offs_ptr, total_rows, N,
                            K, num_groups, b_group_rows, b_group_cols, BM, BN, BK, GROUP_M, GP, STAGES, NUM_PROGRAMS,
                            False)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _k_consumer(a_bufs, b_bufs, own_a, own_b, c_view, full, empty, c_desc, a_ptr, b_ptr, out_ptr, offs_ptr,
                    fa_ptr, fb_ptr, total_tiles, per_group, num_m, num_n, N, K, stride_an, stride_bk, stride_og,
                    stride_on, HALF: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                    ACCUMULATE: gl.constexpr, TMA_OUT: gl.constexpr, LEAD: gl.constexpr):
        """One warpgroup: rows HALF*BM/2.. of each output tile, one MMA of the whole tile width per
        step (`_steps`). A group starting off 16 bytes: every
        step through this half's own buffers (its 64 rows of A, all BN columns of B; the latter
        also hold its results on their way to a TMA store: `c_view`)."""
        HM: gl.constexpr = BM // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        zero = gl.zeros([HM, BN], gl.float32, mma)
        a_mine = own_a.index(HALF)
        b_mine = own_b.index(HALF)
        c_mine = c_view.index(HALF)  # the same bytes as b_mine
        it = 0
        for t in range(gl.program_id(0), total_tiles, NUM_PROGRAMS):
            g, pm, pn, start, length = bw._tile_of(t, offs_ptr, per_group, num_m, num_n, GROUP_M)
            row0, rows, row_ok = bw._half_rows(pm, N, HALF, BM, row_l)
            col0 = pn * BN
            f = gl.load(fa_ptr + g) * gl.load(fb_ptr + g)
            acc = zero
            if start % 16 == 0:
                nk = tma_steps(start, length, BK, TAIL_DESC, LEAD)
                acc = _steps(a_bufs, b_bufs, full, empty, acc, it, nk, HALF, HM, STAGES)
                it += nk
                bw._store_result(acc * f, c_mine, c_desc, out_ptr, g, rows, row_ok, row0, col0, N, K, stride_og,
                                 stride_on, HM, col_l, ACCUMULATE, TMA_OUT, True)
            else:  # TMA cannot start off a 16-byte boundary: masked byte loads
                if TMA_OUT:
                    tma.store_wait(0)  # B's buffer may still feed the last TMA store of results
                for ki in range(gl.cdiv(length, BK)):
                    t0 = start + ki * BK
                    bw._own_free()
                    tail_to_smem(a_ptr, a_mine, row0, N, t0, length - ki * BK, stride_an, ld)
                    tail_to_smem(b_ptr, b_mine, col0, K, t0, length - ki * BK, stride_bk, ld)
                    fence_async_shared()
                    sm90.thread_barrier()  # the step is whole before the MMA reads it
                    acc = warpgroup_mma(a_mine, b_mine.permute((1, 0)), acc)
                bw._store_result(acc * f, c_mine, c_desc, out_ptr, g, rows, row_ok, row0, col0, N, K, stride_og,
                                 stride_on, HM, col_l, ACCUMULATE, False, False)
                sm90.thread_barrier()  # the last MMA is done with B's buffer before results are staged there
        if TMA_OUT:
            tma.store_wait(0)

    _K_SIZES = ["total_tiles", "per_group", "num_m", "num_n", "stride_og"]

    @gluon.jit(do_not_specialize=_K_SIZES)
    def tensor_wgrad_ws_kernel(a_desc, b_desc, c_desc, s_desc, a_ptr, b_ptr, out_ptr, offs_ptr, fa_ptr, fb_ptr,
                               total_tiles, per_group, num_m, num_n, N, K, stride_an, stride_bk, stride_og,
                               stride_on, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                               GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                               ACCUMULATE: gl.constexpr, TMA_OUT: gl.constexpr, LEAD: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """out[g] = (A[:, tokens of g] @ B[:, tokens of g]^T) * fa[g] * fb[g] (see
        k_grouped_gemm_kernel), FP8 tensor scaling. Partitions as the m-grouped kernel's; s_desc: a
        stand-in for the block producer's scale rows (none here)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.float32, [1, 1, BN], s_desc.layout)
        full, empty = sm90.stage_barriers(STAGES)
        C_DTYPE: gl.constexpr = c_desc.dtype
        C_LAYOUT: gl.constexpr = c_desc.layout
        B_DTYPE: gl.constexpr = b_desc.dtype
        B_LAYOUT: gl.constexpr = b_desc.layout
        # per half: its 64 rows of A and all BN columns of B (a group off 16 bytes); B's hold its results
        own_a = gl.allocate_shared_memory(a_desc.dtype, [2, BM // 2, BK], a_desc.layout)
        own_b = gl.allocate_shared_memory(B_DTYPE, [2, BN, BK], B_LAYOUT)
        c_view = sm90.reinterpret(own_b, C_DTYPE, [2, BM // 2, BN], C_LAYOUT)
        gl.warp_specialize([
            (_k_consumer, (a_bufs, b_bufs, own_a, own_b, c_view, full, empty, c_desc, a_ptr, b_ptr, out_ptr,
                           offs_ptr, fa_ptr, fb_ptr, total_tiles, per_group, num_m, num_n, N, K, stride_an, stride_bk,
                           stride_og, stride_on, 0, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS, ACCUMULATE,
                           TMA_OUT, LEAD)),
            (_k_consumer, (a_bufs, b_bufs, own_a, own_b, c_view, full, empty, c_desc, a_ptr, b_ptr, out_ptr,
                           offs_ptr, fa_ptr, fb_ptr, total_tiles, per_group, num_m, num_n, N, K, stride_an, stride_bk,
                           stride_og, stride_on, 1, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS, ACCUMULATE,
                           TMA_OUT, LEAD)),
            (bw._producer, (a_desc, b_desc, s_desc, s_desc, a_bufs, b_bufs, s_bufs, s_bufs, full, empty, offs_ptr,
                            offs_ptr, offs_ptr, a_ptr, b_ptr, total_tiles, per_group, num_m, num_n, N, K,
                            stride_an, stride_bk, BM, BN, BK, GROUP_M, STAGES, NUM_PROGRAMS, TAIL_DESC, False,
                            LEAD)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# What the TENSOR GEMMs dispatch to (the launchers' keywords): 128 x 256 tiles, a 64 x 256 sum per
# consumer.
DISPATCH_M = dict(bn=256, stages=3, group_m=8)
DISPATCH_K = dict(stages=3, group_m=8, lead=32)  # lead: steps from the 32-token boundary before a group
# From this many rows per group on (on average), the m-grouped GEMM takes the Triton kernel: on
# Mixtral's 8 groups of 4096 rows it ran 1-16 % faster than the Gluon one, whose lead lies in the
# tile changes of many smaller groups (DeepSeek-V3's 2048 rows, Qwen3's 1024:
# benchmarks/results/sweeps/tensor_gemm.json, moe_tensor_gemm.json).
TRITON_ROWS_PER_GROUP = 4096
# Calls whose kernel failed to compile (a Triton without this Gluon API): they take the Triton kernel.
FAILED: dict[tuple, str] = {}
_OUT_DTYPES = (torch.bfloat16, torch.float16)  # fp32 output promotes every step: the Triton kernel's


def _fp8(op) -> bool:
    return op.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and op.factor is not None


def unsupported_m(a, b, n_out: int, k: int, out_dtype, total_rows: int, groups: int) -> str | None:
    """Why the Gluon kernel cannot run this m-grouped TENSOR call (None: it can): it needs Gluon's
    Hopper API on an sm90 device, a 16-bit output, FP8 codes with their factors, TMA-aligned
    operands and output rows, N a multiple of the tile, and enough rows per group for 128-row tiles
    (fewer go to the Triton kernel's small-M tiles) but fewer than TRITON_ROWS_PER_GROUP.
    QMOE_TENSOR_GEMM=triton turns it off."""
    why = sm90.gluon_unavailable(a.data.device, sm90.TENSOR_GEMM_SWITCH)
    if why is not None:
        return why
    if out_dtype not in _OUT_DTYPES or not (_fp8(a) and _fp8(b)):
        return f"output dtype {out_dtype}, operands {a.data.dtype} x {b.data.dtype}"
    if a.stride_k != 1 or b.stride_k != 1 or not (sm90.tma_aligned(a.data) and sm90.tma_aligned(b.data)):
        return "operands not contiguous along K or rows not 16-byte aligned (TMA)"
    if n_out % DISPATCH_M["bn"] or k % 16:
        return f"N={n_out} (a multiple of {DISPATCH_M['bn']} needed), K={k}"
    if total_rows <= 96 * groups:
        return "few rows per group (the Triton kernel's 64-row tiles)"
    if total_rows >= TRITON_ROWS_PER_GROUP * groups:
        return f"{TRITON_ROWS_PER_GROUP} rows per group or more (the Triton kernel is ahead there)"
    return None


def _m_stages(stages: int, bn: int, out_dtype, tma_store: bool = True) -> int:
    """At most `stages` stages of 128 x bn tiles beside the result buffers and the stand-in scale row."""
    c = 2 * 64 * bn * torch.finfo(out_dtype).bits // 8 if tma_store else 0
    return max(1, min(stages, (sm90.SMEM_BYTES - sm90.SMEM_SPARE - 128 * 4 - c) // ((128 + bn) * 128)))


def launch_m_dispatched(a, b, offsets, total_rows: int, n_out: int, k: int, groups: int, out_dtype, out):
    """The dispatched m-grouped configuration into `out`; None, launching nothing, where
    `unsupported_m` says so or its compile failed (recorded in FAILED, warned once)."""
    if unsupported_m(a, b, n_out, k, out_dtype, total_rows, groups) is not None:
        return None
    b_columnwise = b.group_stride < b.stride_r
    key = ("m", out_dtype, b_columnwise, a.data.dtype, b.data.dtype)
    return sm90.launch_once(FAILED, key, "FP8 tensor GEMM", lambda: launch_tensor_gemm_ws(
        a, b, offsets, total_rows, n_out, k, groups, out_dtype, out=out, b_columnwise=b_columnwise, **DISPATCH_M))


def launch_tensor_gemm_ws(a, b, offsets: torch.Tensor, total_rows: int, n_out: int, k: int, groups: int,
                          out_dtype=torch.bfloat16, *, out: torch.Tensor | None = None, b_columnwise: bool = False,
                          bn: int = 256, stages: int = 3, group_m: int = 8, tma_store: bool = True,
                          programs: int | None = None,
                          consumer_regs: int = 232, producer_regs: int = 40, info: dict | None = None) -> torch.Tensor:
    """out [total_rows, n_out] of the FP8 tensor-scaled m-grouped GEMM; a, b: grouped_gemm._Operand
    (TENSOR scaling: codes and per-group factors). tma_store: results through shared memory by TMA
    (else straight from registers, which leaves room for a fourth stage). Host-sync-free: the grid
    is the SM count."""
    if gluon is None:
        raise RuntimeError(sm90.GLUON_ERROR)
    if bn not in (128, 256) or n_out % bn:
        raise ValueError(f"bn={bn}, N={n_out}: the kernel takes 128- or 256-column tiles dividing N")
    if _m_stages(stages, bn, out_dtype, tma_store) < stages:
        raise ValueError(f"{stages} stages of 128 x {bn} tiles with {out_dtype} results exceed shared memory")
    if out is None:
        out = torch.empty((total_rows, n_out), dtype=out_dtype, device=a.data.device)
    if total_rows == 0 or n_out == 0 or faking():
        return out
    g_rows, g_cols = b_group_offsets(b, b_columnwise)
    programs = num_sms(a.data.device) if programs is None else programs
    compiled = tensor_gemm_ws_kernel[(programs,)](
        sm90.desc(a.data, [128, 128]), sm90.desc(b.data, [bn, 128]), sm90.desc(out, [64, bn]),
        sm90.stand_in_scale_desc(out), out, offsets, a.factor, b.factor, total_rows, n_out, k, groups, g_rows, g_cols,
        out.stride(0), BM=128, BN=bn, BK=128, GROUP_M=group_m, GP=triton.next_power_of_2(groups + 1),
        STAGES=stages, NUM_PROGRAMS=programs, TMA_STORE=tma_store, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, num_warps=4)
    kernel_info(compiled, info)
    return out


def unsupported_k(a, b, out: torch.Tensor, accumulate: bool) -> str | None:
    """Why the Gluon kernel cannot run this k-grouped TENSOR call (None: it can): it needs Gluon's
    Hopper API on an sm90 device, a 16-bit output with contiguous rows, FP8 codes with their
    factors, tokens contiguous and TMA-aligned, and the output's columns a multiple of 256.
    QMOE_TENSOR_GEMM=triton turns it off."""
    why = sm90.gluon_unavailable(a.data.device, sm90.TENSOR_GEMM_SWITCH)
    if why is not None:
        return why
    if out.dtype not in _OUT_DTYPES or out.stride(2) != 1 or not (_fp8(a) and _fp8(b)):
        return f"output dtype {out.dtype}, strides {out.stride()}, operands {a.data.dtype} x {b.data.dtype}"
    if a.stride_k != 1 or b.stride_k != 1 or not (sm90.tma_aligned(a.data) and sm90.tma_aligned(b.data)):
        return "tokens not contiguous or rows not 16-byte aligned (TMA)"
    if out.shape[2] % 256:
        return f"K={out.shape[2]} (a multiple of 256 needed)"
    return None


def _k_stages(stages: int) -> int:
    """At most `stages` stages of 128 x 256 tiles beside each consumer's own A and B buffers and the
    stand-in scale row."""
    own = 2 * (64 + 256) * 128
    return max(1, min(stages, (sm90.SMEM_BYTES - sm90.SMEM_SPARE - 256 * 4 - own) // ((128 + 256) * 128)))


def launch_k_dispatched(a, b, offsets, n: int, k: int, groups: int, out: torch.Tensor, accumulate: bool):
    """The dispatched k-grouped configuration into `out`; None, launching nothing, where
    `unsupported_k` says so or its compile failed (recorded in FAILED, warned once)."""
    if unsupported_k(a, b, out, accumulate) is not None:
        return None
    key = ("k", out.dtype, accumulate, a.data.dtype, b.data.dtype)
    return sm90.launch_once(FAILED, key, "FP8 tensor wgrad GEMM",
                            lambda: launch_tensor_wgrad_ws(a, b, offsets, n, k, groups, out, accumulate, **DISPATCH_K))


def launch_tensor_wgrad_ws(a, b, offsets: torch.Tensor, n: int, k: int, groups: int, out: torch.Tensor,
                           accumulate: bool = False, *, stages: int = 3, group_m: int = 8, lead: int = 16,
                           programs: int | None = None, consumer_regs: int = 232, producer_regs: int = 40,
                           info: dict | None = None) -> torch.Tensor:
    """out [groups, n, k] (+= with accumulate) of the FP8 tensor-scaled k-grouped GEMM; a [n, T],
    b [k, T]: grouped_gemm._Operand (TENSOR scaling, tokens contiguous). lead: the token boundary
    (16, 32, 64 or 128) a group's steps start from (`_block_wgrad_tails`; 16: its first token).
    Host-sync-free."""
    if k % 256 or a.stride_k != 1 or b.stride_k != 1:
        raise ValueError(f"K={k}, token strides {a.stride_k}, {b.stride_k}: the kernel takes K % 256 == 0 and "
                         f"contiguous tokens")
    if _k_stages(stages) < stages:
        raise ValueError(f"{stages} stages exceed shared memory")
    if lead not in (16, 32, 64, 128):
        raise ValueError(f"lead={lead}: the kernel takes 16, 32, 64 or 128")
    if gluon is None:
        raise RuntimeError(sm90.GLUON_ERROR)
    if n == 0 or k == 0 or groups == 0 or faking():
        return out
    tma_out = bw._tma_out(out, n, k, accumulate)
    num_m, num_n = -(-n // 128), k // 256
    per_group = num_m * num_n
    programs = num_sms(a.data.device) if programs is None else programs
    flat = out.view(groups * n, k) if tma_out else out.new_empty((64, 256))  # a stand-in never stored to
    compiled = sm90.with_scratch(a.data.device, lambda: tensor_wgrad_ws_kernel[(programs,)](
        sm90.desc(a.data, [128, 128]), sm90.desc(b.data, [256, 128]), sm90.desc(flat, [64, 256]),
        sm90.stand_in_scale_desc(out, 256), a.data.view(torch.uint8), b.data.view(torch.uint8), out, offsets,
        a.factor, b.factor, groups * per_group, per_group, num_m, num_n, n, k, a.stride_r, b.stride_r,
        out.stride(0), out.stride(1), BM=128, BN=256, BK=128, GROUP_M=group_m, STAGES=stages, NUM_PROGRAMS=programs,
        ACCUMULATE=accumulate, TMA_OUT=tma_out, LEAD=lead, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        num_warps=4))  # the group descriptors of partial last steps live in its scratch
    kernel_info(compiled, info)
    return out

