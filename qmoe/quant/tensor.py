"""QuantizedTensor: the data and scales of one quantized 2-D tensor, in canonical layouts.

A plain storage object (no autograd, no torch.Tensor subclassing) so the hot path touches
only tensors. "rowwise" data quantizes x [M, K] in blocks along K; "columnwise" data is the
quantized transpose [K, M], the operand a TN GEMM needs for dgrad/wgrad.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qmoe.contracts.scales import ScaleSlot, gemm_scale
from qmoe.contracts.validate import check_dequantize_dtype, check_flag


@dataclass(eq=False, repr=False)
class QuantizedTensor:
    """Canonical storage (NUMERICS.md); `quantizer` knows the format and how to dequantize.

    shape: the logical high-precision shape (leading dims flatten into M).
    rowwise_data: [M, K] fp8, or [M, K/2] uint8 for NVFP4; None when not requested.
    rowwise_scale_inv: 0-dim fp32 (per tensor), [M, ceil(K/b)] (1-D blocks) or the 2-D block grid.
    columnwise_data / columnwise_scale_inv: the same for x.T; None when not requested.
    The scales are kept as the quantizer wrote them and read in the canonical layout
    (`qmoe.contracts.scales.ScaleSlot`).
    amax: fp32 per-tensor amax for NVFP4 (the tensor scale), else None.
    columnwise_amax: NVFP4's amax of the columnwise copy (after the Hadamard transform, if any).
    """

    quantizer: object
    shape: torch.Size
    dtype: torch.dtype
    rowwise_data: torch.Tensor | None = None
    rowwise_scale_inv: torch.Tensor | None = ScaleSlot()
    columnwise_data: torch.Tensor | None = None
    columnwise_scale_inv: torch.Tensor | None = ScaleSlot()
    amax: torch.Tensor | None = None
    columnwise_amax: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        t = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data
        return t.device

    @property
    def shape_2d(self) -> tuple[int, int]:
        k = self.shape[-1] if len(self.shape) else 1
        m = 1
        for d in self.shape[:-1]:
            m *= d
        return m, k

    def dequantize(self, dtype: torch.dtype = torch.float32, columnwise: bool = False) -> torch.Tensor:
        """High-precision values: rowwise in the original shape, or the columnwise copy as [K, M]."""
        check_dequantize_dtype(dtype)
        check_flag("columnwise", columnwise)
        if columnwise and self.columnwise_data is None:
            raise ValueError("this tensor was quantized without columnwise data; "
                             "quantize(..., columnwise=True) to get the transposed copy")
        if not columnwise and self.rowwise_data is None:
            raise ValueError("this tensor was quantized without rowwise data; quantize(..., rowwise=True)")
        out = self.quantizer.dequantize(self, dtype=dtype, columnwise=columnwise)
        return out if columnwise else out.reshape(self.shape)

    def __repr__(self) -> str:
        parts = [f"shape={tuple(self.shape)}", f"quantizer={self.quantizer!r}"]
        for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            t = gemm_scale(self, name.startswith("col")) if name.endswith("scale_inv") else getattr(self, name)
            if t is not None:
                parts.append(f"{name}={tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}")
        return f"QuantizedTensor({', '.join(parts)})"
