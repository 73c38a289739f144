"""Keep qmoe's CUDA modules out of torch.compile's graphs until compiled runs are proven correct.

Measured on an H200 (torch 2.11, triton 3.6; benchmarks/results/gpu_tests.txt): compiling
`MoELayer` with the default Inductor backend gave outputs 33% off eager in norm for every recipe
(or failed to lower), and backend="aot_eager" gave wrong fp32 input gradients, while the same
code compiles correctly on CPU. Until that is fixed, a qmoe module called inside a compiled
region on a CUDA tensor runs eagerly (a graph break around it), so a compiled model that contains
qmoe layers stays correct; on the CPU the module is traced as usual (one graph, no breaks).
"""
from __future__ import annotations

import functools

import torch


def eager_on_cuda_under_compile(forward):
    """Decorate an nn.Module.forward whose first tensor argument decides the device."""
    eager = torch.compiler.disable(forward)

    @functools.wraps(forward)
    def wrapper(self, x, *args, **kwargs):
        if isinstance(x, torch.Tensor) and x.is_cuda and torch.compiler.is_compiling():
            return eager(self, x, *args, **kwargs)
        return forward(self, x, *args, **kwargs)
    return wrapper
