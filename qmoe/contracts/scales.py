"""Where a quantized tensor keeps its scales: in the layout the quantizer wrote, which may be one
the GEMMs read directly (NUMERICS.md: GEMM-ready layouts are internal), while what users read
is the canonical layout.

The FP8 block cast writes 1 x 128 scales steps-major (`qmoe.kernels._layout.steps_major`): a
tile's scales are consecutive words, and the block GEMMs stream them that way. Copying them to
the canonical row-major layout and back for every GEMM would move them twice for nothing, so
`ScaleSlot` keeps what was written and makes the canonical copy only when the attribute is read.
"""
from __future__ import annotations

import torch

from qmoe.contracts.formats import E2M1, nvfp4_tensor_scale


class ScaleSlot:
    """A scale attribute (`rowwise_scale_inv`, `columnwise_scale_inv`) of a quantized tensor class.

    Assigning stores the tensor as given. Reading gives the canonical layout: the stored tensor
    itself where its strides are row-major and dense, else a row-major copy of it (same shape and
    values; writing into that copy changes nothing stored). `gemm_scale` gives the stored tensor,
    for the kernels that take any strides.
    """

    def __set_name__(self, owner, name: str):
        self.key = "_stored_" + name

    def __get__(self, obj, owner=None):
        if obj is None:  # the class attribute: a dataclass field's default
            return None
        s = obj.__dict__.get(self.key)
        if isinstance(s, torch.Tensor) and s.dim() == 2 and s.stride() != (s.shape[1], 1):
            # is_contiguous() also holds for a one-column steps-major view, whose last stride is not 1
            return torch.empty(s.shape, dtype=s.dtype, device=s.device).copy_(s)
        return s

    def __set__(self, obj, value):
        obj.__dict__[self.key] = value


def gemm_scale(t, columnwise: bool) -> torch.Tensor | None:
    """The scales of t's rowwise or columnwise copy as stored (any strides): what the GEMMs read."""
    return t.__dict__.get("_stored_columnwise_scale_inv" if columnwise else "_stored_rowwise_scale_inv")


def tensor_factor(t, columnwise: bool) -> torch.Tensor | None:
    """NVFP4's per-tensor (per-group) factor S_dec = 1 / S_enc(amax) of t's rowwise or columnwise
    copy, fp32: what multiplies the exact q * s_b products (a GEMM's accumulator, a copy held as
    values) to give the dequantized values (NUMERICS.md); None for formats without one."""
    if t.quantizer.fmt != E2M1:
        return None
    return 1.0 / nvfp4_tensor_scale(t.columnwise_amax if columnwise else t.amax)
