"""Delayed scaling's per-step update as one launch. Reference twin: `qmoe.reference.delayed_scaling`.

The update is little GPU work, but written as torch ops it is some twenty launches per slot,
and an MoE layer updates six slots a step (input, weight and grad_output of two grouped
linears): their host time bounds small layers (docs/performance.md, Qwen3's small experts).
Here one program per block of slots reads each slot's window and writes it back rolled, in
place (group slots are views of the history), and the scale. The window is a dependent chain of
loads and stores within one program, so a program takes a whole window per step where its tile
holds one, and fewer slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.contracts.formats import FLT_MAX
from qmoe.kernels._arith import INF_BITS, abs_bits
from qmoe.kernels._launch import wrapped

_FLT_MAX = tl.constexpr(FLT_MAX)
_BLOCK_G = 32  # slots per program, at most
_TILE = 4096  # window entries per step of a program's loop


@triton.jit
def _update_amax_history_kernel(
        # pointers
        hist_ptr, scale_ptr, count_ptr,
        # sizes
        L, G,
        # strides (the window's rows and slots)
        stride_l, stride_g,
        # meta
        FMT_MAX: tl.constexpr, MARGIN_DIV: tl.constexpr, MOST_RECENT: tl.constexpr, COUNT: tl.constexpr,
        BL: tl.constexpr, BG: tl.constexpr):
    """The window of active slots rolled in place (others kept, a non-finite newest amax cleared),
    scale updated, non-finite steps counted (see the reference). Rows go up by one: each step
    loads its rows and the first row of the next step before any is stored (a barrier between),
    and the last row takes the newest amax, loaded before anything was stored."""
    cols = tl.program_id(0) * BG + tl.arange(0, BG)
    c_ok = cols < G
    newest = tl.load(hist_ptr + cols * stride_g, mask=c_ok, other=0.0)
    finite = abs_bits(newest) < INF_BITS
    active = (newest != 0) & finite
    amax_bits = abs_bits(newest)  # amaxes are >= 0, and NaN's bits exceed every number's: max of bits == amax
    for r0 in range(0, L, BL):
        rows = r0 + tl.arange(0, BL)
        m = (rows < L)[:, None] & c_ok[None, :]
        h = tl.load(hist_ptr + rows[:, None] * stride_l + cols[None, :] * stride_g, mask=m, other=0.0)
        if not MOST_RECENT:
            amax_bits = tl.maximum(amax_bits, tl.max(abs_bits(h), 0))
        below = m & (rows < L - 1)[:, None]
        shifted = tl.load(hist_ptr + (rows + 1)[:, None] * stride_l + cols[None, :] * stride_g, mask=below, other=0.0)
        shifted = tl.where(rows[:, None] == L - 1, newest[None, :], shifted)  # the newest moves to the last row
        shifted = tl.where(rows[:, None] == 0, 0.0, shifted)  # row 0 cleared for the next step
        kept = tl.where(finite[None, :] | (rows[:, None] != 0), h, 0.0)  # a non-finite newest is not recorded
        tl.debug_barrier()  # every row of this step, and the next step's first, read before any is written
        tl.store(hist_ptr + rows[:, None] * stride_l + cols[None, :] * stride_g,
                 tl.where(active[None, :], shifted, kept), mask=m)
    amax = amax_bits.to(tl.float32, bitcast=True)
    new_scale = tl.math.div_rn(tl.full(amax.shape, FMT_MAX, tl.float32), amax)
    new_scale = tl.where(new_scale == float("inf"), _FLT_MAX, new_scale)
    new_scale = tl.math.div_rn(new_scale, tl.full(amax.shape, MARGIN_DIV, tl.float32))
    ok = active & (amax_bits < 0x7F800000) & (amax > 0)
    old = tl.load(scale_ptr + cols, mask=c_ok, other=1.0)
    tl.store(scale_ptr + cols, tl.where(ok, new_scale, old), mask=c_ok)
    if COUNT:
        count = tl.load(count_ptr + cols, mask=c_ok, other=0)
        tl.store(count_ptr + cols, count + (~finite).to(tl.int32), mask=c_ok)


def update_amax_history(amax_history: torch.Tensor, scale: torch.Tensor, fmt_max: float, margin: int,
                        algo: str, nonfinite_steps: torch.Tensor | None = None) -> None:
    """Kernel twin of qmoe.reference.delayed_scaling.update_amax_history (in place, same bits)."""
    length = amax_history.shape[0]
    slots = amax_history[0].numel()
    if length == 0 or slots == 0:
        return
    s_l = amax_history.stride(0)
    s_g = amax_history.stride(1) if amax_history.dim() == 2 else 1
    dense_scale = scale if scale.is_contiguous() else scale.contiguous()
    count = nonfinite_steps
    if count is not None and (count.dtype != torch.int32 or not count.is_contiguous()):
        count = count.to(torch.int32).contiguous()
    bl = min(triton.next_power_of_2(length), _TILE)  # the whole window in one step where it fits
    bg = min(_BLOCK_G, triton.next_power_of_2(slots), _TILE // bl)  # more programs, fewer steps
    wrapped(_update_amax_history_kernel)[(triton.cdiv(slots, bg),)](
        amax_history, dense_scale, count if count is not None else dense_scale, length, slots, s_l, s_g,
        FMT_MAX=float(fmt_max), MARGIN_DIV=float(2.0 ** margin), MOST_RECENT=algo == "most_recent",
        COUNT=count is not None, BL=bl, BG=bg)
    if dense_scale is not scale:
        scale.copy_(dense_scale)
    if count is not None and count is not nonfinite_steps:
        nonfinite_steps.copy_(count)
