"""How the Gluon casts' columnwise codes leave (private helper of `qmoe/kernels/_cast_transpose_gl.py`):
a tile's codes, staged in shared memory a row per column, go to the columnwise copy [K, M] as
128-byte runs of a row each, or, where a group starts inside a line of that copy, as the aligned
lines two row tiles share, the previous tile's last rows carried in a second stage.

Where a group starts on 16 rows but not on a line (a layer's expert groups are padded to 16 or
32 rows, not to the cast's 128-row tiles), every run would straddle two lines; the casts walk
such inputs in column strips (`_cast_walk_gl`), so the tile above was cast just before and its
rows can complete the line.
"""
from __future__ import annotations

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.kernels._gluon_sm90 import gluon

if gluon is not None:
    from qmoe.kernels._gluon_sm90 import gl

    @gluon.jit
    def _write_column_runs(stage, first, step, K, col_ptr, row0, row_end, M, BM: gl.constexpr,
                           num_warps: gl.constexpr):
        """Store the staged columnwise codes: stage [n, BM] holds in row i the codes of column
        first + i * step for rows row0 + [0, BM) of the tile, and col is [K, M]. A thread stores 16
        bytes, a row of the stage leaves as one 128-byte line: 16-byte vectors where the tile is
        whole and starts on 16 rows, masked bytes otherwise."""
        out_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BM // 16), BM // 16], [num_warps, 1], [1, 0])
        q = stage.load(out_l)
        cols = first + step * gl.arange(0, stage.shape[0], layout=gl.SliceLayout(1, out_l))
        offs = gl.arange(0, BM, layout=gl.SliceLayout(0, out_l))
        base = col_ptr + cols.to(gl.int64)[:, None] * M
        if (row0 + BM <= row_end) & (row0 % 16 == 0):
            rows = (row0 // 16) * 16 + offs  # the same rows, visibly 16-aligned
            gl.store(base + rows[None, :], q, mask=(cols < K)[:, None])
        else:
            rows = row0 + offs
            gl.store(base + rows[None, :], q, mask=(cols < K)[:, None] & (rows < row_end)[None, :])

    @gluon.jit
    def _shuffle(v, lane):
        """v of lane `lane` of the warp, per element (every lane takes part)."""
        return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, -1;", "=r,r,r", [v, lane],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _write_column_lines(prev, cur, first, step, K, col_ptr, row0, M, carry, flush, BM: gl.constexpr,
                            num_warps: gl.constexpr):
        """_write_column_runs for a whole tile whose first row is 16-aligned but not BM-aligned (a
        group starting inside a 128-byte line of the columnwise copy), as whole lines: each row of
        the stage leaves as the aligned line that holds its first rows, completed in front by the
        previous tile's last rows when `carry` (that tile, the row tile above in the same group,
        was cast just before into `prev`, and left them unwritten); with `flush`, the tile's own
        last rows then go out too, as the front of the next line. Stores that straddle two lines
        run the copy far below the bandwidth. The stages are read as words, 16-byte chunks on
        consecutive lanes; a line's chunk comes from the lane that holds it (a warp shuffle)."""
        CH: gl.constexpr = BM // 16  # 16-byte chunks per row of the stage
        LR: gl.constexpr = 32 // CH  # rows of the stage per warp and pass
        out_l: gl.constexpr = gl.BlockedLayout([1, 4], [LR, CH], [num_warps, 1], [1, 0])
        qc = cur.load(out_l)
        qp = prev.load(out_l)
        r = gl.arange(0, cur.shape[0], layout=gl.SliceLayout(1, out_l))
        w = gl.arange(0, BM // 4, layout=gl.SliceLayout(0, out_l))
        shift = (row0 % BM) // 16  # chunks of the line in front of the tile's first row
        chunk = gl.expand_dims(w // 4, 0)
        lane = gl.expand_dims((r % LR) * CH, 1) + ((chunk - shift) & (CH - 1))
        mine = _shuffle(qc, lane)  # the line's chunk from this tile; in front of it, from the previous
        cols = first + step * r
        base = (col_ptr.to(gl.pointer_type(gl.int32)) + gl.expand_dims(cols.to(gl.int64) * (M // 4), 1)
                + (row0 // BM) * (BM // 4) + gl.expand_dims(w, 0))
        ok = gl.expand_dims(cols < K, 1)
        gl.store(base, gl.where(chunk >= shift, mine, _shuffle(qp, lane)), mask=ok & ((chunk >= shift) | carry))
        if flush:
            gl.store(base + BM // 4, mine, mask=ok & (chunk < shift))

    @gluon.jit
    def _store_columns(cur, stages, i, kt, K, col_ptr, row0, row_end, M, carry, flush, HALVES: gl.constexpr,
                       LINES: gl.constexpr, PHASE: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                       num_warps: gl.constexpr):
        """Store the columnwise codes of the program's i-th tile, staged in `cur`, one of `stages`
        (LINES: stages[i % 2], the previous tile's in the other one), a row per column (HALVES: a
        row per pair of columns, the low column's codes then the high one's): as whole lines
        (_write_column_lines) where LINES and the tile allows, else as runs (_write_column_runs).
        PHASE: the stages' swizzle (rows per phase of 16-byte chunks)."""
        STEP: gl.constexpr = 2 if HALVES else 1
        # lines for a whole tile that starts on 16 rows inside a line (an aligned one's runs are lines)
        if LINES and (row0 % 16 == 0) & (row0 % BM != 0) & (row0 + BM <= row_end) & (M % 16 == 0):
            n: gl.constexpr = cur.shape[0]
            W: gl.constexpr = cur.shape[1] // 4
            word_l: gl.constexpr = gl.SwizzledSharedLayout(4, PHASE, 8, order=[1, 0])
            pw = sm90.reinterpret(stages.index((i + 1) % 2), gl.int32, [n, W], word_l)
            cw = sm90.reinterpret(cur, gl.int32, [n, W], word_l)
            for half in gl.static_range(STEP):
                _write_column_lines(pw.slice(half * (BM // 4), BM // 4, dim=1),
                                    cw.slice(half * (BM // 4), BM // 4, dim=1),
                                    kt * BK + half, STEP, K, col_ptr, row0, M, carry, flush, BM, num_warps)
        else:
            for half in gl.static_range(STEP):
                _write_column_runs(cur.slice(half * BM, BM, dim=1), kt * BK + half, STEP, K, col_ptr, row0, row_end,
                                   M, BM, num_warps)
