"""`qmoe.nn.Linear`: a dense layer whose GEMMs follow the active `qmoe.autocast` recipe."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qmoe.autocast import (RecipeState, autocast_state, load_recipe_state, recipe_state_pre_hook,
                           refuse_foreign_recompute)
from qmoe.ops.amp import cast_for_autocast, torch_autocast_off
from qmoe.ops.linear import quantized_linear
from qmoe.quant.weight_cache import WeightCache
from qmoe.contracts.validate import check_device, check_flag, check_params_dtype, check_size


class Linear(nn.Module):
    """y = x W^T + b; inside `qmoe.autocast(recipe=...)` input, weight and grad_output are quantized.

    x: [..., in_features]; returns [..., out_features]. Outside autocast (or with
    enabled=False) it is a plain high-precision linear layer. Under `torch.autocast` the
    quantized GEMM follows the recipe (the weight is quantized from its own dtype) and the
    output comes out in torch.autocast's dtype; without a recipe it is `nn.Linear` under autocast.

    cache_quantized_weights: keep the quantized weight in `weight_cache` while it, the recipe and
    its scales are unchanged, as `qmoe.nn.GroupedLinear` does (same bits; see there).

    >>> layer = qmoe.nn.Linear(256, 128)
    >>> with qmoe.autocast(recipe=Float8CurrentScaling()):
    ...     y = layer(torch.randn(32, 256))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, params_dtype=None, device=None,
                 cache_quantized_weights: bool = False):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            check_size(name, v, "Linear")
        check_flag("bias", bias, "Linear")
        check_params_dtype(params_dtype, "Linear")
        device = check_device(device)
        self.in_features, self.out_features = in_features, out_features
        kw = dict(dtype=params_dtype, device=device)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.reset_parameters()
        self.recipe_state = RecipeState()
        self._register_load_state_dict_pre_hook(recipe_state_pre_hook, with_module=True)
        self.weight_cache = WeightCache()
        self.cache_quantized_weights = cache_quantized_weights

    @property
    def cache_quantized_weights(self) -> bool:
        return self._cache_quantized_weights

    @cache_quantized_weights.setter
    def cache_quantized_weights(self, value: bool) -> None:
        check_flag("cache_quantized_weights", value, "Linear")
        self._cache_quantized_weights = value
        if not value:
            self.weight_cache.clear()

    def _apply(self, fn, *args, **kwargs):
        self.weight_cache.clear()  # .to() / .cuda() / .half(): the kept copy belongs to the old weight
        return super()._apply(fn, *args, **kwargs)

    def __setstate__(self, state):
        # layers pickled before the option existed load with it off
        state.setdefault("weight_cache", WeightCache())
        state.setdefault("_cache_quantized_weights", False)
        super().__setstate__(state)

    # ---- recipe state in state_dict(): delayed-scaling amax histories and scales, per recipe
    def get_extra_state(self) -> dict:
        return self.recipe_state.state_dict()

    def set_extra_state(self, state) -> None:
        load_recipe_state(self.recipe_state, state)

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"Linear expects a floating-point tensor, got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"Linear expects input [..., {self.in_features}], got shape {tuple(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(f"input is on {x.device} but the layer's weight is on {self.weight.device}")
        refuse_foreign_recompute("qmoe.nn.Linear")
        state = autocast_state()
        recipe = state.active_recipe
        if recipe is None:
            return F.linear(x, self.weight, self.bias)  # torch.autocast treats it as it treats nn.Linear
        quantizers = self.recipe_state.get(recipe, state.amax_reduction_group)
        x = cast_for_autocast(x)  # the recipe owns the GEMM; the output takes torch.autocast's dtype
        cache = (self.weight_cache.bind([self.weight])
                 if self.cache_quantized_weights and not torch.compiler.is_compiling() else None)
        with torch_autocast_off():
            if x.dtype == torch.float64:  # quantizers read at most fp32; the recipe's format is far coarser
                bias = None if self.bias is None else self.bias.float()
                return quantized_linear(x.float(), self.weight.float(), bias, quantizers, cache).double()
            return quantized_linear(x, self.weight, self.bias, quantizers, cache)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
