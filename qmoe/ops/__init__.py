"""Functional ops and autograd Functions; each picks the Triton kernel or the reference."""
from qmoe.ops.linear import quantized_linear
