"""All-to-all over a `torch.distributed` group, with the backward that sends gradients back.

Rows travel with `torch.distributed.all_to_all_single` (NCCL on GPUs, gloo on CPU): rank i
sends `send_splits[j]` consecutive rows to rank j and receives `recv_splits[j]` rows from it,
in rank order. The gradient of an all-to-all is the all-to-all with the splits swapped.
Every rank of the group must run the same collectives in the same order: each Function here
issues its collectives in a fixed order in forward and in backward, whatever the data.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# dtypes every backend carries; others (FP8 codes, E8M0 scales) travel as bytes of the same width
_WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
                torch.int32, torch.int64)


@dataclass(frozen=True)
class Exchange:
    """Who sends how many rows to whom in one all-to-all.

    send_splits / recv_splits: per-rank row counts (host ints), or None for equal splits of a
    static buffer (the fixed-capacity mode: no host values, CUDA-graph capturable).
    recv_rows: rows this rank receives (the output's first dimension).
    """

    group: object
    send_splits: tuple[int, ...] | None
    recv_splits: tuple[int, ...] | None
    recv_rows: int
    send_rows: int

    def reverse(self) -> "Exchange":
        """The exchange that sends every row back where it came from."""
        return Exchange(self.group, self.recv_splits, self.send_splits, self.send_rows, self.recv_rows)


def all_to_all(x: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """Send x [send_rows, ...] (any dtype) by `exchange`; returns [recv_rows, ...] (not differentiable)."""
    if x.shape[0] != exchange.send_rows:
        raise ValueError(f"all_to_all: x has {x.shape[0]} rows but the exchange sends {exchange.send_rows}")
    wire = x if x.dtype in _WIRE_DTYPES else x.view(torch.uint8)  # 1-byte formats: same shape
    wire = wire.contiguous()
    out = wire.new_empty((exchange.recv_rows, *wire.shape[1:]))
    dist.all_to_all_single(out, wire, list(exchange.recv_splits) if exchange.recv_splits is not None else None,
                           list(exchange.send_splits) if exchange.send_splits is not None else None,
                           group=exchange.group)
    return out if wire is x or out.dtype == x.dtype else out.view(x.dtype)


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all of several row tensors with one `Exchange`, in argument order.

    Floating-point tensors get their gradients sent back; others (quantized bytes) are data only.
    """

    @staticmethod
    def forward(ctx, exchange: Exchange, *tensors):
        ctx.exchange = exchange
        ctx.floating = [t.is_floating_point() for t in tensors]
        outs = tuple(all_to_all(t, exchange) for t in tensors)
        ctx.mark_non_differentiable(*(o for o, f in zip(outs, ctx.floating) if not f))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        back = ctx.exchange.reverse()
        return (None, *(all_to_all(g.contiguous(), back) if f else None for g, f in zip(grads, ctx.floating)))


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [ep * L] (tokens this rank sends to each expert, experts in rank order) ->
    [ep, L]: row j holds what rank j sends to this rank's L local experts. One small all-to-all."""
    ep = dist.get_world_size(group)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(ep, -1)
