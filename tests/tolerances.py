"""NUMERICS.md's end-to-end tolerances, applied scale-free.

A quantized GEMM's error grows with the tensor's magnitude, so (rtol, atol) are applied to the
tensors divided by the reference's largest magnitude, plus a relative Frobenius-norm bound:
    ||out - ref|| / ||ref|| <= rtol   and   |out - ref| / max|ref| <= atol + rtol  (every element).
"""
import torch

from qmoe.recipes import NVFP4BlockScaling

TOLERANCES = {"bf16": (1.6e-2, 1e-5), "fp8": (0.125, 0.0675), "nvfp4": (0.25, 0.125)}


def recipe_tolerance(recipe) -> tuple[float, float]:
    if recipe is None:
        return TOLERANCES["bf16"]
    return TOLERANCES["nvfp4"] if isinstance(recipe, NVFP4BlockScaling) else TOLERANCES["fp8"]


def assert_within_tolerance(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, what: str = "") -> None:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= rtol, f"{what}: relative error {rel:.4f} > rtol {rtol}"
    worst = ((out - ref).abs().max() / ref.abs().max()).item()
    assert worst <= atol + rtol, f"{what}: worst element error {worst:.4f} of max|ref| > {atol + rtol}"
