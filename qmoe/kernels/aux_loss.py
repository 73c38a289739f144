"""Triton auxiliary losses and expert-bias update. Reference twin: `qmoe.reference.aux_loss`.

Dimensions: T tokens, E experts, K top-k, B sequences of L tokens (T = B * L, batch-major).

Both balance losses are one weighted sum, sum over (t, e) of probs[t, e] * w[seq(t), e] with
w = tokens_per_expert (one "sequence" of all T tokens) or the per-sequence counts, times a
constant. So a loss is: tiles of [BLOCK_T, BLOCK_E] each write one fp32 partial (grid over
rows x experts x sequences: any T and E fill the GPU, no cooperative launch), then one small
program adds the partials in a fixed order (deterministic, no float atomics) and applies the
constant, reading `num_tokens` from the device when it is a tensor. The gradient is that
constant times w broadcast over each sequence's rows (for the batch-level loss, a stride-0
view of one row).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.reference.aux_loss import (check_moe_aux_loss_args, check_seq_aux_loss_args,
                                     check_update_expert_bias_args, _check_coeff, _check_scores)

# Tiles of about this many elements: large enough to stream at bandwidth, small enough that
# even T = 128k, E = 64 gives thousands of programs.
_TILE_ELEMENTS = 4096
_MAX_BLOCK_E = 256
_FINISH_BLOCK = 1024


@triton.jit
def _weighted_sum_kernel(
    # pointers
    x_ptr, w_ptr, partial_ptr,
    # sizes
    L, E,
    # strides (rows)
    stride_x, stride_w,
    # meta
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """partial[b, lt, eb] = sum of x[b*L + rows, cols] * w[b, cols] over one tile."""
    lt, eb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = lt * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < E
    mask = (rows < L)[:, None] & col_ok[None, :]
    row64 = b.to(tl.int64) * L + rows
    x = tl.load(x_ptr + row64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + b * stride_w + cols, mask=col_ok, other=0).to(tl.float32)
    total = tl.sum(tl.sum(x * w[None, :], axis=1), axis=0)
    tl.store(partial_ptr + (b * tl.num_programs(1) + eb) * tl.num_programs(0) + lt, total)


@triton.jit
def _count_kernel(
    # pointers
    map_ptr, counts_ptr,
    # sizes
    L, E,
    # strides (rows)
    stride_map,
    # meta
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """counts[b, e] += tokens of sequence b routed to e within one tile (integer atomics)."""
    lt, eb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = lt * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < E
    mask = (rows < L)[:, None] & col_ok[None, :]
    row64 = b.to(tl.int64) * L + rows
    m = tl.load(map_ptr + row64[:, None] * stride_map + cols[None, :], mask=mask, other=0)
    tl.atomic_add(counts_ptr + b * E + cols, tl.sum(m.to(tl.int32), axis=0), mask=col_ok)


@triton.jit
def _finish_kernel(
    # pointers
    partial_ptr, num_tokens_ptr, out_ptr,
    # sizes
    n,
    # scalars
    scale,
    # meta
    NUM_TOKENS_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr,
):
    """out = sum(partial) * scale, divided by num_tokens^2 when that lives on the device."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + idx, mask=idx < n, other=0.0)
    total = tl.sum(acc, axis=0) * scale
    if NUM_TOKENS_ON_DEVICE:
        nt = tl.load(num_tokens_ptr).to(tl.float32)
        total = total / (nt * nt)
    tl.store(out_ptr, total)


