"""The grouped linear backward frees each quantized operand once its GEMM has read it.

The backward runs dgrad, then wgrad. The peak of a layer's backward is at the wgrad, so the
weight's columnwise copy (dgrad's only) and the gradient's rowwise copy must be gone by then;
the columnwise copies wgrad reads must still be there. Checked with weak references to the
quantized tensors, seen by the test-only step observer (no reference kept from the test).
"""
import weakref

import pytest
import torch

import qmoe
from qmoe.ops.grouped_linear import observe_steps
from tests.nn.recipe_cases import QUANTIZED

E, K, N = 4, 64, 96
SPLITS = [48, 0, 80, 32]


@pytest.mark.parametrize("recompute_weight", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("recipe", QUANTIZED)
def test_dgrad_operands_freed_before_wgrad(recipe, recompute_weight):
    torch.manual_seed(0)
    layer = qmoe.nn.GroupedLinear(E, K, N, recompute_weight_columnwise=recompute_weight)
    x = torch.randn(sum(SPLITS), K, requires_grad=True)
    split_sizes = torch.tensor(SPLITS)
    refs, alive_at_wgrad = {}, {}

    def watch(plan, step, inputs, out):
        if step in ("quantize_weight", "quantize_grad") and out is not None:
            for copy in ("rowwise_data", "columnwise_data"):
                t = getattr(out, copy, None)
                if isinstance(t, torch.Tensor):
                    refs[(step, copy)] = weakref.ref(t)
        if step == "wgrad":
            alive_at_wgrad.update({key: ref() is not None for key, ref in refs.items()})

    with observe_steps(watch), qmoe.autocast(recipe=recipe):
        y = layer(x, split_sizes)
        y.backward(torch.randn_like(y))
    assert alive_at_wgrad, "no wgrad step observed"
    assert not alive_at_wgrad[("quantize_grad", "rowwise_data")]  # dgrad's gradient copy
    assert alive_at_wgrad[("quantize_grad", "columnwise_data")]  # wgrad's
    assert not alive_at_wgrad[("quantize_weight", "columnwise_data")]  # dgrad's weight copy
    assert layer.weights()[0].grad is not None and x.grad is not None
