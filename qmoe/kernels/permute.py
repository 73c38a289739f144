"""Triton token permutation for expert dispatch. Reference twin: `qmoe.reference.permute`.

Dimensions: T tokens, E experts, K top-k, N row width (elements), R = T*K + E*(align-1) rows.

The plan (`permute_index`) is four small launches with no host read: count each expert's
tokens per chunk of BLOCK_T tokens, scan those counts per block of experts (chunk bases,
padded split sizes), scan the split sizes into group offsets (one program, E values), then
give every (token, expert) pair its row: offset[e] + tokens before it in column e. Data then moves once per row:

- permute: each token's row is read once and stored to its K rows (scatter); rows no token
  fills (each group's padding, and the tail past the last group) are zeroed by a kernel that
  only touches those rows, so R * N is never memset;
- unpermute: each token gathers and adds its K rows in fp32 (no atomics: deterministic);
- the backward of each is the other, plus the probability gradients.

Data is moved as raw bits (int views of the same width), so FP8 rows, E8M0 scales or any dtype
permute alike. With `with_amax`, the permute of float rows and the unpermute backward also
reduce each expert group's max|row| over finite values as they store the rows (atomic max of
the float bits, exact in any order), so a current-scaling quantizer of the permuted rows (FC1's
input) or of grad_y (FC2's grad_output) need not read them again (`RowsWithAmax`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from qmoe.kernels._arith import atomic_max_bits, finite_abs_bits
from qmoe.kernels._launch import kernel_op, wrapped
from qmoe.kernels._layout import raw_bits, rows_contiguous
from qmoe.contracts.carriers import RowIdMap, RowsWithAmax, num_permuted_rows
from qmoe.contracts.validate import check_amax_rows, check_merging_probs, check_permute_index_args, check_rows

_INDEX_BLOCK_T = 64      # tokens per chunk of the plan: tile [64, BLOCK_E] of the routing map
_INDEX_BLOCK_E = 128
_SCAN_BLOCK_C = 32       # chunks per step of an expert block's scan
_OFFSETS_BLOCK_E = 1024  # experts per step of the single-program offsets scan
_TAIL_PROGRAMS = 64      # programs zeroing the rows past the last group (grid-stride)
_PAD_BLOCK_R = 16
_ROW_BYTES_PER_PROGRAM = 4096  # bytes of one row a data program moves (16-byte vectors x 256)

# how the amax of permuted rows reads their raw bits (check_amax_rows admits these dtypes only)
_TL_FLOAT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _count_tokens_kernel(
    # pointers
    map_ptr, chunk_counts_ptr,
    # sizes
    T, E,
    # strides (rows)
    stride_map,
    # meta
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """chunk_counts[c, e] = tokens of chunk c routed to expert e."""
    c, eb = tl.program_id(0), tl.program_id(1)
    rows = c * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < E
    mask = (rows < T)[:, None] & col_ok[None, :]
    m = tl.load(map_ptr + rows.to(tl.int64)[:, None] * stride_map + cols[None, :], mask=mask, other=0)
    tl.store(chunk_counts_ptr + c.to(tl.int64) * E + cols, tl.sum(m.to(tl.int32), axis=0), mask=col_ok)


@triton.jit
def _chunk_scan_kernel(
    # pointers
    chunk_counts_ptr, chunk_base_ptr, counts_ptr, split_ptr,
    # sizes
    num_chunks, E, align,
    # meta
    BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Per block of experts: exclusive scan of the chunk counts, totals, padded split sizes."""
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < E
    running = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunk = c0 + tl.arange(0, BLOCK_C)
        mask = (chunk < num_chunks)[:, None] & col_ok[None, :]
        where = chunk.to(tl.int64)[:, None] * E + cols[None, :]
        cnt = tl.load(chunk_counts_ptr + where, mask=mask, other=0)
        tl.store(chunk_base_ptr + where, running[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=mask)
        running += tl.sum(cnt, axis=0)
    tl.store(counts_ptr + cols, running, mask=col_ok)
    tl.store(split_ptr + cols, (running + align - 1) // align * align, mask=col_ok)


@triton.jit
def _expert_offsets_kernel(
    # pointers
    split_ptr, offsets_ptr,
    # sizes
    E,
    # meta
    BLOCK_E: tl.constexpr,
):
    """One program: offsets[0] = 0, offsets[1 + e] = padded rows of experts 0..e."""
    carry = tl.sum(tl.zeros([BLOCK_E], tl.int32), axis=0)
    tl.store(offsets_ptr, carry)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        padded = tl.load(split_ptr + cols, mask=cols < E, other=0)
        tl.store(offsets_ptr + 1 + cols, carry + tl.cumsum(padded, axis=0), mask=cols < E)
        carry += tl.sum(padded, axis=0)


@triton.jit
def _map_rows_kernel(
    # pointers
    map_ptr, chunk_base_ptr, offsets_ptr, rows_ptr, experts_ptr,
    # sizes
    T, E,
    # strides (rows)
    stride_map,
    # meta
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """rows/experts [T, K]: each token's copies in ascending expert order, -1 past its count."""
    c = tl.program_id(0)
    tok = c * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < T
    tok64 = tok.to(tl.int64)
    filled = tl.zeros([BLOCK_T], tl.int32)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        col_ok = cols < E
        mask = tok_ok[:, None] & col_ok[None, :]
        m = (tl.load(map_ptr + tok64[:, None] * stride_map + cols[None, :], mask=mask, other=0) != 0).to(tl.int32)
        base = tl.load(chunk_base_ptr + c.to(tl.int64) * E + cols, mask=col_ok, other=0)
        start = tl.load(offsets_ptr + cols, mask=col_ok, other=0)
        dest = (start + base)[None, :] + tl.cumsum(m, axis=0) - m
        slot = filled[:, None] + tl.cumsum(m, axis=1) - m
        ok = (m != 0) & (slot < TOP_K)
        where = tok64[:, None] * TOP_K + slot
        tl.store(rows_ptr + where, dest, mask=ok)
        tl.store(experts_ptr + where, tl.zeros([BLOCK_T, BLOCK_E], tl.int32) + cols[None, :], mask=ok)
        filled += tl.sum(m, axis=1)
    ks = tl.arange(0, BLOCK_K)
    unused = tok_ok[:, None] & (ks[None, :] >= filled[:, None]) & (ks[None, :] < TOP_K)
    where = tok64[:, None] * TOP_K + ks[None, :]
    none = tl.full([BLOCK_T, BLOCK_K], -1, tl.int32)
    tl.store(rows_ptr + where, none, mask=unused)
    tl.store(experts_ptr + where, none, mask=unused)


@triton.jit
def _copy_row(rows_ptr, slot, R, cols):
    """Output row (int64) of one copy, broadcast like `cols`, and whether the copy is used.

    Broadcast rather than scalar so it combines with vector masks (the interpreter rejects
    scalar-and-vector masks).
    """
    r = tl.load(rows_ptr + slot) + tl.zeros_like(cols)
    return r.to(tl.int64), (r >= 0) & (r < R)


@triton.jit
def _copy_weight(probs_row_ptr, experts_ptr, slot, ok):
    """probs[t, expert of the copy] as fp32, broadcast like `ok`; 0 for an unused copy."""
    e = tl.maximum(tl.load(experts_ptr + slot), 0)  # unused copies say -1: read column 0
    return tl.where(ok, tl.load(probs_row_ptr + e).to(tl.float32), 0.0)


@triton.jit
def _scatter_rows_kernel(
    # pointers
    x_ptr, rows_ptr, experts_ptr, out_ptr, amax_ptr,
    # sizes
    N, R,
    # strides (rows)
    stride_x, stride_out,
    # meta
    TOP_K: tl.constexpr, AMAX: tl.constexpr, FLOAT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[rows[t, k]] = x[t] for each used copy: one read of x, K writes.

    AMAX: also raise amax[expert of each used copy] (int32 bits) to max|x[t]| over its finite
    values, x's raw bits read as FLOAT: each expert group's amax, without reading `out` again.
    """
    t, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    v = tl.load(x_ptr + t * stride_x + cols, mask=col_ok, other=0)
    for k in tl.static_range(TOP_K):
        r, ok = _copy_row(rows_ptr, t * TOP_K + k, R, cols)
        tl.store(out_ptr + r * stride_out + cols, v, mask=col_ok & ok)
    if AMAX:
        m = tl.max(finite_abs_bits(v.to(FLOAT, bitcast=True).to(tl.float32)), 0)
        for k in tl.static_range(TOP_K):
            r = tl.load(rows_ptr + t * TOP_K + k)
            if (r >= 0) & (r < R):
                atomic_max_bits(amax_ptr + tl.load(experts_ptr + t * TOP_K + k), m)


@triton.jit
def _gather_rows_kernel(
    # pointers
    y_ptr, rows_ptr, experts_ptr, probs_ptr, out_ptr,
    # sizes
    N, R,
    # strides (rows)
    stride_y, stride_probs, stride_out,
    # meta
    TOP_K: tl.constexpr, HAS_PROBS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[t] = sum_k y[rows[t, k]] (* probs[t, experts[t, k]]), fp32, in slot order."""
    t, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k in tl.static_range(TOP_K):
        r, ok = _copy_row(rows_ptr, t * TOP_K + k, R, cols)
        v = tl.load(y_ptr + r * stride_y + cols, mask=col_ok & ok, other=0.0).to(tl.float32)
        if HAS_PROBS:
            v = v * _copy_weight(probs_ptr + t * stride_probs, experts_ptr, t * TOP_K + k, ok)
        acc += v
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _scatter_grad_rows_kernel(
    # pointers
    g_ptr, y_ptr, rows_ptr, experts_ptr, probs_ptr, grad_y_ptr, grad_probs_ptr, amax_ptr,
    # sizes
    N, R,
    # strides (rows)
    stride_g, stride_y, stride_probs, stride_grad_y, stride_grad_probs,
    # meta
    TOP_K: tl.constexpr, HAS_PROBS: tl.constexpr, PROBS_GRAD: tl.constexpr, AMAX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Backward of the weighted gather: grad_y[rows[t, k]] = g[t] * p, grad_p = <g[t], y[row]>.

    One program per token walks the whole row, so each dot product is finished in registers.
    AMAX: also raise amax[expert] (int32 bits) to max|grad_y row| over its finite values, as
    stored, for each used copy: each expert group's amax of grad_y.
    """
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    dots = tl.zeros([BLOCK_K], tl.float32)
    peaks = tl.zeros([BLOCK_K], tl.int32)
    running = tl.zeros([BLOCK_N], tl.int32)  # without probs every copy stores g: one elementwise max
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        g = tl.load(g_ptr + t * stride_g + cols, mask=col_ok, other=0.0).to(tl.float32)
        if AMAX and not HAS_PROBS:  # masked columns hold 0
            running = tl.maximum(running, finite_abs_bits(g.to(grad_y_ptr.dtype.element_ty).to(tl.float32)))
        for k in tl.static_range(TOP_K):
            r, ok = _copy_row(rows_ptr, t * TOP_K + k, R, cols)
            if HAS_PROBS:
                gw = g * _copy_weight(probs_ptr + t * stride_probs, experts_ptr, t * TOP_K + k, ok)
            else:
                gw = g
            stored = gw.to(grad_y_ptr.dtype.element_ty)
            tl.store(grad_y_ptr + r * stride_grad_y + cols, stored, mask=col_ok & ok)
            if PROBS_GRAD:
                yv = tl.load(y_ptr + r * stride_y + cols, mask=col_ok & ok, other=0.0).to(tl.float32)
                dots = tl.where(ks == k, dots + tl.sum(g * yv, axis=0), dots)
            if AMAX and HAS_PROBS:  # each copy stores its own multiple of g
                peak = tl.max(finite_abs_bits(stored.to(tl.float32)), 0)  # masked columns hold 0
                peaks = tl.where(ks == k, tl.maximum(peaks, peak), peaks)
    if AMAX and not HAS_PROBS:
        peaks += tl.max(running, 0)
    if PROBS_GRAD or AMAX:
        r = tl.load(rows_ptr + t * TOP_K + ks, mask=ks < TOP_K, other=-1)
        e = tl.load(experts_ptr + t * TOP_K + ks, mask=ks < TOP_K, other=0)
        ok = (r >= 0) & (r < R)
        if PROBS_GRAD:
            tl.store(grad_probs_ptr + t * stride_grad_probs + e,
                     dots.to(grad_probs_ptr.dtype.element_ty), mask=ok)
        if AMAX:
            current = tl.load(amax_ptr + e, mask=ok, other=0)
            tl.atomic_max(amax_ptr + e, peaks, mask=ok & (peaks > current))


@triton.jit
def _zero_rows(out_ptr, lo, hi, step, N, stride_out, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    zeros = tl.zeros([BLOCK_R, BLOCK_N], out_ptr.dtype.element_ty)
    for r0 in range(lo, hi, step):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < hi
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], zeros,
                     mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _zero_padding_rows_kernel(
    # pointers
    out_ptr, counts_ptr, offsets_ptr,
    # sizes
    N, R, E,
    # strides (rows)
    stride_out,
    # scalars
    tail_programs,
    # meta
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Zero the rows no token fills: program e < E takes expert e's padding, the others the tail."""
    pid = tl.program_id(0)
    if pid < E:
        lo = tl.load(offsets_ptr + pid) + tl.load(counts_ptr + pid)
        hi = tl.minimum(tl.load(offsets_ptr + pid + 1), R)
        _zero_rows(out_ptr, lo, hi, BLOCK_R, N, stride_out, BLOCK_R, BLOCK_N)
    else:
        lo = tl.load(offsets_ptr + E) + (pid - E) * BLOCK_R
        _zero_rows(out_ptr, lo, R, tail_programs * BLOCK_R, N, stride_out, BLOCK_R, BLOCK_N)


@triton.jit
def _permute_probs_kernel(
    # pointers
    probs_ptr, rows_ptr, experts_ptr, out_ptr,
    # sizes
    T, R,
    # strides (rows)
    stride_probs, stride_out,
    # meta
    TOP_K: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Forward: out[rows[t, k]] = probs[t, experts[t, k]]. Backward: the same pairs, reversed."""
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    mask = (tok < T)[:, None] & (ks < TOP_K)[None, :]
    where = tok[:, None] * TOP_K + ks[None, :]
    r = tl.load(rows_ptr + where, mask=mask, other=-1)
    e = tl.load(experts_ptr + where, mask=mask, other=0)
    ok = mask & (r >= 0) & (r < R)
    if BACKWARD:  # probs_ptr: grad of out [R]; out_ptr: grad of probs [T, E]
        g = tl.load(probs_ptr + r, mask=ok, other=0.0)
        tl.store(out_ptr + tok[:, None] * stride_out + e, g.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        p = tl.load(probs_ptr + tok[:, None] * stride_probs + e, mask=ok, other=0.0)
        tl.store(out_ptr + r, p.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- launchers


def _raw_2d(t: torch.Tensor) -> torch.Tensor:
    """[T, N] (or [T] as [T, 1]) integer view of the bits of `t`, rows contiguous."""
    t = t if t.dim() == 2 else t.unsqueeze(1)
    return raw_bits(rows_contiguous(t))


def _block_n(n: int, itemsize: int) -> int:
    return max(1, min(triton.next_power_of_2(max(n, 1)), _ROW_BYTES_PER_PROGRAM // itemsize))


def _zero_padding_rows(out: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor) -> None:
    r, n = out.shape
    e = counts.shape[0]
    if r == 0 or n == 0:
        return
    tail = min(_TAIL_PROGRAMS, triton.cdiv(r, _PAD_BLOCK_R))
    wrapped(_zero_padding_rows_kernel)[(e + tail,)](
        out, counts, offsets, n, r, e, out.stride(0), tail,
        BLOCK_R=_PAD_BLOCK_R, BLOCK_N=_block_n(n, out.element_size()))


def permute_index(routing_map, top_k, align_size):
    """Triton twin of `qmoe.reference.permute.permute_index`: (RowIdMap, split_sizes [E] int32)."""
    check_permute_index_args(routing_map, top_k, align_size)
    t, e = routing_map.shape
    rows, experts, counts, offsets, split_sizes = _permute_index_op(routing_map, top_k, align_size)
    return RowIdMap(rows, experts, counts, offsets, num_permuted_rows(t, top_k, e, align_size)), split_sizes


@kernel_op("qmoe::permute_index")
def _permute_index_op(routing_map: torch.Tensor, top_k: int,
                      align_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, experts, counts, offsets, split_sizes): the four launches as one op (KernelOp)."""
    t, e = routing_map.shape
    dev = routing_map.device
    m = routing_map.to(torch.uint8).contiguous()  # not a view: Inductor cannot lower bool->uint8 views
    num_chunks = triton.cdiv(t, _INDEX_BLOCK_T)
    chunk_counts = torch.empty(max(num_chunks, 1), e, dtype=torch.int32, device=dev)
    chunk_base = torch.empty_like(chunk_counts)
    counts = torch.empty(e, dtype=torch.int32, device=dev)
    split_sizes = torch.empty(e, dtype=torch.int32, device=dev)
    offsets = torch.empty(e + 1, dtype=torch.int32, device=dev)
    rows = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    experts = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    if t:
        wrapped(_count_tokens_kernel)[(num_chunks, triton.cdiv(e, _INDEX_BLOCK_E))](
            m, chunk_counts, t, e, m.stride(0), BLOCK_T=_INDEX_BLOCK_T, BLOCK_E=_INDEX_BLOCK_E)
    wrapped(_chunk_scan_kernel)[(triton.cdiv(e, _INDEX_BLOCK_E),)](
        chunk_counts, chunk_base, counts, split_sizes, num_chunks, e, align_size,
        BLOCK_C=_SCAN_BLOCK_C, BLOCK_E=_INDEX_BLOCK_E)
    wrapped(_expert_offsets_kernel)[(1,)](split_sizes, offsets, e, BLOCK_E=_OFFSETS_BLOCK_E)
    if t:
        wrapped(_map_rows_kernel)[(num_chunks,)](
            m, chunk_base, offsets, rows, experts, t, e, m.stride(0),
            TOP_K=top_k, BLOCK_T=_INDEX_BLOCK_T, BLOCK_E=_INDEX_BLOCK_E,
            BLOCK_K=triton.next_power_of_2(top_k))
    return rows, experts, counts, offsets, split_sizes


# Every launcher below is one opaque torch op (kernel_op) taking the RowIdMap's tensors (a custom
# op's schema holds tensors and scalars, not the NamedTuple).

def _map_args(row_id_map: RowIdMap) -> tuple:
    return row_id_map.rows, row_id_map.experts, row_id_map.counts, row_id_map.offsets, row_id_map.num_rows


def permute_rows(x, row_id_map, with_amax=False):
    """Triton twin of `qmoe.reference.permute.permute_rows`: [T, N] any dtype -> [R, N]
    (with_amax: `RowsWithAmax(out, amax [E] fp32)`, reduced as the rows are copied)."""
    check_rows("x", x, row_id_map.rows.shape[0], row_id_map.rows.device)
    if with_amax:
        check_amax_rows("x", x)
    out, amax = _permute_rows_op(x, *_map_args(row_id_map), bool(with_amax))
    return RowsWithAmax(out, amax) if with_amax else out


@kernel_op("qmoe::permute_rows")
def _permute_rows_op(x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                     offsets: torch.Tensor, num_rows: int, with_amax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [R, N] x's dtype, amax [E] fp32 or [0] without with_amax)."""
    raw = _raw_2d(x)
    t, n = raw.shape
    out = torch.empty(num_rows, n, dtype=raw.dtype, device=raw.device)
    bits = torch.zeros(counts.shape[0] if with_amax else 0, dtype=torch.int32, device=raw.device)
    if t and n:
        block_n = _block_n(n, raw.element_size())
        wrapped(_scatter_rows_kernel)[(t, triton.cdiv(n, block_n))](
            raw, rows, experts, out, bits, n, num_rows, raw.stride(0), out.stride(0),
            TOP_K=rows.shape[1], AMAX=with_amax, FLOAT=_TL_FLOAT.get(x.dtype, tl.float32), BLOCK_N=block_n)
    _zero_padding_rows(out, counts, offsets)
    out = out.view(x.dtype)
    return out if x.dim() == 2 else out.squeeze(1), bits.view(torch.float32)


@triton.jit
def _row_amax_kernel(x_ptr, out_ptr, T, N, stride_x, BT: tl.constexpr, BN: tl.constexpr):
    """out[t] = max|x[t]| over finite values, as int32 bits of a non-negative float."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    acc = tl.zeros([BT], dtype=tl.int32)
    for c in range(0, N, BN):
        cols = c + tl.arange(0, BN)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                    mask=(rows < T)[:, None] & (cols < N)[None, :], other=0.0)
        acc = tl.maximum(acc, tl.max(finite_abs_bits(x.to(tl.float32)), 1))
    tl.store(out_ptr + rows, acc, mask=rows < T)


@kernel_op("qmoe::permute_row_amax")
def _row_amax_op(x: torch.Tensor) -> torch.Tensor:
    t, n = x.shape
    bits = torch.zeros(t, dtype=torch.int32, device=x.device)
    if t and n:
        wrapped(_row_amax_kernel)[(triton.cdiv(t, 4),)](x, bits, t, n, x.stride(0), BT=4, BN=512, num_warps=4)
    return bits.view(torch.float32)


def row_amax(x):
    """Triton twin of `qmoe.reference.permute.row_amax`: [T, N] float -> [T] fp32."""
    return _row_amax_op(rows_contiguous(x))


def permute_probs(probs, row_id_map):
    """Triton twin of `qmoe.reference.permute.permute_probs`: [T, E] -> [R] (probs dtype)."""
    check_merging_probs(probs, row_id_map)
    return _permute_probs_op(rows_contiguous(probs), *_map_args(row_id_map))


@kernel_op("qmoe::permute_probs")
def _permute_probs_op(probs: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                      offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    out = torch.zeros(num_rows, dtype=probs.dtype, device=probs.device)
    _launch_probs(probs, out, rows, experts, num_rows, backward=False, stride_probs=probs.stride(0), stride_out=0)
    return out


def permute_probs_backward(grad_out_probs, row_id_map, probs_dtype=torch.float32):
    """Triton twin of `qmoe.reference.permute.permute_probs_backward`: [R] -> [T, E]."""
    return _permute_probs_backward_op(grad_out_probs.contiguous(), *_map_args(row_id_map), probs_dtype)


@kernel_op("qmoe::permute_probs_backward")
def _permute_probs_backward_op(grad_out_probs: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor,
                               counts: torch.Tensor, offsets: torch.Tensor, num_rows: int,
                               probs_dtype: torch.dtype) -> torch.Tensor:
    t, e = rows.shape[0], counts.shape[0]
    grad = torch.zeros(t, e, dtype=probs_dtype, device=grad_out_probs.device)
    _launch_probs(grad_out_probs, grad, rows, experts, num_rows, backward=True, stride_probs=0,
                  stride_out=grad.stride(0))
    return grad


def _launch_probs(src, dst, rows, experts, num_rows, *, backward, stride_probs, stride_out):
    t, k = rows.shape
    if t == 0:
        return
    block_k = triton.next_power_of_2(k)
    block_t = max(1, 1024 // block_k)
    wrapped(_permute_probs_kernel)[(triton.cdiv(t, block_t),)](
        src, rows, experts, dst, t, num_rows, stride_probs,
        stride_out, TOP_K=k, BACKWARD=backward, BLOCK_T=block_t, BLOCK_K=block_k)


def unpermute_rows(y, row_id_map, merging_probs=None):
    """Triton twin of `qmoe.reference.permute.unpermute_rows`: [R, H] float -> [T, H]."""
    check_rows("y", y, row_id_map.num_rows, row_id_map.rows.device)
    if merging_probs is not None:
        check_merging_probs(merging_probs, row_id_map)
        merging_probs = rows_contiguous(merging_probs)
    return _unpermute_rows_op(rows_contiguous(y), merging_probs, *_map_args(row_id_map))


@kernel_op("qmoe::unpermute_rows")
def _unpermute_rows_op(y: torch.Tensor, merging_probs: Optional[torch.Tensor], rows: torch.Tensor,
                       experts: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
                       num_rows: int) -> torch.Tensor:
    t, k = rows.shape
    n = y.shape[1]
    out = torch.empty(t, n, dtype=y.dtype, device=y.device)
    if t and n:
        block_n = _block_n(n, y.element_size())
        probs = merging_probs if merging_probs is not None else y  # dummy, never read
        wrapped(_gather_rows_kernel)[(t, triton.cdiv(n, block_n))](
            y, rows, experts, probs, out, n, num_rows,
            y.stride(0), probs.stride(0), out.stride(0),
            TOP_K=k, HAS_PROBS=merging_probs is not None, BLOCK_N=block_n)
    return out


def permute_rows_backward(grad_out, row_id_map):
    """Triton twin of `qmoe.reference.permute.permute_rows_backward`: [R, N] -> [T, N]."""
    return unpermute_rows(grad_out, row_id_map)


def unpermute_rows_backward(grad_out, y, row_id_map, merging_probs=None, need_probs_grad=True, with_amax=False):
    """Triton twin of `qmoe.reference.permute.unpermute_rows_backward`: (grad_y, grad_probs)
    (with_amax: grad_y as `RowsWithAmax(grad_y, amax [E] fp32)`, reduced as it is stored)."""
    probs_grad = merging_probs is not None and need_probs_grad
    if with_amax:
        check_amax_rows("y", y)
    grad_y, grad_probs, amax = _unpermute_rows_backward_op(
        rows_contiguous(grad_out), rows_contiguous(y),
        rows_contiguous(merging_probs) if merging_probs is not None else None, probs_grad,
        *_map_args(row_id_map), bool(with_amax))
    return RowsWithAmax(grad_y, amax) if with_amax else grad_y, (grad_probs if probs_grad else None)


@kernel_op("qmoe::unpermute_rows_backward")
def _unpermute_rows_backward_op(grad_out: torch.Tensor, y: torch.Tensor, merging_probs: Optional[torch.Tensor],
                                probs_grad: bool, rows: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                                offsets: torch.Tensor, num_rows: int,
                                with_amax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_y [R, N], grad_probs [T, E] or [0] without probs_grad, amax [E] fp32 or [0] without with_amax)."""
    t, k = rows.shape
    n = y.shape[1]
    grad_y = torch.empty(num_rows, n, dtype=y.dtype, device=y.device)
    if probs_grad:
        grad_probs = torch.zeros(merging_probs.shape, dtype=merging_probs.dtype, device=y.device)
    else:
        grad_probs = torch.empty(0, dtype=torch.float32, device=y.device)
    bits = torch.zeros(counts.shape[0] if with_amax else 0, dtype=torch.int32, device=y.device)
    if t and n:
        probs = merging_probs if merging_probs is not None else y
        gp = grad_probs if probs_grad else y  # dummy, never written
        wrapped(_scatter_grad_rows_kernel)[(t,)](
            grad_out, y, rows, experts, probs, grad_y, gp, bits,
            n, num_rows,
            grad_out.stride(0), y.stride(0), probs.stride(0), grad_y.stride(0), gp.stride(0),
            TOP_K=k, HAS_PROBS=merging_probs is not None, PROBS_GRAD=probs_grad, AMAX=with_amax,
            BLOCK_N=min(_block_n(n, 4), 1024), BLOCK_K=triton.next_power_of_2(k))
    _zero_padding_rows(grad_y, counts, offsets)
    return grad_y, grad_probs, bits.view(torch.float32)
