"""One 128 x 128 bf16 tile of NVFP4's Gluon cast (1 x 16 blocks), in shared memory, to packed
E2M1 codes and E4M3 block scales, or the rowwise copy's exact values: the per-tile body of
`_cast_transpose_gl.fp8_block_cast_kernel` for NVFP4 (its docstring tells the whole kernel: TMA
ring, persistent programs, groups, a fused GLU), dispatched from `quantize_nvfp4.nvfp4_op`.

Same bits as `quantize_nvfp4._nvfp4_kernel` from the same elementwise arithmetic (`_e2m1`), but
for the Hadamard transform's rounding; the tensor amaxes come from that module's amax launch,
which also zeroes the columnwise bytes of groups that start on an odd row. The tile is read as
words of two bf16 values, once per layout:

- rows: a thread holds one block (8 words), so its amax, scale, codes and the two words of packed
  codes never leave the thread;
- columns: a thread holds 16 rows of one word, a 16-row block of two columns, so the columnwise
  blocks, the 16-point Hadamard transform (four butterflies) and the packing along M stay in the
  thread: no transpose, which is what holds the Triton kernel's columnwise copy back.

Columnwise codes are packed along M, two rows per byte, 16 rows to two words, stored straight
from registers. Where a tile's rows are not whole words of that copy (a group starting on a row
not a multiple of 8, or ending inside the tile) it stores bytes, and nibbles of bytes two groups
share with atomic ORs, as the Triton kernel does. Not here (`unsupported_nvfp4` sends them to the
Triton kernel): 16 x 16 blocks (the Triton kernel, which computes their codes once for both
copies, is faster), stochastic rounding, and columnwise copies as values.
"""
from __future__ import annotations

import triton

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.kernels._arith import abs_bits, bits_to_float, clamp_nan, reciprocal
from qmoe.kernels._e2m1 import E2M1_MAX, block_scale, e2m1_codes, e2m1_round, tensor_scale
from qmoe.kernels._gluon_sm90 import gluon
from qmoe.kernels._tiles import RHT_SIGN_MASK

NVFP4_VALUES = 16  # values per NVFP4 scale block

