"""Delayed scaling's per-step update (NUMERICS.md), in pure torch: the spec of the kernel twin
`qmoe/kernels/delayed_scaling.py`.

History layout (TransformerEngine's): row 0 holds the amax being recorded this step; the update
takes the window's amax, rolls the rows up by one (the newest moves to the last row) and clears
row 0 for the next step. A slot (column) whose newest amax is 0 recorded nothing this step and
keeps its history and scale. A slot whose newest amax is inf or NaN saw a non-finite step: that
amax is not recorded (row 0 is cleared, the window and the scale stay as they are) and the slot's
`nonfinite_steps` counter goes up, so one bad step cannot freeze the scale for a whole window.
"""
from __future__ import annotations

import torch

from qmoe.contracts.formats import FLT_MAX


def update_amax_history(amax_history: torch.Tensor, scale: torch.Tensor, fmt_max: float, margin: int,
                        algo: str, nonfinite_steps: torch.Tensor | None = None) -> None:
    """Roll the window and recompute the scale, in place.

    amax_history: [L] or [L, G] fp32 (G grouped slots, one per expert), non-negative amaxes.
    scale: [] or [G] fp32. New scale = fmt_max / amax (the window's max, or the newest with
    algo "most_recent"), FLT_MAX where that overflows, divided by 2^margin; kept where the slot
    recorded nothing or its amax is 0 or not finite.
    nonfinite_steps: [] or [G] int32, counts the steps whose newest amax was inf or NaN.
    """
    hist = amax_history
    newest = hist[0]
    finite = torch.isfinite(newest)
    active = (newest != 0) & finite
    amax = hist.amax(dim=0) if algo == "max" else newest.clone()
    rolled = torch.roll(hist, -1, 0) if hist.shape[0] > 1 else hist.clone()
    rolled[0] = 0
    dropped = hist.clone()
    dropped[0] = 0
    hist.copy_(torch.where(active, rolled, torch.where(finite, hist, dropped)))
    new_scale = torch.full_like(amax, fmt_max) / amax  # true fp32 division, not reciprocal * max
    new_scale = torch.where(new_scale == float("inf"), torch.full_like(new_scale, FLT_MAX), new_scale)
    new_scale = new_scale / (2.0 ** margin)
    ok = active & torch.isfinite(amax) & (amax > 0)
    scale.copy_(torch.where(ok, new_scale, scale))
    if nonfinite_steps is not None:
        nonfinite_steps.add_((~finite).to(nonfinite_steps.dtype))
