"""qmoe: quantization-recipe-driven Mixture-of-Experts for PyTorch, with Triton kernels.

    import qmoe
    from qmoe.recipes import MXFP8BlockScaling
    with qmoe.autocast(recipe=MXFP8BlockScaling()):
        y = layer(x)
"""
from qmoe.autocast import autocast, autocast_state
from qmoe.checkpoint import checkpoint
from qmoe.capabilities import capabilities
from qmoe.contracts.errors import UnsupportedError
from qmoe.quant import GroupedTensor, QuantizedTensor
from qmoe import graph, nn, ops, parallel, recipes  # noqa: E402  (public subpackages)

__version__ = "0.1.0"

__all__ = ["autocast", "autocast_state", "checkpoint", "capabilities", "UnsupportedError", "GroupedTensor",
           "QuantizedTensor", "__version__"]
