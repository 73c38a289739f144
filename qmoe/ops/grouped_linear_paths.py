"""The two paths of a grouped linear (DESIGN.md, "grouped path vs split-quantize fallback").

Dimensions: R packed rows, E experts (groups), K in features, N out features.

Each path is a strategy with the same named steps; `qmoe.ops.grouped_linear`'s plan calls
them in this order (forward, then backward):

    quantize_input   x [R, K]     -> fprop's rowwise operand (+ wgrad's columnwise copy)
    quantize_weight  W [E, N, K]  -> fprop's rowwise operand (+ dgrad's columnwise copy)
    fprop            y  [R, N]    = x_g @ W_g^T
    quantize_grad    dy [R, N]    -> dgrad's rowwise operand and / or wgrad's columnwise one
    dgrad            dx [R, K]    = dy_g @ W_g
    wgrad            dW [E, N, K] = dy_g^T @ x_g

The quantize steps run only under a recipe; without one the plan hands the GEMM steps plain
tensors (x, W cast to x's dtype, dy), which they multiply in that dtype.

- `GROUPED`: one GroupedTensor per operand and one grouped GEMM per step
  (`qmoe.ops.grouped_gemm`); split sizes stay on the device, so nothing syncs with the host.
- `SPLIT`: split sizes read on the host; every group is quantized on its own with its
  `Quantizer.for_group` (the same per-group scales and history slots the grouped path uses) and
  multiplied in fp32 from its dequantized values (`group_gemm_nt`): the grouped path's
  cross-check, and the fallback where the grouped kernels do not run.
"""
from __future__ import annotations

import copy

import torch

from qmoe.contracts.carriers import ActivatedRows, RowsWithAmax
from qmoe.contracts.enums import GroupedPath
from qmoe.contracts.scales import gemm_scale
from qmoe.ops.grouped_gemm import k_grouped_gemm, m_grouped_gemm, quantize_weights
from qmoe.quant import GroupedTensor, QuantizedTensor, Quantizer


class Groups:
    """The row groups of one call.

    split_sizes: [E] int64 on the rows' device, the last group also holding the rows past their
    sum (`absorb_tail`); offsets: [E+1] their prefix sums (device); bounds: each group's
    (start, end) row on the host, read on the split path only (None on the grouped path);
    device: the rows' device, where the outputs go.
    """

    def __init__(self, split_sizes: torch.Tensor, offsets: torch.Tensor, bounds: list[tuple[int, int]] | None,
                 device: torch.device):
        self.split_sizes, self.offsets, self.bounds, self.device = split_sizes, offsets, bounds, device


