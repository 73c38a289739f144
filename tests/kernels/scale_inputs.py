"""Amaxes that probe an FP8 scale's rounding (NUMERICS.md "FP8 scale from amax"): every binade of
fp32, each at mantissas just below, at and just above the FP8 maxima's 1.75 and at the binade's
ends; subnormals, 0, FLT_MAX, inf and NaN; and random values."""
from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max


def edge_amaxes(device="cpu", seed=0) -> torch.Tensor:
    ulp = 2.0 ** -23
    mantissas = torch.tensor([1.0, 1.0 + ulp, 1.75 - ulp, 1.75, 1.75 + ulp, 1.75 + 2 * ulp, 2.0 - ulp],
                             dtype=torch.float64)
    binades = torch.exp2(torch.arange(-126, 128, dtype=torch.float64))
    normal = (binades[:, None] * mantissas[None, :]).reshape(-1)
    normal = normal[normal <= FLT_MAX].float()
    subnormal = torch.tensor([1, 2, 3, 0x1FFFFF, 0x380000, 0x3FFFFF, 0x400000, 0x7FFFFF],
                             dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(seed)
    random = torch.exp(torch.randn(256, generator=g, dtype=torch.float64) * 30).clamp(max=FLT_MAX).float()
    special = torch.tensor([0.0, FLT_MAX, float("inf"), float("nan")])
    return torch.cat([normal, subnormal, random, special]).to(device)
