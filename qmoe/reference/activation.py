"""Reference expert activations with the routing-prob scale, the spec of `qmoe/kernels/activation.py`.

Dimensions: R permuted rows, F ffn columns (the activation's output width), k the GLU
interleave block.

h: [R, 2F] for GLU activations (gate columns first, then linear columns; with
`glu_interleave_size=k`, alternating k-column gate / linear blocks), [R, F] otherwise;
probs: [R] float routing probability of each permuted row (0 on padding rows) or None.
The forward returns act(h) * probs[:, None] in h's dtype, computed in fp32 (fp64 for fp64 h, so
tests can check gradients in double precision). The backward is written out analytically, in
the operation order of torch's autograd of that forward:

    a    = act(h) * p                      dact = da * p
    dh   = dact * act'(h)                  dprobs[r] = sum_j da[r, j] * act(h)[r, j]

`scaled_activation_forward` / `scaled_activation_backward` are the twins of the kernels (same
names and signatures); `scaled_activation` is the plain formula autograd differentiates in tests.

>>> h, probs = torch.randn(6, 8), torch.rand(6)
>>> a = scaled_activation_forward(h, probs, "swiglu")                       # [6, 4]
>>> dh, dprobs = scaled_activation_backward(h, probs, torch.randn(6, 4), "swiglu")
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qmoe.contracts.carriers import (ACTIVATIONS, GELU_BETA, GELU_KAPPA, QGEGLU_ALPHA, QGEGLU_LIMIT, ActivatedRows,
                                     GatheredRows, RowsWithAmax, glu_block, is_glu)
from qmoe.contracts.validate import check_activation, check_amax_rows, check_scaled_activation_args
from qmoe.reference.quantize import group_amax

def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 / bf16 / fp16 h, fp64 for fp64 h."""
    return torch.float64 if h.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------- GLU layouts

def split_glu(h: torch.Tensor, glu_interleave_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R, 2F] -> (gate [R, F], linear [R, F]), reading k-column interleaved blocks when k is set."""
    rows, two_f = h.shape
    k = glu_interleave_size
    if not k:
        return h[:, :two_f // 2], h[:, two_f // 2:]
    blocks = h.reshape(rows, two_f // (2 * k), 2, k)  # [R, F/k, (gate, linear), k]
    return blocks[:, :, 0].reshape(rows, two_f // 2), blocks[:, :, 1].reshape(rows, two_f // 2)


def join_glu(gate: torch.Tensor, linear: torch.Tensor, glu_interleave_size: int | None = None) -> torch.Tensor:
    """Inverse of split_glu: (gate [R, F], linear [R, F]) -> [R, 2F] in the same layout."""
    k = glu_interleave_size
    if not k:
        return torch.cat((gate, linear), dim=1)
    rows, f = gate.shape
    return torch.stack((gate.reshape(rows, f // k, k), linear.reshape(rows, f // k, k)), dim=2).reshape(rows, 2 * f)


# ---------------------------------------------------------------- the formula (autograd's spec)

def activation_fn(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h) in fp32 (fp64 for fp64 h) without the prob scale; h in the logical GLU layout."""
    h = h.to(compute_dtype(h))
    if activation == "relu2":
        return F.relu(h).square()
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    gate, linear = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(gate) * linear
    if activation == "geglu":
        return F.gelu(gate, approximate="tanh") * linear
    if activation == "clamped_qgeglu":
        gate = gate.clamp(max=QGEGLU_LIMIT)
        linear = linear.clamp(-QGEGLU_LIMIT, QGEGLU_LIMIT)
        return (linear + 1) * gate * torch.sigmoid(QGEGLU_ALPHA * gate)
    raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")


