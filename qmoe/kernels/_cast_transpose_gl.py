"""FP8 block and MXFP8 quantization with a columnwise copy, through shared memory, in Triton's
Gluon dialect (private helper of `qmoe/kernels/quantize.py`, whose `fp8_block_op` and `mxfp8_op`
dispatch every call with a columnwise copy here where `unsupported` returns None; otherwise the
Triton kernels run).

Same contract and bits as `_fp8_block_kernel`: 1 x 128 blocks (a scale per 128 values of a row,
and per 128 rows of a column for the columnwise copy) or 128 x 128 blocks (one scale per tile,
both orientations), optionally per group with device split sizes; and as `_mxfp8_kernel` for
bf16 (an E8M0 exponent per 32 values of a row and per 32 rows of a column).

Why a second kernel: the Triton kernel transposes its 128 x 128 tile in registers, and Triton's
layout conversion of a tile that wide runs far below the copy bandwidth. Here a TMA load puts
each tile in shared memory and the warps read it twice, once with a layout in which a thread
holds a run of one row (rowwise amax, codes stored along rows) and once with one in which a
thread holds a run of one column (columnwise amax and codes): no transpose in registers. The
columnwise codes go back to shared memory, a row per column, and leave from there as whole
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
linear halves of h, and the activated tile, rounded as the activation op rounds it, goes through
shared memory to the same cast.

Grouped inputs: row tiles start afresh at every group (as `tiles.tile_rows` lays them out); a
tile's TMA box may run into the next group's rows, which the columnwise amax masks out and no
store writes.
"""
from __future__ import annotations

import torch
import triton

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.contracts.carriers import ACTIVATIONS, GLU_ACTIVATIONS
from qmoe.kernels._arith import (abs_bits, bits_to_float, cast_codes, exp2_int, fp8_scale_from_amax, mx_exponent,
                                scale_inverse)
from qmoe.kernels._launch import faking, num_sms
from qmoe.kernels.activation import NO_ACTIVATION, _activation, input_width
from qmoe.kernels._layout import group_pow2

from qmoe.kernels._gluon_sm90 import gluon

MX_VALUES = 32  # values per MXFP8 scale block

