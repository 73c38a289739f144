"""qmoe.ops.grouped_linear with only some inputs taking a gradient: each backward step runs only
for what is asked (the layer-level tests are in tests/nn/test_grouped_linear.py)."""
import pytest
import torch

from qmoe.ops.grouped_linear import grouped_linear
from qmoe.recipes import Float8CurrentScaling, MXFP8BlockScaling

E, K, N = 4, 64, 48
SPLITS = [32, 0, 16, 16]


def _quantizers(recipe):
    return None if recipe is None else {r: recipe.quantizer(r) for r in ("input", "weight", "grad_output")}


@pytest.mark.parametrize("path", ["grouped", "split"])
@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(), MXFP8BlockScaling()],
                         ids=["fp32", "current", "mxfp8"])
def test_only_the_bias_takes_a_gradient(recipe, path):
    """x and W frozen: no dgrad or wgrad runs (nothing to quantize dy for); dbias is dy's sum per group."""
    torch.manual_seed(0)
    x, w = torch.randn(sum(SPLITS), K), torch.randn(E, N, K)
    b = torch.randn(E, N, requires_grad=True)
    dy = torch.randn(sum(SPLITS), N)
    y = grouped_linear(x, torch.tensor(SPLITS), w, b, quantizers=_quantizers(recipe), path=path)
    y.backward(dy)
    want = torch.stack([part.sum(0) for part in dy.split(SPLITS)])
    torch.testing.assert_close(b.grad, want, rtol=1e-5, atol=1e-5)
