"""The five quantization recipes: frozen dataclasses, validated on construction.

A recipe is exactly what its fields say (no environment variables in defaults). It answers
which element format each tensor role gets and how many rows an expert's token group is
padded to (`align_size`); `quantizer(role)` builds the matching `qmoe.quant` quantizer.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from qmoe.contracts.formats import E4M3, E5M2, ElementFormat, ScaleMode

ROLES = ("input", "weight", "grad_output")
MAX_ALIGN_SIZE = 4096  # padding rows per expert beyond this would dwarf any real token group


class Format(enum.Enum):
    """FP8 element formats of a recipe: E4M3 everywhere, or HYBRID (E4M3 forward, E5M2 backward)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def element_format(self, role: str) -> ElementFormat:
        if self is Format.E4M3:
            return E4M3
        if self is Format.E5M2:
            return E5M2
        return E5M2 if role == "grad_output" else E4M3


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown tensor role {role!r}; expected one of {', '.join(ROLES)}")
    return role


def _check_format(recipe, allowed=(Format.E4M3, Format.HYBRID)):
    fmt = recipe.fp8_format
    if not isinstance(fmt, Format):
        raise ValueError(f"{type(recipe).__name__}.fp8_format must be a qmoe.recipes.Format, got {fmt!r}")
    if fmt not in allowed:
        raise ValueError(
            f"{type(recipe).__name__}.fp8_format={fmt.name} is not supported: pure E5M2 loses too much "
            f"forward precision; use one of {', '.join(f.name for f in allowed)}")


def _check_positive_int(recipe, name):
    v = getattr(recipe, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{type(recipe).__name__}.{name} must be a positive integer, got {v!r}")


def _check_nonneg_float(recipe, name):
    v = getattr(recipe, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0.0) or v == float("inf"):
        raise ValueError(f"{type(recipe).__name__}.{name} must be a finite number >= 0, got {v!r}")


def _check_bool(recipe, name):
    if not isinstance(getattr(recipe, name), bool):
        raise ValueError(f"{type(recipe).__name__}.{name} must be True or False, got {getattr(recipe, name)!r}")


# Recipes sit below qmoe.quant (DESIGN.md), so they cannot import the quantizers they describe:
# qmoe.quant.factory registers its builder here when imported (`import qmoe` imports it).
_quantizer_factory = None


def register_quantizer_factory(factory) -> None:
    """Set the function (recipe, role) -> Quantizer that `Recipe.quantizer` calls (qmoe.quant's)."""
    global _quantizer_factory
    _quantizer_factory = factory


class Recipe:
    """Base of every recipe. Subclasses are frozen dataclasses."""

    config_name: str = ""

    def quantizer(self, role: str):
        """A fresh `qmoe.quant.Quantizer` for a tensor role ("input", "weight", "grad_output")."""
        role = check_role(role)
        if _quantizer_factory is None:
            raise RuntimeError("no quantizer factory registered: import qmoe (or qmoe.quant) first")
        return _quantizer_factory(self, role)

    def element_format(self, role: str) -> ElementFormat:
        raise NotImplementedError

    def align_multiple(self) -> int:
        """What every expert's row count must be a multiple of for this recipe's kernels (1: anything)."""
        return 1

    def align_reason(self) -> str:
        return ""

    def _validate_common(self):
        _check_positive_int(self, "align_size")
        if self.align_size > MAX_ALIGN_SIZE:
            raise ValueError(f"{type(self).__name__}.align_size={self.align_size} is more than {MAX_ALIGN_SIZE}: every "
                             f"expert's group is padded by up to align_size - 1 rows")
        need = self.align_multiple()
        if self.align_size % need:
            raise ValueError(f"{type(self).__name__}.align_size={self.align_size} must be a multiple of {need}: "
                             f"{self.align_reason()}")
        for f in fields(self):
            if f.type in ("bool", bool):
                _check_bool(self, f.name)


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """FP8 with one scale per tensor taken from a window of past amaxes (no amax pass per call)."""

    margin: int = 0  # scale = fp8_max / amax / 2**margin: headroom for growing activations
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # "max" over the window, or "most_recent"
    reduce_amax: bool = True  # all-reduce MAX over autocast's amax_reduction_group
    align_size: int = 16  # FP8 tensor-core GEMMs want 16-row multiples
    config_name = "delayed"

    def __post_init__(self):
        _check_format(self)
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be an integer >= 0, got {self.margin!r}")
        _check_positive_int(self, "amax_history_len")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling.amax_compute_algo must be 'max' or 'most_recent', "
                             f"got {self.amax_compute_algo!r}")
        self._validate_common()

    def element_format(self, role):
        return self.fp8_format.element_format(check_role(role))


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """FP8 with one scale per tensor from this tensor's own amax (an extra amax pass, no history)."""

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False  # round scales down to a power of two (exact rescaling)
    amax_epsilon: float = 0.0  # floor on amax, so near-zero tensors do not get huge scales
    align_size: int = 16
    config_name = "current"

    def __post_init__(self):
        _check_format(self)
        _check_nonneg_float(self, "amax_epsilon")
        self._validate_common()

    def element_format(self, role):
        return self.fp8_format.element_format(check_role(role))


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 with an fp32 scale per 1x128 activation/gradient block and per 128x128 weight block."""

    fp8_format: Format = Format.E4M3
    use_f32_scales: bool = False  # False: power-of-two scales (DeepSeek-V3); True: exact fp32 scales
    amax_epsilon: float = 0.0
    align_size: int = 16
    config_name = "block"

    def __post_init__(self):
        _check_format(self)
        _check_nonneg_float(self, "amax_epsilon")
        self._validate_common()

    @property
    def power_2_scale(self) -> bool:
        return not self.use_f32_scales

    def element_format(self, role):
        return self.fp8_format.element_format(check_role(role))


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: FP8 elements with a power-of-two (E8M0) scale per 32 consecutive values."""

    fp8_format: Format = Format.E4M3
    scale_mode: ScaleMode = ScaleMode.ROUND_UP  # ROUND_UP never saturates; FLOOR is OCP MX v1.0
    align_size: int = 32  # groups padded to whole 32-row blocks for the columnwise copy
    config_name = "mxfp8"

    def __post_init__(self):
        _check_format(self)
        if not isinstance(self.scale_mode, ScaleMode):
            raise ValueError(f"MXFP8BlockScaling.scale_mode must be a qmoe.recipes.ScaleMode, got {self.scale_mode!r}")
        self._validate_common()

    def element_format(self, role):
        return self.fp8_format.element_format(check_role(role))


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements, an E4M3 scale per 16 values (16x16 for weights), an fp32 tensor amax."""

    disable_rht: bool = False  # random Hadamard transform spreads outliers in the wgrad copies
    disable_stochastic_rounding: bool = False  # unbiased rounding of gradients
    disable_2d_quantization: bool = False  # 16x16 weight blocks make W and W^T quantize identically
    align_size: int = 128
    config_name = "nvfp4"

    def __post_init__(self):
        self._validate_common()

    def align_multiple(self) -> int:
        return 2 if self.disable_rht else 16

    def align_reason(self) -> str:
        if self.disable_rht:
            return "the columnwise (wgrad) copy packs two rows per byte"
        return ("the random Hadamard transform of the columnwise (wgrad) copy runs over 16 rows "
                "(NVFP4BlockScaling(disable_rht=True) needs a multiple of 2)")

    def element_format(self, role):
        from qmoe.contracts.formats import E2M1

        check_role(role)
        return E2M1


RECIPES = {cls.config_name: cls for cls in
           (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)}