if gluon is not None:
    from qmoe.kernels._cast_tiles_gl import _bf16_pairs_to_float, _max_u16x2
    from qmoe.kernels._gluon_sm90 import gl

    NV_BLOCK = gl.constexpr(NVFP4_VALUES)
    RHT_MASK = gl.constexpr(RHT_SIGN_MASK)

    @triton.constexpr_function
    def _axis_only(layout, rank, axis):
        """The 1-D layout of `axis` of a rank-`rank` layout: every other axis sliced away, the
        highest first (what expand_dims over the others, lowest first, undoes)."""
        for d in reversed(range(rank)):
            if d != axis:
                layout = gl.SliceLayout(d, layout)
        return layout

    @gluon.jit
    def _iota(n: gl.constexpr, layout: gl.constexpr, rank: gl.constexpr, axis: gl.constexpr):
        """0 .. n - 1 along `axis` of a rank-`rank` tensor in `layout`, size 1 along the others."""
        x = gl.arange(0, n, layout=_axis_only(layout, rank, axis))
        for d in gl.static_range(rank):
            if d != axis:
                x = gl.expand_dims(x, d)
        return x

    @gluon.jit
    def _pack(v, rank: gl.constexpr, axis: gl.constexpr, BITS: gl.constexpr):
        """Fields v (each below 2^BITS) along `axis`, which one thread holds, as one integer:
        field i at bit i * BITS."""
        L: gl.constexpr = v.type.layout
        N: gl.constexpr = v.shape[axis]
        return gl.sum(v << (_iota(N, L, rank, axis) * BITS), axis)

    @gluon.jit
    def _bf16_word(lo, hi):
        """Two fp32 values rounded to bf16 (as .to(bfloat16)), as one word: lo in the low half."""
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _halves(w, enc_lo, enc_hi):
        """Both bf16 values of each word times their encode multipliers, clamped to E2M1's range."""
        lo, hi = _bf16_pairs_to_float(w)
        return clamp_nan(lo * enc_lo, -E2M1_MAX, E2M1_MAX), clamp_nan(hi * enc_hi, -E2M1_MAX, E2M1_MAX)

    @gluon.jit
    def _values(y_lo, y_hi, s_lo, s_hi):
        """The exact values q * s_b of both halves, as a word of two bf16 (as `store_values`)."""
        return _bf16_word(e2m1_round(y_lo, False, 0.0) * s_lo, e2m1_round(y_hi, False, 0.0) * s_hi)

    @gluon.jit
    def _rows_1x16(tile, row_ptr, row_s_ptr, s_enc, row0, row_end, kt, K, stride_rs, stride_rsk,
                   VALUES: gl.constexpr, num_warps: gl.constexpr):
        """The rowwise copy of a tile in 1 x 16 blocks: a thread holds one block, as [2, 4] words."""
        BM: gl.constexpr = tile.shape[0]
        NB: gl.constexpr = tile.shape[1] // NV_BLOCK
        L: gl.constexpr = gl.BlockedLayout([1, 1, 2, 4], [32 // NB, NB, 1, 1], [num_warps, 1, 1, 1], [3, 2, 1, 0])
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
        w = sm90.reinterpret(tile, gl.int32, [BM, NB, 2, 4], plain).load(L)
        packed = gl.reduce(gl.reduce(w & 0x7FFF7FFF, 3, _max_u16x2), 2, _max_u16x2)  # [BM, NB]
        sb, enc = block_scale(bits_to_float(gl.maximum(packed << 16, packed & -65536)), s_enc, reciprocal(s_enc))
        enc4 = gl.expand_dims(gl.expand_dims(enc, 2), 3)
        y_lo, y_hi = _halves(w, enc4, enc4)
        rows = row0 + _iota(BM, L, 4, 0)
        blocks = kt * NB + _iota(NB, L, 4, 1)  # column blocks of x
        ok = (rows < row_end) & (blocks * NV_BLOCK < K)
        if VALUES:
            s4 = gl.expand_dims(gl.expand_dims(sb.to(gl.float32), 2), 3)
            words = blocks * (NV_BLOCK // 2) + _iota(2, L, 4, 2) * 4 + _iota(4, L, 4, 3)
            gl.store(row_ptr.to(gl.pointer_type(gl.int32)) + rows.to(gl.int64) * (K // 2) + words,
                     _values(y_lo, y_hi, s4, s4), mask=ok)
        else:
            codes = e2m1_codes(y_lo, False, 0.0) | (e2m1_codes(y_hi, False, 0.0) << 4)  # a byte per word
            L3: gl.constexpr = gl.SliceLayout(3, L)
            rows3 = row0 + _iota(BM, L3, 3, 0)
            blocks3 = kt * NB + _iota(NB, L3, 3, 1)
            gl.store(row_ptr.to(gl.pointer_type(gl.int32)) + rows3.to(gl.int64) * (K // 8) + blocks3 * 2
                     + _iota(2, L3, 3, 2), _pack(codes, 4, 3, 8),
                     mask=(rows3 < row_end) & (blocks3 * NV_BLOCK < K))
            L2: gl.constexpr = gl.SliceLayout(2, L3)
            rows2 = row0 + _iota(BM, L2, 2, 0)
            blocks2 = kt * NB + _iota(NB, L2, 2, 1)
            gl.store(row_s_ptr + rows2.to(gl.int64) * stride_rs + blocks2 * stride_rsk, sb.to(gl.uint8, bitcast=True),
                     mask=(rows2 < row_end) & (blocks2 * NV_BLOCK < K))

    @gluon.jit
    def _store_col_codes(col_ptr, c, row0, row_end, kt, K, M, HALF: gl.constexpr):
        """Store the columnwise codes c [RB, 2, 2, 2, 2, NB, 8] (rows: 16 per block, by bit from the
        highest; words of the tile) of the columns 2w + HALF into col [K, M / 2] bytes, two rows to a
        byte: as words where the tile is whole and starts on a word of that copy, else as bytes, with
        the nibbles of a byte another group shares (the group starts or ends on an odd row) ORed in
        atomically into bytes zeroed before."""
        P: gl.constexpr = c.type.layout
        RB: gl.constexpr = c.shape[0]
        NB: gl.constexpr = c.shape[5]
        BW: gl.constexpr = NB * 8
        bytes_ = _pack(c, 7, 4, 4)  # [RB, 2, 2, 2, NB, 8]: rows 2i and 2i + 1
        if (row0 % 8 == 0) & (row0 + RB * NV_BLOCK <= row_end) & (M % 8 == 0):
            words = _pack(_pack(bytes_, 6, 3, 8), 5, 2, 16)  # [RB, 2, NB, 8]: 8 rows per word
            W: gl.constexpr = words.type.layout
            cols_w = 2 * (kt * BW + _iota(NB, W, 4, 2) * 8 + _iota(8, W, 4, 3)) + HALF
            first = (row0 // 8) + _iota(RB, W, 4, 0) * 2 + _iota(2, W, 4, 1)
            gl.store(col_ptr.to(gl.pointer_type(gl.int32)) + cols_w.to(gl.int64) * (M // 8) + first, words,
                     mask=cols_w < K)
        else:
            rows = _block_rows(row0, RB, P)
            cols = 2 * (kt * BW + _iota(NB, P, 7, 5) * 8 + _iota(8, P, 7, 6)) + HALF
            ok = (rows < row_end) & (cols < K)
            if row0 % 2 == 0:  # whole bytes of this group as bytes; the last one, if shared, below
                B: gl.constexpr = bytes_.type.layout
                cols_b = 2 * (kt * BW + _iota(NB, B, 6, 4) * 8 + _iota(8, B, 6, 5)) + HALF
                even = row0 + _iota(RB, B, 6, 0) * NV_BLOCK + _iota(2, B, 6, 1) * 8 + _iota(2, B, 6, 2) * 4 + \
                    _iota(2, B, 6, 3) * 2
                gl.store(col_ptr + cols_b.to(gl.int64) * (M // 2) + even // 2, bytes_.to(gl.uint8),
                         mask=(even + 1 < row_end) & (cols_b < K))
                shared = ok & (rows == row_end - 1) & (row_end % 2 == 1)
            else:
                shared = ok
            byte = cols.to(gl.int64) * (M // 2) + rows // 2
            shift = ((byte & 3) * 8).to(gl.int32) + (rows % 2) * 4
            gl.atomic_or(col_ptr.to(gl.pointer_type(gl.int32)) + (byte >> 2), c << shift, mask=shared & (c != 0))

    @gluon.jit
    def _block_rows(row0, RB: gl.constexpr, P: gl.constexpr):
        """The rows of a [RB, 2, 2, 2, 2, ...] tensor in layout P: 16 per block, by bit from the highest."""
        return (row0 + _iota(RB, P, 7, 0) * NV_BLOCK + _iota(2, P, 7, 1) * 8
                + _iota(2, P, 7, 2) * 4 + _iota(2, P, 7, 3) * 2 + _iota(2, P, 7, 4))

    @gluon.jit
    def _butterfly(v, AXIS: gl.constexpr):
        """One step of the Walsh-Hadamard transform along the size-2 axis AXIS of a rank-7 v, which one
        thread holds: (a, b) -> (a + b, a - b)."""
        L: gl.constexpr = v.type.layout
        first = _iota(2, L, 7, AXIS) == 0
        total = gl.expand_dims(gl.sum(v, AXIS), AXIS)
        diff = gl.expand_dims(gl.sum(gl.where(first, v, -v), AXIS), AXIS)
        return gl.where(first, total, diff)

    @gluon.jit
    def _hadamard(w, row_ok):
        """The random Hadamard transform of every 16-row block of both columns of each word (rows of
        another group as zeros, as the Triton kernel loads them): signs, then the four butterflies of
        the 16-point transform in each thread, then 1/4 (fp32; the Triton kernel's product sums in
        another order, so they agree to fp32 rounding, exactly where every sum is exact)."""
        L: gl.constexpr = w.type.layout
        pos = _iota(2, L, 7, 1) * 8 + _iota(2, L, 7, 2) * 4 + _iota(2, L, 7, 3) * 2 + _iota(2, L, 7, 4)
        neg = (RHT_MASK >> pos) & 1
        lo, hi = _bf16_pairs_to_float(gl.where(row_ok, w ^ ((neg << 31) | (neg << 15)), 0))
        for axis in gl.static_range(1, 5):
            lo = _butterfly(lo, axis)
            hi = _butterfly(hi, axis)
        return lo * 0.25, hi * 0.25

    @gluon.jit
    def _block_amax(v):
        """max|v| (NaN wins) over each 16-row block of a [RB, 2, 2, 2, 2, NB, 8] fp32 tensor -> [RB, NB, 8]."""
        b = abs_bits(v)
        return bits_to_float(gl.max(gl.max(gl.max(gl.max(b, 4), 3), 2), 1))

    @gluon.jit
    def _columns(tile, col_ptr, col_s_ptr, s_enc, row0, row_end, sblk, kt, M, K, stride_cs, stride_csm,
                 RHT: gl.constexpr, num_warps: gl.constexpr):
        """The columnwise copy, 1 x 16 blocks along M (after the Hadamard transform with RHT), from the
        tile read as [row blocks, four bits of the row in the block, word blocks, 8 words]: a thread
        holds a 16-row block of one word, two columns."""
        BM: gl.constexpr = tile.shape[0]
        BW: gl.constexpr = tile.shape[1] // 2
        RB: gl.constexpr = BM // NV_BLOCK
        NB: gl.constexpr = BW // 8
        P: gl.constexpr = gl.BlockedLayout([1, 2, 2, 2, 2, 1, 1], [1, 1, 1, 1, 1, 4, 8], [num_warps, 1, 1, 1, 1, 1, 1],
                                           [6, 5, 4, 3, 2, 1, 0])
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[6, 5, 4, 3, 2, 1, 0])
        w = sm90.reinterpret(tile, gl.int32, [RB, 2, 2, 2, 2, NB, 8], plain).load(P)
        ok = _block_rows(row0, RB, P) < row_end  # rows of the group only
        if RHT:
            lo, hi = _hadamard(w, ok)
            amax_lo = _block_amax(lo)
            amax_hi = _block_amax(hi)
        else:
            lo, hi = _bf16_pairs_to_float(w)
            m = w & gl.where(ok, 0x7FFF7FFF, 0)
            a = gl.reduce(gl.reduce(gl.reduce(gl.reduce(m, 4, _max_u16x2), 3, _max_u16x2), 2, _max_u16x2), 1,
                          _max_u16x2)  # [RB, NB, 8]: max|x| of both columns of each word over its 16 rows
            amax_lo = bits_to_float(a << 16)
            amax_hi = bits_to_float(a & -65536)
        C3: gl.constexpr = amax_lo.type.layout
        s_lo, enc_lo = block_scale(amax_lo, s_enc, reciprocal(s_enc))
        s_hi, enc_hi = block_scale(amax_hi, s_enc, reciprocal(s_enc))
        even = 2 * (kt * BW + _iota(NB, C3, 3, 1) * 8 + _iota(8, C3, 3, 2))  # column of each low half
        s_ptrs = col_s_ptr + even.to(gl.int64) * stride_cs + (sblk + _iota(RB, C3, 3, 0)) * stride_csm
        s_ok = (row0 + _iota(RB, C3, 3, 0) * NV_BLOCK < row_end) & (even < K)
        gl.store(s_ptrs, s_lo.to(gl.uint8, bitcast=True), mask=s_ok)
        gl.store(s_ptrs + stride_cs, s_hi.to(gl.uint8, bitcast=True), mask=s_ok)
        e_lo = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(enc_lo, 1), 2), 3), 4)
        e_hi = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(enc_hi, 1), 2), 3), 4)
        y_lo = clamp_nan(lo * e_lo, -E2M1_MAX, E2M1_MAX)
        y_hi = clamp_nan(hi * e_hi, -E2M1_MAX, E2M1_MAX)
        _store_col_codes(col_ptr, e2m1_codes(y_lo, False, 0.0), row0, row_end, kt, K, M, 0)
        _store_col_codes(col_ptr, e2m1_codes(y_hi, False, 0.0), row0, row_end, kt, K, M, 1)

    @gluon.jit
    def _cast_tile_nvfp4(tile, row_ptr, row_s_ptr, col_ptr, col_s_ptr, amax, col_amax, row0, row_end, sblk, kt, M,
                         K, stride_rs, stride_rsk, stride_cs, stride_csm, ROWWISE: gl.constexpr, COLWISE: gl.constexpr,
                         ROW_VALUES: gl.constexpr, RHT: gl.constexpr, num_warps: gl.constexpr):
        """NVFP4 of one bf16 tile whose group's tensor amaxes are `amax` and, for the columnwise copy,
        `col_amax` (see the module docstring)."""
        if ROWWISE:
            _rows_1x16(tile, row_ptr, row_s_ptr, tensor_scale(amax), row0, row_end, kt, K, stride_rs, stride_rsk,
                       ROW_VALUES, num_warps)
        if COLWISE:
            _columns(tile, col_ptr, col_s_ptr, tensor_scale(col_amax), row0, row_end, sblk, kt, M, K, stride_cs,
                     stride_csm, RHT, num_warps)
