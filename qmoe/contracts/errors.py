"""Errors qmoe raises at its public boundary (`qmoe.UnsupportedError` is this class)."""
from __future__ import annotations

import torch


class UnsupportedError(RuntimeError):
    """A recipe, op or path that this device or backend cannot run.

    The message names the op, the recipe, the device and the way out, e.g.
    ``grouped_path="split"`` or ``QMOE_BACKEND=reference``.
    """

    def __init__(self, op: str, *, recipe=None, device=None, why: str = "", fix: str = ""):
        self.op, self.recipe, self.device = op, recipe, device
        parts = [f"{op} is not supported"]
        if recipe is not None:
            parts.append(f"for recipe {type(recipe).__name__ if not isinstance(recipe, str) else recipe}")
        if device is not None:
            parts.append(f"on device {device}")
        msg = " ".join(parts)
        if why:
            msg += f": {why}"
        if fix:
            msg += f". Way out: {fix}"
        super().__init__(msg)


def refuse_compile(op: str, *, recipe: str, why: str, fix: str) -> None:
    """Stop a torch.compile trace that reaches this call with UnsupportedError(op, ...); no-op in eager.

    torch.compile reports it wrapped (torch._dynamo.exc.InternalTorchDynamoError, a RuntimeError)
    with this message first.
    """
    if torch.compiler.is_compiling():
        _raise_at_trace_time(op, recipe, why, fix)


@torch.compiler.assume_constant_result
def _raise_at_trace_time(op: str, recipe: str, why: str, fix: str) -> None:
    # An exception raised by traced code only makes torch.compile run that code eagerly, where
    # is_compiling() is False and nothing would be refused; this function runs at trace time.
    raise UnsupportedError(op, recipe=recipe, why=why, fix=fix)
