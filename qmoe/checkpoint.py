"""`qmoe.checkpoint`: activation checkpointing that recomputes the same bits.

`torch.utils.checkpoint.checkpoint` reruns a function in the backward pass. For qmoe modules a
plain rerun is wrong three ways: it runs outside the `qmoe.autocast` region when the backward
is called after the region exits (so it does not quantize at all), delayed scaling's scales
have moved on at the region's exit (so it quantizes differently), and it records every amax and
updates the router's expert bias a second time. `qmoe.checkpoint` wraps the same function with
what the rerun needs: the region the forward ran in, and a `ForwardLog` in which the first run
keeps the scales and expert biases it used and from which the rerun reads them back. Gradients
are then those of the step without checkpointing, bit for bit, for every recipe, whether the
backward runs inside or outside the region.

qmoe modules refuse to be recomputed by `torch.utils.checkpoint` directly (a
`qmoe.UnsupportedError` that names `qmoe.checkpoint`) rather than give different gradients.
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint

from qmoe.contracts.errors import UnsupportedError
from qmoe.quant.replay import ForwardLog, active_log, capture_regions, restored_regions, using_log

__all__ = ["checkpoint"]


def checkpoint(function, *args, use_reentrant: bool = False, **kwargs):
    """`torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., **kwargs)` for qmoe models.

    Runs `function(*args)` without keeping its activations and reruns it in the backward under
    the same qmoe recipe, with the same delayed-scaling scales and expert biases, recording no
    amax and updating no expert bias twice: the gradients equal the non-checkpointed step's bit
    for bit. Every keyword of torch's function (preserve_rng_state, context_fn, determinism_check,
    debug) passes through; torch.autocast's state is restored by torch as usual.

    With use_reentrant=True the first run sees no autograd, so an MoE layer's `aux_loss` would
    have no gradient: qmoe.checkpoint returns the auxiliary losses of the qmoe layers that ran
    inside through the checkpoint as well and puts them back on the layers (`layer.aux_loss`),
    so adding them to the loss works as without checkpointing. The function's output must then
    be a tensor or a tuple.

    >>> y = qmoe.checkpoint(block, x)                      # inside or outside qmoe.autocast
    >>> (y.square().mean() + block.moe.aux_loss).backward()
    """
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be True or False, got {use_reentrant!r}")
    if active_log() is not None:
        raise UnsupportedError("qmoe.checkpoint inside another qmoe.checkpoint",
                               fix="checkpoint the outer function only, or the inner ones only")
    regions = capture_regions()  # the qmoe.autocast region in force here (registered by qmoe.autocast)
    log = ForwardLog()
    runs = [0]
    packing: dict = {}  # reentrant mode with aux losses: what the first run packed beside the output

    def run(*inner_args, **inner_kwargs):
        runs[0] += 1
        if runs[0] > 1:
            log.start_replay()
        with using_log(log), restored_regions(regions):
            out = function(*inner_args, **inner_kwargs)
        if not use_reentrant or not log.side_outputs:
            return out
        packed, side = _pack(out, log.side_outputs)
        if runs[0] == 1:
            packing.update(single=isinstance(out, torch.Tensor), head=len(packed) - len(set(i for _, i in side)),
                           side=side)
        return packed

    out = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)
    if packing:
        for module, i in packing["side"]:
            module.aux_loss = out[i]
        out = out[0] if packing["single"] else out[:packing["head"]]
    return out


def _pack(out, modules):
    """(out followed by the modules' aux losses, each tensor once; [(module, its index)])."""
    if isinstance(out, torch.Tensor):
        head = (out,)
    elif isinstance(out, tuple):
        head = out
    else:
        raise TypeError(f"qmoe.checkpoint(use_reentrant=True) over MoE layers needs the function to return a "
                        f"tensor or a tuple (their aux losses travel beside it), got {type(out).__name__}")
    tensors, index, side = [], {}, []
    for module in modules:
        loss = module.aux_loss
        if id(loss) not in index:
            index[id(loss)] = len(head) + len(tensors)
            tensors.append(loss)
        side.append((module, index[id(loss)]))
    return (*head, *tensors), side
