"""The recipes the layer tests run, as pytest parameters shared by the nn test modules."""
import pytest

from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)

QUANTIZED = [
    pytest.param(DelayedScaling(), id="delayed"),
    pytest.param(Float8CurrentScaling(), id="current"),
    pytest.param(Float8BlockScaling(), id="block"),
    pytest.param(MXFP8BlockScaling(), id="mxfp8"),
    pytest.param(NVFP4BlockScaling(), id="nvfp4"),
]
# recipes whose quantization draws no random numbers: grouped and split paths must agree bit for bit
DETERMINISTIC = [
    pytest.param(None, id="fp32"),
    pytest.param(DelayedScaling(), id="delayed"),
    pytest.param(Float8CurrentScaling(), id="current"),
    pytest.param(Float8BlockScaling(), id="block"),
    pytest.param(MXFP8BlockScaling(), id="mxfp8"),
    pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), id="nvfp4-rne"),
]
