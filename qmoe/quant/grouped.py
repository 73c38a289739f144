"""GroupedTensor: all experts' quantized rows, columnwise copies and scales in single buffers.

Group g owns rows offsets[g]:offsets[g+1] of the packed input and is quantized exactly as if
it were alone (per-group amax and scales; no block crosses a group boundary). Split sizes stay
on the device; layouts are described in `qmoe/reference/grouped_quantize.py`.
"""
from __future__ import annotations

import copy

import torch

from qmoe.backend import use_kernels
from qmoe.contracts.carriers import ActivatedRows, GatheredRows, RowsWithAmax, row_groups, stored_tensor
from qmoe.contracts.formats import pack_e2m1, unpack_e2m1
from qmoe.contracts.scales import ScaleSlot, gemm_scale, tensor_factor
from qmoe.contracts.validate import (check_dequantize_dtype, check_flag, check_gather_index, check_group_amax,
                                     check_split_sizes)
from qmoe.dispatch import ACTIVATION
from qmoe.quant.quantizer import NVFP4Quantizer, Quantizer, check_float_input
from qmoe.quant.tensor import QuantizedTensor
from qmoe.reference.grouped_quantize import group_scale_offsets
from qmoe.reference.quantize import saturate_to


def _device_splits(split_sizes, num_rows: int, device: torch.device, validate: bool = True) -> torch.Tensor:
    """Checked split sizes as an int64 tensor on `device`; `validate` also reads their values (sign,
    sum): a host sync for device splits, so callers with trusted splits pass validate=False."""
    check_split_sizes(split_sizes, device=device, num_rows=num_rows, read="always" if validate else "never")
    if isinstance(split_sizes, (list, tuple)):
        split_sizes = torch.tensor(split_sizes, dtype=torch.int64)
    return split_sizes.to(device=device, dtype=torch.int64)


