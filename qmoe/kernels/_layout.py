"""Host-side argument layout for the kernels: dense rows, split sizes on the device, group counts."""
from __future__ import annotations

import torch
import triton

from qmoe.contracts.validate import check_split_sizes


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as a view of integers of its element width, for kernels that move values without
    reading them (any float dtype, NaN payloads included)."""
    return t.view(_RAW[t.element_size()])


def group_pow2(num_groups: int) -> int:
    """The power-of-two width (at least 2) of a kernel's vector over `num_groups` groups."""
    return max(2, triton.next_power_of_2(num_groups))


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` when its last dimension is dense (the kernels take a row stride), else a dense copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def device_splits(split_sizes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Split sizes as an int tensor on x's device (a no-op for device splits); their values are the
    caller's (qmoe.quant.GroupedTensor reads them where that costs no host sync)."""
    check_split_sizes(split_sizes, device=x.device, read="never")
    return split_sizes.to(x.device) if split_sizes.device != x.device else split_sizes


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with unit stride along K (copies only when it has none)."""
    if x.dim() != 2:
        raise ValueError(f"quantize kernels take a 2-D tensor [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize kernels take float32, bfloat16 or float16 input, got {x.dtype}")
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def steps_major(rows: int, steps: int, dtype: torch.dtype, device, zeros: bool = False) -> torch.Tensor:
    """A [rows, steps] scale tensor stored steps-major: the transposed view of a [steps, rows]
    buffer whose rows are padded to 16 bytes. One step's scales of a 128-row tile are then
    consecutive words, which the block cast stores in runs and the block GEMMs load as one TMA
    box (`gemm_steps_major`). zeros: scale entries nobody writes read as zero."""
    per = max(1, 16 // dtype.itemsize)
    buf = (torch.zeros if zeros else torch.empty)((steps, -(-rows // per) * per), dtype=dtype, device=device)
    return buf[:, :rows].t()


def gemm_steps_major(scale: torch.Tensor) -> torch.Tensor | None:
    """`scale` [rows, steps] as the [steps, rows] view a TMA descriptor takes (unit stride along
    rows, 16-byte aligned step stride and base), or None where it is not stored that way."""
    if scale.dim() != 2 or scale.stride(0) != 1 or scale.data_ptr() % 16:
        return None
    if (scale.stride(1) * scale.element_size()) % 16 or scale.stride(1) < scale.shape[0]:
        return None
    return scale.t()
