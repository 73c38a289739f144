"""FP8 block quantization of both orientations through shared memory, in Triton's Gluon dialect
(private helper of `qmoe/kernels/quantize.py`, whose `fp8_block_op` dispatches 1x128 blocks in
both orientations here where `unsupported` returns None; otherwise the Triton kernel runs).

Same contract and bits as `_fp8_block_kernel`: 1 x 128 blocks (a scale per 128 values of a row,
and per 128 rows of a column for the columnwise copy) or 128 x 128 blocks (one scale per tile,
both orientations), optionally per group with device split sizes.

Why a second kernel: the Triton kernel transposes its 128 x 128 tile in registers, and Triton's
layout conversion of a tile that wide runs far below the copy bandwidth. Here a TMA load puts
each tile in shared memory and the warps read it twice, once with a layout in which a thread
holds a run of one row (rowwise amax, codes stored along rows) and once with one in which a
thread holds a run of one column (columnwise amax, codes stored along the transposed rows):
no transpose in registers and no bank conflicts (both reads take whole 128-byte lines). The
programs are persistent and prefetch STAGES - 1 tiles ahead, so loads stay in flight while a
tile's codes are computed and stored.

Grouped inputs: row tiles start afresh at every group (as `tiles.tile_rows` lays them out); a
tile's TMA box may run into the next group's rows, which the columnwise amax masks out and no
store writes.
"""
from __future__ import annotations

import torch

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.kernels._arith import abs_bits, bits_to_float, cast_codes, fp8_scale_from_amax, reciprocal
from qmoe.kernels._launch import num_sms
from qmoe.kernels._layout import group_pow2

from qmoe.kernels._gluon_sm90 import gluon