class GroupedTensor:
    """Quantized data of G groups of rows of one [sum M_g, K] tensor, in grouped layouts.

    rowwise_data: [sum M, K] (NVFP4: [sum M, K/2]); columnwise_data: [K, sum M] (NVFP4: [K, sum M / 2]).
    rowwise_scale_inv / columnwise_scale_inv: [G] per-tensor scales, or grouped block scales whose
    per-group start is `rowwise_scale_offsets` / `columnwise_scale_offsets` ([G+1], device);
    kept as the quantizer wrote them and read in the canonical layout (`ScaleSlot`).
    amax / columnwise_amax: [G] NVFP4 tensor amaxes.
    bf16_copies: None, or (weights kept across calls, `qmoe.quant.weight_cache`) a dict in which
    the emulated MXFP8 / NVFP4 GEMMs' dequantize-first route keeps the exact bf16 values it
    makes of these weights, so it makes them once.
    values: None, or {"rowwise" / "columnwise": [sum M, K] bf16} for copies held as their exact
    values instead of codes and scales (`quantize(values=...)`): what the emulated GEMMs'
    dequantize-first route multiplies, written by the cast itself, so no dequantize pass runs.
    NVFP4's are q * s_b: its tensor factor (`contracts.scales.tensor_factor`, from the amaxes,
    which stay) multiplies them, as it does the GEMMs' accumulators.
    """

    bf16_copies: dict | None = None
    rowwise_scale_inv = ScaleSlot()
    columnwise_scale_inv = ScaleSlot()

    def __init__(self, quantizer: Quantizer, shape: torch.Size, dtype: torch.dtype, split_sizes: torch.Tensor,
                 rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None,
                 amax=None, columnwise_amax=None, values=None):
        self.quantizer, self.shape, self.dtype = quantizer, torch.Size(shape), dtype
        self.split_sizes = split_sizes
        self.offsets = torch.cat((split_sizes.new_zeros(1), split_sizes.cumsum(0)))
        self.rowwise_data, self.rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        self.columnwise_data, self.columnwise_scale_inv = columnwise_data, columnwise_scale_inv
        self.amax, self.columnwise_amax = amax, columnwise_amax
        self.values = values or None
        block = quantizer.block
        self.rowwise_scale_offsets = (group_scale_offsets(split_sizes, block[0])
                                      if block is not None and block[0] > 1 else None)
        self.columnwise_scale_offsets = (group_scale_offsets(split_sizes, block[1])
                                         if block is not None else None)

    @property
    def num_groups(self) -> int:
        return self.split_sizes.numel()

    @property
    def device(self) -> torch.device:
        return self.split_sizes.device

    def exact_values(self, columnwise: bool) -> torch.Tensor | None:
        """The copy's exact bf16 values [sum M, K] where it is held as values, else None."""
        return (self.values or {}).get("columnwise" if columnwise else "rowwise")

    def has_copy(self, columnwise: bool) -> bool:
        """Whether the rowwise (columnwise) copy is here, as codes or as values."""
        data = self.columnwise_data if columnwise else self.rowwise_data
        return data is not None or self.exact_values(columnwise) is not None

    @classmethod
    def quantize(cls, x: torch.Tensor | ActivatedRows | RowsWithAmax, split_sizes, quantizer: Quantizer,
                 rowwise: bool = True, columnwise: bool = True, validate: bool = True,
                 values: tuple = ()) -> "GroupedTensor":
        """Quantize x [sum M_g, K] group by group with `quantizer`.

        x may be an `ActivatedRows` (act(h) * probs, qmoe.reference.activation): the kernels
        apply the activation while loading h, and the [sum M_g, K] activation output is never
        written; the result is the same as quantizing that output (computed first where the
        kernels do not run, and for quantizers that do not fuse: `Quantizer.fuses_activation`;
        a quantizer that `takes_amax` then gets the activation's amax from the same launch).

        x may be a `RowsWithAmax` (rows and their per-group amax [G] fp32, from the kernel that
        wrote them): a quantizer that `takes_amax` uses that amax instead of measuring it, so the
        rows are read once; the result is the same as quantizing the rows alone.

        x (or a RowsWithAmax's rows) may be a `GatheredRows` (source rows picked by an index, the
        permute of FC1's input): the kernels read each row from the source as they load, so the
        permuted copy is never written; copied first where the kernels do not run. The same result
        as quantizing `x.materialize()`.

        split_sizes: [G] int tensor (on x's device, or the host) or a list of ints; zeros allowed.
        validate=False skips the sign/sum check, which reads device splits on the host; pass it
        only for splits that are valid by construction (e.g. from `qmoe.ops.moe_permute`).

        values: copies ("rowwise", "columnwise") that only an emulated GEMM will read, wanted as
        their exact bf16 values (`GroupedTensor.values`) in place of codes. A hint: formats and
        kernels that do not make them (all but MXFP8 and NVFP4) return codes.

        >>> q = MXFP8BlockScaling().quantizer("input")
        >>> gt = GroupedTensor.quantize(torch.randn(96, 64), [32, 0, 64], q)
        >>> gt.split()[2].rowwise_data.shape
        torch.Size([64, 64])
        """
        amax = None
        if isinstance(x, RowsWithAmax):
            x, amax = x.rows, x.amax
        check_float_input(stored_tensor(x), "GroupedTensor.quantize")
        if isinstance(x, GatheredRows):
            check_gather_index(x.index, x.source)
            if not use_kernels(x.source):  # the gather lives in the kernels: copy the rows first
                x = x.materialize()
        if not isinstance(quantizer, Quantizer):
            raise TypeError(f"quantizer must be a qmoe Quantizer (recipe.quantizer(role)), got {quantizer!r}")
        if x.dim() != 2:
            raise ValueError(f"GroupedTensor.quantize needs a 2-D input [sum M_g, K], got shape {tuple(x.shape)}")
        check_flag("rowwise", rowwise)
        check_flag("columnwise", columnwise)
        if not (rowwise or columnwise):
            raise ValueError("GroupedTensor.quantize needs rowwise=True, columnwise=True or both")
        values = tuple(values)
        unknown = [v for v in values if v not in ("rowwise", "columnwise")]
        if unknown:
            raise ValueError(f"values names copies, \"rowwise\" and / or \"columnwise\"; got {unknown}")
        values = tuple(v for v in values if (rowwise if v == "rowwise" else columnwise))
        splits = _device_splits(split_sizes, x.shape[0], x.device, validate)
        if amax is not None:
            if isinstance(x, ActivatedRows):
                raise TypeError("a RowsWithAmax holds the rows themselves, not an ActivatedRows")
            check_group_amax("the RowsWithAmax's amax", amax, splits.numel(), x.device)
        if isinstance(x, ActivatedRows) and not (use_kernels(x.h) and quantizer.fuses_activation):
            # the fusion lives in the kernels: compute the rows first, as the unfused layer would,
            # with the groups' amax from the same launch where the quantizer takes one
            offsets = torch.cat((splits.new_zeros(1), splits.cumsum(0))) if quantizer.takes_amax else None
            x = ACTIVATION.pick("scaled_activation_forward", x.h)(*x, amax_offsets=offsets)
            if offsets is not None:
                x, amax = x.rows, x.amax
        quantizer.check_shape(x.shape[0], x.shape[1], rowwise, columnwise)
        if validate:  # the sizes were read on the host anyway: check each group's own needs
            for m in splits.tolist():
                quantizer.check_group_rows(m, columnwise)
        if amax is not None and quantizer.takes_amax:
            x = RowsWithAmax(x, amax)
        parts = quantizer._quantize_grouped(x, splits, rowwise, columnwise, values)
        return cls(quantizer, x.shape, x.dtype, splits, **parts)

    @classmethod
    def from_rows(cls, qt: QuantizedTensor, split_sizes) -> "GroupedTensor":
        """Group the rows of a rowwise QuantizedTensor from `Quantizer.quantize_for_dispatch`.

        Such rows keep their meaning in any group, so nothing is re-quantized: 1-row block
        scales [M, S] stay per row, and a per-tensor scale becomes every group's scale [G].
        qt: rowwise data [M, K] (rows grouped by `split_sizes`; rows past their sum join no
        group); split_sizes: [G] int on qt's device, trusted (not read on the host).
        The result has no columnwise copy: quantize it from high-precision values if needed.
        """
        if not isinstance(qt, QuantizedTensor) or qt.rowwise_data is None:
            raise TypeError("GroupedTensor.from_rows needs a QuantizedTensor with rowwise data "
                            "(Quantizer.quantize_for_dispatch)")
        q = qt.quantizer
        if qt.amax is not None or (q.block is not None and q.block[0] != 1):
            raise ValueError(f"{q!r} rows do not stand alone (per-group amax or multi-row blocks); "
                             f"quantize them inside the GroupedTensor instead")
        m, k = qt.shape_2d
        splits = _device_splits(split_sizes, m, qt.device, validate=False)
        scale = gemm_scale(qt, False)
        if q.block is None:
            scale = scale.reshape(1).expand(splits.numel()).contiguous()
        return cls(q, torch.Size((m, k)), qt.dtype, splits, rowwise_data=qt.rowwise_data, rowwise_scale_inv=scale)

    # ---- per-group views
    def _host_bounds(self):
        off = self.offsets.tolist()
        return list(zip(off[:-1], off[1:]))

    def _group_scales(self, scales, g, a, b, columnwise: bool):
        q = self.quantizer
        if scales is None:
            return None
        if q.block is None:
            return scales[g]
        br, bc = q.block
        if br == 1:
            if not columnwise:
                return scales[a:b]
            s = int(self.columnwise_scale_offsets[g])
            return scales[:, s:s + -(-(b - a) // bc)]
        s = int(self.rowwise_scale_offsets[g])
        n = -(-(b - a) // br)
        return scales[:, s:s + n] if columnwise else scales[s:s + n]

    def split(self) -> list[QuantizedTensor]:
        """One QuantizedTensor per group, in canonical layouts (reads the split sizes on the host)."""
        fp4 = isinstance(self.quantizer, NVFP4Quantizer)
        if self.values:
            raise ValueError(f"the {' and '.join(self.values)} copy is held as exact values, not codes: it has no "
                             f"per-group QuantizedTensors; read it with dequantize()")
        out = []
        for g, (a, b) in enumerate(self._host_bounds()):
            row = col = None
            if self.rowwise_data is not None:
                row = self.rowwise_data[a:b]
            if self.columnwise_data is not None:
                if fp4 and (b - a) % 2:
                    raise ValueError(f"group {g} has {b - a} rows: its NVFP4 columnwise copy packs two rows per "
                                     f"byte and cannot stand alone; pad groups to an even size (align_size) "
                                     f"or use the GroupedTensor's buffers directly")
                col = (pack_e2m1(unpack_e2m1(self.columnwise_data)[:, a:b].contiguous()) if fp4
                       else self.columnwise_data[:, a:b])
            out.append(QuantizedTensor(
                self.quantizer, torch.Size((b - a, self.shape[1])), self.dtype,
                rowwise_data=row, rowwise_scale_inv=self._group_scales(gemm_scale(self, False), g, a, b, False),
                columnwise_data=col,
                columnwise_scale_inv=self._group_scales(gemm_scale(self, True), g, a, b, True),
                amax=self.amax[g] if self.amax is not None else None,
                columnwise_amax=self.columnwise_amax[g] if self.columnwise_amax is not None else None))
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32, columnwise: bool = False) -> torch.Tensor:
        """[sum M, K] high-precision values (columnwise=True: the [K, sum M] transposed copies)."""
        check_dequantize_dtype(dtype)
        check_flag("columnwise", columnwise)
        held = self.exact_values(columnwise)
        if held is not None:
            held = held.float()
            factor = tensor_factor(self, columnwise)
            if factor is not None:  # each row times its group's factor, as the codes' dequantize
                group = row_groups(self.offsets, held.shape[0]).clamp(max=self.num_groups - 1)
                held = held * factor.to(held.device)[group][:, None]
            return saturate_to(held.t() if columnwise else held, dtype).contiguous()
        parts = [t.dequantize(dtype, columnwise=columnwise) for t in self._codes_of(columnwise).split()]
        return torch.cat(parts, 1 if columnwise else 0)

    def _codes_of(self, columnwise: bool) -> "GroupedTensor":
        """A shallow copy holding this copy's codes alone: split() repacks every copy it holds, and
        the other one may be values, or an NVFP4 columnwise copy whose odd groups cannot stand alone."""
        one = copy.copy(self)
        one.values = None
        if columnwise:
            one.rowwise_data = one.rowwise_scale_inv = None
        else:
            one.columnwise_data = one.columnwise_scale_inv = None
        return one

    def __repr__(self) -> str:
        return (f"GroupedTensor(num_groups={self.num_groups}, shape={tuple(self.shape)}, "
                f"quantizer={self.quantizer!r}, rowwise={self.has_copy(False)}, "
                f"columnwise={self.has_copy(True)}" + (f", values={sorted(self.values)}" if self.values else "") + ")")