@triton.jit
def _broadcast_grad_kernel(
    # pointers
    grad_loss_ptr, w_ptr, num_tokens_ptr, out_ptr,
    # sizes
    L, E,
    # strides (rows)
    stride_w, stride_out,
    # scalars
    scale,
    # meta
    NUM_TOKENS_ON_DEVICE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """out[b*L + t, e] = grad_loss * scale * w[b, e] (/ num_tokens^2 when on the device)."""
    lt, eb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = lt * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < E
    mask = (rows < L)[:, None] & col_ok[None, :]
    g = tl.load(grad_loss_ptr).to(tl.float32) * scale
    if NUM_TOKENS_ON_DEVICE:
        nt = tl.load(num_tokens_ptr).to(tl.float32)
        g = g / (nt * nt)
    w = tl.load(w_ptr + b * stride_w + cols, mask=col_ok, other=0).to(tl.float32)
    grad = tl.zeros([BLOCK_T, BLOCK_E], tl.float32) + (g * w)[None, :]
    row64 = b.to(tl.int64) * L + rows
    tl.store(out_ptr + row64[:, None] * stride_out + cols[None, :],
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
    x_ptr, partial_ptr,
    # sizes
    T, E,
    # strides (rows)
    stride_x,
    # meta
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    lse = _row_logsumexp(x_ptr, rows.to(tl.int64), row_ok, E, stride_x, BLOCK_T, BLOCK_E)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(tl.where(row_ok, lse * lse, 0.0), axis=0))


@triton.jit
def _z_loss_bwd_kernel(
    # pointers
    grad_loss_ptr, x_ptr, dx_ptr,
    # sizes
    T, E,
    # strides (rows)
    stride_x, stride_dx,
    # scalars
    scale,
    # meta
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """dx = grad_loss * scale * 2 * lse * softmax(x), scale = coeff / T."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
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


# ---------------------------------------------------------------- launchers


def _tiles(rows: int, e: int):
    block_e = min(triton.next_power_of_2(max(e, 1)), _MAX_BLOCK_E)
    block_t = max(1, min(_TILE_ELEMENTS // block_e, triton.next_power_of_2(max(rows, 1))))
    # grid: row tiles on axis 0 (up to 2^31 - 1), E blocks and sequences on axes 1, 2 (< 65536)
    return block_t, block_e


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _weighted_loss(x, w, seq_length, scale, num_tokens_tensor):
    """sum_{t,e} x[t, e] * w[t // seq_length, e] * scale (/ num_tokens^2): a 0-dim fp32 tensor."""
    t, e = x.shape
    b = t // seq_length
    out = torch.empty((), dtype=torch.float32, device=x.device)
    block_t, block_e = _tiles(seq_length, e)
    grid = (triton.cdiv(seq_length, block_t), triton.cdiv(e, block_e), b)
    partial = torch.zeros(max(grid[0] * grid[1] * grid[2], 1), dtype=torch.float32, device=x.device)
    if x.numel():
        _weighted_sum_kernel[grid](x, w, partial, seq_length, e, x.stride(0), w.stride(0),
                                   BLOCK_T=block_t, BLOCK_E=block_e)
    nt = num_tokens_tensor if num_tokens_tensor is not None else out  # dummy when not read
    _finish_kernel[(1,)](partial, nt, out, partial.numel(), scale,
                         NUM_TOKENS_ON_DEVICE=num_tokens_tensor is not None, BLOCK=_FINISH_BLOCK)
    return out


def _weighted_grad(grad_loss, t, e, dtype, w, seq_length, scale, num_tokens_tensor):
    """[t, e] gradient: grad_loss * scale * w[row // seq_length, e] (/ num_tokens^2)."""
    out = torch.empty(t, e, dtype=dtype, device=w.device)
    block_t, block_e = _tiles(seq_length, e)
    grid = (triton.cdiv(seq_length, block_t), triton.cdiv(e, block_e), t // seq_length)
    if out.numel() == 0:
        return out
    nt = num_tokens_tensor if num_tokens_tensor is not None else grad_loss
    _broadcast_grad_kernel[grid](grad_loss, w, nt, out, seq_length, e, w.stride(0), out.stride(0),
                                 scale, NUM_TOKENS_ON_DEVICE=num_tokens_tensor is not None,
                                 BLOCK_T=block_t, BLOCK_E=block_e)
    return out


def _moe_aux_constants(num_tokens, num_experts, top_k, coeff):
    """(scale, num_tokens tensor or None): an int num_tokens is folded into the scale."""
    scale = num_experts * coeff / top_k
    if isinstance(num_tokens, torch.Tensor):
        return scale, num_tokens
    return scale / (float(num_tokens) * float(num_tokens)), None


def moe_aux_loss(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff):
    """Triton twin of `qmoe.reference.aux_loss.moe_aux_loss`."""
    check_moe_aux_loss_args(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff)
    scale, nt = _moe_aux_constants(num_tokens, num_experts, top_k, coeff)
    w = tokens_per_expert.contiguous().view(1, -1)
    return _weighted_loss(_rows_contiguous(probs), w, max(probs.shape[0], 1), scale, nt)


def moe_aux_loss_backward(grad_loss, probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff):
    """Triton twin of `qmoe.reference.aux_loss.moe_aux_loss_backward`."""
    scale, nt = _moe_aux_constants(num_tokens, num_experts, top_k, coeff)
    w = tokens_per_expert.contiguous().view(1, -1)
    # Every token's row of the gradient is the same [E] vector: compute it once and return a
    # stride-0 view, so the backward moves E values instead of T * E (as autograd of the
    # reference does); consumers read it with a row stride of 0.
    row = _weighted_grad(grad_loss, 1, probs.shape[1], probs.dtype, w, 1, scale, nt)
    return row.expand(probs.shape[0], -1)


def _sequence_counts(routing_map, seq_length):
    t, e = routing_map.shape
    b = t // seq_length
    counts = torch.zeros(b, e, dtype=torch.int32, device=routing_map.device)
    if t:
        m = _rows_contiguous(routing_map).view(torch.uint8)
        block_t, block_e = _tiles(seq_length, e)
        grid = (triton.cdiv(seq_length, block_t), triton.cdiv(e, block_e), b)
        _count_kernel[grid](m, counts, seq_length, e, m.stride(0), BLOCK_T=block_t, BLOCK_E=block_e)
    return counts


def seq_aux_loss(probs, routing_map, seq_length, top_k, coeff):
    """Triton twin of `qmoe.reference.aux_loss.seq_aux_loss`."""
    check_seq_aux_loss_args(probs, routing_map, seq_length, top_k, coeff)
    t, e = probs.shape
    counts = _sequence_counts(routing_map, seq_length)
    scale = e * coeff / (top_k * seq_length * seq_length * max(t // seq_length, 1))
    return _weighted_loss(_rows_contiguous(probs), counts, seq_length, scale, None)


def seq_aux_loss_backward(grad_loss, probs, routing_map, seq_length, top_k, coeff):
    """Triton twin of `qmoe.reference.aux_loss.seq_aux_loss_backward`."""
    t, e = probs.shape
    counts = _sequence_counts(routing_map, seq_length)
    scale = e * coeff / (top_k * seq_length * seq_length * max(t // seq_length, 1))
    return _weighted_grad(grad_loss, t, e, probs.dtype, counts, seq_length, scale, None)


def _z_tiles(t, e):
    block_e = min(triton.next_power_of_2(max(e, 1)), 1024)
    block_t = max(1, min(_TILE_ELEMENTS // block_e, 64, triton.next_power_of_2(max(t, 1))))
    return block_t, block_e


def z_loss(logits, coeff):
    """Triton twin of `qmoe.reference.aux_loss.z_loss`."""
    _check_scores("logits", logits)
    _check_coeff(coeff)
    t, e = logits.shape
    logits = _rows_contiguous(logits)
    block_t, block_e = _z_tiles(t, e)
    grid = (triton.cdiv(t, block_t),)
    if t == 0 or e == 0:  # the mean of nothing, as the reference says
        return torch.full((), float("nan"), dtype=torch.float32, device=logits.device)
    partial = torch.empty(grid[0], dtype=torch.float32, device=logits.device)
    out = torch.empty((), dtype=torch.float32, device=logits.device)
    _z_loss_kernel[grid](logits, partial, t, e, logits.stride(0), BLOCK_T=block_t, BLOCK_E=block_e)
    _finish_kernel[(1,)](partial, out, out, grid[0], coeff / t,
                         NUM_TOKENS_ON_DEVICE=False, BLOCK=_FINISH_BLOCK)
    return out


def z_loss_backward(grad_loss, logits, coeff):
    """Triton twin of `qmoe.reference.aux_loss.z_loss_backward`."""
    t, e = logits.shape
    logits = _rows_contiguous(logits)
    dx = torch.empty(t, e, dtype=logits.dtype, device=logits.device)
    if dx.numel() == 0:
        return dx
    block_t, block_e = _z_tiles(t, e)
    _z_loss_bwd_kernel[(triton.cdiv(t, block_t),)](
        grad_loss, logits, dx, t, e, logits.stride(0), dx.stride(0), coeff / max(t, 1),
        BLOCK_T=block_t, BLOCK_E=block_e)
    return dx


def update_expert_bias(bias, tokens_per_expert, rate=1e-3):
    """Triton twin of `qmoe.reference.aux_loss.update_expert_bias` (in place, returns bias)."""
    check_update_expert_bias_args(bias, tokens_per_expert, rate)
    e = bias.shape[0]
    if e:
        _update_expert_bias_kernel[(1,)](bias, tokens_per_expert.contiguous(), e, float(rate),
                                         BLOCK_E=min(triton.next_power_of_2(e), 4096))
    return bias
