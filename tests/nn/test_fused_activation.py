"""The expert activation fused into FC2's input quantization == the activation run first, bit for bit.

`GroupedLinear(..., input_activation=(activation, probs, k))` takes FC1's output h and quantizes
act(h) * probs straight from h (on the GPU the quantize kernels apply the activation as they
load: kernels.activation.load_rows; on the CPU the reference computes the rows first). On the
GPU, against the same layer fed `expert_activation(h, probs, ...)`: the output and the gradients
of h, probs, weight, bias and bias scales are equal bit for bit (the bias kernel's dbias has no
atomics: the same dy gives the same bits). On the CPU both of those would run the same reference
code, so the other arm is the activation written with torch's functions and autograd: the output
and the layer's gradients are equal bit for bit, the hand-written dh and dprobs within an ulp.
Under every recipe and without one (then nothing is fused and the activation runs first).
GroupedMLP goes through this path.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.functional import relu, silu
from hypothesis import given, settings
from hypothesis import strategies as st

import qmoe
from qmoe.recipes import recipe_from_config

RECIPES = [None, "delayed", "current", "block", "mxfp8", "nvfp4"]
# (activation, glu_interleave_size, h's dtype)
ACTIVATIONS = [("swiglu", None, torch.bfloat16), ("swiglu", 32, torch.bfloat16),
               ("clamped_qgeglu", None, torch.float32),
               ("gelu", None, torch.bfloat16), ("relu2", None, torch.float32)]
E, F, N = 4, 256, 128


def _recipe(name):
    if name is None:
        return None
    config = {"name": name}
    if name == "nvfp4":
        config["disable_stochastic_rounding"] = True
    return recipe_from_config(config)


def _run(fc2, h, probs, splits, recipe, activation, k, fused, dy):
    h, probs = h.detach().clone().requires_grad_(True), probs.detach().clone().requires_grad_(True)
    fc2.zero_grad(set_to_none=True)
    scales = probs.to(h.dtype)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        if fused:
            y = fc2(h, splits, scales, input_activation=(activation, probs, k))
        else:
            y = fc2(qmoe.ops.expert_activation(h, probs, activation, k), splits, scales)
    y.backward(dy)
    return {"y": y.detach(), "dh": h.grad, "dprobs": probs.grad, **{n: p.grad for n, p in fc2.named_parameters()}}


def _plain_activation(h, probs, activation, k):
    """act(h) * probs in fp32 with torch's own functions and autograd, cast to h's dtype: the
    activation written a second time, apart from qmoe's activation op and its hand-written backward."""
    hf = h.float()
    if activation == "relu2":
        return (relu(hf).square() * probs[:, None]).to(h.dtype)
    rows, two_f = hf.shape
    if k:  # k-column blocks alternate gate, linear
        blocks = hf.reshape(rows, two_f // (2 * k), 2, k)
        gate, linear = blocks[:, :, 0].reshape(rows, -1), blocks[:, :, 1].reshape(rows, -1)
    else:
        gate, linear = hf[:, : two_f // 2], hf[:, two_f // 2:]
    assert activation == "swiglu", activation
    return (silu(gate) * linear * probs[:, None]).to(h.dtype)


def _run_plain(fc2, h, probs, splits, recipe, activation, k, dy):
    h, probs = h.detach().clone().requires_grad_(True), probs.detach().clone().requires_grad_(True)
    fc2.zero_grad(set_to_none=True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = fc2(_plain_activation(h, probs, activation, k), splits, probs.to(h.dtype))
    y.backward(dy)
    return {"y": y.detach(), "dh": h.grad, "dprobs": probs.grad, **{n: p.grad for n, p in fc2.named_parameters()}}


def _check(device, recipe_name, activation, k, dtype, sizes=(128, 0, 256, 128), path="grouped"):
    torch.manual_seed(0)
    glu = activation in ("swiglu", "geglu", "clamped_qgeglu")
    splits = torch.tensor(sizes, device=device)
    rows = int(splits.sum())
    fc2 = qmoe.nn.GroupedLinear(len(sizes), F, N, scale_bias=True, grouped_path=path, params_dtype=dtype,
                                device=device)
    gen = torch.Generator().manual_seed(1)
    h = (torch.randn(rows, (2 if glu else 1) * F, generator=gen) * 3).to(device, dtype)
    probs = torch.rand(rows, generator=gen).to(device)
    dy = torch.randn(rows, N, generator=gen).to(device, dtype)
    recipe = _recipe(recipe_name)
    twin = copy.deepcopy(fc2)  # before any step: delayed scaling's state changes with each
    got = _run(fc2, h, probs, splits, recipe, activation, k, True, dy)
    if device == "cpu":  # the fused path computes the rows with the same reference code: check
        # it against the activation written apart (tests/nn/test_fused_activation.py's docstring)
        want = _run_plain(twin, h, probs, splits, recipe, activation, k, dy)
        _assert_activation_grads_close(got.pop("dh"), want.pop("dh"), got.pop("dprobs"), want.pop("dprobs"))
    else:
        want = _run(twin, h, probs, splits, recipe, activation, k, False, dy)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] is not None, name
        assert torch.equal(got[name], want[name]), name


def _assert_activation_grads_close(dh, dh_want, dprobs, dprobs_want):
    """The hand-written backward against autograd's: one output ulp for dh (2^-7 in bf16, fp32
    terms in another order), fp32 summation order for dprobs."""
    ulp = {torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}[dh.dtype]
    torch.testing.assert_close(dh.float(), dh_want.float(), rtol=ulp, atol=1e-6 * float(dh_want.abs().max()))
    torch.testing.assert_close(dprobs, dprobs_want, rtol=1e-5, atol=1e-6 * float(dprobs_want.abs().max()))


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("activation, k, dtype", ACTIVATIONS[:2])
def test_fused_equals_activation_first(recipe_name, activation, k, dtype):
    _check("cpu", recipe_name, activation, k, dtype)


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(0, 3).map(lambda b: 32 * b), min_size=1, max_size=5).filter(lambda v: sum(v) > 0),
       recipe_name=st.sampled_from(RECIPES[1:]), activation=st.sampled_from(["swiglu", "relu2"]))
