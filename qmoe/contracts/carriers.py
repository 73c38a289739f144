"""What ops hand each other: the permutation map, fused-activation rows, rows with a known amax,
and the constants both the kernels and their reference twins compute with.

Dimensions: T tokens, K top-k, E experts (groups), R permuted rows, F ffn columns.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from qmoe.contracts.enums import Activation

# ---------------------------------------------------------------- activations

GLU_ACTIVATIONS = tuple(a.value for a in Activation if a.is_glu)
ACTIVATIONS = GLU_ACTIVATIONS + tuple(a.value for a in Activation if not a.is_glu)
QGEGLU_LIMIT = 7.0  # GPT-OSS clamps the gate above and the linear part to +-limit
QGEGLU_ALPHA = 1.702
GELU_BETA = math.sqrt(2.0 / math.pi)  # tanh-approximate gelu: 0.5 x (1 + tanh(beta (x + kappa x^3)))
GELU_KAPPA = 0.044715


def is_glu(activation: str) -> bool:
    return activation in GLU_ACTIVATIONS


def glu_block(activation: str, glu_interleave_size: int | None) -> int:
    """The interleave block k that applies, 0 when the gate and linear halves are contiguous
    (GLU without interleaving, or an activation that is not a GLU: the size is ignored there)."""
    return glu_interleave_size if is_glu(activation) and glu_interleave_size else 0


def interleave_glu(w: torch.Tensor, block: int) -> torch.Tensor:
    """Logical FC1 rows [gate(F); linear(F)] -> alternating `block`-row gate/linear blocks.

    Works on the row dimension -2 of [.., 2F, K] weights and on the last dim of [.., 2F] biases
    (pass the bias as w[..., None] and squeeze back).
    """
    two_f = w.shape[-2]
    f = two_f // 2
    if two_f % 2 or f % block:
        raise ValueError(f"glu_interleave_size={block} must divide the FFN size {f}")
    gate, linear = w[..., :f, :], w[..., f:, :]
    g = gate.reshape(*w.shape[:-2], f // block, block, w.shape[-1])
    lin = linear.reshape(*w.shape[:-2], f // block, block, w.shape[-1])
    return torch.stack((g, lin), dim=-3).reshape(w.shape)


def deinterleave_glu(w: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of interleave_glu."""
    two_f = w.shape[-2]
    f = two_f // 2
    if two_f % 2 or f % block:
        raise ValueError(f"glu_interleave_size={block} must divide the FFN size {f}")
    v = w.reshape(*w.shape[:-2], f // block, 2, block, w.shape[-1])
    gate = v[..., 0, :, :].reshape(*w.shape[:-2], f, w.shape[-1])
    linear = v[..., 1, :, :].reshape(*w.shape[:-2], f, w.shape[-1])
    return torch.cat((gate, linear), dim=-2)


class ActivatedRows(NamedTuple):
    """The rows act(h) * probs[:, None], not computed yet: a quantizer that takes it reads h and
    applies the activation as it loads (the expert MLP's activation fused into the quantization
    of FC2's input), so the [R, F] activation never goes to memory. Its values are exactly those
    of the activation op on the same backend, `qmoe.ops.activation.activation_forward(*rows)`
    (fp32 math, rounded once to h's dtype): the kernel's on the kernel path, the reference's
    (`qmoe.reference.activation.scaled_activation_forward`) on the reference path, two formulas
    that can differ in the last ulps. The reference quantizers compute them with
    `qmoe.reference.activation.rows_of`.
    """

    h: torch.Tensor
    probs: torch.Tensor | None
    activation: str
    glu_interleave_size: int | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.h.shape[0], self.h.shape[1] // 2 if is_glu(self.activation) else self.h.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.h.dtype

    @property
    def device(self) -> torch.device:
        return self.h.device

    def dim(self) -> int:
        return 2



# ---------------------------------------------------------------- amaxes from the kernel that wrote the rows

class RowsWithAmax(NamedTuple):
    """Rows [R, K] with the amax of each group already known, reduced by the kernel that wrote them.

    A per-tensor current-scaling quantizer needs each group's max|x| before it can cast: measured
    by the quantizer itself, that is a second read of the rows. The kernels that make the expert
    GEMMs' operands (the permute of FC1's input, the unpermute backward of FC2's grad_output, the
    activation backward of FC1's grad_output) hold every value in registers as they store it, so
    they also reduce the amax (an atomic max of |x|'s float bits per group: exact, order-free)
    and hand it over here; `GroupedTensor.quantize` of a RowsWithAmax then only casts
    (`Quantizer.takes_amax`; every other quantizer reads the rows alone).

    rows: [R, K] bf16 / fp16 / fp32. amax: [G] fp32, for each group of the consumer's split sizes
    the max of |rows| over its finite values (0 for a group with none): bit for bit what the
    quantizer would measure (`qmoe.reference.quantize.group_amax`). Rows outside every group
    must be zero (padding).
    """

    rows: torch.Tensor
    amax: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def dim(self) -> int:
        return self.rows.dim()


class GatheredRows(NamedTuple):
    """The rows source[index[r]] (a zero row where index[r] < 0), not copied yet: a quantizer that
    takes them reads each row from `source` as it loads, so the permuted [R, K] copy of FC1's
    input never goes to memory (the permute fused into the quantization). The result is that of
    quantizing `materialize()` bit for bit: the rows are copies, nothing is computed on them.

    source: [T, K] bf16 / fp16 / fp32 (the tokens). index: [R] int32 on source's device, the
    source row of each row (`qmoe.ops.moe_permute(..., gather=True)` makes it). row_id_map: the
    `RowIdMap` of that permute, or None: a grouped linear needs it to send the rows' gradient back
    to the tokens in the permute backward's own order (the same bits as unfused).
    """

    source: torch.Tensor
    index: torch.Tensor
    row_id_map: "RowIdMap | None" = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.index.shape[0], self.source.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def device(self) -> torch.device:
        return self.source.device

    def dim(self) -> int:
        return 2

    def materialize(self) -> torch.Tensor:
        """The rows themselves, [R, K] (device ops, no host sync)."""
        if self.source.shape[0] == 0:
            return self.source.new_zeros(self.shape)
        rows = self.source.index_select(0, self.index.clamp(min=0).long())
        return torch.where((self.index >= 0)[:, None], rows, rows.new_zeros(()))


def stored_tensor(x) -> torch.Tensor:
    """The tensor a quantizer's input is read from: an `ActivatedRows`' h, a `GatheredRows`'
    source, or x itself (where it lives decides which implementation runs)."""
    if isinstance(x, ActivatedRows):
        return x.h
    return x.source if isinstance(x, GatheredRows) else x


class AmaxSlot:
    """A gradient's per-group amax, handed from the backward that computes the gradient to the
    backward that quantizes it: autograd passes tensors only, so the two ends share this slot.

    The producing backward calls `put(rows, amax)`; the consuming one calls `take(dy)`, which
    returns the amax only when dy *is* those rows (the very tensor object). A gradient hook, a
    second consumer adding its gradient, or a dtype cast in between makes dy another tensor, and
    the consumer then measures its own amax. `take` empties the slot either way, so it holds the
    gradient no longer than autograd does.
    """

    __slots__ = ("rows", "amax")

    def __init__(self):
        self.rows = self.amax = None

    def put(self, rows: torch.Tensor, amax: torch.Tensor) -> None:
        self.rows, self.amax = rows, amax

    def take(self, dy: torch.Tensor) -> torch.Tensor | None:
        amax = self.amax if dy is self.rows else None
        self.rows = self.amax = None
        return amax

    def __repr__(self) -> str:
        return f"AmaxSlot(filled={self.rows is not None})"


# ---------------------------------------------------------------- routing and permutation

# A normalised sum over the chosen experts adds this so an all-zero selection stays finite.
NORMALIZE_EPS = 1e-20


class RowIdMap(NamedTuple):
    """Where each token's copies went. Opaque to users: pass it from permute to unpermute.

    rows: [T, K] int32, output row of each of the token's copies (ascending expert), -1 if unused.
    experts: [T, K] int32, the expert of each copy, -1 if unused.
    counts: [E] int32, tokens routed to each expert (unpadded).
    offsets: [E + 1] int32, first row of each expert's group; offsets[E] = rows in groups.
    num_rows: R, the static output row count.
    """

    rows: torch.Tensor
    experts: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    num_rows: int


def num_permuted_rows(num_tokens: int, top_k: int, num_experts: int, align_size: int) -> int:
    """The static row count R of a permuted batch."""
    return num_tokens * top_k + num_experts * (align_size - 1)


def row_groups(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group index [R] int64 of every row from offsets [E+1] (device op, no host sync).

    Rows past offsets[-1] get E (no group).
    """
    rows = torch.arange(num_rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets[1:].contiguous(), rows, right=True)


def permuted_destinations(row_id_map: RowIdMap) -> torch.Tensor:
    """Flat [T * K] int64 output rows of the tokens' copies, unused and out-of-range slots sent to a
    dump row R (device ops, no host sync)."""
    rows = row_id_map.rows.long()
    r = row_id_map.num_rows
    return torch.where((rows >= 0) & (rows < r), rows, r).flatten()


def permuted_sources(row_id_map: RowIdMap) -> torch.Tensor:
    """The source token of every permuted row, [R] int32, -1 for padding rows (device ops, no host
    sync): the index of the `GatheredRows` that stand for `moe_permute`'s output."""
    t, k = row_id_map.rows.shape
    r = row_id_map.num_rows
    tokens = torch.arange(t, dtype=torch.int32, device=row_id_map.rows.device).repeat_interleave(k)
    out = torch.full((r + 1,), -1, dtype=torch.int32, device=row_id_map.rows.device)
    return out.scatter(0, permuted_destinations(row_id_map), tokens)[:r]


def routed_max(per_token: torch.Tensor, row_id_map: RowIdMap) -> torch.Tensor:
    """[E] fp32: for each expert the max of `per_token` [T] fp32 (non-negative) over the tokens
    routed to it, 0 for an expert with none (device ops): a per-expert amax of permuted rows from
    their tokens' own amaxes, the padding rows being zero."""
    e = row_id_map.counts.shape[0]
    experts = row_id_map.experts.long()
    slot = torch.where(experts >= 0, experts, e)  # unused copies go to a dump column E
    # a [T, E + 1] table (each token's experts differ: no two writes race) reduced down its columns,
    # rather than a scatter-max into E slots, whose atomics all contend for a few addresses
    table = per_token.new_zeros(per_token.shape[0], e + 1).scatter(1, slot, per_token[:, None].expand(slot.shape))
    return table.amax(0)[:e] if per_token.shape[0] else per_token.new_zeros(e)
