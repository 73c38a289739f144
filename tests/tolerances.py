"""NUMERICS.md's end-to-end tolerances, applied scale-free.

A quantized GEMM's error grows with the tensor's magnitude, so (rtol, atol) are applied to the
tensors divided by the reference's largest magnitude, plus a relative Frobenius-norm bound:
    ||out - ref|| / ||ref|| <= rtol   and   |out - ref| / max|ref| <= atol + rtol  (every element).
"""
import torch

from qmoe.recipes import NVFP4BlockScaling

TOLERANCES = {"bf16": (1.6e-2, 1e-5), "fp8": (0.125, 0.0675), "nvfp4": (0.25, 0.125)}


def recipe_tolerance(recipe, gemms_in_series: int = 1) -> tuple[float, float]:
    """(rtol, atol) of NUMERICS.md for a recipe (None = bf16).

    gemms_in_series: quantized GEMMs chained between input and output (an expert MLP has 2: FC1
    and FC2, each quantizing both operands). Independent quantization errors add in quadrature,
    so the relative tolerance of one GEMM grows by sqrt(n) along the chain.
    """
    if recipe is None:
        rtol, atol = TOLERANCES["bf16"]
    else:
        rtol, atol = TOLERANCES["nvfp4"] if isinstance(recipe, NVFP4BlockScaling) else TOLERANCES["fp8"]
    return rtol * gemms_in_series ** 0.5, atol


def assert_within_tolerance(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, what: str = "") -> None:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= rtol, f"{what}: relative error {rel:.4f} > rtol {rtol}"
    worst = ((out - ref).abs().max() / ref.abs().max()).item()
    assert worst <= atol + rtol, f"{what}: worst element error {worst:.4f} of max|ref| > {atol + rtol}"
