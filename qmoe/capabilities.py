"""What each recipe runs on a device: the hardware path and the backend, with the reason."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qmoe.backend import backend_override
from qmoe.recipes.recipe import RECIPES


@dataclass(frozen=True)
class Capability:
    recipe: str
    hardware: str  # "native", "emulated" (exact, Hopper for MXFP8/NVFP4) or "reference" (pure torch)
    backend: str  # "triton" or "reference"
    why: str


def _cuda_capability(device: torch.device):
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None


def capabilities(device=None) -> dict[str, Capability]:
    """Per recipe config name ("delayed", "current", "block", "mxfp8", "nvfp4"): how it runs on `device`.

    device: a torch device or string; default the current CUDA device if any, else the CPU.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    out = {}
    override = backend_override()
    if device.type != "cuda":
        why = f"no GPU kernels for {device.type}: the pure-torch reference (the spec) runs everything"
        return {name: Capability(name, "reference", "reference", why) for name in RECIPES}
    cap = _cuda_capability(device)
    if cap is None:
        why = "CUDA is not available in this torch build"
        return {name: Capability(name, "reference", "reference", why) for name in RECIPES}
    sm = cap[0] * 10 + cap[1]
    triton_ok = sm >= 90 and override != "reference"
    backend = "triton" if triton_ok else "reference"
    for name in RECIPES:
        if name in ("delayed", "current", "block"):
            hw = "native" if sm >= 89 else "reference"
            why = f"sm{sm} has FP8 tensor cores" if sm >= 89 else f"sm{sm} has no FP8 tensor cores"
        elif sm >= 100:
            hw, why = "native", f"sm{sm} has native {name.upper()} block-scaled tensor cores"
        elif sm >= 90:
            hw, why = "emulated", (f"sm{sm} has no {name.upper()} tensor cores: values are dequantized exactly "
                                   f"to bf16 in registers and multiplied on bf16 tensor cores")
        else:
            hw, why = "reference", f"sm{sm} is below sm90: the pure-torch reference runs it"
        if override == "reference":
            why += "; QMOE_BACKEND=reference selects the pure-torch reference"
        elif not triton_ok:
            why += "; qmoe's Triton kernels need sm90+"
        out[name] = Capability(name, hw, backend, why)
    return out
