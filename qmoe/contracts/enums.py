"""The named choices of qmoe's ops, as string enums.

Each is an `enum.StrEnum`, so a member equals (and hashes as) its string: public arguments stay
plain strings ("swiglu", "auto", ...), and each op parses them once at its boundary with the
`parse_*` function here, which raises a ValueError naming the argument and the choices.
"""
from __future__ import annotations

import enum

import torch

from qmoe.contracts.formats import E2M1
from qmoe.contracts.scales import gemm_scale


class Scaling(enum.StrEnum):
    """How an operand's values are scaled: decides which GEMM body multiplies it."""

    NONE = "none"  # plain bf16/fp16/fp32 tensor
    TENSOR = "tensor"  # FP8, one fp32 scale per group (delayed / current scaling)
    BLOCK = "block"  # FP8, fp32 scale per 1x128 row block or 128x128 tile
    MX = "mx"  # FP8, E8M0 scale per 1x32
    NVFP4 = "nvfp4"  # E2M1, E4M3 scale per 1x16 or 16x16, fp32 tensor amax


class ScoreFunction(enum.StrEnum):
    """How router logits become scores."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    SQRTSOFTPLUS = "sqrtsoftplus"  # sqrt(softplus(x)): positive, and grows like sqrt(x)


class Activation(enum.StrEnum):
    """The expert MLP's activation; the GLU ones take [R, 2F] (gate half, then linear half)."""

    SWIGLU = "swiglu"
    GEGLU = "geglu"
    CLAMPED_QGEGLU = "clamped_qgeglu"  # GPT-OSS: clamped gate and linear parts, sigmoid(alpha x) gate
    RELU2 = "relu2"
    GELU = "gelu"  # tanh approximation

    @property
    def is_glu(self) -> bool:
        return self in (Activation.SWIGLU, Activation.GEGLU, Activation.CLAMPED_QGEGLU)


class GroupedPath(enum.StrEnum):
    """How a grouped linear runs (DESIGN.md, "grouped path vs split-quantize fallback")."""

    AUTO = "auto"  # grouped where the recipe and device support it, else split
    GROUPED = "grouped"  # one quantize and one grouped GEMM for all groups; split sizes stay on the device
    SPLIT = "split"  # split sizes read on the host, each group quantized and multiplied on its own


class GemmRoute(enum.StrEnum):
    """How the grouped GEMM kernels multiply emulated (MXFP8 / NVFP4 on sm90) operands."""

    AUTO = "auto"  # chosen from the rows per group
    FUSED = "fused"  # dequantize in registers inside the GEMM
    DEQUANT = "dequant"  # one exact bf16 dequantize pass per operand, then a bf16 grouped GEMM


def _parse(cls: type[enum.StrEnum], value, name: str):
    member = _BY_VALUE[cls].get(value) if isinstance(value, str) else None
    if member is None:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{name}={value!r} is unknown; use one of {choices}")
    return member


# value -> member (members hash as their strings, so a member finds itself): one dict lookup per call
_BY_VALUE = {cls: {m.value: m for m in cls} for cls in (Scaling, ScoreFunction, Activation, GroupedPath, GemmRoute)}


def parse_score_function(score_function) -> ScoreFunction:
    return _parse(ScoreFunction, score_function, "score_function")


def parse_activation(activation) -> Activation:
    return _parse(Activation, activation, "activation")


def parse_grouped_path(grouped_path) -> GroupedPath:
    return _parse(GroupedPath, grouped_path, "grouped_path")


def parse_gemm_route(route) -> GemmRoute:
    return _parse(GemmRoute, route, "route")


def is_grouped(x) -> bool:
    """True for a GroupedTensor (duck-typed: the contract sits below qmoe.quant)."""
    return hasattr(x, "split_sizes") and hasattr(x, "quantizer") and hasattr(x, "offsets")


def scaling_of(gt) -> Scaling:
    """The Scaling of a GroupedTensor, asked of its quantizer (format, block) and scale dtype."""
    q = gt.quantizer
    if q.fmt == E2M1:
        return Scaling.NVFP4
    if q.block is None:
        return Scaling.TENSOR
    scale = gemm_scale(gt, False)
    if scale is None:
        scale = gemm_scale(gt, True)
    if scale is None:  # both copies held as exact values, which MXFP8 alone writes
        return Scaling.MX
    return Scaling.MX if scale.dtype == torch.float8_e8m0fnu else Scaling.BLOCK
