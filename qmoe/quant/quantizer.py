"""One Quantizer per format: FP8 per tensor (current / delayed), FP8 blocks, MXFP8, NVFP4.

A quantizer knows its element format, block shape and scale layout; callers ask it
(`block`, `scale_shape`, `quantize`, `dequantize`) instead of asking which recipe is active.
Every compute step goes through a `qmoe.dispatch` table, which picks the Triton kernel
on sm90+ GPUs and the reference (the spec) elsewhere, with identical signatures.
"""
from __future__ import annotations

import math

import torch

from qmoe.contracts.carriers import RowsWithAmax, stored_tensor
from qmoe.contracts.errors import refuse_compile
from qmoe.contracts.scales import gemm_scale
from qmoe.contracts.validate import check_flag, cuda_index
from qmoe.contracts.formats import (E2M1, FP8_BLOCK, MXFP8_BLOCK, NVFP4_BLOCK, RHT_SIZE, ElementFormat, ScaleMode,
                                   ceil_div)
from qmoe.dispatch import GROUPED_QUANTIZE, QUANTIZE, QUANTIZE_NVFP4, Dispatch
from qmoe.quant.delayed import (DelayedScalingState, all_reduce_amax, in_forward_region, register_backward,
                                register_forward)
from qmoe.quant.replay import active_log, recomputing
from qmoe.quant.tensor import QuantizedTensor

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float_input(x, what: str = "quantize") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} needs a float32, bfloat16 or float16 tensor, got {x.dtype}; "
                        f"convert with x.float() first")
    if x.dim() < 2:
        raise ValueError(f"{what} needs a tensor of at least 2 dimensions [..., K], got shape {tuple(x.shape)}; "
                         f"use x.reshape(1, -1) for a single row")


