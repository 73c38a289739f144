"""`qmoe.nn.GroupedLinear`: E experts' linear layers applied to their own groups of rows."""
from __future__ import annotations

import math
import re

import torch
from torch import nn

from qmoe.autocast import (RecipeState, autocast_state, load_recipe_state, recipe_state_pre_hook,
                           refuse_foreign_recompute)
from qmoe.ops.amp import cast_for_autocast, torch_autocast_off
from qmoe.contracts.enums import GroupedPath
from qmoe.ops.grouped_gemm import select_grouped_path
from qmoe.ops.grouped_linear import grouped_linear
from qmoe.ops.permute import gathered_rows, moe_unpermute
from qmoe.quant.weight_cache import WeightCache
from qmoe.contracts.carriers import GatheredRows, is_glu
from qmoe.contracts.validate import (PARAMS_DTYPES, check_activation, check_device, check_flag, check_layer_input,
                                     check_params_dtype, check_size, check_split_sizes)

_PER_EXPERT = re.compile(r"^(weight|bias)(\d+)$")
_AMAX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what producers reduce amaxes of


class GroupedLinear(nn.Module):
    """y[rows of expert g] = x_g @ W_g^T (+ b_g, scaled per row with scale_bias).

    forward(x [R, in_features], split_sizes [E] int tensor on x's device, scales [R] or None)
    -> [R, out_features]. Rows past sum(split_sizes) join the last group (moe_permute's tail).

    Parameters are single grouped (`weight [E, N, K]`, `bias [E, N]`) or per expert (`weight0..`,
    `bias0..`); `load_state_dict` accepts either form for either layout. Inside
    `qmoe.autocast(recipe=...)` input, weights and grad_output are quantized per the recipe's roles.
    Under `torch.autocast` x is cast to its dtype and the output comes out in it; the weights are
    quantized from their own dtype (a recipe) or cast to it (no recipe, as `nn.Linear` is).

    grouped_path: "auto" (grouped where supported), "grouped" (raises where unsupported) or
    "split" (host split sizes, each expert on its own: the cross-check).
    scale_bias: the bias is multiplied by scales[row] (e.g. the routing prob); gradients flow to
    bias and scales.
    delay_wgrad_compute: backward computes only dgrad; call backward_dw() later for the weight
    gradients (pipeline schedules overlap it with other work).
    cache_quantized_weights: keep the quantized weights (and, for the emulated MXFP8 / NVFP4 GEMMs'
    dequantize-first route, their bf16 values) in `weight_cache` from one forward to the next
    while the weights, the recipe and its scales are unchanged (`qmoe.quant.weight_cache`): the
    micro-batches of one optimizer step and checkpoint recomputes quantize them once. Same
    outputs and gradients bit for bit; the quantized copies stay held between steps. Changes the
    version counter does not see (writes through `.data`, a flat buffer the weights view, a
    replayed optimizer step, FSDP2 / ZeRO-3 refilling sharded weights) need `weight_cache.clear()`
    (`qmoe.quant.clear_weight_caches(model)`) after them. Under CUDA graphs the weights are kept
    only with `qmoe.graph.capture(..., keep_weights=True)` (or `qmoe.quant.capture_weights`).
    Grouped path only.
    recompute_weight_columnwise: keep no quantized columnwise weight copy between forward and
    backward: the backward quantizes it again from the weight (kept for free: it is the
    parameter; per-expert weights are stacked into a copy) with the forward's scales. Same
    gradients bit for bit; one weight copy less held, one more weight quantization per step.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 single_grouped_weight: bool = True, single_grouped_bias: bool = True, scale_bias: bool = False,
                 delay_wgrad_compute: bool = False, grouped_path: str = "auto", params_dtype=None, device=None,
                 cache_quantized_weights: bool = False, recompute_weight_columnwise: bool = False):
        super().__init__()
        for name, v in (("num_groups", num_groups), ("in_features", in_features), ("out_features", out_features)):
            check_size(name, v, "GroupedLinear")
        for name, v in (("bias", bias), ("single_grouped_weight", single_grouped_weight),
                        ("single_grouped_bias", single_grouped_bias), ("scale_bias", scale_bias),
                        ("delay_wgrad_compute", delay_wgrad_compute),
                        ("recompute_weight_columnwise", recompute_weight_columnwise)):
            check_flag(name, v, "GroupedLinear")
        check_params_dtype(params_dtype, "GroupedLinear")
        device = check_device(device)
        if scale_bias and not bias:
            raise ValueError("scale_bias=True needs bias=True")
        select_grouped_path(grouped_path, "cpu")  # validates the name
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.single_grouped_weight, self.single_grouped_bias = single_grouped_weight, single_grouped_bias
        self.use_bias, self.scale_bias = bias, scale_bias
        self.delay_wgrad_compute, self.grouped_path = delay_wgrad_compute, grouped_path
        kw = dict(dtype=params_dtype, device=device)
        e, n, k = num_groups, out_features, in_features
        if single_grouped_weight:
            self.weight = nn.Parameter(torch.empty(e, n, k, **kw))
        else:
            for g in range(e):
                self.register_parameter(f"weight{g}", nn.Parameter(torch.empty(n, k, **kw)))
        if bias:
            if single_grouped_bias:
                self.bias = nn.Parameter(torch.empty(e, n, **kw))
            else:
                for g in range(e):
                    self.register_parameter(f"bias{g}", nn.Parameter(torch.empty(n, **kw)))
        else:
            self.bias = None
        self.reset_parameters()
        self.recipe_state = RecipeState()
        self._register_load_state_dict_pre_hook(recipe_state_pre_hook, with_module=True)
        self.weight_cache = WeightCache()
        self.cache_quantized_weights = cache_quantized_weights
        self.recompute_weight_columnwise = recompute_weight_columnwise
        self._wgrad_queue: list = []
        self._register_load_state_dict_pre_hook(self._convert_state_dict_layout)

    @property
    def cache_quantized_weights(self) -> bool:
        return self._cache_quantized_weights

    @cache_quantized_weights.setter
    def cache_quantized_weights(self, value: bool) -> None:
        check_flag("cache_quantized_weights", value, "GroupedLinear")
        self._cache_quantized_weights = value
        if not value:
            self.weight_cache.clear()

    def _apply(self, fn, *args, **kwargs):
        self.weight_cache.clear()  # .to() / .cuda() / .half(): the kept copies belong to the old weights
        return super()._apply(fn, *args, **kwargs)

    def __setstate__(self, state):
        # layers pickled before these options existed load with them off
        state.setdefault("weight_cache", WeightCache())
        state.setdefault("_cache_quantized_weights", False)
        state.setdefault("recompute_weight_columnwise", False)
        super().__setstate__(state)

    # ---- recipe state in state_dict(): delayed-scaling amax histories and scales, per recipe
    def get_extra_state(self) -> dict:
        return self.recipe_state.state_dict()

    def set_extra_state(self, state) -> None:
        load_recipe_state(self.recipe_state, state)

    # ---- parameters
    def weights(self) -> list[nn.Parameter]:
        return [self.weight] if self.single_grouped_weight else \
            [getattr(self, f"weight{g}") for g in range(self.num_groups)]

    def biases(self) -> list[nn.Parameter]:
        if not self.use_bias:
            return []
        return [self.bias] if self.single_grouped_bias else \
            [getattr(self, f"bias{g}") for g in range(self.num_groups)]

    def stacked_weight(self) -> torch.Tensor:
        return self.weight if self.single_grouped_weight else torch.stack(self.weights())

    def stacked_bias(self) -> torch.Tensor | None:
        if not self.use_bias:
            return None
        return self.bias if self.single_grouped_bias else torch.stack(self.biases())

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.in_features)
        for w in self.weights():
            nn.init.uniform_(w, -bound, bound)
        for b in self.biases():
            nn.init.uniform_(b, -bound, bound)

    def _convert_state_dict_layout(self, state_dict, prefix, *args, **kwargs):
        """Accept single-grouped and per-expert keys for either layout (both directions)."""
        for name, single in (("weight", self.single_grouped_weight), ("bias", self.single_grouped_bias)):
            if name == "bias" and not self.use_bias:
                continue
            grouped_key = prefix + name
            per = {}
            for key in list(state_dict):
                if key.startswith(prefix):
                    m = _PER_EXPERT.match(key[len(prefix):])
                    if m and m.group(1) == name:
                        if m.group(2) != str(int(m.group(2))):  # weight00 would silently replace weight0
                            raise ValueError(f"state_dict key {key!r} is not a per-expert key: expected "
                                             f"{prefix}{name}0 .. {prefix}{name}{self.num_groups - 1}")
                        per[int(m.group(2))] = key
            has_grouped = grouped_key in state_dict
            if has_grouped and per:
                raise ValueError(f"state_dict holds both {grouped_key!r} and per-expert {name}0..: ambiguous; "
                                 f"keep one form")
            if per and sorted(per) != list(range(self.num_groups)):
                missing = sorted(set(range(self.num_groups)) - set(per))
                extra = sorted(set(per) - set(range(self.num_groups)))
                raise ValueError(f"state_dict's per-expert {name}s are incomplete for {self.num_groups} experts "
                                 f"(missing {prefix}{name}{missing[:4]}..., extra {extra})")
            if single and per:
                want = (self.out_features, self.in_features) if name == "weight" else (self.out_features,)
                for g in range(self.num_groups):
                    t = state_dict[per[g]]
                    if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                        raise ValueError(f"state_dict[{per[g]!r}] must have shape {list(want)}, got "
                                         f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
                state_dict[grouped_key] = torch.stack([state_dict.pop(per[g]) for g in range(self.num_groups)])
            elif not single and has_grouped:
                stacked = state_dict.pop(grouped_key)
                if stacked.shape[0] != self.num_groups:
                    raise ValueError(f"{grouped_key} has {stacked.shape[0]} experts, this layer {self.num_groups}")
                for g in range(self.num_groups):
                    state_dict[f"{prefix}{name}{g}"] = stacked[g].clone()

    # ---- compute
    def takes_amax(self, role: str, x: torch.Tensor) -> bool:
        """Whether a forward on x here would use a producer's per-group amax for `role`: "input"
        (forward's input_amax) or "grad_output" (grad_output_amax): under a recipe whose quantizer
        of that role takes one (`Quantizer.takes_amax`), on the grouped path, for bf16 / fp16 /
        fp32 x. A producer asks first, so it reduces the amax only when it will be used."""
        state = autocast_state()
        recipe = state.active_recipe
        if recipe is None or x.dtype not in _AMAX_DTYPES:
            return False
        if select_grouped_path(self.grouped_path, x.device) is not GroupedPath.GROUPED:
            return False
        return self.recipe_state.get(recipe, state.amax_reduction_group)[role].takes_amax

    def forward(self, x: torch.Tensor, split_sizes: torch.Tensor, scales: torch.Tensor | None = None,
                quantized_input=None, *, input_activation: tuple | None = None, recompute_activation: bool = False,
                input_amax: torch.Tensor | None = None, grad_output_amax=None, grad_input_amax=None, unpermute=None):
        """quantized_input: optional QuantizedTensor, x's rows already quantized rowwise by the recipe's
        input format (expert-parallel quantized dispatch); the forward GEMM uses it as it is and x
        (its dequantized values) takes the gradient and gives wgrad's columnwise copy.

        input_activation: optional (activation, probs [R] or None, glu_interleave_size): x is the
        previous layer's output h and this layer's input is act(h) * probs
        (`qmoe.ops.expert_activation`), fused into the input's quantization on the grouped path
        under a recipe (GroupedMLP's FC2 uses it).

        recompute_activation: with input_activation, the backward rebuilds the weight gradient's
        input operand from h and probs instead of keeping it (`qmoe.ops.grouped_linear`).

        input_amax ([E] fp32), grad_output_amax and grad_input_amax (`AmaxSlot`s): amaxes the
        kernels producing x and dy reduce, and this layer's backward reduces for dx, so the
        current-scaling quantizers only cast (`qmoe.ops.grouped_linear`; ask `takes_amax`).

        x may be the `GatheredRows` of `qmoe.ops.moe_permute(..., gather=True)` (the permuted rows,
        read from the tokens by the input's quantize kernels; `qmoe.ops.grouped_linear`).

        unpermute: the `RowIdMap` of the permute that made x's rows: the output is their
        `moe_unpermute` (no merging probs), [T, out_features], summed inside the op under a recipe
        so the backward reads the output gradient's rows from the tokens' gradient
        (`qmoe.ops.grouped_linear`)."""
        self._check_inputs(x, split_sizes, scales, input_activation)
        gather = None
        if isinstance(x, GatheredRows):
            gather, x = x, x.source
        refuse_foreign_recompute("qmoe.nn.GroupedLinear")
        state = autocast_state()
        recipe = state.active_recipe
        quantizers = self.recipe_state.get(recipe, state.amax_reduction_group) if recipe is not None else None
        path = select_grouped_path(self.grouped_path, x.device)
        sink = self._wgrad_queue if self.delay_wgrad_compute and torch.is_grad_enabled() else None
        weight = self.stacked_weight()
        if sink is not None:
            # deferred weight gradients arrive in backward_dw(): a stand-in leaf keeps autograd from
            # running the weights' post-accumulate-grad hooks (with no gradient) during backward
            weight = weight.detach().requires_grad_(weight.requires_grad)
        cast = cast_for_autocast(x)  # torch.autocast's dtype in and out; the recipe owns the GEMMs
        if cast is not x:  # values the producer's amax was not taken on
            input_amax = None
        x = cast
        if gather is not None:  # the same rows of the (cast) tokens
            x = gather._replace(source=x)
            if x.dtype == torch.float64:
                x = gathered_rows(x)
        bias = self.stacked_bias()
        amaxes = dict(input_amax=input_amax, grad_output_amax=grad_output_amax, grad_input_amax=grad_input_amax,
                      unpermute=unpermute)
        keep = dict(recompute_weight_columnwise=self.recompute_weight_columnwise,
                    weight_cache=self.weight_cache.bind(self.weights())
                    if self.cache_quantized_weights and quantizers is not None and not torch.compiler.is_compiling()
                    else None)
        if x.dtype == torch.float64:
            if quantizers is None:
                path = "split"  # plain fp64 matmuls per group; the grouped GEMMs stop at fp32
            else:  # quantizers read at most fp32, and every recipe's format is far coarser than that
                with torch_autocast_off():
                    y = grouped_linear(x.float(), split_sizes, weight.float(), None if bias is None else bias.float(),
                                       scales if self.scale_bias else None, quantizers, path, sink,
                                       quantized_input, input_activation, recompute_activation, **keep).double()
                return y if unpermute is None else moe_unpermute(y, unpermute)  # summed in fp64
        with torch_autocast_off():
            return grouped_linear(x, split_sizes, weight, bias, scales if self.scale_bias else None, quantizers,
                                  path, sink, quantized_input, input_activation, recompute_activation, **amaxes, **keep)

    def _check_inputs(self, x, split_sizes, scales, input_activation=None):
        rows = x.shape[0]  # a GatheredRows' count of permuted rows, not of its tokens
        if isinstance(x, GatheredRows):
            if input_activation is not None:
                raise ValueError("a GatheredRows input is FC1's (permuted tokens); input_activation is FC2's")
            x = x.source
        width = self.in_features
        if input_activation is not None:
            if not isinstance(input_activation, tuple) or len(input_activation) != 3:
                raise TypeError("input_activation must be (activation, probs or None, glu_interleave_size or None)")
            width *= 2 if is_glu(check_activation(input_activation[0])) else 1
        if not isinstance(x, torch.Tensor) or x.dtype not in PARAMS_DTYPES:
            check_layer_input("GroupedLinear", x, width, f"[R, {width}]",
                              float64=self.weights()[0].dtype == torch.float64)
        if x.dim() != 2 or x.shape[1] != width:
            what = f" (the {input_activation[0]} activation's input)" if input_activation is not None else ""
            raise ValueError(f"GroupedLinear expects x [R, {width}]{what}, got {tuple(x.shape)}")
        # values are checked by the op where they can be read without a host sync
        check_split_sizes(split_sizes, device=x.device, num_groups=self.num_groups, read="never", on_device=True)
        if self.scale_bias:
            if scales is None:
                raise ValueError("scale_bias=True needs scales [R]")
            if scales.shape != (rows,) or not scales.is_floating_point():
                raise ValueError(f"scales must be a float tensor [R] = [{rows}], got "
                                 f"{tuple(scales.shape)} {scales.dtype}")
        elif scales is not None:
            raise ValueError("scales are only used with scale_bias=True")

    def backward_dw(self) -> None:
        """Run the deferred weight-gradient GEMMs and accumulate into the weights' .grad.

        Runs the parameters' post-accumulate-grad hooks, as a normal backward would.
        """
        queue, self._wgrad_queue = self._wgrad_queue, []
        for fn in queue:
            dw = fn()
            params = self.weights()
            # per-expert grads are clones: in-place accumulation into unbind() views is refused
            grads = [dw] if self.single_grouped_weight else [d.clone() for d in dw.unbind(0)]
            for p, g in zip(params, grads):
                g = g.to(p.dtype)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
                hooks = getattr(p, "_post_accumulate_grad_hooks", None)
                for hook in hooks.values() if hooks else ():
                    hook(p)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, grouped_path={self.grouped_path!r}")
