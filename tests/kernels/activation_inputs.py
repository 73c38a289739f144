"""Inputs for the activation kernel tests (interpreter and GPU): one recipe, the same numbers everywhere."""
import torch

from qmoe.contracts.carriers import is_glu


def activation_inputs(activation, dtype, rows, f, seed=0, device="cpu"):
    """h ~ 4 N(0, 1) with exact +-7 (clamped_qgeglu's bounds) and zeros sprinkled in; probs with a
    padding row of 0; da ~ N(0, 1). Drawn on the CPU (the same numbers on any machine)."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * f if is_glu(activation) else f
    h = torch.randn(rows, width, generator=gen) * 4
    pick = torch.rand(rows, width, generator=gen)
    h = torch.where(pick < 0.05, 7.0, torch.where(pick < 0.1, -7.0, torch.where(pick < 0.12, 0.0, h)))
    probs = torch.rand(rows, generator=gen)
    probs[rows // 2:rows // 2 + 1] = 0.0
    da = torch.randn(rows, f, generator=gen)
    return h.to(device, dtype), probs.to(device), da.to(device, dtype)
