"""`qmoe.nn.GroupedMLP`: every expert's FC1 -> activation (times the routing prob) -> FC2."""
from __future__ import annotations

import torch
from torch import nn

from qmoe.nn.grouped_linear import GroupedLinear
from qmoe.contracts.carriers import AmaxSlot, deinterleave_glu, interleave_glu, is_glu
from qmoe.contracts.validate import check_activation, check_flag, check_params_dtype, check_size


class GroupedMLP(nn.Module):
    """E experts' MLPs over permuted rows: FC2(act(FC1(x)) * prob) with FC2's bias scaled by prob too.

    forward(x [R, H], split_sizes [E] int on x's device, probs [R] fp32 or None) -> [R, H].
    The prob multiplies the activation output (and FC2's bias), so each row's expert output is
    prob * expert(x) and the prob receives its gradient; padding rows (prob 0) come out zero.

    Under a recipe on the grouped path the activation is fused into the quantization of FC2's
    input (`GroupedLinear(..., input_activation=...)`): the quantize kernels read FC1's output and
    apply the activation as they load, so the [R, F] activation is never written; the results
    are those of running it first, bit for bit.

    FC1 is `fc1.weight [E, 2F, H]` for GLU activations (gate rows first, then linear rows) and
    `[E, F, H]` otherwise; FC2 is `fc2.weight [E, H, F]`. `glu_interleave_size=k` stores FC1's
    rows physically as alternating k-row gate/linear blocks (so an activation fused into FC1's
    epilogue sees both halves of a column block in one tile); `state_dict()` and
    `load_state_dict()` always use the logical layout.

    recompute_activation: FC2's input (the activation output, quantized for FC2's weight
    gradient under a recipe) is not kept for the backward, which rebuilds it from FC1's output
    h and the probs it keeps anyway: one [R, F] operand less held between forward and backward
    (F bytes a row in FP8, F / 2 in NVFP4, 2F in bf16), one more activation and quantization of
    it in the backward, the same gradients bit for bit.

    cache_quantized_weights, recompute_weight_columnwise: FC1's and FC2's (`GroupedLinear`);
    setting either attribute sets both layers'.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 glu_interleave_size: int | None = None, bias: bool = False, grouped_path: str = "auto",
                 delay_wgrad_compute: bool = False, single_grouped_weight: bool = True, params_dtype=None,
                 device=None, recompute_activation: bool = False, cache_quantized_weights: bool = False,
                 recompute_weight_columnwise: bool = False):
        super().__init__()
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("ffn_hidden_size", ffn_hidden_size)):
            check_size(name, v, "GroupedMLP")
        for name, v in (("bias", bias), ("delay_wgrad_compute", delay_wgrad_compute),
                        ("single_grouped_weight", single_grouped_weight),
                        ("recompute_activation", recompute_activation)):
            check_flag(name, v, "GroupedMLP")
        check_params_dtype(params_dtype, "GroupedMLP")
        self.activation = check_activation(activation)
        self.recompute_activation = recompute_activation
        glu = is_glu(activation)
        if glu_interleave_size is not None:
            if not glu:
                raise ValueError(f"glu_interleave_size applies to GLU activations, not {activation!r}")
            if isinstance(glu_interleave_size, bool) or not isinstance(glu_interleave_size, int) \
                    or glu_interleave_size < 1 or ffn_hidden_size % glu_interleave_size:
                raise ValueError(f"glu_interleave_size={glu_interleave_size!r} must be a positive divisor of "
                                 f"ffn_hidden_size={ffn_hidden_size}")
        self.glu_interleave_size = glu_interleave_size
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        kw = dict(bias=bias, grouped_path=grouped_path, delay_wgrad_compute=delay_wgrad_compute,
                  single_grouped_weight=single_grouped_weight, single_grouped_bias=single_grouped_weight,
                  params_dtype=params_dtype, device=device, cache_quantized_weights=cache_quantized_weights,
                  recompute_weight_columnwise=recompute_weight_columnwise)
        self.fc1 = GroupedLinear(num_experts, hidden_size, (2 if glu else 1) * ffn_hidden_size, **kw)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, scale_bias=bias, **kw)
        if glu_interleave_size:
            self._register_state_dict_hook(self._logical_state_dict)
            self._register_load_state_dict_pre_hook(self._physical_state_dict)

    @property
    def cache_quantized_weights(self) -> bool:
        return self.fc1.cache_quantized_weights

    @cache_quantized_weights.setter
    def cache_quantized_weights(self, value: bool) -> None:
        for fc in (self.fc1, self.fc2):
            fc.cache_quantized_weights = value

    @property
    def recompute_weight_columnwise(self) -> bool:
        return self.fc1.recompute_weight_columnwise

    @recompute_weight_columnwise.setter
    def recompute_weight_columnwise(self, value: bool) -> None:
        check_flag("recompute_weight_columnwise", value, "GroupedMLP")
        for fc in (self.fc1, self.fc2):
            fc.recompute_weight_columnwise = value

    # ---- GLU interleaving between the logical (state_dict) and physical (parameter) layouts
    def _glu_keys(self, prefix):
        keys = [prefix + "fc1.weight", prefix + "fc1.bias"]
        keys += [f"{prefix}fc1.weight{g}" for g in range(self.num_experts)]
        keys += [f"{prefix}fc1.bias{g}" for g in range(self.num_experts)]
        return keys

    def _convert(self, state_dict, prefix, fn):
        k = self.glu_interleave_size
        for key in self._glu_keys(prefix):
            if key in state_dict:
                t = state_dict[key]
                is_bias = ".bias" in key[len(prefix):]
                state_dict[key] = fn(t.unsqueeze(-1), k).squeeze(-1) if is_bias else fn(t, k)

    def _logical_state_dict(self, module, state_dict, prefix, local_metadata):
        self._convert(state_dict, prefix, deinterleave_glu)
        return state_dict

    def _physical_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._convert(state_dict, prefix, interleave_glu)

    # ---- compute
    def forward(self, x: torch.Tensor, split_sizes: torch.Tensor, probs: torch.Tensor | None = None,
                quantized_input=None, *, input_amax: torch.Tensor | None = None,
                grad_output_amax=None, unpermute=None) -> torch.Tensor:
        """quantized_input: optional QuantizedTensor of x's rows quantized before an expert-parallel
        dispatch; FC1 multiplies it as it is (see `GroupedLinear.forward`).

        input_amax: x's per-expert amax [E] fp32 from the kernel that wrote x (FC1's input_amax);
        grad_output_amax: the `AmaxSlot` the output gradient's producer fills (FC2's). FC2's
        backward hands FC1 the amax of FC1's output gradient itself (the activation backward
        reduces it). All for the current-scaling quantizers, which then only cast.

        unpermute: the `RowIdMap` of the permute that made x: the output is then each token's rows
        summed, [T, H] (`qmoe.ops.moe_unpermute` without merging probs, run inside FC2 under a
        recipe so its backward reads the output gradient's rows from the tokens' gradient)."""
        if probs is not None and (probs.shape != (x.shape[0],) or not probs.is_floating_point()):
            raise ValueError(f"probs must be a float tensor [R] = [{x.shape[0]}], got {tuple(probs.shape)}")
        # FC1's output gradient comes from FC2's backward (its fused activation's backward)
        inner = AmaxSlot() if self.takes_amax("hidden_grad", x) else None
        h = self.fc1(x, split_sizes, quantized_input=quantized_input, input_amax=input_amax,
                     grad_output_amax=inner)
        scales = None
        if self.fc2.scale_bias:
            scales = probs.to(h.dtype) if probs is not None else torch.ones(x.shape[0], dtype=h.dtype, device=x.device)
        # the activation runs inside FC2: fused into the quantization of FC2's input under a recipe
        return self.fc2(h, split_sizes, scales, input_activation=(self.activation, probs, self.glu_interleave_size),
                        recompute_activation=self.recompute_activation, grad_output_amax=grad_output_amax,
                        grad_input_amax=inner, unpermute=unpermute)

    def takes_amax(self, operand: str, x: torch.Tensor) -> bool:
        """Whether a forward on x [R, H] would use a producer's per-group amax of `operand`: "input"
        (x: FC1's input), "grad_output" (the output's gradient: FC2's grad_output) or
        "hidden_grad" (FC1's output gradient, reduced by FC2's activation backward; not while
        torch.compile traces, where the hand-over between the backwards is not kept)."""
        if operand == "input":
            return self.fc1.takes_amax("input", x)
        if operand == "grad_output":
            return self.fc2.takes_amax("grad_output", x) and not torch.compiler.is_compiling()
        if operand == "hidden_grad":
            return self.fc1.takes_amax("grad_output", x) and not torch.compiler.is_compiling()
        raise ValueError(f"operand must be 'input', 'grad_output' or 'hidden_grad', got {operand!r}")

    def backward_dw(self) -> None:
        self.fc1.backward_dw()
        self.fc2.backward_dw()
