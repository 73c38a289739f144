"""FP8 block and MXFP8 quantization with a columnwise copy, through shared memory, in Triton's
Gluon dialect (private helper of `qmoe/kernels/quantize.py`, whose `fp8_block_op` and `mxfp8_op`
dispatch every call with a columnwise copy, or MXFP8's exact values, here where `unsupported`
returns None; otherwise the Triton kernels run).

Same contract and bits as `_fp8_block_kernel`: 1 x 128 blocks (a scale per 128 values of a row,
and per 128 rows of a column for the columnwise copy) or 128 x 128 blocks (one scale per tile,
both orientations), optionally per group with device split sizes; and as `_mxfp8_kernel` for
bf16 (an E8M0 exponent per 32 values of a row and per 32 rows of a column).

Why a second kernel: the Triton kernel transposes its 128 x 128 tile in registers, and Triton's
layout conversion of a tile that wide runs far below the copy bandwidth. Here a TMA load puts
each tile in shared memory and the warps read it twice, once with a layout in which a thread
holds a run of one row (rowwise amax, codes stored along rows) and once with one in which a
thread holds a run of one column (columnwise amax and codes; the per-tile bodies are
`_cast_tiles_gl`'s): no transpose in registers.
The columnwise codes go back to shared memory, a row per column, and leave from there as whole
128-byte lines (`_cast_columns_gl`; stored straight from the column layout, each warp's store
would touch 32 lines 16 bytes at a time, which holds the copy far below the bandwidth). bf16 tiles are
read as 32-bit words of two values (amaxes over packed 16-bit magnitudes, conversions to fp32 by
shifts), and a tile's scales are computed once per row and column rather than on every thread
that reduced them. The programs are persistent and prefetch STAGES - 1 tiles ahead, so loads
stay in flight while a tile's codes are computed and stored; they walk the tiles in bands of row
tiles (`_cast_walk_gl`), so the tiles in flight at once share DRAM pages of the columnwise copy
as well as of the input.

Scales: in the canonical layout a tile's 128 row scales lie a row of the scale tensor apart, and
so do its column scales, so every one is a store of its own. The kernel takes both strides of
each scale tensor, and `fp8_block_op` and `mxfp8_op` store their 1-D block scales steps-major
(`_layout.steps_major`): a tile's scales are consecutive, and stay that way for the GEMMs.

A fused GLU activation (FC2's input, act(h) * probs): each ring slot holds the tile's gate and
linear halves of h, and the activated tile, rounded as the activation op rounds it, replaces the
gate half in shared memory and goes to the same cast from there.

Grouped inputs: row tiles start afresh at every group (as `tiles.tile_rows` lays them out); a
tile's TMA box may run into the next group's rows, which the columnwise amax masks out and no
store writes.
"""
from __future__ import annotations

import torch

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.contracts.carriers import ACTIVATIONS, GLU_ACTIVATIONS
from qmoe.kernels._launch import faking, num_sms
from qmoe.kernels.activation import GATHER, _GATHER, NO_ACTIVATION, _activation, input_rows, input_width
from qmoe.kernels._layout import group_pow2

from qmoe.kernels._gluon_sm90 import gluon

from qmoe.kernels._cast_tiles_gl import MX_VALUES

