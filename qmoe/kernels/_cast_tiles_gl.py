"""One 128 x 128 tile of the block casts, in shared memory, to FP8 codes and scales (or MXFP8's
exact values): the per-tile bodies of `_cast_transpose_gl.fp8_block_cast_kernel`, which brings
the tiles in and carries the columnwise codes out (its docstring tells the whole kernel).

Three bodies, by input and format: `_cast_tile` reads the tile as fp32 (any input dtype),
`_cast_tile_bf16` reads bf16 as 32-bit words of two values (amaxes over packed 16-bit
magnitudes, conversions to fp32 by shifts), `_cast_tile_mx` does the same for MXFP8's 32-value
E8M0 blocks and can write a copy's exact bf16 values in place of its codes. Each reads the tile
once per orientation, with a layout in which a thread holds a run of one row, then one in which
it holds a run of one column: no transpose in registers. Columnwise codes go to `col_stage`, a
row per column, for the kernel to store.
"""
from __future__ import annotations

import triton

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.kernels._arith import (abs_bits, bits_to_float, cast_codes, exp2_int, fp8_scale_from_amax, mx_exponent,
                                scale_inverse)
from qmoe.kernels._gluon_sm90 import gluon

MX_VALUES = 32  # values per MXFP8 scale block

if gluon is not None:
    from qmoe.kernels._gluon_sm90 import gl

    MX_BLOCK = gl.constexpr(MX_VALUES)

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

    @triton.constexpr_function
    def _pairs(out_dtype):
        """PTX's name for a pair of codes of the FP8 dtype `out_dtype` (e4m3x2 or e5m2x2)."""
        return "e4m3x2" if out_dtype == gl.float8e4nv else "e5m2x2"

    @gluon.jit
    def _row_codes(w, s, OUT_DTYPE: gl.constexpr):
        """Codes of both bf16 values of each word times s, as one int16 (the low value's code in
        the low byte): the same multiply and saturating round-to-nearest-even as cast_codes."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 l, h; shl.b32 l, $1, 16; and.b32 h, $1, 0xFFFF0000; "
            "mul.rn.f32 l, l, $2; mul.rn.f32 h, h, $2; cvt.rn.satfinite." + _pairs(OUT_DTYPE) + ".f32 $0, h, l; }",
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
        fmt: gl.constexpr = _pairs(OUT_DTYPE)
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
