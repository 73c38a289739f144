"""Which implementation runs an op: Triton kernels or the pure-torch reference (DESIGN.md).

Kernels run on CUDA devices of compute capability >= 9.0; everything else, and any run with
`QMOE_BACKEND=reference`, uses `qmoe.reference`. `qmoe.dispatch` holds the per-family tables
that this choice picks from. `QMOE_BACKEND=triton` forces the kernels
whatever the device: for Triton's interpreter (TRITON_INTERPRET=1 on CPU tensors) and for
trying older GPUs. The environment is read per call, so tests and users can switch backends
without re-importing.
"""
from __future__ import annotations

import functools
import os

import torch

from qmoe.contracts.validate import cuda_index


def backend_override() -> str | None:
    v = os.environ.get("QMOE_BACKEND", "").strip().lower()
    if v in ("", "auto"):
        return None
    if v not in ("reference", "triton"):
        raise ValueError(f"QMOE_BACKEND={v!r} is not a backend; use 'reference', 'triton' or leave it unset")
    return v


@functools.lru_cache(maxsize=None)
def _device_has_kernels(index: int) -> bool:
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernels(*tensors: torch.Tensor) -> bool:
    """True when an op on these tensors (None entries ignored) should run qmoe's Triton kernels."""
    override = backend_override()
    if override is not None:
        return override == "triton"
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if not devices or any(d.type != "cuda" for d in devices):
        return False
    return all(_device_has_kernels(cuda_index(d))
               for d in devices)
