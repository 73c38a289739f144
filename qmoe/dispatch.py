"""Which function runs an op: one explicit table per op family, Triton kernel beside reference twin.

Each table maps a name to (kernel, reference twin), both imported here by name, so grep and an
IDE follow `GROUPED_GEMM.pick("m_grouped_gemm", ...)` straight to `qmoe/kernels/grouped_gemm.py`
and `qmoe/reference/grouped_gemm.py`. The choice between them is `qmoe.backend.use_kernels`:
kernels on CUDA devices of compute capability >= 9.0, the reference elsewhere, either forced by
`QMOE_BACKEND=reference|triton`. A kernel entry of None (no Triton on this platform) raises
`qmoe.UnsupportedError` naming the op when the kernels are asked for. A reference entry of None
marks a kernel-only launcher: the op's autograd Function calls it on the kernels' path, and the
op's reference path composes the twins of `qmoe.reference` itself.

While torch.compile traces, the reference's host-looping grouped ops are replaced by their
custom-op twins (`qmoe.reference.compiled.TWINS`), which the compiler can trace.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from qmoe.backend import use_kernels
from qmoe.contracts.errors import UnsupportedError
from qmoe.reference import activation as r_activation
from qmoe.reference import aux_loss as r_aux_loss
from qmoe.reference import bias as r_bias
from qmoe.reference import delayed_scaling as r_delayed_scaling
from qmoe.reference import grouped_gemm as r_grouped_gemm
from qmoe.reference import grouped_quantize as r_grouped_quantize
from qmoe.reference import permute as r_permute
from qmoe.reference import quantize as r_quantize
from qmoe.reference import quantize_nvfp4 as r_quantize_nvfp4
from qmoe.reference.compiled import TWINS

try:
    import triton  # noqa: F401  (only asks whether the kernels can be imported here)
except ImportError:  # Triton is a dependency on Linux only: elsewhere every kernel entry is None
    triton = None

if triton is not None:
    from qmoe.kernels import activation as k_activation
    from qmoe.kernels import aux_loss as k_aux_loss
    from qmoe.kernels import bias as k_bias
    from qmoe.kernels import delayed_scaling as k_delayed_scaling
    from qmoe.kernels import grouped_gemm as k_grouped_gemm
    from qmoe.kernels import grouped_quantize as k_grouped_quantize
    from qmoe.kernels import permute as k_permute
    from qmoe.kernels import quantize as k_quantize
    from qmoe.kernels import quantize_nvfp4 as k_quantize_nvfp4
    from qmoe.kernels import router as k_router
else:
    k_activation = k_aux_loss = k_bias = k_delayed_scaling = k_grouped_gemm = None
    k_grouped_quantize = k_permute = k_quantize = k_quantize_nvfp4 = k_router = None


class Dispatch:
    """One op family's table: name -> (kernel, reference twin)."""

    def __init__(self, family: str, table: dict[str, tuple[Callable | None, Callable | None]]):
        self.family, self.table = family, table

    def pick(self, name: str, *tensors: torch.Tensor) -> Callable:
        """The kernel when `use_kernels(*tensors)` (None entries ignored), else the reference twin."""
        kernel, reference = self.table[name]
        if use_kernels(*tensors):
            return self._kernel(name, kernel, tensors)
        if torch.compiler.is_compiling():
            twin = TWINS.get((self.family, name))
            if twin is not None:
                return twin
        if reference is None:
            raise UnsupportedError(f"{self.family}.{name}", why="it is a kernel launcher with no reference twin",
                                   fix=f"call the qmoe.ops {self.family} op, which composes the reference")
        return reference

    def kernel(self, name: str, *tensors: torch.Tensor) -> Callable:
        """The kernel of `name`, for an op that already chose the kernels' path."""
        return self._kernel(name, self.table[name][0], tensors)

    def _kernel(self, name, kernel, tensors) -> Callable:
        if kernel is None:
            device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
            raise UnsupportedError(f"{self.family}.{name}", device=device,
                                   why="its Triton kernel is not available (Triton is not installed)",
                                   fix="install Triton (Linux), or run the pure-torch reference with "
                                       "QMOE_BACKEND=reference")
        return kernel

    def __repr__(self) -> str:
        return f"Dispatch({self.family!r}, {sorted(self.table)})"


