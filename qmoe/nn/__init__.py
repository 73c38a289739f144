"""Modules users hold: dense and grouped layers, the router and the MoE layer."""
from qmoe.nn.linear import Linear

__all__ = ["Linear"]
from qmoe.nn.grouped_linear import GroupedLinear  # noqa: E402
from qmoe.nn.grouped_mlp import GroupedMLP  # noqa: E402
from qmoe.nn.moe import MoELayer  # noqa: E402
from qmoe.nn.router import TopKRouter  # noqa: E402

__all__ += ["GroupedLinear", "GroupedMLP", "MoELayer", "TopKRouter"]