def scaled_activation(h: torch.Tensor, probs: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(h) * probs[:, None] -> [R, F] in h's dtype (h in the logical GLU layout)."""
    out = activation_fn(h, check_activation(activation))
    if probs is not None:
        out = out * probs.to(out.dtype)[:, None]
    return out.to(h.dtype)


# ---------------------------------------------------------------- kernel twins

def scaled_activation_forward(h: torch.Tensor, probs: torch.Tensor | None, activation: str,
                              glu_interleave_size: int | None = None, amax_offsets: torch.Tensor | None = None):
    """act(h) * probs[:, None]: h [R, 2F] or [R, F], probs [R] or None -> a [R, F] in h's dtype.

    amax_offsets: [G + 1] int on h's device (row groups, as `group_amax`): return
    `RowsWithAmax(a, amax [G] fp32)`, each group's max|a| over finite values.
    """
    check_scaled_activation_args(h, probs, activation, glu_interleave_size)
    if amax_offsets is not None:
        check_amax_rows("h", h)
        a = scaled_activation_forward(h, probs, activation, glu_interleave_size)
        return RowsWithAmax(a, group_amax(a, amax_offsets))
    k = glu_block(activation, glu_interleave_size)
    if k:
        h = join_glu(*split_glu(h, k))  # the logical layout [gate | linear]
    return scaled_activation(h, probs, activation)


def scaled_activation_backward(h: torch.Tensor, probs: torch.Tensor | None, da: torch.Tensor, activation: str,
                               glu_interleave_size: int | None = None, need_dprobs: bool = True,
                               amax_offsets: torch.Tensor | None = None):
    """Gradients of `scaled_activation_forward` for the output gradient da [R, F].

    Returns (dh [R, 2F] or [R, F] in h's dtype and layout, dprobs [R] fp32 (fp64 for fp64 h), or
    None when probs is None or need_dprobs is False). Nothing is read from a forward: act(h) is
    recomputed. amax_offsets: [G + 1] row groups; dh comes as `RowsWithAmax(dh, amax [G] fp32)`.
    """
    check_scaled_activation_args(h, probs, activation, glu_interleave_size, da)
    if amax_offsets is not None:
        check_amax_rows("h", h)
        dh, dprobs = scaled_activation_backward(h, probs, da, activation, glu_interleave_size, need_dprobs)
        return RowsWithAmax(dh, group_amax(dh, amax_offsets)), dprobs
    ct = compute_dtype(h)
    dout = da.to(ct)
    dact = dout * probs.to(ct)[:, None] if probs is not None else dout
    if is_glu(activation):
        k = glu_block(activation, glu_interleave_size)
        gate, linear = split_glu(h.to(ct), k)
        act, dgate, dlinear = _glu_backward(activation, gate, linear, dact)
        dh = join_glu(dgate, dlinear, k)
    else:
        act, dh = _pointwise_backward(activation, h.to(ct), dact)
    dprobs = (dout * act).sum(dim=1) if probs is not None and need_dprobs else None
    return dh.to(h.dtype), dprobs


def _gelu_tanh_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu_tanh(x), d gelu_tanh / dx), the tanh form torch's gelu and its backward use."""
    t = torch.tanh(GELU_BETA * (x + GELU_KAPPA * x * x * x))
    grad = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * (GELU_BETA * (1 + 3 * GELU_KAPPA * x * x))
    return F.gelu(x, approximate="tanh"), grad


def _glu_backward(activation, gate, linear, dact):
    """(act, dgate, dlinear) of act = f(gate) * g(linear) for the output gradient dact."""
    if activation == "swiglu":
        s = torch.sigmoid(gate)
        silu = gate * s
        return silu * linear, dact * linear * (s * (1 + gate * (1 - s))), dact * silu
    if activation == "geglu":
        gelu, dgelu = _gelu_tanh_and_grad(gate)
        return gelu * linear, dact * linear * dgelu, dact * gelu
    # clamped_qgeglu: (lin + 1) * g * sigmoid(alpha g) with g = min(gate, L), lin = clamp(linear, -L, L);
    # a clamp passes the gradient where its input lies inside the range, bounds included (as torch.clamp)
    g = gate.clamp(max=QGEGLU_LIMIT)
    lin = linear.clamp(-QGEGLU_LIMIT, QGEGLU_LIMIT)
    s = torch.sigmoid(QGEGLU_ALPHA * g)
    glu = g * s
    dglu = s * (1 + QGEGLU_ALPHA * g * (1 - s))
    dgate = torch.where(gate <= QGEGLU_LIMIT, dact * (lin + 1) * dglu, 0.0)
    dlinear = torch.where((linear >= -QGEGLU_LIMIT) & (linear <= QGEGLU_LIMIT), dact * glu, 0.0)
    return (lin + 1) * g * s, dgate, dlinear


def _pointwise_backward(activation, x, dact):
    """(act, dx) of a pointwise activation for the output gradient dact."""
    if activation == "relu2":
        r = F.relu(x)
        return r * r, dact * (2 * r)
    gelu, dgelu = _gelu_tanh_and_grad(x)  # "gelu"
    return gelu, dact * dgelu


# ---------------------------------------------------------------- an activation fused into its consumer

def rows_of(x) -> torch.Tensor:
    """x itself, the values act(h) * probs[:, None] of an `ActivatedRows` (computed here), or the
    rows of a `GatheredRows` (copied here)."""
    if isinstance(x, GatheredRows):
        return x.materialize()
    return scaled_activation_forward(*x) if isinstance(x, ActivatedRows) else x
