"""NUMERICS.md's tolerances in one place: every test that compares numbers asks here.

Three tiers, as NUMERICS.md states them (no test widens them):
- quantization, data movement, grouped vs split and graph replay vs eager where the same kernels
  run: bit for bit (`assert_bit_identical`);
- a GEMM against its reference on random normal inputs ("GEMM contract"): a relative Frobenius
  error of 1e-2 for a bf16 output, 1e-3 for fp32 accumulation of exact products (`GEMM_RTOL`,
  `assert_gemm_within_contract`);
- end to end against the same computation in fp32 ("Tolerances for end-to-end comparisons"):
  the recipe's (rtol, atol), times sqrt(n) for a quantity downstream of n quantized GEMMs in
  series (`recipe_tolerance`), checked as
      ||out - ref|| / ||ref|| <= rtol   and   |out - ref| <= atol + rtol * max|ref|  (every element)
  (`assert_within_tolerance`).
"""
import math

import torch

from qmoe.recipes import NVFP4BlockScaling

END_TO_END = {"bf16": (1.6e-2, 1e-5), "fp8": (0.125, 0.0675), "nvfp4": (0.25, 0.125)}
GEMM_RTOL = {torch.bfloat16: 1e-2, torch.float32: 1e-3}
# An MoE layer's quantities and the quantized GEMMs in series in front of each (FC1, then FC2;
# backward: FC2's dgrad, then FC1's dgrad / wgrad): the n of recipe_tolerance.
MOE_GEMM_DEPTH = {"y": 2, "dx": 3, "router": 2, "w1": 3, "b1": 2, "w2": 2, "b2": 1}


def recipe_tolerance(recipe, gemms_in_series: int = 1) -> tuple[float, float]:
    """(rtol, atol) of NUMERICS.md for a recipe (None = bf16 math against fp32).

    gemms_in_series: quantized GEMMs chained between the inputs and the quantity compared (a
    layer's output: 2, FC1 then FC2; its input gradient: 3). Independent errors add in
    quadrature, so NUMERICS.md allows rtol * sqrt(n) and atol * sqrt(n), and nothing looser.
    """
    if gemms_in_series < 1:
        raise ValueError(f"gemms_in_series must be >= 1, got {gemms_in_series}")
    if recipe is None:
        rtol, atol = END_TO_END["bf16"]
    else:
        rtol, atol = END_TO_END["nvfp4" if isinstance(recipe, NVFP4BlockScaling) else "fp8"]
    widen = math.sqrt(gemms_in_series)
    return rtol * widen, atol * widen


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    diff = (out - ref).norm().item()
    return diff / ref.norm().item() if diff else 0.0


def assert_within_tolerance(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, what: str = "") -> None:
    """NUMERICS.md's end-to-end comparison: the norm bound and the elementwise bound."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    rel = relative_error(out, ref)
    assert rel <= rtol, f"{what}: relative error {rel:.4g} > rtol {rtol:.4g}"
    worst = (out - ref).abs().max().item() if out.numel() else 0.0
    bound = atol + rtol * (ref.abs().max().item() if ref.numel() else 0.0)
    assert worst <= bound, f"{what}: worst element error {worst:.4g} > atol + rtol * max|ref| = {bound:.4g}"


def assert_recipe_close(out, ref, recipe, gemms_in_series: int = 1, what: str = "") -> None:
    """`assert_within_tolerance` with the recipe's tolerance n quantized GEMMs deep."""
    assert_within_tolerance(out, ref, *recipe_tolerance(recipe, gemms_in_series), what=what)


def assert_gemm_within_contract(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """NUMERICS.md's GEMM contract: out against the fp32/fp64 product of the dequantized operands."""
    rtol = GEMM_RTOL[out.dtype]
    rel = relative_error(out, ref)
    assert rel <= rtol, f"{what}: GEMM relative error {rel:.4g} > {rtol} ({out.dtype} output)"


def assert_bit_identical(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Same kernels, same inputs: the same bits (NaNs in the same places count as equal)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{tuple(out.shape)} " \
        f"!= {ref.dtype}{tuple(ref.shape)}"
    if out.dtype.is_floating_point and out.element_size() > 1:
        same = torch.equal(out, ref) or torch.equal(out.isnan(), ref.isnan()) and torch.equal(
            out.nan_to_num(0.0), ref.nan_to_num(0.0))
    else:
        same = torch.equal(out.view(torch.uint8) if out.element_size() == 1 else out,
                           ref.view(torch.uint8) if ref.element_size() == 1 else ref)
    if not same:
        diff = (out.float() - ref.float()).abs().nan_to_num(float("inf")).max().item()
        raise AssertionError(f"{what}: not bit-identical (max |diff| {diff:.4g})")
