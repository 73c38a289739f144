"""Triton auxiliary losses and expert-bias update. Reference twin: `qmoe.reference.aux_loss`.

Dimensions: T tokens, E experts, K top-k, B sequences of L tokens (T = B * L, batch-major).

At training sizes a loss reads a few MB (microseconds of bandwidth), so what it costs is
launches and host work. Each loss is therefore one forward and one backward launch:

- Forward: every program reduces its tiles to one fp32 partial and stores it, then takes a
  ticket from a zeroed counter; the program that takes the last ticket resets the counter
  (so the next launch on the stream needs no memset: `counters.tickets`), adds the
  partials in slot order and writes the loss. One launch for any T and E (no cooperative
  launch, no host read), and deterministic: no float atomics, the same bits on every run and
  in graph replay. On the way it writes what the backward needs besides grad_loss: the
  balance losses' gradient rows for a unit grad_loss ([B, E]), z_loss's per-row logsumexp.
- Backward: one Triton launch writing the contiguous [T, E] gradient, which autograd keeps as
  `.grad` without the copy a stride-0 broadcast would cost. It is Triton's even where a launch
  costs more host time than ATen's: ATen's multiply over a stride-0 view (or by a 0-dim
  device tensor) runs its unvectorized loop, slower on the device even replayed in a CUDA graph
  (benchmarks/results/sweeps/aux_loss_variants.json), and in a training step the host runs
  ahead of the GPU.

The launchers without a `check_` call (`aux_loss_forward`, `seq_aux_loss_forward`,
`z_loss_forward`, `grad_from_rows`, `broadcast_grad`, `z_loss_grad`) trust
their caller: `qmoe.ops` validates once per call and then calls them. The twins named like
the reference validate and call them.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from qmoe.kernels._counters import is_last_to_arrive, sum_partials, tickets
from qmoe.kernels._launch import num_sms, wrapped
from qmoe.kernels._layout import rows_contiguous
from qmoe.contracts.validate import (check_coeff, check_moe_aux_loss_args, check_scores, check_seq_aux_loss_args,
                                     check_update_expert_bias_args)

# Elements a program holds per step: 16 KB of fp32, 32 values a thread at 4 warps, so each
# thread has eight 16-byte loads in flight; enough to stream at bandwidth, few registers.
_TILE = 4096
_MAX_BLOCK_E = 1024
# Reductions run as persistent grids of this many programs per SM (fewer when there are fewer
# tiles): enough warps in flight to saturate memory, and at most a few hundred partials.
_PROGRAMS_PER_SM = 4
# The last program adds the partials in chunks of this many.
_FINISH_BLOCK = 512
# seq_aux_loss column block: 32 fp32 = 128 bytes a row, whole cache lines; narrow so that
# B * E / 32 (b, column) pairs times a few row chunks fill the GPU.
_SEQ_BLOCK_E = 32


def _launcher(kernel):
    # The losses' Functions are traced by torch.compile (they are not KernelOps): there the
    # kernel itself, which Dynamo knows how to trace, and not `wrapped`, which it cannot.
    return kernel if torch.compiler.is_compiling() else wrapped(kernel)


# ---------------------------------------------------------------- kernels


@triton.jit
def _moe_aux_loss_kernel(
    # pointers
    probs_ptr, w_ptr, num_tokens_ptr, work_ptr, ticket_ptr, out_ptr,
    # sizes
    T, E,
    # strides (rows; columns are contiguous)
    stride_p,
    # scalars
    scale,
    # meta
    NUM_TOKENS_ON_DEVICE: tl.constexpr, WRITE_GRAD_ROW: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, FINISH_BLOCK: tl.constexpr,
):
    """out = scale * sum_{t, e} probs[t, e] * w[e] (/ num_tokens^2 when that is a tensor).

    A persistent grid: program p takes tiles p, p + P, ... and keeps one [BLOCK_T, BLOCK_E]
    fp32 accumulator, so a tile costs a load and an FMA, and each program one partial.
    work (fp32): [the gradient row scale * w (/ num_tokens^2), E values, if WRITE_GRAD_ROW |
    one partial per program].
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_eb = tl.cdiv(E, BLOCK_E)
    n_tiles = tl.cdiv(T, BLOCK_T) * n_eb
    g_scale = scale
    if NUM_TOKENS_ON_DEVICE:
        nt = tl.load(num_tokens_ptr).to(tl.float32)
        g_scale = scale / (nt * nt)
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for tile in range(pid, n_tiles, nprog):
        rows = (tile // n_eb) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = (tile % n_eb) * BLOCK_E + tl.arange(0, BLOCK_E)
        col_ok = cols < E
        x = tl.load(probs_ptr + rows.to(tl.int64)[:, None] * stride_p + cols[None, :],
                    mask=(rows < T)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0).to(tl.float32)
        acc += x * w[None, :]
        if WRITE_GRAD_ROW:
            if tile < n_eb:  # the first row block's programs: each column once
                tl.store(work_ptr + cols, w * g_scale, mask=col_ok)
    partial_ptr = work_ptr
    if WRITE_GRAD_ROW:
        partial_ptr = work_ptr + E
    tl.store(partial_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))
    if is_last_to_arrive(ticket_ptr, nprog):
        total = sum_partials(partial_ptr, nprog, FINISH_BLOCK) * scale
        if NUM_TOKENS_ON_DEVICE:
            total = total / (nt * nt)
        tl.store(out_ptr, total)


