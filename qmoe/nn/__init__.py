"""Modules users hold: dense and grouped layers, the router and the MoE layer."""
from qmoe.nn.linear import Linear

__all__ = ["Linear"]