def _where_supported(kernel, reference, supported):
    """`kernel` for the arguments `supported` accepts, its reference twin (same signature) for the
    rest: the few configurations a kernel does not cover run the spec instead."""
    if kernel is None:
        return None

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        return (kernel if supported(*args, **kwargs) else reference)(*args, **kwargs)
    return run


# Each entry names the same function in qmoe/kernels/<family>.py and qmoe/reference/<family>.py;
# `k_x and k_x.f` is None where Triton is absent.
QUANTIZE = Dispatch("quantize", {
    "tensor_amax": (k_quantize and k_quantize.tensor_amax, r_quantize.tensor_amax),
    "compute_fp8_scale": (_where_supported(
        k_quantize and k_quantize.compute_fp8_scale, r_quantize.compute_fp8_scale,
        lambda amax, *args, **kwargs: k_quantize.fp8_scale_supported(amax)),
        r_quantize.compute_fp8_scale),
    "quantize_fp8_tensorwise": (k_quantize and k_quantize.quantize_fp8_tensorwise, r_quantize.quantize_fp8_tensorwise),
    "dequantize_fp8_tensorwise": (k_quantize and k_quantize.dequantize_fp8_tensorwise,
                                  r_quantize.dequantize_fp8_tensorwise),
    "quantize_fp8_block": (_where_supported(
        k_quantize and k_quantize.quantize_fp8_block, r_quantize.quantize_fp8_block,
        lambda x, rows, cols, *args, **kwargs: k_quantize.fp8_block_supported(rows, cols)),
        r_quantize.quantize_fp8_block),
    "dequantize_fp8_block": (k_quantize and k_quantize.dequantize_fp8_block, r_quantize.dequantize_fp8_block),
    "quantize_mxfp8": (_where_supported(
        k_quantize and k_quantize.quantize_mxfp8, r_quantize.quantize_mxfp8,
        lambda x, fmt, scale_mode=None, rowwise=True, columnwise=False, block=32:
        k_quantize.mxfp8_block_supported(block)),
        r_quantize.quantize_mxfp8),
    "dequantize_mxfp8": (k_quantize and k_quantize.dequantize_mxfp8, r_quantize.dequantize_mxfp8),
})
QUANTIZE_NVFP4 = Dispatch("quantize_nvfp4", {
    "quantize_nvfp4": (k_quantize_nvfp4 and k_quantize_nvfp4.quantize_nvfp4, r_quantize_nvfp4.quantize_nvfp4),
    "dequantize_nvfp4": (k_quantize_nvfp4 and k_quantize_nvfp4.dequantize_nvfp4, r_quantize_nvfp4.dequantize_nvfp4),
})
GROUPED_QUANTIZE = Dispatch("grouped_quantize", {
    "grouped_tensor_amax": (k_grouped_quantize and k_grouped_quantize.grouped_tensor_amax,
                            r_grouped_quantize.grouped_tensor_amax),
    "grouped_quantize_fp8_tensorwise": (k_grouped_quantize and k_grouped_quantize.grouped_quantize_fp8_tensorwise,
                                        r_grouped_quantize.grouped_quantize_fp8_tensorwise),
    "grouped_quantize_fp8_block": (_where_supported(
        k_grouped_quantize and k_grouped_quantize.grouped_quantize_fp8_block,
        r_grouped_quantize.grouped_quantize_fp8_block,
        lambda x, splits, rows, cols, *args, **kwargs: k_quantize.fp8_block_supported(rows, cols)),
        r_grouped_quantize.grouped_quantize_fp8_block),
    "grouped_quantize_mxfp8": (k_grouped_quantize and k_grouped_quantize.grouped_quantize_mxfp8,
                               r_grouped_quantize.grouped_quantize_mxfp8),
    "grouped_quantize_nvfp4": (k_grouped_quantize and k_grouped_quantize.grouped_quantize_nvfp4,
                               r_grouped_quantize.grouped_quantize_nvfp4),
})
DELAYED_SCALING = Dispatch("delayed_scaling", {
    "update_amax_history": (k_delayed_scaling and k_delayed_scaling.update_amax_history,
                            r_delayed_scaling.update_amax_history),
})
ACTIVATION = Dispatch("activation", {
    "scaled_activation_forward": (k_activation and k_activation.scaled_activation_forward,
                                  r_activation.scaled_activation_forward),
    "scaled_activation_backward": (k_activation and k_activation.scaled_activation_backward,
                                   r_activation.scaled_activation_backward),
})
BIAS = Dispatch("bias", {
    "grouped_bias_forward": (k_bias and k_bias.grouped_bias_forward, r_bias.grouped_bias_forward),
    "grouped_bias_backward": (k_bias and k_bias.grouped_bias_backward, r_bias.grouped_bias_backward),
})
GROUPED_GEMM = Dispatch("grouped_gemm", {
    "m_grouped_gemm": (k_grouped_gemm and k_grouped_gemm.m_grouped_gemm, r_grouped_gemm.m_grouped_gemm),
    "k_grouped_gemm": (k_grouped_gemm and k_grouped_gemm.k_grouped_gemm, r_grouped_gemm.k_grouped_gemm),
    "reads_values": (k_grouped_gemm and k_grouped_gemm.reads_values, r_grouped_gemm.reads_values),
})
# Routing families: the ops' autograd Functions call these launchers on the kernels' path; the
# reference path runs qmoe.reference.{router, aux_loss, permute}'s public ops (same results).
ROUTER = Dispatch("router", {
    "route_forward": (k_router and k_router.route_forward, None),
    "route_backward": (k_router and k_router.route_backward, None),
})
AUX_LOSS = Dispatch("aux_loss", {
    "moe_aux_constants": (k_aux_loss and k_aux_loss.moe_aux_constants, None),
    "aux_loss_forward": (k_aux_loss and k_aux_loss.aux_loss_forward, None),
    "seq_aux_scale": (k_aux_loss and k_aux_loss.seq_aux_scale, None),
    "seq_aux_loss_forward": (k_aux_loss and k_aux_loss.seq_aux_loss_forward, None),
    "grad_from_rows": (k_aux_loss and k_aux_loss.grad_from_rows, None),
    "z_loss_forward": (k_aux_loss and k_aux_loss.z_loss_forward, None),
    "z_loss_grad": (k_aux_loss and k_aux_loss.z_loss_grad, None),
    "update_expert_bias": (k_aux_loss and k_aux_loss.update_expert_bias, r_aux_loss.update_expert_bias),
})
PERMUTE = Dispatch("permute", {
    "permute_index": (k_permute and k_permute.permute_index, r_permute.permute_index),
    "permute_rows": (k_permute and k_permute.permute_rows, r_permute.permute_rows),
    "row_amax": (k_permute and k_permute.row_amax, r_permute.row_amax),
    "permute_rows_backward": (k_permute and k_permute.permute_rows_backward, r_permute.permute_rows_backward),
    "permute_probs": (k_permute and k_permute.permute_probs, r_permute.permute_probs),
    "permute_probs_backward": (k_permute and k_permute.permute_probs_backward, r_permute.permute_probs_backward),
    "unpermute_rows": (k_permute and k_permute.unpermute_rows, r_permute.unpermute_rows),
    "unpermute_rows_backward": (k_permute and k_permute.unpermute_rows_backward, r_permute.unpermute_rows_backward),
})
