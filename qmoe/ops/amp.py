"""How qmoe's ops meet `torch.autocast` (the rule of DESIGN.md's training-loop contract).

Under `torch.autocast(device_type, dtype=D)` a qmoe module casts its activation input to D at
its boundary, as `nn.Linear` does, and then runs its own ops with torch.autocast switched off:
quantized GEMMs follow the qmoe recipe (weights are quantized from whatever dtype they have),
high-precision GEMMs run in D, routing runs in fp32, and outputs come out in D. torch.autocast
must stay off inside: it would recast the fp32 GEMMs of the reference path to D (changing the
recipe's numerics) and refuses fp8 tensors outright. The backward of a custom autograd Function
runs under the autocast state in force where `.backward()` is called, so every qmoe Function
switches it off in its backward too (`autocast_off`).
"""
from __future__ import annotations

import contextlib
import functools

import torch

_DEVICE_TYPES = ("cpu", "cuda")


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """torch.autocast's lower-precision dtype for `device`'s type, or None where autocast is off."""
    kind = device.type
    if kind not in _DEVICE_TYPES or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def cast_for_autocast(x: torch.Tensor) -> torch.Tensor:
    """x in torch.autocast's dtype where autocast is on for x's device (a differentiable cast), else x."""
    dtype = autocast_dtype(x.device)
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


@contextlib.contextmanager
def torch_autocast_off():
    """Switch torch.autocast off for every device type where it is on (a no-op where none is)."""
    with contextlib.ExitStack() as stack:
        for kind in _DEVICE_TYPES:
            if torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def autocast_off(fn):
    """Decorator for an autograd Function's forward/backward: run it with torch.autocast off."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch_autocast_off():
            return fn(*args, **kwargs)
    return wrapper
