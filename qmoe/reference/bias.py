"""Reference grouped bias (optionally scaled per row), the spec of `qmoe/kernels/bias.py`.

Dimensions: R rows (packed tokens of all groups), E groups, N features.
y[i] += bias[g(i)] * s[i] where g(i) is row i's group and s the per-row scale (1 when absent).
Backward: dbias[g] = sum_{i in g} dy[i] * s[i]; dscales[i] = sum_j dy[i, j] * bias[g(i), j],
both accumulated in fp32.
"""
from __future__ import annotations

import torch

from qmoe.contracts.carriers import row_groups


def _bias_rows(bias: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    padded = torch.cat((bias.float(), bias.new_zeros(1, bias.shape[1], dtype=torch.float32)), 0)
    return padded[groups]  # rows without a group read the zero row


def grouped_bias_forward(y: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor,
                         scales: torch.Tensor | None = None) -> torch.Tensor:
    """y [R, N] + bias [E, N] per group (times scales [R] when given), fp32 math, y's dtype out."""
    b = _bias_rows(bias, row_groups(offsets, y.shape[0]))
    if scales is not None:
        b = b * scales.float()[:, None]
    out = y.float() + b
    # no `.to` when y is fp32: a no-op `.to` returns an alias of `out`, and AOTAutograd (torch
    # 2.11, CUDA) gave that aliased output of an autograd.Function a zero gradient
    return out if out.dtype == y.dtype else out.to(y.dtype)


def grouped_bias_backward(dy: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor,
                          scales: torch.Tensor | None = None, need_dscales: bool = True):
    """(dbias [E, N] fp32, dscales [R] fp32 or None) of grouped_bias_forward."""
    groups = row_groups(offsets, dy.shape[0])
    e, n = bias.shape
    w = dy.float() if scales is None else dy.float() * scales.float()[:, None]
    dbias = torch.zeros(e + 1, n, dtype=torch.float32, device=dy.device).index_add_(0, groups, w)[:e]
    dscales = None
    if scales is not None and need_dscales:
        dscales = (dy.float() * _bias_rows(bias, groups)).sum(dim=1)
    return dbias, dscales
