"""Arrival counters for last-program-finishes reductions: a kernel's programs each store a
partial, draw a ticket, and the program that draws the last one reduces the partials.

`tickets` hands out zeroed counters shared without memsets, `is_last_to_arrive` is the
device-side handshake (it leaves the counter zeroed again), `sum_partials` the deterministic
reduction the last program runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe.contracts.validate import cuda_index

# Counters handed to graph captures: allocated (zeroed) outside any capture, each captured launch
# keeps its own slice for the graph's lifetime. Per device index: [buffer, next free slot].
_CAPTURE_TICKETS: dict[int, list] = {}
_CAPTURE_TICKET_SLOTS = 1 << 14
# Counters for eager launches, one buffer per (device index, CUDA stream).
_STREAM_TICKETS: dict[tuple[int, int], torch.Tensor] = {}


def tickets(n: int, device: torch.device) -> torch.Tensor:
    """At least `n` zeroed int32 arrival counters for a last-program-finishes kernel, which
    draws from them with `is_last_to_arrive` (its last program sets each back to zero).

    Because the kernel leaves them zeroed, a launch needs no memset of its own (one launch, and
    its host time, fewer per loss). Sharing is safe where launches cannot overlap: eager
    launches share one buffer per CUDA stream (a stream runs its kernels one after another),
    and a launch captured into a CUDA graph gets counters of its own, which it keeps zeroed
    for every replay, on any stream. A capture before any eager launch on that device, or one
    that has used up the capture slots, falls back to a captured memset of fresh counters.
    """
    if device.type != "cuda" or torch.compiler.is_compiling():
        # Triton's interpreter runs one launch at a time; a traced graph gets fresh counters
        # (what it does with a module-level buffer the kernel mutates is not ours to decide)
        return torch.zeros(n, dtype=torch.int32, device=device)
    index = cuda_index(device)
    if torch.cuda.is_current_stream_capturing():
        pool = _CAPTURE_TICKETS.get(index)
        if pool is None or pool[1] + n > pool[0].numel():
            return torch.zeros(n, dtype=torch.int32, device=device)
        start, pool[1] = pool[1], pool[1] + n
        return pool[0][start:start + n]
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    buf = _STREAM_TICKETS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        _STREAM_TICKETS[key] = buf
        if index not in _CAPTURE_TICKETS:
            _CAPTURE_TICKETS[index] = [torch.zeros(_CAPTURE_TICKET_SLOTS, dtype=torch.int32,
                                                   device=device), 0]
    return buf


@triton.jit
def is_last_to_arrive(ticket_ptr, n):
    """True in the last of `n` programs to call this on a zeroed counter, which that program
    sets back to zero (`tickets` hands the counter to the next launch).

    The CUDA threadfence-reduction handshake: the barrier orders every thread's earlier
    stores before the ticket, the ticket's acq_rel makes them visible to the program that
    draws the last one (which then reads them with volatile loads, past the L1). All `n`
    have drawn by then, so nothing of this launch touches the counter after the reset.
    """
    tl.debug_barrier()
    last = tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == n - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed")
    return last


@triton.jit
def sum_partials(partial_ptr, n, BLOCK: tl.constexpr):
    """Sum of partial[0:n] in a fixed order (the same bits on every run)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + idx, mask=idx < n, other=0.0, volatile=True)
    return tl.sum(acc, axis=0)

