"""The Gluon casts' walk over their tiles (private helper of `qmoe/kernels/_cast_transpose_gl.py`):
which 128 x 128 tile a persistent program takes next, where its rows lie when the input is
grouped, and the TMA load that puts it (or, for a fused GLU, its gate and linear halves) into a
slot of the program's ring.

A gathered input (a `GatheredRows`: each row read from its source row by an index) cannot come by
TMA, which loads boxes: each thread copies its 16-byte pieces of the tile's rows into the slot
(`cp.async`, zeros where a row has no source), one commit group per tile (`_issue_gathered`).

Order: bands of row tiles (`_tile_order`), so the tiles in flight at once share DRAM pages of the
columnwise copy as well as of the input; or column strips, a contiguous run of tiles per program,
so that one program casts a group's row tiles one after the other. Groups: row tiles and scale
blocks start afresh at every group, as `tiles.tile_rows` lays them out for the Triton kernels.
"""
from __future__ import annotations

import triton

from qmoe.kernels import _gluon_sm90 as sm90
from qmoe.kernels._gluon_sm90 import gluon

if gluon is not None:
    from qmoe.kernels._gluon_sm90 import gl, mbarrier

    @gluon.jit
    def _group_table(splits_ptr, G, BM: gl.constexpr, SB: gl.constexpr, GP: gl.constexpr, GROUPED: gl.constexpr,
                     WARPS: gl.constexpr):
        """Per group: index, first row, rows, row tiles, cumulative row tiles, first SB-row scale
        block (all zero ungrouped: splits_ptr is then never read)."""
        SPT: gl.constexpr = GP // 32 if GP >= 32 else 1
        layout: gl.constexpr = gl.BlockedLayout([SPT], [32], [WARPS], [0])  # replicated over warps
        gi = gl.arange(0, GP, layout=layout)
        sizes = gl.load(splits_ptr + gi, mask=(gi < G) & GROUPED, other=0).to(gl.int32)
        starts = gl.associative_scan(sizes, 0, sm90.add) - sizes
        tiles = gl.cdiv(sizes, BM)
        tile_end = gl.associative_scan(tiles, 0, sm90.add)
        blocks = gl.cdiv(sizes, SB)
        return gi, starts, sizes, tiles, tile_end, gl.associative_scan(blocks, 0, sm90.add) - blocks

    @gluon.jit
    def _tile_order(t, nk, nm, TILE_GROUP: gl.constexpr):
        """Tile t -> (row tile, column tile) of nm x nk: bands of TILE_GROUP row tiles, each walked
        down its rows first, then along K (TILE_GROUP 1: every row tile along K). The tiles that run
        at once then cover a few kilobytes of each row they read and of each columnwise row they
        write, rather than whole input rows and 128 bytes of each columnwise row. TILE_GROUP 0:
        column strips, every row tile of a column tile before the next column tile (`_tile_of`)."""
        if TILE_GROUP == 0:
            vt = t % nm
            kt = t // nm
        elif TILE_GROUP == 1:
            vt = t // nk
            kt = t % nk
        else:
            band = t // (TILE_GROUP * nk)
            first = band * TILE_GROUP
            height = gl.minimum(nm - first, TILE_GROUP)
            inner = t - band * (TILE_GROUP * nk)
            vt = first + inner % height
            kt = inner // height
        return vt, kt

    @gluon.jit
    def _first_tile(pid, total, NUM_PROGRAMS: gl.constexpr, TILE_GROUP: gl.constexpr):
        """(program pid's first tile, how many it takes) of `total`: with column strips
        (TILE_GROUP 0) a contiguous run, so a program takes a group's row tiles one after the other
        and can write the columnwise lines two of them share whole; else every NUM_PROGRAMS-th tile."""
        if TILE_GROUP == 0:
            first = pid * total // NUM_PROGRAMS
            count = (pid + 1) * total // NUM_PROGRAMS - first
        else:
            first = pid
            count = gl.cdiv(gl.maximum(total - pid, 0), NUM_PROGRAMS)
        return first, count

    @gluon.jit
    def _tile_of(first, i, NUM_PROGRAMS: gl.constexpr, TILE_GROUP: gl.constexpr):
        """The program's i-th tile (see _first_tile)."""
        if TILE_GROUP == 0:
            t = first + i
        else:
            t = first + i * NUM_PROGRAMS
        return t

    @gluon.jit
    def _locate(t, nk, nm, M, gi, starts, sizes, tiles, tile_end, first_block, BM: gl.constexpr, SB: gl.constexpr,
                GROUPED: gl.constexpr, TILE_GROUP: gl.constexpr):
        """Tile t (in _tile_order) -> (first row, end row of its group, first SB-row scale block,
        column tile). Row tiles and scale blocks along M start afresh at every group."""
        vt, kt = _tile_order(t, nk, nm, TILE_GROUP)
        if GROUPED:
            g = gl.sum((tile_end <= vt).to(gl.int32), 0)
            sel = gi == g
            start = gl.sum(gl.where(sel, starts, 0), 0)
            local = (vt - gl.sum(gl.where(sel, tile_end - tiles, 0), 0)) * BM
            row0 = start + local
            row_end = start + gl.sum(gl.where(sel, sizes, 0), 0)
            sblk = gl.sum(gl.where(sel, first_block, 0), 0) + local // SB
        else:
            row0 = vt * BM
            row_end = M
            sblk = vt * (BM // SB)
        return row0, row_end, sblk, kt

    @gluon.jit
    def _issue(desc, bufs, ready, t, slot, nk, nm, M, K, gi, starts, sizes, tiles, tile_end, BM: gl.constexpr,
               BK: gl.constexpr, GROUPED: gl.constexpr, TILE_GROUP: gl.constexpr, GLU: gl.constexpr,
               GLU_BLOCK: gl.constexpr):
        """Load tile t into ring slot `slot`: x's tile, or with GLU the gate's and the linear part's
        tiles of h for output columns kt * BK + [0, BK) (K: the output width)."""
        row0, _, _, kt = _locate(t, nk, nm, M, gi, starts, sizes, tiles, tile_end, tiles, BM, BM, GROUPED, TILE_GROUP)
        if GLU:
            mbarrier.expect(ready.index(slot), 2 * desc.block_type.nbytes)
            if GLU_BLOCK == 0:  # gate columns first, then linear columns
                gate = kt * BK
                linear = K + kt * BK
            else:  # blocks of GLU_BLOCK gate columns, each followed by its linear columns
                gate = (kt * BK // GLU_BLOCK) * (2 * GLU_BLOCK) + kt * BK % GLU_BLOCK
                linear = gate + GLU_BLOCK
            sm90.tma_load(desc, [row0, gate], ready.index(slot), bufs.index(2 * slot))
            sm90.tma_load(desc, [row0, linear], ready.index(slot), bufs.index(2 * slot + 1))
        else:
            mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
            sm90.tma_load(desc, [row0, kt * BK], ready.index(slot), bufs.index(slot))

    @triton.constexpr_function
    def _gather_layout(BK, VEC, num_warps):
        """Each thread's 16-byte pieces of a tile's rows, a warp's threads along one or two rows."""
        tk = min(BK // VEC, 32)
        return gl.BlockedLayout([1, VEC], [32 // tk, tk], [num_warps, 1], [1, 0])

    @gluon.jit
    def _gathered_sources(index_ptr, t, live, nk, nm, M, gi, starts, sizes, tiles, tile_end, BM: gl.constexpr,
                          BK: gl.constexpr, GROUPED: gl.constexpr, TILE_GROUP: gl.constexpr, VEC: gl.constexpr,
                          num_warps: gl.constexpr):
        """(the source rows of tile t's rows, -1: none, all -1 unless `live`; its column tile), loaded a
        tile ahead of their copy so that the load's latency passes while the tile before is cast."""
        layout: gl.constexpr = _gather_layout(BK, VEC, num_warps)
        row0, _, _, kt = _locate(t, nk, nm, M, gi, starts, sizes, tiles, tile_end, tiles, BM, BM, GROUPED, TILE_GROUP)
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        return gl.load(index_ptr + rows, mask=(rows < M) & live, other=-1), kt

    @gluon.jit
    def _issue_gathered(x_ptr, src, kt, stride_x, bufs, slot, K, BK: gl.constexpr, VEC: gl.constexpr,
                        num_warps: gl.constexpr):
        """Copy a tile's rows, row r being x's row src[r] (`_gathered_sources`; none where negative:
        zeros), columns of column tile kt, into ring slot `slot` by cp.async (the caller commits the
        group and waits for it)."""
        layout: gl.constexpr = _gather_layout(BK, VEC, num_warps)
        cols = kt * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
        ptrs = x_ptr + gl.expand_dims(src.to(gl.int64) * stride_x, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(src >= 0, 1) & gl.expand_dims(cols < K, 0)
        sm90.cp_async(bufs.index(slot), ptrs, mask=mask)