if gluon is not None:
    from qmoe.kernels._cast_columns_gl import _store_columns
    from qmoe.kernels._cast_tiles_gl import MX_BLOCK, _cast_tile, _cast_tile_bf16, _cast_tile_mx
    from qmoe.kernels._cast_walk_gl import (_first_tile, _gathered_sources, _group_table, _issue, _issue_gathered,
                                            _locate, _tile_of)
    from qmoe.kernels._gluon_sm90 import TensorDescriptor, async_copy, gl, mbarrier

    @gluon.jit
    def _activate_tile(gate, linear, act, probs_ptr, row0, col0, M, K, ACT: gl.constexpr, num_warps: gl.constexpr):
        """act <- act(gate, linear) * probs[row] for a tile of GLU halves in shared memory, in fp32 as
        `_forward_kernel` computes it (kernels.activation._activation) and rounded to act's dtype:
        the quantized result is bit for bit that of quantizing the activation op's output. Columns
        at or past K are zero (with GLU_BLOCK 0 the gate tile runs on into the linear half there).
        act may be gate itself: loads and stores share one layout, so a thread overwrites only the
        values it has read."""
        BM: gl.constexpr = act.shape[0]
        BK: gl.constexpr = act.shape[1]
        RB: gl.constexpr = 32  # rows per pass: 16 values of each operand per thread
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [num_warps, 1], [1, 0])
        cols = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
        for r in gl.static_range(BM // RB):
            g = gate.slice(r * RB, RB, dim=0).load(layout).to(gl.float32)
            y = linear.slice(r * RB, RB, dim=0).load(layout).to(gl.float32)
            a, _, _ = _activation(g, y, g, ACT)
            rows = row0 + r * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, layout))
            p = gl.load(probs_ptr + rows, mask=rows < M, other=0.0).to(gl.float32)
            a = gl.where(gl.expand_dims(cols < K, 0), a * gl.expand_dims(p, 1), 0.0)
            act.slice(r * RB, RB, dim=0).store(a.to(act.dtype))

    # M stays specialised: as the columnwise copy's row stride, its divisibility by 16 lets the
    # columnwise codes leave as 16-byte vectors
    @gluon.jit(do_not_specialize=["G"])
    def fp8_block_cast_kernel(x_desc, x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, splits_ptr, probs_ptr,
                              M, K, G, eps, stride_x, stride_rs, stride_rsk, stride_cs, stride_csm,
                              FMT_MAX: gl.constexpr, OUT_DTYPE: gl.constexpr, POW2: gl.constexpr,
                              BLOCK_2D: gl.constexpr, ROWWISE: gl.constexpr, COLWISE: gl.constexpr,
                              GROUPED: gl.constexpr, GP: gl.constexpr, STAGES: gl.constexpr,
                              NUM_PROGRAMS: gl.constexpr, VEC: gl.constexpr, PACKED: gl.constexpr,
                              MX: gl.constexpr, EMAX: gl.constexpr, ROUND_UP: gl.constexpr,
                              STAGE_PHASE: gl.constexpr, TILE_GROUP: gl.constexpr, ACT: gl.constexpr,
                              GLU_BLOCK: gl.constexpr, ROW_VALUES: gl.constexpr, COL_VALUES: gl.constexpr,
                              num_warps: gl.constexpr):
        """One 128 x 128 tile (FP8 block: one 128-wide scale block each way; MX: 32-wide E8M0 blocks)
        per trip of a persistent loop (see the module docstring). With a GLU activation (ACT >= 0),
        x_desc is over h and each slot holds the tile's gate and linear halves; the activated tile
        goes to shared memory and is cast from there. ROW_VALUES / COL_VALUES (MX): that copy as exact
        bf16 values in x's layout, in place of its codes (`_cast_tile_mx`). ACT = GATHER: row r is
        x_ptr's row probs_ptr[r] (int32, none where negative), copied into the ring by cp.async
        (`_issue_gathered`), one commit group per tile, empty past the program's last (x_desc
        then only types the ring)."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        GLU: gl.constexpr = ACT >= 0
        GATHERED: gl.constexpr = ACT == _GATHER
        bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES if GLU else STAGES, BM, BK], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        # the tile's columnwise codes on their way out: a row per column (bf16: per pair of columns),
        # 16-byte chunks swizzled per STAGE_PHASE rows so that the rows one store instruction writes
        # (every second row from words, every fourth from fp32 reads) fall on distinct banks
        # (column strips: two, the tile's and the previous one's, whose last rows a line may still need)
        stage_l: gl.constexpr = gl.SwizzledSharedLayout(16, STAGE_PHASE, 8, order=[1, 0])
        COL_CODES: gl.constexpr = COLWISE and not COL_VALUES
        LINES: gl.constexpr = TILE_GROUP == 0 and COL_CODES
        NSTAGE: gl.constexpr = 2 if LINES else 1
        HALVES: gl.constexpr = PACKED or MX
        if HALVES:
            col_stages = gl.allocate_shared_memory(gl.uint8, [NSTAGE, BK // 2, 2 * BM], stage_l)
        else:
            col_stages = gl.allocate_shared_memory(gl.uint8, [NSTAGE, BK, BM], stage_l)

        nk = gl.cdiv(K, BK)
        SB: gl.constexpr = MX_BLOCK if MX else BM  # rows per scale block along M
        gi, starts, sizes, tiles, tile_end, first_block = _group_table(splits_ptr, G, BM, SB, GP, GROUPED, num_warps)
        if GROUPED:
            nm = gl.sum(tiles, 0)
        else:
            nm = gl.cdiv(M, BM)
        first_tile, mine = _first_tile(gl.program_id(0), nm * nk, NUM_PROGRAMS, TILE_GROUP)
        for j in gl.static_range(STAGES - 1):
            if GATHERED:
                src, src_kt = _gathered_sources(probs_ptr, _tile_of(first_tile, j, NUM_PROGRAMS, TILE_GROUP),
                                                j < mine, nk, nm, M, gi, starts, sizes, tiles, tile_end, BM, BK,
                                                GROUPED, TILE_GROUP, VEC, num_warps)
                if j < mine:
                    _issue_gathered(x_ptr, src, src_kt, stride_x, bufs, j, K, BK, VEC, num_warps)
                async_copy.commit_group()
            elif j < mine:
                _issue(x_desc, bufs, ready, _tile_of(first_tile, j, NUM_PROGRAMS, TILE_GROUP), j, nk, nm, M, K,
                       gi, starts, sizes, tiles, tile_end, BM, BK, GROUPED, TILE_GROUP, GLU, GLU_BLOCK)
        if GATHERED:  # the sources of the next tile to copy, a trip ahead
            src, src_kt = _gathered_sources(probs_ptr, _tile_of(first_tile, STAGES - 1, NUM_PROGRAMS, TILE_GROUP),
                                            STAGES - 1 < mine, nk, nm, M, gi, starts, sizes, tiles, tile_end, BM,
                                            BK, GROUPED, TILE_GROUP, VEC, num_warps)

        prev_row0 = -1  # the last tile's first row and column tile (column strips: the carried lines)
        prev_kt = -1
        for i in range(mine):
            sm90.thread_barrier()  # every warp is done with the slot the next load overwrites
            nxt = i + STAGES - 1
            if GATHERED:
                if nxt < mine:
                    _issue_gathered(x_ptr, src, src_kt, stride_x, bufs, nxt % STAGES, K, BK, VEC, num_warps)
                src, src_kt = _gathered_sources(probs_ptr, _tile_of(first_tile, nxt + 1, NUM_PROGRAMS, TILE_GROUP),
                                                nxt + 1 < mine, nk, nm, M, gi, starts, sizes, tiles, tile_end, BM, BK,
                                                GROUPED, TILE_GROUP, VEC, num_warps)
            elif nxt < mine:
                _issue(x_desc, bufs, ready, _tile_of(first_tile, nxt, NUM_PROGRAMS, TILE_GROUP), nxt % STAGES,
                       nk, nm, M, K, gi, starts, sizes, tiles, tile_end, BM, BK, GROUPED, TILE_GROUP, GLU,
                       GLU_BLOCK)
            slot = i % STAGES
            if GATHERED:  # tile i's group is complete in every thread, and so in shared memory
                async_copy.commit_group()
                async_copy.wait_group(STAGES - 1)
                sm90.thread_barrier()
            else:
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            row0, row_end, sblk, kt = _locate(_tile_of(first_tile, i, NUM_PROGRAMS, TILE_GROUP), nk, nm, M, gi,
                                              starts, sizes, tiles, tile_end, first_block, BM, SB, GROUPED,
                                              TILE_GROUP)
            col_stage = col_stages.index(i % NSTAGE)
            if GLU:  # the activated tile replaces its gate half in the slot
                tile = bufs.index(2 * slot)
                _activate_tile(tile, bufs.index(2 * slot + 1), tile, probs_ptr, row0, kt * BK, M, K, ACT, num_warps)
                sm90.thread_barrier()  # the activated tile is whole before any warp reads it
            else:
                tile = bufs.index(slot)
            if MX:
                _cast_tile_mx(tile, col_stage, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, sblk, kt, M, K,
                              stride_rs, stride_rsk, stride_cs, stride_csm, FMT_MAX, OUT_DTYPE, EMAX, ROUND_UP, ROWWISE,
                              COLWISE, ROW_VALUES, COL_VALUES, num_warps)
            elif PACKED:
                _cast_tile_bf16(tile, col_stage, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, sblk, kt, M,
                                K, eps, stride_rs, stride_rsk, stride_cs, stride_csm, FMT_MAX, OUT_DTYPE, POW2,
                                BLOCK_2D, ROWWISE, COLWISE, num_warps)
            else:
                _cast_tile(tile, col_stage, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, sblk, kt, M, K, eps,
                           stride_rs, stride_rsk, stride_cs, stride_csm, FMT_MAX, OUT_DTYPE, POW2, BLOCK_2D, ROWWISE,
                           COLWISE, VEC, num_warps)
            if COL_CODES:
                sm90.thread_barrier()  # the stage is whole before any warp stores from it
                # the row tile above, in this group, was the last one cast here: its last rows wait in the
                # other stage; this tile's wait for the next one unless that is the tile below, whole
                carry = (kt == prev_kt) & (row0 == prev_row0 + BM)
                flush = (i + 1 == mine) | (row0 + 2 * BM > row_end)
                _store_columns(col_stage, col_stages, i, kt, K, col_ptr, row0, row_end, M, carry, flush, HALVES, LINES,
                               STAGE_PHASE, BM, BK, num_warps)
                prev_row0 = row0
                prev_kt = kt

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


_TILE = 128
# What fp8_block_op and mxfp8_op dispatch to: stages of the TMA ring, warps per program, programs
# per SM, row tiles per band of the tile order. FP8 columnwise codes alone take a third stage
# (benchmarks/results/sweeps/block_cast_bands.json, block_cast_dispatch.json). Grouped inputs walk
# column strips (tile_group 0), so groups that start inside a line of the columnwise copy still
# write it in whole lines (benchmarks/results/sweeps/block_cast_lines.json).
DISPATCH = dict(stages=2, warps=8, per_sm=1, tile_group=8)
DISPATCH_COLUMNWISE = dict(DISPATCH, stages=3)
# The casts whose own arithmetic holds one program per SM below the copy bandwidth take two, at
# 128 registers each: a fused GLU (one ring stage each: its slots hold both halves of h), and
# MXFP8 columnwise copies written as values (benchmarks/results/sweeps/cast_layer_configs.json).
DISPATCH_GLU = dict(DISPATCH, stages=1, per_sm=2, maxnreg=128)
DISPATCH_COL_VALUES = dict(DISPATCH, per_sm=2, maxnreg=128)
GROUPED_TILE_GROUP = 0
_SCRATCH = 8192  # shared memory the kernel takes besides its buffers (barriers, reductions' scratch)


def dispatch_config(mx: bool, rowwise: bool, columnwise: bool, act: int = NO_ACTIVATION,
                    values: tuple[bool, bool] = (False, False)) -> dict:
    """The launch keywords (before `_dispatched`) of a cast of these copies."""
    if act >= 0:
        return DISPATCH_GLU
    if columnwise and values[1]:
        return DISPATCH_COL_VALUES
    return DISPATCH if rowwise or mx else DISPATCH_COLUMNWISE


def _dispatched(config: dict, splits) -> dict:
    """The launch keywords of a dispatched call: `config`, in column strips for grouped inputs."""
    return dict(config, tile_group=GROUPED_TILE_GROUP) if splits is not None else config


def unsupported(x: torch.Tensor, block_cols: int, act: int = NO_ACTIVATION, glu_block: int = 0,
                mx: bool = False, shapes_only: bool = False) -> str | None:
    """Why this kernel cannot quantize x (None: it can): it needs Gluon on an sm90 GPU, 128-wide
    FP8 blocks (mx: 32-value MXFP8 blocks of bf16), x's rows TMA-aligned, and for a fused
    activation a GLU of a bf16 h whose halves come in runs of whole tiles (glu_block 0 or a multiple
    of 128). QMOE_BLOCK_CAST=triton turns it off. shapes_only: answer for the real call during a
    fake-tensor pass."""
    why = sm90.gluon_unavailable(x.device, "QMOE_BLOCK_CAST", shapes_only)
    if why is not None:
        return why
    if block_cols != (MX_VALUES if mx else _TILE):
        return f"{block_cols}-wide blocks ({MX_VALUES if mx else _TILE} only)"
    if act not in (NO_ACTIVATION, GATHER):
        if not 0 <= act < len(GLU_ACTIVATIONS):
            return f"a fused {ACTIVATIONS[act]} (a pointwise activation: the Triton kernel applies it as it loads)"
        if x.dtype != torch.bfloat16:
            return f"a fused activation of a {x.dtype} h (bf16 only)"
        if glu_block % _TILE:
            return f"GLU halves interleaved in blocks of {glu_block} columns (0 or multiples of {_TILE} only)"
    if x.dtype not in ((torch.bfloat16,) if mx else (torch.bfloat16, torch.float16, torch.float32)):
        return f"input dtype {x.dtype}"
    if not sm90.tma_aligned(x, base=not (shapes_only and faking())):  # a fake tensor has no address
        return "x's rows are not contiguous and 16-byte aligned (TMA)"
    return None


# Calls whose kernel failed to compile (a Triton without this Gluon API): they take the Triton kernel.
FAILED: dict[tuple, str] = {}


def launch_dispatched(x: torch.Tensor, splits, num_groups: int, two_d: bool, block_cols: int, act: int,
                      glu_block: int, probs, out_code, fmt_max: float, power_2_scale: bool, amax_epsilon: float,
                      rowwise: bool, row, row_s, col, col_s) -> bool:
    """Quantize x (or act(x) * probs, see fp8_block_op) in 1 x 128 (two_d: 128 x 128) blocks,
    columnwise and optionally rowwise, with the dispatched configuration into fp8_block_op's
    outputs; False, launching nothing, where `unsupported` says so or its compile failed (recorded
    in FAILED, with a warning once): the caller then runs the Triton kernel."""
    if unsupported(x, block_cols, act, glu_block) is not None:
        return False

    def go():
        launch(x, splits, num_groups, two_d, out_code, fmt_max, power_2_scale, amax_epsilon, rowwise, True,
               row, row_s, col, col_s, act=act, glu_block=glu_block, probs=probs,
               **_dispatched(dispatch_config(False, rowwise, True, act), splits))
        return True

    key = (x.dtype, splits is not None, two_d, rowwise, act, glu_block)
    return sm90.launch_once(FAILED, key, "FP8 block cast", go) is True


def launch_dispatched_mx(x: torch.Tensor, splits, num_groups: int, block: int, act: int, glu_block: int, probs,
                         out_code, fmt_max: float, emax: int, round_up: bool, rowwise: bool, columnwise: bool, row,
                         row_s, col, col_s, values: tuple[bool, bool] = (False, False)) -> bool:
    """launch_dispatched for mxfp8_op: MXFP8 of a bf16 x (or of act(x) * probs), either copy or
    both; values: (rowwise, columnwise) copies written as exact bf16 values into row / col [M, K]."""
    if unsupported(x, block, act, glu_block, mx=True) is not None:
        return False

    def go():
        launch(x, splits, num_groups, False, out_code, fmt_max, False, 0.0, rowwise, columnwise, row, row_s, col,
               col_s, mx=(emax, round_up), act=act, glu_block=glu_block, probs=probs, values=values,
               **_dispatched(dispatch_config(True, rowwise, columnwise, act, values), splits))
        return True

    key = ("mx", splits is not None, rowwise, columnwise, act, glu_block, values)
    return sm90.launch_once(FAILED, key, "MXFP8 cast", go) is True


def writes_values(x: torch.Tensor, act: int = NO_ACTIVATION, glu_block: int = 0) -> bool:
    """Whether an MXFP8 cast of x (or of act(x) * probs) writes exact bf16 values in place of codes
    where asked (`launch_dispatched_mx`'s values): this kernel runs it. A fake-tensor pass answers
    as the real call will."""
    return unsupported(x, MX_VALUES, act, glu_block, mx=True, shapes_only=True) is None


def launch(x: torch.Tensor, splits, num_groups: int, two_d: bool, out_code, fmt_max: float,
           power_2_scale: bool, amax_epsilon: float, rowwise: bool, columnwise: bool, row, row_s, col, col_s, *,
           stages: int = 3, warps: int = 8, per_sm: int = 1, maxnreg: int | None = None,
           programs: int | None = None, packed: bool = True, mx: tuple[int, bool] | None = None,
           stage_phase: int | None = None, tile_group: int = 1, act: int = NO_ACTIVATION, glu_block: int = 0,
           probs: torch.Tensor | None = None, values: tuple[bool, bool] = (False, False)) -> None:
    """Fill fp8_block_op's outputs (allocated by it, same layouts) for an [M, K] x; out_code is
    the codes' Triton FP8 dtype; maxnreg caps registers (two programs per SM need <= 128 at 8 warps);
    packed=False reads bf16 as fp32 as the other dtypes are (same bits, for comparison). With
    mx = (emax, round_up), MXFP8 of a bf16 x into mxfp8_op's outputs instead (two_d, power_2_scale
    and amax_epsilon unused; its E8M0 scales as bytes or as float8_e8m0fnu views). stage_phase:
    rows of the columnwise stage per swizzle phase (None: the read path's conflict-free one).
    tile_group: row tiles per band of the tile order (`_cast_walk_gl._tile_order`; 0: column strips,
    whose columnwise lines leave whole, with a second stage for them: bands where M is not a
    multiple of 16 or shared memory lacks room). act (a GLU's code), glu_block, probs ([M] fp32):
    x is h [M, 2K] and the quantized input act(h) * probs, as fp8_block_op's; act = GATHER: probs
    is an int32 index [M] of x's rows (a `GatheredRows`), read into the ring by cp.async.
    The scale outputs may have any strides (the dispatched path's are transposed). values (MX only):
    (rowwise, columnwise) copies as exact bf16 values into row / col, [M, K] bf16 each, no scales."""
    if any(values) and mx is None:
        raise ValueError("exact values are written for MXFP8 only")
    m, k = input_rows(x, probs, act), input_width(x, act)
    row_s, col_s = (s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s for s in (row_s, col_s))
    grouped = splits is not None
    upper = -(-m // _TILE) + (num_groups if grouped else 0)
    if programs is None:
        programs = min(upper * -(-k // _TILE), num_sms(x.device) * per_sm)
    words = packed and x.dtype == torch.bfloat16
    tile_bytes = _TILE * _TILE * x.element_size()
    glu = act >= 0
    smem = stages * tile_bytes * (2 if glu else 1) + 2 * _TILE * _TILE
    if tile_group == 0 and (not columnwise or values[1] or m % 16 or smem > sm90.SMEM_BYTES - _SCRATCH):
        tile_group = DISPATCH["tile_group"]  # nothing to carry (no columnwise copy, or rows off 16), or no room
    if stage_phase is None:  # a store instruction writes rows 2 apart (words of bf16), 4 apart (fp32 reads)
        stage_phase = 2 if words or mx is not None else 4
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=torch.finfo(x.dtype).bits, rank=2)
    desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [_TILE, _TILE], layout)
    fp8_block_cast_kernel[(programs,)](
        desc, x, row.view(torch.uint8), row_s, col.view(torch.uint8), col_s, splits if grouped else row_s,
        probs if probs is not None else row_s, m, k, num_groups, amax_epsilon, x.stride(0),
        *(row_s.stride() if row_s.dim() == 2 else (0, 1)), *(col_s.stride() if col_s.dim() == 2 else (0, 1)),
        FMT_MAX=fmt_max, OUT_DTYPE=out_code, POW2=power_2_scale, BLOCK_2D=two_d, ROWWISE=rowwise,
        COLWISE=columnwise, GROUPED=grouped, GP=max(32, group_pow2(num_groups)), STAGES=stages, NUM_PROGRAMS=programs,
        VEC=16 // x.element_size(), PACKED=words, MX=mx is not None,
        EMAX=mx[0] if mx else 0, ROUND_UP=bool(mx and mx[1]), STAGE_PHASE=stage_phase, TILE_GROUP=tile_group,
        ACT=act, GLU_BLOCK=glu_block, ROW_VALUES=bool(values[0]), COL_VALUES=bool(values[1]), num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