@triton.jit
def _seq_aux_loss_kernel(
    # pointers
    probs_ptr, map_ptr, scratch_ptr, ticket_ptr, out_ptr,
    # sizes
    B, L, E, CHUNK,
    # strides (rows; columns are contiguous)
    stride_p, stride_m,
    # scalars
    scale,
    # meta
    NUM_CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    FINISH_BLOCK: tl.constexpr,
):
    """Sequence-level loss: out = sum_{b, e} w[b, e] * P[b, e], w = scale * count[b, e].

    count[b, e] and P[b, e] (routed tokens and summed probs of expert e in sequence b) are sums
    over the L rows of a sequence, and the loss multiplies them, so a (b, column block) pair is
    finished by whoever holds both whole sums. Program (chunk, pair) sums CHUNK rows; with one
    chunk it holds them, otherwise it stores its partial sums and the last chunk of the pair to
    arrive adds them in chunk order. The pair's finisher writes w (the backward's gradient
    rows) and the pair's loss partial; the last pair to finish adds those and writes out.

    scratch (fp32): w [B, E] | pair partials [B * n_eb] | chunk partial sums [NUM_CHUNKS, 2, B, E].
    ticket (int32, zeroed): the pairs' ticket | one ticket per pair (NUM_CHUNKS > 1).
    """
    pid = tl.program_id(0)
    n_eb = tl.cdiv(E, BLOCK_E)
    n_pairs = B * n_eb
    chunk = pid % NUM_CHUNKS
    pair = pid // NUM_CHUNKS
    b = pair // n_eb
    cols = (pair % n_eb) * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < E
    row_end = tl.minimum(chunk * CHUNK + CHUNK, L)
    seq_row0 = b.to(tl.int64) * L
    acc_p = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    acc_c = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    for r in range(chunk * CHUNK, row_end, BLOCK_T):
        rows = r + tl.arange(0, BLOCK_T)
        mask = (rows < row_end)[:, None] & col_ok[None, :]
        rows64 = seq_row0 + rows
        acc_p += tl.load(probs_ptr + rows64[:, None] * stride_p + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
        acc_c += tl.load(map_ptr + rows64[:, None] * stride_m + cols[None, :], mask=mask,
                         other=0).to(tl.int32)
    psum = tl.sum(acc_p, axis=0)
    count = tl.sum(acc_c, axis=0).to(tl.float32)  # exact: counts stay far below 2^24

    w_ptr = scratch_ptr
    pair_partial_ptr = scratch_ptr + B * E
    finish = True
    if NUM_CHUNKS > 1:
        chunk_ptr = pair_partial_ptr + n_pairs
        slot = (chunk * 2 * B + b) * E + cols
        tl.store(chunk_ptr + slot, psum, mask=col_ok)
        tl.store(chunk_ptr + slot + B * E, count, mask=col_ok)
        finish = is_last_to_arrive(ticket_ptr + 1 + pair, NUM_CHUNKS)
        if finish:
            psum = tl.zeros([BLOCK_E], tl.float32)
            count = tl.zeros([BLOCK_E], tl.float32)
            for c in range(NUM_CHUNKS):
                slot = (c * 2 * B + b) * E + cols
                psum += tl.load(chunk_ptr + slot, mask=col_ok, other=0.0, volatile=True)
                count += tl.load(chunk_ptr + slot + B * E, mask=col_ok, other=0.0, volatile=True)
    if finish:
        w = count * scale
        tl.store(w_ptr + b * E + cols, w, mask=col_ok)
        tl.store(pair_partial_ptr + pair, tl.sum(w * psum, axis=0))
        if is_last_to_arrive(ticket_ptr, n_pairs):
            tl.store(out_ptr, sum_partials(pair_partial_ptr, n_pairs, FINISH_BLOCK))


@triton.jit
def _broadcast_grad_kernel(
    # pointers
    grad_loss_ptr, w_ptr, num_tokens_ptr, out_ptr,
    # sizes
    T, L, E,
    # strides (rows)
    stride_w,
    # scalars
    scale,
    # meta
    NUM_TOKENS_ON_DEVICE: tl.constexpr, ONE_SEQUENCE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """out[t, e] = grad_loss * scale * w[t // L, e] (/ num_tokens^2 when on the device); out is
    contiguous [T, E]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < E
    mask = (rows < T)[:, None] & col_ok[None, :]
    g = tl.load(grad_loss_ptr).to(tl.float32)
    if NUM_TOKENS_ON_DEVICE:
        nt = tl.load(num_tokens_ptr).to(tl.float32)
        g = g / (nt * nt)
    g = g * scale
    if ONE_SEQUENCE:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0).to(tl.float32)
        grad = tl.broadcast_to((g * w)[None, :], [BLOCK_T, BLOCK_E])
    else:
        seq = (rows // L).to(tl.int64)
        w = tl.load(w_ptr + seq[:, None] * stride_w + cols[None, :], mask=mask, other=0).to(tl.float32)
        grad = g * w
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :],
             grad.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_logsumexp(x_ptr, rows64, row_ok, E, stride_x, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Online logsumexp of BLOCK_T rows, fp32; -inf for rows of only -inf."""
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], tl.float32)
    for start in range(0, E, BLOCK_E):
        cols = start + tl.arange(0, BLOCK_E)
        mask = row_ok[:, None] & (cols < E)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids -inf - -inf
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = m_new
    return tl.log(s) + tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _z_loss_kernel(
    # pointers
    x_ptr, lse_ptr, partial_ptr, ticket_ptr, out_ptr,
    # sizes
    T, E,
    # strides (rows)
    stride_x,
    # scalars
    scale,
    # meta
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, FINISH_BLOCK: tl.constexpr,
):
    """out = scale * sum_t lse[t]^2 (scale = coeff / T); lse[t] is stored for the backward."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK_T], tl.float32)
    for blk in range(pid, tl.cdiv(T, BLOCK_T), nprog):
        rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        lse = _row_logsumexp(x_ptr, rows.to(tl.int64), row_ok, E, stride_x, BLOCK_T, BLOCK_E)
        tl.store(lse_ptr + rows, lse, mask=row_ok)
        acc += tl.where(row_ok, lse * lse, 0.0)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))
    if is_last_to_arrive(ticket_ptr, nprog):
        tl.store(out_ptr, sum_partials(partial_ptr, nprog, FINISH_BLOCK) * scale)


@triton.jit
def _z_loss_bwd_kernel(
    # pointers
    grad_loss_ptr, x_ptr, lse_ptr, dx_ptr,
    # sizes
    T, E,
    # strides (rows)
    stride_x, stride_dx,
    # scalars
    scale,
    # meta
    HAS_LSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """dx = grad_loss * scale * 2 * lse * softmax(x), scale = coeff / T; lse from the forward
    when HAS_LSE, else recomputed."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    if HAS_LSE:
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    else:
        lse = _row_logsumexp(x_ptr, rows64, row_ok, E, stride_x, BLOCK_T, BLOCK_E)
    g = tl.load(grad_loss_ptr).to(tl.float32) * scale * 2.0 * lse
    for start in range(0, E, BLOCK_E):
        cols = start + tl.arange(0, BLOCK_E)
        mask = row_ok[:, None] & (cols < E)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        dx = g[:, None] * tl.exp(x - lse[:, None])
        tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _update_expert_bias_kernel(
    # pointers
    bias_ptr, counts_ptr,
    # sizes
    E,
    # scalars
    rate,
    # meta
    BLOCK_E: tl.constexpr,
):
    """One program: mean of the counts, then bias += rate * sign(mean - count), in place."""
    acc = tl.zeros([BLOCK_E], tl.float32)
    for start in range(0, E, BLOCK_E):
        cols = start + tl.arange(0, BLOCK_E)
        acc += tl.load(counts_ptr + cols, mask=cols < E, other=0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / E
    for start in range(0, E, BLOCK_E):
        cols = start + tl.arange(0, BLOCK_E)
        ok = cols < E
        d = mean - tl.load(counts_ptr + cols, mask=ok, other=0).to(tl.float32)
        sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        b = tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(bias_ptr + cols, (b + sign * rate).to(bias_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- launch geometry
# Pure functions of shapes, memoised: in the hot path a launch costs a dict lookup, not a
# recomputation of its grid.


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv / next_power_of_2: on recent Triton those are constexpr functions whose
    # host-side call costs microseconds.
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=4096)
def _tile(t: int, e: int, max_block_e: int = _MAX_BLOCK_E):
    """(BLOCK_T, BLOCK_E) of about _TILE elements for a [t, e] operand."""
    block_e = min(_next_pow2(e), max_block_e)
    block_t = max(1, min(_TILE // block_e, _next_pow2(t)))
    return block_t, block_e


@functools.lru_cache(maxsize=4096)
def _grad_geometry(t: int, e: int):
    """(grid, BLOCK_T, BLOCK_E) of the elementwise gradient over [t, e]."""
    block_t, block_e = _tile(t, e)
    return (_cdiv(t, block_t), _cdiv(e, block_e)), block_t, block_e


@functools.lru_cache(maxsize=4096)
def _reduce_geometry(t: int, e: int, device: torch.device):
    """(programs, BLOCK_T, BLOCK_E) of the persistent reductions over a [t, e] operand."""
    block_t, block_e = _tile(t, e)
    tiles = _cdiv(t, block_t) * _cdiv(e, block_e)
    return max(1, min(tiles, _PROGRAMS_PER_SM * num_sms(device))), block_t, block_e


@functools.lru_cache(maxsize=4096)
def _seq_geometry(b: int, seq_length: int, e: int, device: torch.device):
    """(num_chunks, chunk rows, BLOCK_T, BLOCK_E, scratch size) of `_seq_aux_loss_kernel`.

    Rows are split into chunks until the (chunk, sequence, column block) grid is about
    _PROGRAMS_PER_SM programs per SM: few sequences or experts still fill the GPU.
    """
    block_t, block_e = _tile(seq_length, e, _SEQ_BLOCK_E)
    pairs = b * _cdiv(e, block_e)
    want = _cdiv(_PROGRAMS_PER_SM * num_sms(device), pairs)
    chunks = max(1, min(want, _cdiv(seq_length, block_t)))
    chunk = _cdiv(_cdiv(seq_length, chunks), block_t) * block_t
    chunks = _cdiv(seq_length, chunk)
    scratch = b * e + pairs + (chunks * 2 * b * e if chunks > 1 else 0)
    return chunks, chunk, block_t, block_e, pairs, scratch


@functools.lru_cache(maxsize=4096)
def _z_geometry(t: int, e: int, device: torch.device):
    """(forward programs, backward programs, BLOCK_T, BLOCK_E): whole rows, at most 64 of them,
    per step; the forward is persistent, the backward one program per row block."""
    block_e = min(_next_pow2(e), _MAX_BLOCK_E)
    block_t = max(1, min(_TILE // block_e, 64, _next_pow2(t)))
    blocks = _cdiv(t, block_t)
    return max(1, min(blocks, _PROGRAMS_PER_SM * num_sms(device))), blocks, block_t, block_e


# ---------------------------------------------------------------- unchecked launchers (qmoe.ops)


def aux_loss_forward(probs, weights, scale, num_tokens=None, grad_rows=False):
    """(loss, rows): sum_{t, e} probs[t, e] * weights[e] * scale (/ num_tokens^2), a 0-dim fp32
    tensor, and with `grad_rows` the gradient row for a unit grad_loss, fp32, the first E values
    of `rows` (for `grad_from_rows`), else None.

    probs [T, E] float; weights [E] int or float, contiguous; num_tokens None or a 0-dim
    device tensor (read on the device). Unchecked (see the module docstring).
    """
    t, e = probs.shape
    if t == 0 or e == 0:
        zero = torch.zeros((), dtype=torch.float32, device=probs.device)
        return zero, (torch.zeros(e, dtype=torch.float32, device=probs.device) if grad_rows else None)
    probs = rows_contiguous(probs)
    programs, block_t, block_e = _reduce_geometry(t, e, probs.device)
    out = torch.empty((), dtype=torch.float32, device=probs.device)
    work = torch.empty(programs + (e if grad_rows else 0), dtype=torch.float32, device=probs.device)
    ticket = tickets(1, probs.device)
    _launcher(_moe_aux_loss_kernel)[(programs,)](
        probs, weights, out if num_tokens is None else num_tokens, work, ticket, out,
        t, e, probs.stride(0), scale,
        NUM_TOKENS_ON_DEVICE=num_tokens is not None, WRITE_GRAD_ROW=bool(grad_rows),
        BLOCK_T=block_t, BLOCK_E=block_e, FINISH_BLOCK=_FINISH_BLOCK)
    return out, (work if grad_rows else None)


def seq_aux_loss_forward(probs, routing_map, seq_length, scale):
    """(loss, rows): the sequence-level loss, 0-dim fp32, and its gradient rows for a unit
    grad_loss, w = scale * counts, fp32 [B, E] (the first B * E values of `rows`). Unchecked."""
    t, e = probs.shape
    b = t // seq_length
    if t == 0 or e == 0:
        return torch.zeros((), dtype=torch.float32, device=probs.device), \
            torch.zeros(b * e, dtype=torch.float32, device=probs.device)
    probs = rows_contiguous(probs)
    m = rows_contiguous(routing_map)  # read as bool bytes: no uint8 copy (one launch fewer)
    chunks, chunk, block_t, block_e, pairs, scratch_size = _seq_geometry(b, seq_length, e, probs.device)
    out = torch.empty((), dtype=torch.float32, device=probs.device)
    scratch = torch.empty(scratch_size, dtype=torch.float32, device=probs.device)
    ticket = tickets(1 + (pairs if chunks > 1 else 0), probs.device)
    _launcher(_seq_aux_loss_kernel)[(chunks * pairs,)](
        probs, m, scratch, ticket, out,
        b, seq_length, e, chunk, probs.stride(0), m.stride(0), scale,
        NUM_CHUNKS=chunks, BLOCK_T=block_t, BLOCK_E=block_e, FINISH_BLOCK=_FINISH_BLOCK)
    return out, scratch


def broadcast_grad(grad_loss, weights, t, e, dtype, scale, seq_length, num_tokens=None):
    """Contiguous [t, e] gradient, grad_loss * scale * weights[row // seq_length, e]
    (/ num_tokens^2 when a device tensor), in `dtype`, by the Triton kernel. weights:
    [t // seq_length, E] rows of stride E, any dtype. Unchecked."""
    out = torch.empty(t, e, dtype=dtype, device=weights.device)
    if t == 0 or e == 0:
        return out
    grid, block_t, block_e = _grad_geometry(t, e)
    _launcher(_broadcast_grad_kernel)[grid](
        grad_loss, weights, grad_loss if num_tokens is None else num_tokens, out,
        t, seq_length, e, e, scale,
        NUM_TOKENS_ON_DEVICE=num_tokens is not None, ONE_SEQUENCE=seq_length >= t,
        BLOCK_T=block_t, BLOCK_E=block_e)
    return out


def grad_from_rows(grad_loss, rows, t, e, seq_length, dtype):
    """Contiguous [t, e] gradient grad_loss * rows[row // seq_length, :], in `dtype`.

    rows: fp32 gradient rows for a unit grad_loss, [t // seq_length, e] at the start of a
    contiguous buffer (as the forwards above return them). Unchecked.
    """
    if t == 0 or e == 0:
        return torch.zeros(t, e, dtype=dtype, device=rows.device)
    return broadcast_grad(grad_loss, rows, t, e, dtype, 1.0, seq_length)


def z_loss_forward(logits, coeff):
    """(loss, lse): coeff * mean_t(lse^2), 0-dim fp32, and lse [T] fp32 (for `z_loss_grad`).
    Unchecked."""
    t, e = logits.shape
    if t == 0 or e == 0:  # no tokens, no loss (NUMERICS.md "Non-finite values": empty batches)
        return torch.zeros((), dtype=torch.float32, device=logits.device), \
            torch.zeros(t, dtype=torch.float32, device=logits.device)
    logits = rows_contiguous(logits)
    programs, _, block_t, block_e = _z_geometry(t, e, logits.device)
    out = torch.empty((), dtype=torch.float32, device=logits.device)
    lse = torch.empty(t + programs, dtype=torch.float32, device=logits.device)  # lse | partials
    _launcher(_z_loss_kernel)[(programs,)](
        logits, lse, lse[t:], tickets(1, logits.device), out,
        t, e, logits.stride(0), coeff / t,
        BLOCK_T=block_t, BLOCK_E=block_e, FINISH_BLOCK=_FINISH_BLOCK)
    return out, lse


def z_loss_grad(grad_loss, logits, coeff, lse=None):
    """d z_loss / d logits [T, E] in the logits' dtype, by the Triton kernel; lse [T] fp32 from
    `z_loss_forward`, or None to recompute it. Unchecked."""
    t, e = logits.shape
    logits = rows_contiguous(logits)
    dx = torch.empty(t, e, dtype=logits.dtype, device=logits.device)
    if dx.numel() == 0:
        return dx
    _, blocks, block_t, block_e = _z_geometry(t, e, logits.device)
    _launcher(_z_loss_bwd_kernel)[(blocks,)](
        grad_loss, logits, logits if lse is None else lse, dx, t, e, logits.stride(0), dx.stride(0),
        coeff / t, HAS_LSE=lse is not None, BLOCK_T=block_t, BLOCK_E=block_e)
    return dx


def moe_aux_constants(num_tokens, num_experts, top_k, coeff):
    """(scale, num_tokens tensor or None): an int num_tokens is folded into the scale (0 tokens, which
    only an empty batch may have, divides by 1: the loss of no tokens is 0)."""
    scale = num_experts * coeff / top_k
    if isinstance(num_tokens, torch.Tensor):
        return scale, num_tokens
    n = float(num_tokens) or 1.0
    return scale / (n * n), None


def seq_aux_scale(t, e, seq_length, top_k, coeff):
    return e * coeff / (top_k * seq_length * seq_length * max(t // seq_length, 1))


# ---------------------------------------------------------------- reference-signature twins


def moe_aux_loss(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff):
    """Triton twin of `qmoe.reference.aux_loss.moe_aux_loss`."""
    check_moe_aux_loss_args(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff)
    scale, nt = moe_aux_constants(num_tokens, num_experts, top_k, coeff)
    return aux_loss_forward(probs, tokens_per_expert.contiguous(), scale, nt)[0]


def moe_aux_loss_backward(grad_loss, probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff):
    """Triton twin of `qmoe.reference.aux_loss.moe_aux_loss_backward` (a contiguous [T, E])."""
    scale, nt = moe_aux_constants(num_tokens, num_experts, top_k, coeff)
    t, e = probs.shape
    return broadcast_grad(grad_loss, tokens_per_expert.contiguous(), t, e, probs.dtype, scale,
                          max(t, 1), nt)


def seq_aux_loss(probs, routing_map, seq_length, top_k, coeff):
    """Triton twin of `qmoe.reference.aux_loss.seq_aux_loss`."""
    check_seq_aux_loss_args(probs, routing_map, seq_length, top_k, coeff)
    t, e = probs.shape
    return seq_aux_loss_forward(probs, routing_map, seq_length,
                                seq_aux_scale(t, e, seq_length, top_k, coeff))[0]


def seq_aux_loss_backward(grad_loss, probs, routing_map, seq_length, top_k, coeff):
    """Triton twin of `qmoe.reference.aux_loss.seq_aux_loss_backward` (runs the forward kernel
    for the per-sequence counts, which the op keeps from its forward instead)."""
    t, e = probs.shape
    _, rows = seq_aux_loss_forward(probs, routing_map, seq_length,
                                   seq_aux_scale(t, e, seq_length, top_k, coeff))
    return grad_from_rows(grad_loss, rows, t, e, seq_length, probs.dtype)


def z_loss(logits, coeff):
    """Triton twin of `qmoe.reference.aux_loss.z_loss`."""
    check_scores("logits", logits)
    check_coeff(coeff)
    return z_loss_forward(logits, coeff)[0]


def z_loss_backward(grad_loss, logits, coeff):
    """Triton twin of `qmoe.reference.aux_loss.z_loss_backward`."""
    return z_loss_grad(grad_loss, logits, coeff)


def update_expert_bias(bias, tokens_per_expert, rate=1e-3):
    """Triton twin of `qmoe.reference.aux_loss.update_expert_bias` (in place, returns bias)."""
    check_update_expert_bias_args(bias, tokens_per_expert, rate)
    e = bias.shape[0]
    if e:
        _launcher(_update_expert_bias_kernel)[(1,)](bias, tokens_per_expert.contiguous(), e, float(rate),
                                         BLOCK_E=min(_next_pow2(e), 4096))
    return bias