if gluon is not None:
    from qmoe.kernels._gluon_sm90 import TensorDescriptor, gl, mbarrier

    @gluon.jit
    def _group_table(splits_ptr, G, BM: gl.constexpr, GP: gl.constexpr, GROUPED: gl.constexpr,
                     WARPS: gl.constexpr):
        """Per group: index, first row, rows, row tiles, cumulative row tiles (all zero ungrouped:
        splits_ptr is then never read)."""
        SPT: gl.constexpr = GP // 32 if GP >= 32 else 1
        layout: gl.constexpr = gl.BlockedLayout([SPT], [32], [WARPS], [0])  # replicated over warps
        gi = gl.arange(0, GP, layout=layout)
        sizes = gl.load(splits_ptr + gi, mask=(gi < G) & GROUPED, other=0).to(gl.int32)
        starts = gl.associative_scan(sizes, 0, sm90.add) - sizes
        tiles = gl.cdiv(sizes, BM)
        tile_end = gl.associative_scan(tiles, 0, sm90.add)
        return gi, starts, sizes, tiles, tile_end

    @gluon.jit
    def _locate(t, nk, M, gi, starts, sizes, tiles, tile_end, BM: gl.constexpr, GROUPED: gl.constexpr):
        """Tile t (row tiles walked along K first) -> (first row, end row of its group, row tile,
        column tile). Row tiles start afresh at every group, as the scale blocks along M do, so a
        tile's row tile is also its scale block along M."""
        vt = t // nk
        kt = t % nk
        if GROUPED:
            g = gl.sum((tile_end <= vt).to(gl.int32), 0)
            sel = gi == g
            start = gl.sum(gl.where(sel, starts, 0), 0)
            row0 = start + (vt - gl.sum(gl.where(sel, tile_end - tiles, 0), 0)) * BM
            row_end = start + gl.sum(gl.where(sel, sizes, 0), 0)
        else:
            row0 = vt * BM
            row_end = M
        return row0, row_end, vt, kt

    @gluon.jit
    def _issue(desc, bufs, ready, t, slot, nk, M, gi, starts, sizes, tiles, tile_end, BM: gl.constexpr,
               BK: gl.constexpr, GROUPED: gl.constexpr):
        row0, _, _, kt = _locate(t, nk, M, gi, starts, sizes, tiles, tile_end, BM, GROUPED)
        mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
        sm90.tma_load(desc, [row0, kt * BK], ready.index(slot), bufs.index(slot))

    @gluon.jit
    def _store_columns(col_ptr, qc, offs, cols64, col_ok, row0, row_end, M, BM: gl.constexpr):
        """Columnwise codes qc [BM, BK] of rows row0 + offs (a thread holds runs of rows) at
        col[cols, rows] (col is [K, M]): 16-byte vectors where the tile is whole and starts on 16 rows, masked
        bytes otherwise."""
        if (row0 + BM <= row_end) & (row0 % 16 == 0):
            rows = (row0 // 16) * 16 + offs  # the same rows, visibly 16-aligned
            gl.store(col_ptr + cols64[None, :] * M + rows[:, None], qc, mask=col_ok[None, :])
        else:
            rows = row0 + offs
            gl.store(col_ptr + cols64[None, :] * M + rows[:, None], qc,
                     mask=(rows < row_end)[:, None] & col_ok[None, :])

    # M stays specialised: as the columnwise copy's row stride, its divisibility by 16 lets the
    # columnwise codes leave as 16-byte vectors
    @gluon.jit(do_not_specialize=["G"])
    def fp8_block_cast_kernel(x_desc, row_ptr, row_s_ptr, col_ptr, col_s_ptr, splits_ptr,
                              M, K, G, eps, stride_rs, stride_cs,
                              FMT_MAX: gl.constexpr, OUT_DTYPE: gl.constexpr, POW2: gl.constexpr,
                              BLOCK_2D: gl.constexpr, ROWWISE: gl.constexpr, COLWISE: gl.constexpr,
                              GROUPED: gl.constexpr, GP: gl.constexpr, STAGES: gl.constexpr,
                              NUM_PROGRAMS: gl.constexpr, VEC: gl.constexpr, num_warps: gl.constexpr):
        """One 128 x 128 tile (= one 128-wide scale block each way) per trip of a persistent loop
        (see the module docstring)."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        # a thread holds VEC consecutive values of a row / BM // num_warps rows of 4 columns
        row_l: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (BK // VEC), BK // VEC], [num_warps, 1], [1, 0])
        col_l: gl.constexpr = gl.BlockedLayout([BM // num_warps, 4], [1, 32], [num_warps, 1], [0, 1])
        bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)

        nk = gl.cdiv(K, BK)
        gi, starts, sizes, tiles, tile_end = _group_table(splits_ptr, G, BM, GP, GROUPED, num_warps)
        if GROUPED:
            total = gl.sum(tiles, 0) * nk
        else:
            total = gl.cdiv(M, BM) * nk
        pid = gl.program_id(0)
        mine = gl.cdiv(gl.maximum(total - pid, 0), NUM_PROGRAMS)
        for j in gl.static_range(STAGES - 1):
            if j < mine:
                _issue(x_desc, bufs, ready, pid + j * NUM_PROGRAMS, j, nk, M, gi, starts, sizes, tiles, tile_end,
                       BM, BK, GROUPED)

        for i in range(mine):
            gl.thread_barrier()  # every warp is done with the slot the next load overwrites
            nxt = i + STAGES - 1
            if nxt < mine:
                _issue(x_desc, bufs, ready, pid + nxt * NUM_PROGRAMS, nxt % STAGES, nk, M, gi, starts, sizes,
                       tiles, tile_end, BM, BK, GROUPED)
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            tile = bufs.index(slot)
            row0, row_end, sblk, kt = _locate(pid + i * NUM_PROGRAMS, nk, M, gi, starts, sizes, tiles, tile_end, BM,
                                              GROUPED)
            col0 = kt * BK

            xr = tile.load(row_l).to(gl.float32)
            rows_r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, row_l))
            cols_r = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, row_l))
            ok_r = rows_r < row_end
            bits_r = gl.max(abs_bits(xr), 1)  # [BM]: max|x| per row (NaN wins)
            if BLOCK_2D:  # one scale per tile, from its rows in the group
                s_tile = fp8_scale_from_amax(bits_to_float(gl.max(gl.where(ok_r, bits_r, 0), 0)), FMT_MAX, POW2, eps)
                s_r = gl.where(ok_r, s_tile, s_tile)
            else:
                s_r = fp8_scale_from_amax(bits_to_float(bits_r), FMT_MAX, POW2, eps)
            if ROWWISE:
                q = cast_codes(xr * gl.expand_dims(s_r, 1), FMT_MAX, OUT_DTYPE)
                gl.store(row_ptr + rows_r.to(gl.int64)[:, None] * K + cols_r[None, :], q,
                         mask=ok_r[:, None] & (cols_r < K)[None, :])
                if BLOCK_2D:
                    gl.store(row_s_ptr + sblk * stride_rs + kt, reciprocal(s_tile))
                else:
                    gl.store(row_s_ptr + rows_r.to(gl.int64) * stride_rs + kt, reciprocal(s_r), mask=ok_r)

            if COLWISE:
                xc = tile.load(col_l).to(gl.float32)
                offs_c = gl.arange(0, BM, layout=gl.SliceLayout(1, col_l))
                cols_c = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, col_l))
                ok_c = cols_c < K
                cols64 = cols_c.to(gl.int64)
                if BLOCK_2D:
                    s_c = gl.where(ok_c, s_tile, s_tile)
                    gl.store(col_s_ptr + kt * stride_cs + sblk, reciprocal(s_tile))
                else:
                    bits_c = gl.where((row0 + offs_c < row_end)[:, None], abs_bits(xc), 0)
                    s_c = fp8_scale_from_amax(bits_to_float(gl.max(bits_c, 0)), FMT_MAX, POW2, eps)
                    gl.store(col_s_ptr + cols64 * stride_cs + sblk, reciprocal(s_c), mask=ok_c)
                qc = cast_codes(xc * gl.expand_dims(s_c, 0), FMT_MAX, OUT_DTYPE)
                _store_columns(col_ptr, qc, offs_c, cols64, ok_c, row0, row_end, M, BM)

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


_TILE = 128
# What fp8_block_op dispatches to: stages of the TMA ring, warps per program, programs per SM.
DISPATCH = dict(stages=3, warps=8, per_sm=1)


def unsupported(x: torch.Tensor, block_cols: int, fused_activation: bool) -> str | None:
    """Why this kernel cannot quantize x (None: it can): it needs Gluon on an sm90 GPU, 128-wide
    blocks, no fused activation, and x's rows TMA-aligned. QMOE_BLOCK_CAST=triton turns it off."""
    why = sm90.gluon_unavailable(x.device, "QMOE_BLOCK_CAST")
    if why is not None:
        return why
    if block_cols != _TILE:
        return f"{block_cols}-wide blocks (128 only)"
    if fused_activation:
        return "a fused activation (the Triton kernel applies it as it loads)"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"input dtype {x.dtype}"
    if not sm90.tma_aligned(x):
        return "x's rows are not contiguous and 16-byte aligned (TMA)"
    return None


# Calls whose kernel failed to compile (a Triton without this Gluon API): they take the Triton kernel.
FAILED: dict[tuple, str] = {}


def launch_dispatched(x: torch.Tensor, splits, num_groups: int, block_cols: int, fused_activation: bool, out_code,
                      fmt_max: float, power_2_scale: bool, amax_epsilon: float, row, row_s, col, col_s) -> bool:
    """Quantize x in 1 x 128 blocks, both orientations, with the dispatched configuration into
    fp8_block_op's outputs; False, launching nothing, where `unsupported` says so or its compile
    failed (recorded in FAILED, with a warning once): the caller then runs the Triton kernel."""
    if unsupported(x, block_cols, fused_activation) is not None:
        return False

    def go():
        launch(x, splits, num_groups, False, out_code, fmt_max, power_2_scale, amax_epsilon, True, True,
               row, row_s, col, col_s, **DISPATCH)
        return True

    return sm90.launch_once(FAILED, (x.dtype, splits is not None), "FP8 block cast", go) is True


def launch(x: torch.Tensor, splits, num_groups: int, two_d: bool, out_code, fmt_max: float,
           power_2_scale: bool, amax_epsilon: float, rowwise: bool, columnwise: bool, row, row_s, col, col_s, *,
           stages: int = 3, warps: int = 8, per_sm: int = 1, maxnreg: int | None = None,
           programs: int | None = None) -> None:
    """Fill fp8_block_op's outputs (allocated by it, same layouts) for an [M, K] x; out_code is
    the codes' Triton FP8 dtype; maxnreg caps registers (two programs per SM need <= 128 at 8 warps)."""
    m, k = x.shape
    grouped = splits is not None
    upper = -(-m // _TILE) + (num_groups if grouped else 0)
    if programs is None:
        programs = min(upper * -(-k // _TILE), num_sms(x.device) * per_sm)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=torch.finfo(x.dtype).bits, rank=2)
    desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [_TILE, _TILE], layout)
    fp8_block_cast_kernel[(programs,)](
        desc, row.view(torch.uint8), row_s, col.view(torch.uint8), col_s, splits if grouped else row_s,
        m, k, num_groups, amax_epsilon, row_s.stride(0) if row_s.dim() == 2 else 0,
        col_s.stride(0) if col_s.dim() == 2 else 0,
        FMT_MAX=fmt_max, OUT_DTYPE=out_code, POW2=power_2_scale, BLOCK_2D=two_d, ROWWISE=rowwise,
        COLWISE=columnwise, GROUPED=grouped, GP=max(32, group_pow2(num_groups)), STAGES=stages, NUM_PROGRAMS=programs,
        VEC=16 // x.element_size(), num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}))