class Quantizer:
    """Base class: validation and the QuantizedTensor plumbing shared by every format."""

    fmt: ElementFormat
    block: tuple[int, int] | None = None  # rowwise block (rows, cols); None = one scale per tensor
    # whether the grouped kernels apply an ActivatedRows' activation as they load (same bits either way)
    fuses_activation: bool = True
    # whether the grouped quantize takes a producer's per-group amax (a RowsWithAmax input) instead
    # of reading the rows for it: only a scale that is a function of the group's amax alone can
    takes_amax: bool = False

    def __init__(self, role: str, fmt: ElementFormat):
        self.role, self.fmt = role, fmt

    # ---- public
    def quantize(self, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True) -> QuantizedTensor:
        """Quantize x [..., K] (leading dims flatten into M); columnwise is the quantized transpose [K, M]."""
        check_float_input(x)
        check_flag("rowwise", rowwise)
        check_flag("columnwise", columnwise)
        if not (rowwise or columnwise):
            raise ValueError("quantize needs rowwise=True, columnwise=True or both")
        x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: [M, 0] and [0, 0] are valid
        self.check_shape(*x2d.shape, rowwise=rowwise, columnwise=columnwise)
        parts = self._quantize_2d(x2d, rowwise, columnwise)
        return QuantizedTensor(self, x.shape, x.dtype, **parts)

    def scale_shape(self, m: int, k: int) -> tuple[int, ...]:
        """Canonical scale shape of the rowwise data of an [m, k] tensor (columnwise: scale_shape(k, m))."""
        if self.block is None:
            return ()
        br, bc = self.block
        return (ceil_div(m, br), ceil_div(k, bc))

    def for_group(self, g: int, num_groups: int, device=None) -> "Quantizer":
        """The quantizer that quantizes group g of `num_groups` on its own, as the grouped path would.

        Stateless formats return self; delayed scaling returns a view on group g's slot.
        """
        return self

    def state_dict(self) -> dict:
        """What this quantizer carries from step to step, as tensors ({} for stateless formats)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output; {} means fresh state."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")

    def quantize_for_dispatch(self, x: torch.Tensor, amax_group=None) -> QuantizedTensor | None:
        """Rowwise-quantize x [T, K] into rows that stay valid wherever they are regrouped, or None.

        Expert-parallel dispatch quantizes tokens on their own rank and the experts' rank groups
        them by expert and feeds them to the grouped GEMM as they are (`GroupedTensor.from_rows`).
        That works only where a row's codes and scales do not depend on the group it lands in:
        1-row blocks (FP8 1x128, MXFP8 1x32), and per-tensor current scaling with one amax taken
        over `amax_group` (a MAX all-reduce every rank of the group must join). Formats whose
        scales belong to the group (delayed scaling's per-expert slots, NVFP4's tensor amax)
        return None: send those rows in high precision.
        """
        return None

    # ---- reuse of quantized weights (qmoe.quant.weight_cache)
    def reuse_key(self, device: torch.device, num_groups: int) -> tuple | None:
        """What, besides its input, decides the bits of this quantizer's next grouped quantize of
        `num_groups` groups on `device`: a tuple (numbers compare by value, anything else by
        identity), or None where a kept result may not stand in for that call."""
        return ()

    def reuse_replay(self):
        """Called right after a quantize whose result will be reused: a callable that redoes, at
        each reuse, what that call did besides its output (None: nothing)."""
        return None

    def check_shape(self, m: int, k: int, rowwise: bool, columnwise: bool) -> None:
        """Raise ValueError for shapes this format cannot hold (before any work runs)."""

    def check_group_rows(self, m: int, columnwise: bool) -> None:
        """Raise ValueError if one group of m rows cannot be quantized inside a GroupedTensor."""

    def dequantize(self, qt: QuantizedTensor, dtype=torch.float32, columnwise: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def _quantize_2d(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> dict:
        raise NotImplementedError

    def _quantize_grouped(self, x: torch.Tensor, splits: torch.Tensor, rowwise: bool, columnwise: bool,
                          values: tuple = ()) -> dict:
        """GroupedTensor parts for x [sum M_g, K] split by `splits` [G] (device int64). values: the
        copies wanted as exact bf16 values (`GroupedTensor.quantize`); a format that does not make
        them returns codes."""
        raise NotImplementedError

    @staticmethod
    def _stored(qt, columnwise: bool):
        """(data, scales) of qt's rowwise or columnwise copy, the scales as the quantizer stored
        them: the dequantize kernels and their twins take any strides, so a steps-major layout
        needs no canonical copy first (`ScaleSlot`)."""
        return (qt.columnwise_data if columnwise else qt.rowwise_data), gemm_scale(qt, columnwise)

    def _impl(self, family: Dispatch, name: str, *tensors):
        # a carrier (GroupedTensor.quantize on the kernels' device) runs where its stored tensor is
        return family.pick(name, *(stored_tensor(t) for t in tensors))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, fmt={self.fmt})"


class Float8CurrentQuantizer(Quantizer):
    """FP8 with one scale per tensor from the tensor's own amax.

    Grouped, it takes the amax from the kernel that produced the rows where that kernel reduced
    it (`RowsWithAmax`, `takes_amax`): then the quantize is a single cast pass over the rows
    instead of an amax pass and a cast pass, with the same scales and codes bit for bit.

    amax_reduction_group (set by `qmoe.autocast`'s amax_reduction_group): the weight role's
    amaxes are MAX all-reduced over it, so every rank quantizes a shared weight (replicated, or
    sharded across the group) with the same scales. Activations and gradients keep per-rank
    amaxes. Expert-parallel experts hold different experts per rank and are left out
    (`RecipeState(local_amax=True)`).
    """

    takes_amax = True

    def __init__(self, role, fmt, power_2_scale: bool = False, amax_epsilon: float = 0.0):
        super().__init__(role, fmt)
        self.power_2_scale, self.amax_epsilon = power_2_scale, amax_epsilon
        self.amax_reduction_group = None

    def compute_scale(self, amax: torch.Tensor) -> torch.Tensor:
        return self._impl(QUANTIZE, "compute_fp8_scale", amax)(amax, self.fmt.max, self.power_2_scale,
                                                                 self.amax_epsilon)

    def _shared_amax(self, amax: torch.Tensor) -> torch.Tensor:
        if self.role == "weight" and self.amax_reduction_group is not None:
            amax = all_reduce_amax(amax.clone(), self.amax_reduction_group)
        return amax

    def _scale_for(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute_scale(self._shared_amax(self._impl(QUANTIZE, "tensor_amax", x)(x)))

    def quantize_for_dispatch(self, x, amax_group=None):
        check_float_input(x, "quantize_for_dispatch")
        x2d = x.reshape(-1, x.shape[-1])
        amax = self._impl(QUANTIZE, "tensor_amax", x2d)(x2d).clone()
        scale = self.compute_scale(all_reduce_amax(amax, amax_group))  # one scale on every rank
        row, _, _ = self._impl(QUANTIZE, "quantize_fp8_tensorwise", x2d)(x2d, scale, self.fmt, True, False)
        return QuantizedTensor(self, x2d.shape, x.dtype, rowwise_data=row, rowwise_scale_inv=1.0 / scale)

    def _quantize_2d(self, x, rowwise, columnwise):
        scale = self._scale_for(x)
        row, col, amax = self._impl(QUANTIZE, "quantize_fp8_tensorwise", x)(x, scale, self.fmt, rowwise, columnwise)
        self._recorded(amax)
        scale_inv = 1.0 / scale
        return dict(rowwise_data=row, rowwise_scale_inv=scale_inv if rowwise else None,
                    columnwise_data=col, columnwise_scale_inv=scale_inv if columnwise else None)

    def _recorded(self, amax: torch.Tensor) -> None:
        """Hook for delayed scaling, which keeps the amax it did not use."""

    def reuse_key(self, device, num_groups):
        return (self.amax_reduction_group,)  # the weights' amax is reduced over it

    def _grouped_scales(self, x, splits, amax=None):
        """Per-group scales [G]; amax: the groups' amax from the rows' producer, or None to measure it."""
        if amax is None:
            amax = self._impl(GROUPED_QUANTIZE, "grouped_tensor_amax", x)(x, splits)
        return self.compute_scale(self._shared_amax(amax))

    def _quantize_grouped(self, x, splits, rowwise, columnwise, values=()):
        amax = None
        if isinstance(x, RowsWithAmax):  # GroupedTensor.quantize checked it (takes_amax)
            x, amax = x.rows, x.amax
        scales = self._grouped_scales(x, splits, amax)
        row, col, amax = self._impl(GROUPED_QUANTIZE, "grouped_quantize_fp8_tensorwise", x)(
            x, splits, scales, self.fmt, rowwise, columnwise)
        self._recorded(amax)
        inv = 1.0 / scales
        return dict(rowwise_data=row, rowwise_scale_inv=inv if rowwise else None,
                    columnwise_data=col, columnwise_scale_inv=inv if columnwise else None)

    def dequantize(self, qt, dtype=torch.float32, columnwise=False):
        data, si = self._stored(qt, columnwise)
        return self._impl(QUANTIZE, "dequantize_fp8_tensorwise", data)(data, si, dtype)


class Float8DelayedQuantizer(Float8CurrentQuantizer):
    """FP8 per tensor with the slot's scale from past amaxes; records this call's amax."""

    takes_amax = False  # the scale in force comes from the history; the cast records the amax itself

    def __init__(self, role, fmt, history_len: int = 1024, margin: int = 0, algo: str = "max",
                 reduce_amax: bool = True):
        super().__init__(role, fmt)
        self.state = DelayedScalingState(fmt.max, history_len, margin, algo, reduce_amax)
        self._last_amax: torch.Tensor | None = None  # what the last quantize recorded (reuse_replay)
        self.amax_reduction_group = None

    @property
    def scale(self) -> torch.Tensor | None:
        return self.state.scale

    @property
    def amax_history(self) -> torch.Tensor | None:
        return self.state.amax_history

    @property
    def nonfinite_steps(self) -> torch.Tensor | None:
        """Steps whose amax was inf or NaN, left out of the history (int32, [] or [G]; None before use)."""
        return self.state.nonfinite_steps

    def _scale_for(self, x):
        self._refuse_compile()
        self.state.ensure(x.device, None)
        return self.state.scale_in_force()  # kept with its data

    def _grouped_scales(self, x, splits, amax=None):
        self._refuse_compile()
        self.state.ensure(x.device, splits.numel())
        return self.state.scale_in_force()

    def quantize_for_dispatch(self, x, amax_group=None):
        return None  # the scale is the slot's: per expert in a GroupedTensor, unknown to the sender

    @staticmethod
    def _refuse_compile() -> None:
        refuse_compile("torch.compile", recipe="DelayedScaling",
                       why="its amax histories and scales are updated outside the forward and backward (when "
                           "the autocast region exits, after the backward pass), which a compiled graph cannot "
                           "follow",
                       fix="run DelayedScaling eagerly (or captured with qmoe.graph.capture), or compile with "
                           "Float8CurrentScaling")

    def _recorded(self, amax):
        self._last_amax = amax
        if recomputing():  # qmoe.checkpoint's recompute: the first run recorded this amax
            return
        self.state.record(amax)
        if self.role == "grad_output" and not in_forward_region():
            register_backward(self.state, self.amax_reduction_group)
        else:
            register_forward(self.state)

    def reuse_key(self, device, num_groups):
        """The scale tensor, its version (writes through torch: load_state_dict, a capture's restore)
        and the state's update count (the update kernel writes in place): every update rewrites the
        scale, so a kept weight outlives no update (whether the new scale has the same value is
        known on the device only)."""
        if recomputing():  # qmoe.checkpoint's recompute quantizes with the first run's scale, from the log
            return None
        self.state.ensure(device, num_groups)
        scale = self.state.scale
        if scale.is_inference():  # made under torch.inference_mode: no version counter to ask
            return None
        return (scale, scale._version, self.state.updates)

    def reuse_replay(self):
        """A reuse stands for a quantize call: it records the weight's amax again (the histories are
        those of a run without reuse) and, inside a checkpointed forward, lets the log keep the scale
        in force, which the recompute (quantizing afresh) reads back."""
        amax = self._last_amax

        def replay():
            if active_log() is not None:
                self.state.scale_in_force()
            self._recorded(amax)
        return replay

    def for_group(self, g, num_groups, device=None):
        self.state.ensure(device or (self.state.scale.device if self.state.scale is not None else "cpu"),
                          num_groups)
        view = Float8DelayedQuantizer(self.role, self.fmt)
        view.state = self.state.slot(g, num_groups)
        view.amax_reduction_group = self.amax_reduction_group
        return view

    def state_dict(self) -> dict:
        """{"scale": [] or [G], "amax_history": [L] or [L, G]} fp32 copies; {} before the first quantize."""
        if self.state.scale is None:
            return {}
        return {"scale": self.state.scale.detach().clone(), "amax_history": self.state.amax_history.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        st = self.state
        if not state:
            st.scale = st.amax_history = None  # fresh: made at the next quantize
            return
        if set(state) != {"scale", "amax_history"}:
            raise ValueError(f"a delayed-scaling quantizer's state has keys scale and amax_history, "
                             f"got {sorted(state)}")
        scale, history = state["scale"], state["amax_history"]
        if history.shape[0] != st.history_len or tuple(history.shape[1:]) != tuple(scale.shape):
            raise ValueError(f"delayed-scaling state of shape scale {tuple(scale.shape)}, amax_history "
                             f"{tuple(history.shape)} does not fit amax_history_len={st.history_len}")
        if st.scale is not None and st.scale.shape == scale.shape and st.amax_history.shape == history.shape:
            # in place: a captured CUDA graph (qmoe.graph) keeps reading these very tensors
            st.scale.copy_(scale)
            st.amax_history.copy_(history)
        else:
            st.scale = scale.detach().to(torch.float32, copy=True)
            st.amax_history = history.detach().to(torch.float32, copy=True)  # moved to x's device on use

    def update_scale(self, group=None) -> None:
        """Apply the pending amax now (what autocast does at region exit), reducing over `group`."""
        from qmoe.quant.delayed import update_delayed_scaling

        update_delayed_scaling([self.state], group)


class Float8BlockQuantizer(Quantizer):
    """FP8 with an fp32 scale per 1x128 row block (activations, gradients) or 128x128 tile (weights)."""

    def __init__(self, role, fmt, block_rows: int, power_2_scale: bool = True, amax_epsilon: float = 0.0):
        super().__init__(role, fmt)
        self.block = (block_rows, FP8_BLOCK)
        self.power_2_scale, self.amax_epsilon = power_2_scale, amax_epsilon

    def quantize_for_dispatch(self, x, amax_group=None):
        if self.block[0] != 1:
            return None  # 128x128 tiles span rows
        return self.quantize(x.reshape(-1, x.shape[-1]), rowwise=True, columnwise=False)

    def _quantize_2d(self, x, rowwise, columnwise):
        row, row_si, col, col_si = self._impl(QUANTIZE, "quantize_fp8_block", x)(
            x, self.block[0], self.block[1], self.fmt, self.power_2_scale, self.amax_epsilon, rowwise, columnwise)
        return dict(rowwise_data=row, rowwise_scale_inv=row_si, columnwise_data=col, columnwise_scale_inv=col_si)

    def _quantize_grouped(self, x, splits, rowwise, columnwise, values=()):
        row, rs, col, cs = self._impl(GROUPED_QUANTIZE, "grouped_quantize_fp8_block", x)(
            x, splits, self.block[0], self.block[1], self.fmt, self.power_2_scale, self.amax_epsilon,
            rowwise, columnwise)
        return dict(rowwise_data=row, rowwise_scale_inv=rs, columnwise_data=col, columnwise_scale_inv=cs)

    def dequantize(self, qt, dtype=torch.float32, columnwise=False):
        data, si = self._stored(qt, columnwise)
        return self._impl(QUANTIZE, "dequantize_fp8_block", data)(data, si, self.block[0], self.block[1], dtype)


class MXFP8Quantizer(Quantizer):
    """MXFP8: an E8M0 (power-of-two) scale per 32 consecutive values."""

    def __init__(self, role, fmt, scale_mode: ScaleMode = ScaleMode.ROUND_UP):
        super().__init__(role, fmt)
        self.block = (1, MXFP8_BLOCK)
        self.scale_mode = scale_mode

    def quantize_for_dispatch(self, x, amax_group=None):
        return self.quantize(x.reshape(-1, x.shape[-1]), rowwise=True, columnwise=False)

    def _quantize_2d(self, x, rowwise, columnwise):
        row, row_s, col, col_s = self._impl(QUANTIZE, "quantize_mxfp8", x)(
            x, self.fmt, self.scale_mode, rowwise, columnwise)
        return dict(rowwise_data=row, rowwise_scale_inv=row_s, columnwise_data=col, columnwise_scale_inv=col_s)

    def _quantize_grouped(self, x, splits, rowwise, columnwise, values=()):
        row, rs, col, cs = self._impl(GROUPED_QUANTIZE, "grouped_quantize_mxfp8", x)(
            x, splits, self.fmt, self.scale_mode, rowwise, columnwise, values)
        return _held_as_values(row, rs, col, cs)

    def dequantize(self, qt, dtype=torch.float32, columnwise=False):
        data, s = self._stored(qt, columnwise)
        return self._impl(QUANTIZE, "dequantize_mxfp8", data)(data, s, dtype)


class NVFP4Quantizer(Quantizer):
    """NVFP4: E2M1 values, E4M3 scale per 1x16 (16x16 for weights), fp32 tensor amax.

    `rht` applies the random Hadamard transform to the columnwise (wgrad) copy; `stochastic`
    rounds with random draws from `generator` (set it, e.g. torch.Generator().manual_seed(0),
    to reproduce a run).
    """

    # the NVFP4 kernels hold two copies, the Hadamard product and Philox in registers already: with
    # the activation as well the fused pass is slower than the activation-then-quantize pair
    # (benchmarks/results/fused_activation.json), so the activation runs first
    fuses_activation = False

    def __init__(self, role, block_2d: bool = False, rht: bool = False, stochastic: bool = False,
                 generator: torch.Generator | None = None):
        super().__init__(role, E2M1)
        self.block = (NVFP4_BLOCK, NVFP4_BLOCK) if block_2d else (1, NVFP4_BLOCK)
        self.block_2d, self.rht, self.stochastic, self.generator = block_2d, rht, stochastic, generator

    def check_shape(self, m, k, rowwise, columnwise):
        if rowwise and k % 2:
            raise ValueError(f"NVFP4 packs two values per byte: the last dimension K={k} must be even")
        if columnwise and m % 2:
            raise ValueError(f"NVFP4's columnwise copy packs two rows per byte: M={m} rows must be even; "
                             f"pad the rows (align_size) or quantize with columnwise=False")
        if columnwise and self.rht and m % RHT_SIZE and k:  # the transform of no columns is nothing
            raise ValueError(f"the random Hadamard transform of the columnwise copy needs M={m} to be a multiple "
                             f"of {RHT_SIZE}; pad the rows or use NVFP4BlockScaling(disable_rht=True)")

    def check_group_rows(self, m, columnwise):
        if columnwise and self.rht and m % RHT_SIZE:
            raise ValueError(f"the random Hadamard transform needs every group's rows to be a multiple of "
                             f"{RHT_SIZE}, got a group of {m}; pad groups (align_size) or disable_rht=True")

    def reuse_key(self, device, num_groups):
        return None if self.stochastic else ()  # stochastic rounding draws new random numbers every call

    def _generator_for(self, x):
        g = self.generator
        if self.stochastic and g is not None and _device_key(g.device) != _device_key(x.device):
            raise ValueError(f"the stochastic-rounding generator is on {g.device} but the tensor is on {x.device}; "
                             f"create it with torch.Generator(device=x.device)")
        return g

    def _quantize_2d(self, x, rowwise, columnwise):
        rht = self.rht and x.numel() > 0  # an empty tensor has nothing to transform
        row, row_s, amax, col, col_s, col_amax = self._impl(QUANTIZE_NVFP4, "quantize_nvfp4", x)(
            x, self.block_2d, rowwise, columnwise, rht, self.stochastic, self._generator_for(x))
        return dict(rowwise_data=row, rowwise_scale_inv=row_s, columnwise_data=col, columnwise_scale_inv=col_s,
                    amax=amax, columnwise_amax=col_amax)

    def _quantize_grouped(self, x, splits, rowwise, columnwise, values=()):
        row, rs, amax, col, cs, camax = self._impl(GROUPED_QUANTIZE, "grouped_quantize_nvfp4", x)(
            x, splits, self.block_2d, rowwise, columnwise, self.rht, self.stochastic, self._generator_for(x), values)
        return dict(_held_as_values(row, rs, col, cs), amax=amax, columnwise_amax=camax)

    def dequantize(self, qt, dtype=torch.float32, columnwise=False):
        data, s = self._stored(qt, columnwise)
        amax = qt.columnwise_amax if columnwise else qt.amax
        return self._impl(QUANTIZE_NVFP4, "dequantize_nvfp4", data)(data, s, amax, self.block_2d, dtype)


def _held_as_values(row, rs, col, cs) -> dict:
    """GroupedTensor parts of a cast's copies, where a copy that came without its scales came as
    its exact values (`GroupedTensor.values`)."""
    exact = {}
    if row is not None and rs is None:
        exact["rowwise"], row = row, None
    if col is not None and cs is None:
        exact["columnwise"], col = col, None
    return dict(rowwise_data=row, rowwise_scale_inv=rs, columnwise_data=col, columnwise_scale_inv=cs,
                values=exact or None)


def _device_key(device: torch.device) -> tuple:
    """(type, index) of a device, an index-less CUDA device being the current one (`cuda_index`)."""
    return device.type, cuda_index(device) if device.type == "cuda" else device.index