def absorb_tail(split_sizes: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Split sizes whose last group also takes the rows past their sum (device op, no sync).

    `moe_permute` returns a static row count with unused zero rows at the end; giving them to the
    last group changes no amax, scale or product of the real rows.
    """
    tail = num_rows - split_sizes.sum()
    return torch.cat((split_sizes[:-1], (split_sizes[-1:] + tail)))


def _offsets(split_sizes: torch.Tensor) -> torch.Tensor:
    return torch.cat((split_sizes.new_zeros(1), split_sizes.cumsum(0)))


def _host_bounds(split_sizes: torch.Tensor) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for m in split_sizes.tolist():
        bounds.append((start, start + int(m)))
        start += int(m)
    return bounds


def _is_plain(operand) -> bool:
    return isinstance(operand, torch.Tensor)


def drop_rowwise(operand, shared: bool = False):
    """The operand without its rowwise data (backward reads only the columnwise copies of x and W).

    shared: the operand is kept for later calls too (a weight in qmoe.quant.weight_cache, whose
    rowwise data the next forward reads): a shallow copy goes without it instead."""
    if isinstance(operand, list):
        return [drop_rowwise(t, shared) if t is not None else None for t in operand]
    if not _is_plain(operand):
        if shared:
            operand = copy.copy(operand)
        operand.rowwise_data = operand.rowwise_scale_inv = None
        if getattr(operand, "values", None):  # a GroupedTensor's rowwise copy held as values
            operand.values = {k: v for k, v in operand.values.items() if k != "rowwise"} or None
    return operand


def group_gemm_nt(a, b, a_columnwise: bool, b_columnwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """One group's a @ b^T, where a `*_columnwise` operand enters as its transpose.

    Quantized operands (the split path's NUMERICS.md contract): their dequantized values (the
    columnwise copy is stored transposed) multiplied in fp32, then cast to out_dtype. Plain
    tensors: multiplied in out_dtype.
    """
    if isinstance(a, QuantizedTensor):
        a2 = a.dequantize(torch.float32, columnwise=a_columnwise)
        b2 = b.dequantize(torch.float32, columnwise=b_columnwise)
        return (a2.reshape(-1, a2.shape[-1]) @ b2.reshape(-1, b2.shape[-1]).t()).to(out_dtype)
    a, b = a.to(out_dtype), b.to(out_dtype)
    return (a.t() if a_columnwise else a) @ (b if b_columnwise else b.t())


def _wgrad_dtype(w_dtype: torch.dtype) -> torch.dtype:
    """The grouped wgrad GEMM writes the weight's dtype directly (no fp32 [E, N, K] round trip:
    a cast pass over the whole weight gradient every step). It accumulates in fp32 either way;
    fp32 output also promotes FP8 tensor-core partial sums every K step (NUMERICS.md: bf16
    output <= 1e-2, fp32 accumulation <= 1e-3)."""
    return w_dtype if w_dtype in (torch.bfloat16, torch.float16) else torch.float32


class LinearPath:
    """The steps every path implements (see the module docstring)."""

    kind: GroupedPath
    # whether quantize_input takes an ActivatedRows (the expert activation fused into the quantization)
    fuses_input_activation: bool
    # whether quantized weights may be kept across calls (qmoe.quant.weight_cache): one GroupedTensor
    keeps_weights: bool

    def groups(self, split_sizes: torch.Tensor, x: torch.Tensor) -> Groups:
        """The groups of x's rows (x: the input, or h with a fused activation)."""
        raise NotImplementedError

    def quantize_input(self, x, groups: Groups, quantizer: Quantizer, wgrad: bool,
                       quantized_input: QuantizedTensor | None = None, rowwise: bool = True, values: tuple = ()):
        """x [R, K] (or an ActivatedRows where fused), rowwise for fprop and columnwise if `wgrad`.

        x and quantize_grad's dy may come as a `RowsWithAmax` (their producer's per-group amax).

        quantized_input: x's rows already quantized rowwise (expert-parallel dispatch), used as
        they are; wgrad's columnwise copy is then quantized from x's values.
        rowwise=False: wgrad's columnwise copy only (rebuilt in the backward, recompute_activation).
        values (here and below): the copies wanted as exact values (`GroupedTensor.quantize`), a
        hint the grouped path passes on and the split path ignores.
        """
        raise NotImplementedError

    def quantize_weight(self, weight: torch.Tensor, quantizer: Quantizer, dgrad: bool, rowwise: bool = True,
                        values: tuple = ()):
        """W [E, N, K], rowwise for fprop and columnwise if `dgrad`; rowwise=False: dgrad's copy only."""
        raise NotImplementedError

    def quantize_grad(self, dy: torch.Tensor, groups: Groups, quantizer: Quantizer, dgrad: bool, wgrad: bool,
                      values: tuple = ()):
        raise NotImplementedError

    def fprop(self, x, w, groups: Groups, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def dgrad(self, dy, w, groups: Groups, x_shape: torch.Size, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def wgrad(self, dy, x, groups: Groups, shape: tuple[int, int, int], w_dtype: torch.dtype) -> torch.Tensor:
        """dW [E, N, K]: in the weight's dtype or fp32 (the caller casts)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GroupedLinearPath(LinearPath):
    """All groups in one GroupedTensor per operand and one grouped GEMM per step, split sizes on the device."""

    kind = GroupedPath.GROUPED
    fuses_input_activation = True
    keeps_weights = True

    def groups(self, split_sizes, x):
        split_sizes = absorb_tail(split_sizes, x.shape[0])
        return Groups(split_sizes, _offsets(split_sizes), None, x.device)

    def quantize_input(self, x, groups, quantizer, wgrad, quantized_input=None, rowwise=True, values=()):
        if quantized_input is None:  # x: a tensor, or an ActivatedRows the kernels activate as they load
            return GroupedTensor.quantize(x, groups.split_sizes, quantizer, rowwise=rowwise, columnwise=wgrad,
                                          validate=False, values=values)
        xq = GroupedTensor.from_rows(quantized_input, groups.split_sizes)
        if wgrad:
            cols = GroupedTensor.quantize(x, groups.split_sizes, quantizer, rowwise=False, columnwise=True,
                                          validate=False)
            xq.columnwise_data, xq.columnwise_scale_inv = cols.columnwise_data, gemm_scale(cols, True)
        return xq

    def quantize_weight(self, weight, quantizer, dgrad, rowwise=True, values=()):
        return quantize_weights(weight, quantizer, rowwise=rowwise, columnwise=dgrad, values=values)

    def quantize_grad(self, dy, groups, quantizer, dgrad, wgrad, values=()):
        return GroupedTensor.quantize(dy, groups.split_sizes, quantizer, rowwise=dgrad, columnwise=wgrad,
                                      validate=False, values=values)

    def fprop(self, x, w, groups, out_dtype):
        return m_grouped_gemm(x, w, groups.split_sizes if _is_plain(x) else None, out_dtype=out_dtype)

    def dgrad(self, dy, w, groups, x_shape, out_dtype):
        return m_grouped_gemm(dy, w, groups.split_sizes if _is_plain(dy) else None, b_columnwise=True,
                              out_dtype=out_dtype)

    def wgrad(self, dy, x, groups, shape, w_dtype):
        return k_grouped_gemm(dy, x, groups.split_sizes if _is_plain(dy) else None, out_dtype=_wgrad_dtype(w_dtype))


class SplitLinearPath(LinearPath):
    """Split sizes on the host; each group quantized (`Quantizer.for_group`) and multiplied on its own.

    Operands are lists with one QuantizedTensor per group (None for a group without rows) or,
    without a recipe, the plain tensors sliced by `Groups.bounds`.
    """

    kind = GroupedPath.SPLIT
    fuses_input_activation = False
    keeps_weights = False  # the cross-check quantizes every call

    def groups(self, split_sizes, x):
        split_sizes = absorb_tail(split_sizes, x.shape[0])
        return Groups(split_sizes, _offsets(split_sizes), _host_bounds(split_sizes), x.device)

    @staticmethod
    def _per_group(x, bounds, quantizer, rowwise, columnwise):
        e = len(bounds)
        return [quantizer.for_group(g, e, x.device).quantize(x[a:b], rowwise=rowwise, columnwise=columnwise)
                if b > a else None for g, (a, b) in enumerate(bounds)]

    def quantize_input(self, x, groups, quantizer, wgrad, quantized_input=None, rowwise=True, values=()):
        assert not isinstance(x, ActivatedRows), "the split path runs the activation before it quantizes"
        x = _rows(x)
        if quantized_input is None:
            return self._per_group(x, groups.bounds, quantizer, rowwise, wgrad)
        xs = GroupedTensor.from_rows(quantized_input, groups.split_sizes).split()
        if wgrad:
            for t, c in zip(xs, self._per_group(x, groups.bounds, quantizer, False, True)):
                if c is not None:
                    t.columnwise_data, t.columnwise_scale_inv = c.columnwise_data, gemm_scale(c, True)
        return xs

    def quantize_weight(self, weight, quantizer, dgrad, rowwise=True, values=()):
        e = weight.shape[0]
        return [quantizer.for_group(g, e, weight.device).quantize(weight[g], rowwise=rowwise, columnwise=dgrad)
                for g in range(e)]

    def quantize_grad(self, dy, groups, quantizer, dgrad, wgrad, values=()):
        return self._per_group(_rows(dy), groups.bounds, quantizer, dgrad, wgrad)

    @staticmethod
    def _operand(op, g, a, b):
        return op[a:b] if _is_plain(op) else op[g]

    def fprop(self, x, w, groups, out_dtype):
        y = torch.zeros((groups.bounds[-1][1], _out_features(w)), dtype=out_dtype, device=groups.device)
        for g, (a, b) in enumerate(groups.bounds):
            if b > a:
                y[a:b] = group_gemm_nt(self._operand(x, g, a, b), w[g], False, False, out_dtype)
        return y

    def dgrad(self, dy, w, groups, x_shape, out_dtype):
        dx = torch.zeros(x_shape, dtype=out_dtype, device=groups.device)
        for g, (a, b) in enumerate(groups.bounds):
            if b > a:
                dx[a:b] = group_gemm_nt(self._operand(dy, g, a, b), w[g], False, True, out_dtype)
        return dx

    def wgrad(self, dy, x, groups, shape, w_dtype):
        # fp32 accumulation, or fp64 for a plain fp64 layer
        acc = torch.promote_types(dy.dtype, torch.float32) if _is_plain(dy) else torch.float32
        out = torch.zeros(shape, dtype=acc, device=groups.device)
        for g, (a, b) in enumerate(groups.bounds):
            if b > a:
                out[g] = group_gemm_nt(self._operand(dy, g, a, b), self._operand(x, g, a, b), True, True, acc)
        return out


def _rows(x):
    """The rows of a RowsWithAmax (each group is quantized on its own here, measuring its amax)."""
    return x.rows if isinstance(x, RowsWithAmax) else x


def _out_features(w) -> int:
    """N of the weight operand: a plain [E, N, K] stack or a list of [N, K] QuantizedTensors."""
    return w.shape[1] if _is_plain(w) else w[0].shape_2d[0]


PATHS: dict[GroupedPath, LinearPath] = {GroupedPath.GROUPED: GroupedLinearPath(), GroupedPath.SPLIT: SplitLinearPath()}