def test_fused_equals_activation_first_on_any_split(sizes, recipe_name, activation):
    """Jagged splits, empty experts and one expert holding every row (multiples of 32 rows: the
    MXFP8 columnwise blocks' alignment, as moe_permute pads them)."""
    _check("cpu", recipe_name, activation, None, torch.bfloat16, sizes)


@pytest.mark.parametrize("recipe_name", [None, "current"])
def test_split_path_runs_the_activation_first(recipe_name):
    _check("cpu", recipe_name, "swiglu", None, torch.bfloat16, path="split")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("activation, k, dtype", ACTIVATIONS)
def test_fused_equals_activation_first_on_gpu(recipe_name, activation, k, dtype):
    _check("cuda", recipe_name, activation, k, dtype)


def test_recipe_on_the_grouped_path_takes_the_fused_function(monkeypatch):
    """Under a recipe on the grouped path the layer never calls expert_activation's forward."""
    from qmoe.ops import activation as ops_activation
    calls = []
    monkeypatch.setattr(ops_activation._ExpertActivation, "forward",
                        staticmethod(lambda *a: calls.append(1) or (_ for _ in ()).throw(AssertionError("ran"))))
    fc2 = qmoe.nn.GroupedLinear(2, 64, 32, grouped_path="grouped")
    h, probs = torch.randn(8, 128), torch.rand(8)
    with qmoe.autocast(recipe=_recipe("current")):
        fc2(h, torch.tensor([3, 5]), input_activation=("swiglu", probs, None)).sum().backward()
    assert not calls


def test_input_activation_checks_its_arguments():
    fc2 = qmoe.nn.GroupedLinear(2, 64, 32, grouped_path="grouped")
    splits = torch.tensor([3, 5])
    with pytest.raises(ValueError):
        fc2(torch.randn(8, 100), splits, input_activation=("swiglu", None, None))  # not 2 x 64 columns
    with pytest.raises(ValueError):
        fc2(torch.randn(8, 128), splits, input_activation=("swish", None, None))
    with pytest.raises(ValueError):
        fc2(torch.randn(8, 128), splits, input_activation=("swiglu", torch.rand(7), None))
