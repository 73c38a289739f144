"""`qmoe.nn.MLP`: a dense FC1 -> activation -> FC2 whose GEMMs follow the active recipe.

MoELayer's shared experts (DeepSeek-V3, Qwen2-MoE, Kimi-K2, GLM) are one such MLP run on every
token. Dimension legend: T tokens, H hidden, F ffn.
"""
from __future__ import annotations

import torch
from torch import nn

from qmoe import ops
from qmoe.nn.linear import Linear
from qmoe.contracts.carriers import is_glu
from qmoe.contracts.validate import check_activation


class MLP(nn.Module):
    """fc2(act(fc1(x))): x [..., H] -> [..., H], quantized under `qmoe.autocast` like `qmoe.nn.Linear`.

    `fc1.weight [2F, H]` for GLU activations (gate rows first, then linear rows: the experts'
    layout), `[F, H]` otherwise; `fc2.weight [H, F]`.

    cache_quantized_weights: FC1's and FC2's (`qmoe.nn.Linear`); setting the attribute sets both.

    >>> mlp = MLP(256, 512, activation="swiglu")
    >>> y = mlp(torch.randn(4, 64, 256))
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", bias: bool = False,
                 params_dtype=None, device=None, cache_quantized_weights: bool = False):
        super().__init__()
        self.activation = check_activation(activation)
        kw = dict(bias=bias, params_dtype=params_dtype, device=device, cache_quantized_weights=cache_quantized_weights)
        self.fc1 = Linear(hidden_size, (2 if is_glu(activation) else 1) * ffn_hidden_size, **kw)
        self.fc2 = Linear(ffn_hidden_size, hidden_size, **kw)

    @property
    def cache_quantized_weights(self) -> bool:
        return self.fc1.cache_quantized_weights

    @cache_quantized_weights.setter
    def cache_quantized_weights(self, value: bool) -> None:
        for fc in (self.fc1, self.fc2):
            fc.cache_quantized_weights = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        a = ops.expert_activation(h.reshape(-1, h.shape[-1]), None, self.activation)
        return self.fc2(a).reshape(*x.shape[:-1], -1)