if gluon is not None:
    from qmoe.kernels._cast_columns_gl import _store_columns
    from qmoe.kernels._cast_walk_gl import _first_tile, _group_table, _issue, _locate, _tile_of
    from qmoe.kernels._gluon_sm90 import TensorDescriptor, gl, mbarrier

    MX_BLOCK = gl.constexpr(MX_VALUES)

    @gluon.jit
    def _activate_tile(gate, linear, act, probs_ptr, row0, col0, M, K, ACT: gl.constexpr, num_warps: gl.constexpr):
        """act <- act(gate, linear) * probs[row] for a tile of GLU halves in shared memory, in fp32 as
        `_forward_kernel` computes it (kernels.activation._activation) and rounded to act's dtype:
        the quantized result is bit for bit that of quantizing the activation op's output. Columns
        at or past K are zero (with GLU_BLOCK 0 the gate tile runs on into the linear half there)."""
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

    @gluon.jit
    def _max_u16x2(a, b):
        """Per 16-bit half, the larger unsigned value: for words of two |bf16| patterns, the
        larger magnitude of each half (NaN, whose pattern exceeds inf's, wins)."""
        return gl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _bf16_pairs_to_float(w):
        """The two bf16 values packed in each int32 word, as fp32 (low half, high half)."""
        return (w << 16).to(gl.float32, bitcast=True), (w & -65536).to(gl.float32, bitcast=True)

    @gluon.jit
    def _row_codes(w, s, OUT_DTYPE: gl.constexpr):
        """Codes of both bf16 values of each word times s, as one int16 (the low value's code in
        the low byte): the same multiply and saturating round-to-nearest-even as cast_codes."""
        if OUT_DTYPE == gl.float8e4nv:
            cvt: gl.constexpr = "cvt.rn.satfinite.e4m3x2.f32 $0, h, l;"
        else:
            cvt: gl.constexpr = "cvt.rn.satfinite.e5m2x2.f32 $0, h, l;"
        return gl.inline_asm_elementwise(
            "{ .reg .b32 l, h; shl.b32 l, $1, 16; and.b32 h, $1, 0xFFFF0000; "
            "mul.rn.f32 l, l, $2; mul.rn.f32 h, h, $2; " + cvt + " }",
            "=h,r,f", [w, s], dtype=gl.int16, is_pure=True, pack=1)

    @gluon.jit
    def _cast_tile(tile, col_stage, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, sblk, kt, M, K, eps,
                   stride_rs, stride_rsk, stride_cs, stride_csm, FMT_MAX: gl.constexpr, OUT_DTYPE: gl.constexpr,
                   POW2: gl.constexpr, BLOCK_2D: gl.constexpr, ROWWISE: gl.constexpr, COLWISE: gl.constexpr,
                   VEC: gl.constexpr, num_warps: gl.constexpr):
        """Quantize one tile in shared memory, read once per orientation as fp32."""
        BM: gl.constexpr = tile.shape[0]
        BK: gl.constexpr = tile.shape[1]
        # a thread holds VEC consecutive values of a row / BM // num_warps rows of 4 columns
        row_l: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (BK // VEC), BK // VEC], [num_warps, 1], [1, 0])
        col_l: gl.constexpr = gl.BlockedLayout([BM // num_warps, 4], [1, 32], [num_warps, 1], [0, 1])
        col0 = kt * BK
        if ROWWISE:
            xr = tile.load(row_l).to(gl.float32)
            rows_r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, row_l))
            cols_r = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, row_l))
            ok_r = rows_r < row_end
            bits_r = gl.max(abs_bits(xr), 1)  # [BM]: max|x| per row (NaN wins)
            if BLOCK_2D:  # one scale per tile, from its rows in the group
                s_tile = fp8_scale_from_amax(bits_to_float(gl.max(gl.where(ok_r, bits_r, 0), 0)), FMT_MAX, POW2,
                                             eps)
                s_r = gl.where(ok_r, s_tile, s_tile)
            else:
                s_r = fp8_scale_from_amax(bits_to_float(bits_r), FMT_MAX, POW2, eps)
            q = cast_codes(xr * gl.expand_dims(s_r, 1), FMT_MAX, OUT_DTYPE)
            gl.store(row_ptr + rows_r.to(gl.int64)[:, None] * K + cols_r[None, :], q,
                     mask=ok_r[:, None] & (cols_r < K)[None, :])
            if BLOCK_2D:
                gl.store(row_s_ptr + sblk * stride_rs + kt * stride_rsk, scale_inverse(s_tile, POW2))
            else:
                gl.store(row_s_ptr + rows_r.to(gl.int64) * stride_rs + kt * stride_rsk, scale_inverse(s_r, POW2),
                         mask=ok_r)

        if COLWISE:
            xc = tile.load(col_l).to(gl.float32)
            offs_c = gl.arange(0, BM, layout=gl.SliceLayout(1, col_l))
            cols_c = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, col_l))
            ok_c = cols_c < K
            cols64 = cols_c.to(gl.int64)
            bits_c = gl.where((row0 + offs_c < row_end)[:, None], abs_bits(xc), 0)  # rows of the group only
            if BLOCK_2D:
                if not ROWWISE:  # the tile's scale from the columns' maxima: the same maximum
                    s_tile = fp8_scale_from_amax(bits_to_float(gl.max(gl.max(bits_c, 0), 0)), FMT_MAX, POW2, eps)
                s_c = gl.where(ok_c, s_tile, s_tile)
                gl.store(col_s_ptr + kt * stride_cs + sblk * stride_csm, scale_inverse(s_tile, POW2))
            else:
                s_c = fp8_scale_from_amax(bits_to_float(gl.max(bits_c, 0)), FMT_MAX, POW2, eps)
                gl.store(col_s_ptr + cols64 * stride_cs + sblk * stride_csm, scale_inverse(s_c, POW2), mask=ok_c)
            col_stage.permute([1, 0]).store(cast_codes(xc * gl.expand_dims(s_c, 0), FMT_MAX, OUT_DTYPE))

    @triton.constexpr_function
    def _row_scale_layout(rows, warps):
        """For the [rows] vector of a tile's row amaxes: each row on two lanes of the warp that read
        it (rather than on the 16 that reduced it), so a thread computes one scale, not eight."""
        reps = [2 * warps << i for i in range((rows // (2 * warps)).bit_length() - 1)]
        lanes = reps[:4] + [0] * (4 - len(reps[:4]))
        return gl.DistributedLinearLayout(reg_bases=[[r] for r in reps[4:]], lane_bases=[[v] for v in lanes] + [[1]],
                                          warp_bases=[[2 << i] for i in range(warps.bit_length() - 1)],
                                          block_bases=[], shape=[rows])

    @gluon.jit
    def _cast_tile_bf16(tile, col_stage, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, sblk, kt, M, K, eps,
                        stride_rs, stride_rsk, stride_cs, stride_csm, FMT_MAX: gl.constexpr,
                        OUT_DTYPE: gl.constexpr, POW2: gl.constexpr, BLOCK_2D: gl.constexpr, ROWWISE: gl.constexpr,
                        COLWISE: gl.constexpr, num_warps: gl.constexpr):
        """_cast_tile for bf16, which reads the tile as words of two values: the amaxes are maxima of
        packed 16-bit magnitudes and the conversions to fp32 are shifts."""
        BM: gl.constexpr = tile.shape[0]
        BW: gl.constexpr = tile.shape[1] // 2  # words per tile row
        # a thread holds 4 consecutive words of a row / BM // num_warps rows of 2 words
        row_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BW // 4), BW // 4], [num_warps, 1], [1, 0])
        col_l: gl.constexpr = gl.BlockedLayout([BM // num_warps, 2], [1, 32], [num_warps, 1], [0, 1])
        words = sm90.reinterpret(tile, gl.int32, [BM, BW],
                                  gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
        w0 = kt * BW  # first word column of the tile

        if ROWWISE:
            wr = words.load(row_l)
            rows_r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, row_l))
            wcols_r = w0 + gl.arange(0, BW, layout=gl.SliceLayout(0, row_l))
            ok_r = rows_r < row_end
            packed_r = gl.reduce(wr & 0x7FFF7FFF, 1, _max_u16x2)
            bits_r = gl.maximum(packed_r << 16, packed_r & -65536)  # [BM]: max|x| per row (NaN wins)
            if BLOCK_2D:  # one scale per tile, from its rows in the group
                s_tile = fp8_scale_from_amax(bits_to_float(gl.max(gl.where(ok_r, bits_r, 0), 0)), FMT_MAX, POW2,
                                             eps)
                s_r = gl.where(ok_r, s_tile, s_tile)
            else:
                one_l: gl.constexpr = _row_scale_layout(BM, num_warps)
                amax_1 = bits_to_float(gl.convert_layout(bits_r, one_l))
                s_1 = fp8_scale_from_amax(amax_1, FMT_MAX, POW2, eps)
                s_r = gl.convert_layout(s_1, gl.SliceLayout(1, row_l))
            q = _row_codes(wr, gl.expand_dims(s_r, 1), OUT_DTYPE)
            row_pairs = row_ptr.to(gl.pointer_type(gl.int16))
            gl.store(row_pairs + rows_r.to(gl.int64)[:, None] * (K // 2) + wcols_r[None, :], q,
                     mask=ok_r[:, None] & (wcols_r < K // 2)[None, :])
            if BLOCK_2D:
                gl.store(row_s_ptr + sblk * stride_rs + kt * stride_rsk, scale_inverse(s_tile, POW2))
            else:
                rows_1 = row0 + gl.arange(0, BM, layout=one_l)
                gl.store(row_s_ptr + rows_1.to(gl.int64) * stride_rs + kt * stride_rsk, scale_inverse(s_1, POW2),
                         mask=rows_1 < row_end)

        if COLWISE:
            wc = words.load(col_l)
            offs_c = gl.arange(0, BM, layout=gl.SliceLayout(1, col_l))
            lo, hi = _bf16_pairs_to_float(wc)
            magnitude = gl.where(row0 + offs_c < row_end, 0x7FFF7FFF, 0)  # rows of the group only
            packed_c = gl.reduce(wc & gl.expand_dims(magnitude, 1), 0, _max_u16x2)
            if BLOCK_2D:
                if not ROWWISE:  # the tile's scale from the columns' maxima: the same maximum
                    packed_t = gl.reduce(packed_c, 0, _max_u16x2)
                    s_tile = fp8_scale_from_amax(bits_to_float(gl.maximum(packed_t << 16, packed_t & -65536)),
                                                 FMT_MAX, POW2, eps)
                s_lo = gl.where(gl.arange(0, BW, layout=gl.SliceLayout(0, col_l)) < BW, s_tile, s_tile)
                s_hi = s_lo
                gl.store(col_s_ptr + kt * stride_cs + sblk * stride_csm, scale_inverse(s_tile, POW2))
            else:  # every thread holding a column computes its scale (no exchange through shared memory)
                s_lo = fp8_scale_from_amax(bits_to_float(packed_c << 16), FMT_MAX, POW2, eps)
                s_hi = fp8_scale_from_amax(bits_to_float(packed_c & -65536), FMT_MAX, POW2, eps)
                even = 2 * (w0 + gl.arange(0, BW, layout=gl.SliceLayout(0, col_l))).to(gl.int64)
                s_ptrs = col_s_ptr + even * stride_cs + sblk * stride_csm
                gl.store(s_ptrs, scale_inverse(s_lo, POW2), mask=even < K)
                gl.store(s_ptrs + stride_cs, scale_inverse(s_hi, POW2), mask=even < K)
            # the codes of columns 2w (low halves) and 2w + 1 go to row w of the stage, side by side
            col_stage.slice(0, BM, dim=1).permute([1, 0]).store(
                cast_codes(lo * gl.expand_dims(s_lo, 0), FMT_MAX, OUT_DTYPE))
            col_stage.slice(BM, BM, dim=1).permute([1, 0]).store(
                cast_codes(hi * gl.expand_dims(s_hi, 0), FMT_MAX, OUT_DTYPE))

    @gluon.jit
    def _mx_multiplier(amax, FMT_MAX: gl.constexpr, EMAX: gl.constexpr, ROUND_UP: gl.constexpr):
        """(2^-b for each block amax, NaN for a NaN block; the E8M0 byte b + 127), as the Triton kernel."""
        b = mx_exponent(amax, FMT_MAX, EMAX, ROUND_UP)
        return gl.where(b == 128, amax, exp2_int(-b)), (b + 127).to(gl.uint8)

    @gluon.jit
    def _mx_unit(e):
        """2^b of each E8M0 byte b + 127 (inf for the NaN byte, whose codes are NaN): what a code
        is multiplied by to give its value."""
        return exp2_int(e.to(gl.int32) - 127)

    @gluon.jit
    def _exact_pairs(w, s_lo, s_hi, u_lo, u_hi, OUT_DTYPE: gl.constexpr):
        """The values, as a word of two bf16, of the codes of both bf16 values of each word:
        code(x * s) * u, the code cast as cast_codes casts it and the product in fp32, then as the
        reference's `dequantize_mxfp8` to bf16 gives it: beyond bf16's range (the largest codes of
        a block near the top of it) clamped to its largest value, NaN kept, the rest exact."""
        if OUT_DTYPE == gl.float8e4nv:
            fmt: gl.constexpr = "e4m3x2"
        else:
            fmt: gl.constexpr = "e5m2x2"
        return gl.inline_asm_elementwise(
            "{ .reg .b32 l, h, f; .reg .b16 c, fl, fh; "
            "shl.b32 l, $1, 16; and.b32 h, $1, 0xFFFF0000; mul.rn.f32 l, l, $2; mul.rn.f32 h, h, $3; "
            "cvt.rn.satfinite." + fmt + ".f32 c, h, l; cvt.rn.f16x2." + fmt + " f, c; mov.b32 {fl, fh}, f; "
            "cvt.f32.f16 l, fl; cvt.f32.f16 h, fh; mul.rn.f32 l, l, $4; mul.rn.f32 h, h, $5; "
            "min.NaN.f32 l, l, 0f7F7F0000; min.NaN.f32 h, h, 0f7F7F0000; "
            "max.NaN.f32 l, l, 0fFF7F0000; max.NaN.f32 h, h, 0fFF7F0000; "
            "cvt.rn.bf16x2.f32 $0, h, l; }",
            "=r,r,f,f,f,f", [w, s_lo, s_hi, u_lo, u_hi], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _store_row_exponents(e_r, row_s_ptr, row0, row_end, rows, kt, K, stride_rs, stride_rsk, NB: gl.constexpr,
                             num_warps: gl.constexpr):
        """A tile's rowwise E8M0 bytes [BM, NB] (rows: their rows, in e_r's row slice)."""
        BM: gl.constexpr = e_r.shape[0]
        if stride_rs == 1:  # scales in tile order: a warp's store covers 64 consecutive rows of one block
            run_l: gl.constexpr = gl.BlockedLayout([2, 1], [32, 1], [num_warps // NB, NB], [0, 1])
            rows_run = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, run_l))
            kb_run = kt * NB + gl.arange(0, NB, layout=gl.SliceLayout(0, run_l))
            gl.store(row_s_ptr + gl.expand_dims(rows_run, 1) + gl.expand_dims(kb_run, 0) * stride_rsk,
                     gl.convert_layout(e_r, run_l),
                     mask=gl.expand_dims(rows_run < row_end, 1) & gl.expand_dims(kb_run * MX_BLOCK < K, 0))
        else:
            kb = kt * NB + gl.arange(0, NB, layout=gl.SliceLayout(0, e_r.type.layout))
            gl.store(row_s_ptr + gl.expand_dims(rows.to(gl.int64), 1) * stride_rs
                     + gl.expand_dims(kb, 0) * stride_rsk, e_r,
                     mask=gl.expand_dims(rows < row_end, 1) & gl.expand_dims(kb * MX_BLOCK < K, 0))

    @gluon.jit
    def _cast_tile_mx(tile, col_stage, row_ptr, row_s_ptr, col_ptr, col_s_ptr, row0, row_end, sblk, kt, M, K,
                      stride_rs, stride_rsk, stride_cs, stride_csm, FMT_MAX: gl.constexpr, OUT_DTYPE: gl.constexpr,
                      EMAX: gl.constexpr, ROUND_UP: gl.constexpr, ROWWISE: gl.constexpr, COLWISE: gl.constexpr,
                      ROW_VALUES: gl.constexpr, COL_VALUES: gl.constexpr, num_warps: gl.constexpr):
        """MXFP8 of one bf16 tile: an E8M0 exponent per 32 values of a row and per 32 rows of a column,
        from the tile read as words of two values (see _cast_tile_bf16). Rowwise, a thread holds 4
        words of a 16-word block (4 lanes a block); columnwise, 32 rows of one word, so a column
        block's amax never leaves the thread. ROW_VALUES / COL_VALUES: that copy's exact bf16 values
        (`_exact_pairs`) go to row_ptr / col_ptr, [M, K] like x, in place of its codes and scales."""
        BM: gl.constexpr = tile.shape[0]
        BW: gl.constexpr = tile.shape[1] // 2  # words per tile row
        NB: gl.constexpr = BW * 2 // MX_BLOCK  # blocks per tile row
        WB: gl.constexpr = MX_BLOCK // 2  # words per block
        RB: gl.constexpr = BM // MX_BLOCK  # blocks per tile column
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        w0 = kt * BW
        if ROWWISE:
            # [rows, blocks, words of the block]
            row_l: gl.constexpr = gl.BlockedLayout([1, 1, WB // 4], [32 // (NB * 4), NB, 4], [num_warps, 1, 1],
                                                   [2, 1, 0])
            wr = sm90.reinterpret(tile, gl.int32, [BM, NB, WB], plain).load(row_l)
            packed_r = gl.reduce(wr & 0x7FFF7FFF, 2, _max_u16x2)
            amax_r = bits_to_float(gl.maximum(packed_r << 16, packed_r & -65536))  # [BM, NB]
            mult_r, e_r = _mx_multiplier(amax_r, FMT_MAX, EMAX, ROUND_UP)
            bl2: gl.constexpr = gl.SliceLayout(2, row_l)  # [rows, blocks]
            wl2: gl.constexpr = gl.SliceLayout(0, row_l)  # [blocks, words of the block]
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, bl2))
            words = (w0 + gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(1, wl2)), 1) * WB
                     + gl.expand_dims(gl.arange(0, WB, layout=gl.SliceLayout(0, wl2)), 0))
            rows3 = gl.expand_dims(gl.expand_dims(rows.to(gl.int64), 1), 2)
            mask_r = (rows3 < row_end) & gl.expand_dims(words < K // 2, 0)
            if ROW_VALUES:
                s3 = gl.expand_dims(mult_r, 2)
                u3 = gl.expand_dims(_mx_unit(e_r), 2)
                gl.store(row_ptr.to(gl.pointer_type(gl.int32)) + rows3 * (K // 2) + gl.expand_dims(words, 0),
                         _exact_pairs(wr, s3, s3, u3, u3, OUT_DTYPE), mask=mask_r)
            else:
                q = _row_codes(wr, gl.expand_dims(mult_r, 2), OUT_DTYPE)
                gl.store(row_ptr.to(gl.pointer_type(gl.int16)) + rows3 * (K // 2) + gl.expand_dims(words, 0), q,
                         mask=mask_r)
                _store_row_exponents(e_r, row_s_ptr, row0, row_end, rows, kt, K, stride_rs, stride_rsk, NB,
                                     num_warps)
        if COLWISE:
            # [row blocks, rows of the block, words]: a thread holds a block's rows of one word
            col_l: gl.constexpr = gl.BlockedLayout([1, MX_BLOCK, 1], [1, 1, 32], [RB, 1, num_warps // RB], [1, 2, 0])
            wc = sm90.reinterpret(tile, gl.int32, [RB, MX_BLOCK, BW], plain).load(col_l)
            cl2: gl.constexpr = gl.SliceLayout(1, col_l)  # [row blocks, words]
            rl2: gl.constexpr = gl.SliceLayout(2, col_l)  # [row blocks, rows of the block]
            rb = gl.arange(0, RB, layout=gl.SliceLayout(1, cl2))
            rows = (row0 + gl.expand_dims(gl.arange(0, RB, layout=gl.SliceLayout(1, rl2)), 1) * MX_BLOCK
                    + gl.expand_dims(gl.arange(0, MX_BLOCK, layout=gl.SliceLayout(0, rl2)), 0))
            magnitude = gl.expand_dims(gl.where(rows < row_end, 0x7FFF7FFF, 0), 2)  # rows of the group only
            packed_c = gl.reduce(wc & magnitude, 1, _max_u16x2)  # [RB, BW]
            mult_lo, e_lo = _mx_multiplier(bits_to_float(packed_c << 16), FMT_MAX, EMAX, ROUND_UP)
            mult_hi, e_hi = _mx_multiplier(bits_to_float(packed_c & -65536), FMT_MAX, EMAX, ROUND_UP)
            if COL_VALUES:  # the values in x's own layout: a warp stores 32 consecutive words of a row
                words_c = w0 + gl.arange(0, BW, layout=gl.SliceLayout(0, cl2))
                v = _exact_pairs(wc, gl.expand_dims(mult_lo, 1), gl.expand_dims(mult_hi, 1),
                                 gl.expand_dims(_mx_unit(e_lo), 1), gl.expand_dims(_mx_unit(e_hi), 1), OUT_DTYPE)
                rows3c = gl.expand_dims(rows.to(gl.int64), 2)
                gl.store(col_ptr.to(gl.pointer_type(gl.int32)) + rows3c * (K // 2)
                         + gl.expand_dims(gl.expand_dims(words_c, 0), 1), v,
                         mask=(rows3c < row_end) & gl.expand_dims(gl.expand_dims(words_c < K // 2, 0), 1))
            else:
                even = 2 * (w0 + gl.arange(0, BW, layout=gl.SliceLayout(0, cl2)))  # column of each low half
                s_ptrs = (col_s_ptr + gl.expand_dims(even.to(gl.int64), 0) * stride_cs
                          + (sblk + gl.expand_dims(rb, 1)) * stride_csm)
                s_ok = gl.expand_dims(row0 + rb * MX_BLOCK < row_end, 1) & gl.expand_dims(even < K, 0)
                if stride_cs == 1:  # scales in tile order: a column pair's two bytes as one 16-bit store
                    gl.store(s_ptrs.to(gl.pointer_type(gl.uint16)), e_lo.to(gl.uint16) | (e_hi.to(gl.uint16) << 8),
                             mask=s_ok)
                else:
                    gl.store(s_ptrs, e_lo, mask=s_ok)
                    gl.store(s_ptrs + stride_cs, e_hi, mask=s_ok)  # K is even: the high half's column is in range
                lo, hi = _bf16_pairs_to_float(wc)
                q_lo = gl.reshape(cast_codes(lo * gl.expand_dims(mult_lo, 1), FMT_MAX, OUT_DTYPE), [BM, BW])
                q_hi = gl.reshape(cast_codes(hi * gl.expand_dims(mult_hi, 1), FMT_MAX, OUT_DTYPE), [BM, BW])
                col_stage.slice(0, BM, dim=1).permute([1, 0]).store(q_lo)
                col_stage.slice(BM, BM, dim=1).permute([1, 0]).store(q_hi)

    # M stays specialised: as the columnwise copy's row stride, its divisibility by 16 lets the
    # columnwise codes leave as 16-byte vectors
    @gluon.jit(do_not_specialize=["G"])
    def fp8_block_cast_kernel(x_desc, row_ptr, row_s_ptr, col_ptr, col_s_ptr, splits_ptr, probs_ptr,
                              M, K, G, eps, stride_rs, stride_rsk, stride_cs, stride_csm,
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
        bf16 values in x's layout, in place of its codes (`_cast_tile_mx`)."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        GLU: gl.constexpr = ACT >= 0
        bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES if GLU else STAGES, BM, BK], x_desc.layout)
        if GLU:
            act_tile = gl.allocate_shared_memory(x_desc.dtype, [BM, BK], x_desc.layout)
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
            if j < mine:
                _issue(x_desc, bufs, ready, _tile_of(first_tile, j, NUM_PROGRAMS, TILE_GROUP), j, nk, nm, M, K, gi,
                       starts, sizes, tiles, tile_end, BM, BK, GROUPED, TILE_GROUP, GLU, GLU_BLOCK)

        prev_row0 = -1  # the last tile's first row and column tile (column strips: the carried lines)
        prev_kt = -1
        for i in range(mine):
            sm90.thread_barrier()  # every warp is done with the slot the next load overwrites
            nxt = i + STAGES - 1
            if nxt < mine:
                _issue(x_desc, bufs, ready, _tile_of(first_tile, nxt, NUM_PROGRAMS, TILE_GROUP), nxt % STAGES, nk,
                       nm, M, K, gi, starts, sizes, tiles, tile_end, BM, BK, GROUPED, TILE_GROUP, GLU, GLU_BLOCK)
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            row0, row_end, sblk, kt = _locate(_tile_of(first_tile, i, NUM_PROGRAMS, TILE_GROUP), nk, nm, M, gi,
                                              starts, sizes, tiles, tile_end, first_block, BM, SB, GROUPED,
                                              TILE_GROUP)
            col_stage = col_stages.index(i % NSTAGE)
            if GLU:
                _activate_tile(bufs.index(2 * slot), bufs.index(2 * slot + 1), act_tile, probs_ptr, row0, kt * BK,
                               M, K, ACT, num_warps)
                sm90.thread_barrier()  # the activated tile is whole before any warp reads it
                tile = act_tile
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
GROUPED_TILE_GROUP = 0
_SCRATCH = 8192  # shared memory the kernel takes besides its buffers (barriers, reductions' scratch)


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
    if act != NO_ACTIVATION:
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
               **_dispatched(DISPATCH if rowwise else DISPATCH_COLUMNWISE, splits))
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
               **_dispatched(DISPATCH, splits))
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
    x is h [M, 2K] and the quantized input act(h) * probs, as fp8_block_op's.
    The scale outputs may have any strides (the dispatched path's are transposed). values (MX only):
    (rowwise, columnwise) copies as exact bf16 values into row / col, [M, K] bf16 each, no scales."""
    if any(values) and mx is None:
        raise ValueError("exact values are written for MXFP8 only")
    m, k = x.shape[0], input_width(x, act)
    row_s, col_s = (s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s for s in (row_s, col_s))
    grouped = splits is not None
    upper = -(-m // _TILE) + (num_groups if grouped else 0)
    if programs is None:
        programs = min(upper * -(-k // _TILE), num_sms(x.device) * per_sm)
    words = packed and x.dtype == torch.bfloat16
    tile_bytes = _TILE * _TILE * x.element_size()
    glu = act != NO_ACTIVATION
    smem = stages * tile_bytes * (2 if glu else 1) + (tile_bytes if glu else 0) + 2 * _TILE * _TILE
    if tile_group == 0 and (not columnwise or values[1] or m % 16 or smem > sm90.SMEM_BYTES - _SCRATCH):
        tile_group = DISPATCH["tile_group"]  # nothing to carry (no columnwise copy, or rows off 16), or no room
    if stage_phase is None:  # a store instruction writes rows 2 apart (words of bf16), 4 apart (fp32 reads)
        stage_phase = 2 if words or mx is not None else 4
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=torch.finfo(x.dtype).bits, rank=2)
    desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [_TILE, _TILE], layout)
    fp8_block_cast_kernel[(programs,)](
        desc, row.view(torch.uint8), row_s, col.view(torch.uint8), col_s, splits if grouped else row_s,
        probs if probs is not None else row_s, m, k, num_groups, amax_epsilon,
        *(row_s.stride() if row_s.dim() == 2 else (0, 1)), *(col_s.stride() if col_s.dim() == 2 else (0, 1)),
        FMT_MAX=fmt_max, OUT_DTYPE=out_code, POW2=power_2_scale, BLOCK_2D=two_d, ROWWISE=rowwise,
        COLWISE=columnwise, GROUPED=grouped, GP=max(32, group_pow2(num_groups)), STAGES=stages, NUM_PROGRAMS=programs,
        VEC=16 // x.element_size(), PACKED=words, MX=mx is not None,
        EMAX=mx[0] if mx else 0, ROUND_UP=bool(mx and mx[1]), STAGE_PHASE=stage_phase, TILE_GROUP=tile_group,
        ACT=act, GLU_BLOCK=glu_block, ROW_VALUES=bool(values[0]), COL_VALUES=bool(values[1]), num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
