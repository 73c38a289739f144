"""Every public constructor and function, driven with hypothesis-drawn bad arguments.

A bad argument (wrong type, NaN, inf, negative, zero, empty, wrong dtype or device, a string for
a bool) must raise a ValueError, TypeError or qmoe.UnsupportedError whose message names the
argument, at the call that receives it: never a bare torch or Python error, never later. And
finite valid inputs give finite outputs under every recipe.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import qmoe
from qmoe import ops
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling, recipe_from_config)
from qmoe.recipes.recipe import ROLES

FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALLOWED = (ValueError, TypeError, qmoe.UnsupportedError)

# ---------------------------------------------------------------- bad values by kind

NOT_A_NUMBER = st.sampled_from(["1", [1], torch.ones(1), object()])  # None is valid for some (scaling_factor)
SIZE = st.one_of(st.integers(-(2 ** 40), 0), st.sampled_from([True, False, 2.0, "8", None, float("nan")]))
FLAG = st.sampled_from(["no", "yes", "", 0, 1, None, 1.0, [True]])
NONNEG = st.one_of(st.sampled_from([float("nan"), float("inf"), -float("inf")]), st.floats(-1e300, -1e-300),
                   st.sampled_from([True, None]), NOT_A_NUMBER)
POSITIVE = st.one_of(NONNEG.filter(lambda v: v is not None), st.sampled_from([0, 0.0]))  # None: off
DTYPE = st.sampled_from([torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64, "float32", float])
DEVICE = st.sampled_from(["bogus", "gpu", 3.5, "cuda:99", [0], object()])
NAME = st.one_of(st.text(max_size=6).filter(lambda s: s.lower() not in ("softmax", "sigmoid", "swiglu", "geglu",
                                                                         "gelu", "relu", "silu", "srelu",
                                                                         "sqrelu", "qgelu", "reglu", "qgeglu")),
                 st.sampled_from([None, 3, ["softmax"]]))
COEFF = st.sampled_from([float("nan"), float("inf"), -float("inf"), "1", None, True, torch.ones(1)])  # any finite
KIND = {"size": SIZE, "flag": FLAG, "nonneg": NONNEG, "positive": POSITIVE, "dtype": DTYPE, "device": DEVICE,
        "name": NAME}


def _raises_naming(call, name):
    try:
        call()
    except ALLOWED as e:
        assert name in str(e), f"{type(e).__name__} does not name {name!r}: {e}"
        return
    except Exception as e:  # noqa: BLE001 - the point: any other error fails, with its type
        pytest.fail(f"{name}: a bare {type(e).__name__} instead of a named ValueError/TypeError: {e}")
    pytest.fail(f"{name}: accepted silently")


# ---------------------------------------------------------------- constructors: (build(**kw), argument, kind)

def moe(**kw):
    args = dict(hidden_size=16, ffn_hidden_size=32, num_experts=4, top_k=2)
    args.update(kw)
    return qmoe.nn.MoELayer(**args)


def router(**kw):
    args = dict(hidden_size=16, num_experts=4, top_k=2)
    args.update(kw)
    return qmoe.nn.TopKRouter(**args)


def grouped_linear(**kw):
    args = dict(num_groups=3, in_features=16, out_features=8)
    args.update(kw)
    return qmoe.nn.GroupedLinear(**args)


def grouped_mlp(**kw):
    args = dict(num_experts=3, hidden_size=16, ffn_hidden_size=8)
    args.update(kw)
    return qmoe.nn.GroupedMLP(**args)


def linear(**kw):
    args = dict(in_features=16, out_features=8)
    args.update(kw)
    return qmoe.nn.Linear(**args)


CONSTRUCTORS = [
    *[(moe, a, "size") for a in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k")],
    *[(moe, a, "flag") for a in ("pre_softmax", "expert_bias", "bias", "delay_wgrad_compute", "quantized_dispatch")],
    *[(moe, a, "nonneg") for a in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff")],
    *[(moe, a, "positive") for a in ("scaling_factor", "capacity_factor")],
    (moe, "params_dtype", "dtype"), (moe, "device", "device"), (moe, "activation", "name"),
    (moe, "score_function", "name"),
    *[(router, a, "size") for a in ("hidden_size", "num_experts", "top_k")],
    *[(router, a, "flag") for a in ("pre_softmax", "expert_bias", "router_bias")],
    *[(router, a, "nonneg") for a in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff",
                                      "expert_bias_update_rate")],
    (router, "device", "device"),
    *[(grouped_linear, a, "size") for a in ("num_groups", "in_features", "out_features")],
    *[(grouped_linear, a, "flag") for a in ("bias", "single_grouped_weight", "single_grouped_bias",
                                            "delay_wgrad_compute")],
    (grouped_linear, "params_dtype", "dtype"), (grouped_linear, "device", "device"),
    *[(grouped_mlp, a, "size") for a in ("num_experts", "hidden_size", "ffn_hidden_size")],
    *[(grouped_mlp, a, "flag") for a in ("bias", "delay_wgrad_compute", "single_grouped_weight")],
    (grouped_mlp, "params_dtype", "dtype"), (grouped_mlp, "activation", "name"),
    *[(linear, a, "size") for a in ("in_features", "out_features")],
    (linear, "bias", "flag"), (linear, "params_dtype", "dtype"), (linear, "device", "device"),
    (DelayedScaling, "amax_history_len", "size"), (DelayedScaling, "reduce_amax", "flag"),
    (Float8CurrentScaling, "amax_epsilon", "nonneg"), (Float8CurrentScaling, "power_2_scale", "flag"),
    (Float8BlockScaling, "amax_epsilon", "nonneg"), (Float8BlockScaling, "use_f32_scales", "flag"),
    *[(cls, "align_size", "size") for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                                              MXFP8BlockScaling, NVFP4BlockScaling)],
    *[(NVFP4BlockScaling, a, "flag") for a in ("disable_rht", "disable_stochastic_rounding",
                                               "disable_2d_quantization")],
]


@pytest.mark.parametrize("build, name, kind", CONSTRUCTORS,
                         ids=[f"{getattr(b, '__name__', b)}-{n}" for b, n, _ in CONSTRUCTORS])
@FAST
@given(data=st.data())
def test_constructors_name_their_bad_arguments(build, name, kind, data):
    bad = data.draw(KIND[kind], label=name)
    _raises_naming(lambda: build(**{name: bad}), name)


# ---------------------------------------------------------------- functions: (call(bad), argument, kind)

def _quantizer():
    return Float8CurrentScaling().quantizer("input")


BAD_TENSOR = st.sampled_from([[1.0, 2.0], None, 3.0, torch.ones(4, 32, dtype=torch.int32),
                              torch.ones(4, 32, dtype=torch.bool), torch.ones(32)])
ROUTING = torch.zeros(6, 4, dtype=torch.bool)
ROUTING[:, :2] = True
PROBS = torch.rand(6, 4)

FUNCTIONS = [
    (lambda v: _quantizer().quantize(v), "quantize", BAD_TENSOR),
    (lambda v: _quantizer().quantize(torch.ones(4, 32), rowwise=v), "rowwise", FLAG),
    (lambda v: _quantizer().quantize(torch.ones(4, 32), columnwise=v), "columnwise", FLAG),
    (lambda v: _quantizer().quantize(torch.ones(4, 32)).dequantize(v), "dtype", DTYPE),
    (lambda v: _quantizer().quantize(torch.ones(4, 32)).dequantize(columnwise=v), "columnwise", FLAG),
    (lambda v: qmoe.GroupedTensor.quantize(torch.ones(6, 32), v, _quantizer()), "split_sizes",
     st.sampled_from([[1, 2], [3, 4], [-1, 7], "6", 6.0, torch.tensor([2.0, 4.0]), torch.tensor([[6]])])),
    (lambda v: qmoe.autocast(recipe=v), "recipe", st.sampled_from(["mxfp8", 3, {"name": "mxfp8"}])),
    (lambda v: qmoe.autocast(enabled=v), "enabled", FLAG),
    (lambda v: qmoe.autocast(amax_reduction_group=v), "amax_reduction_group",
     st.sampled_from([42, "world", 1.0, [0, 1]])),
    (lambda v: ops.topk_route(torch.randn(6, 4), v), "top_k", SIZE),
    (lambda v: ops.topk_route(torch.randn(6, 4), 2, scaling_factor=v), "scaling_factor", POSITIVE),
    (lambda v: ops.topk_route(v, 2), "logits", BAD_TENSOR),
    (lambda v: ops.moe_permute(torch.randn(6, 8), ROUTING, top_k=v), "top_k",
     st.one_of(SIZE.filter(lambda v: v is not None), st.just(1), st.integers(5, 10))),  # None: read the map
    (lambda v: ops.moe_permute(torch.randn(6, 8), ROUTING, align_size=v, top_k=2), "align_size", SIZE),
    (lambda v: ops.moe_aux_loss(PROBS, ROUTING.sum(0), 6, 4, 2, v), "coeff", COEFF),
    (lambda v: ops.z_loss(torch.randn(6, 4), v), "coeff", COEFF),
    (lambda v: ops.z_loss(v, 1e-3), "logits", BAD_TENSOR),
    (lambda v: ops.seq_aux_loss(PROBS, ROUTING, v, 2, 1e-2), "seq_length", SIZE),
    (lambda v: ops.update_expert_bias(torch.zeros(4), torch.ones(4), v), "rate", COEFF),
    (lambda v: recipe_from_config(v), "config", st.sampled_from([3, None, ["mxfp8"], b"name: mxfp8"])),
    (lambda v: recipe_from_config({"name": v}), "name", st.sampled_from([["mxfp8"], 3, None, "fp8", ""])),
    (lambda v: moe()(v), "x", BAD_TENSOR),
]


@pytest.mark.parametrize("call, name, values", FUNCTIONS, ids=[f"{i}-{n}" for i, (_, n, _) in enumerate(FUNCTIONS)])
@FAST
@given(data=st.data())
def test_functions_name_their_bad_arguments(call, name, values, data):
    bad = data.draw(values, label=name)
    _raises_naming(lambda: call(bad), name)


# ---------------------------------------------------------------- finite in, finite out

RECIPES = [DelayedScaling(), Float8CurrentScaling(), Float8CurrentScaling(power_2_scale=True), Float8BlockScaling(),
           Float8BlockScaling(use_f32_scales=True), MXFP8BlockScaling(), NVFP4BlockScaling()]

FINITE32 = st.floats(-3.4028234663852886e38, 3.4028234663852886e38, width=32, allow_nan=False,
                     allow_infinity=False)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current", "current-pow2", "block", "block-f32", "mxfp8",
                                                 "nvfp4"])
@FAST
@given(values=st.lists(FINITE32, min_size=1, max_size=8), scale=st.sampled_from([1e-38, 1e-3, 1.0, 1e30, 3e38]),
       role=st.sampled_from(ROLES), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_finite_inputs_give_finite_outputs(recipe, values, scale, role, dtype):
    g = torch.Generator().manual_seed(len(values))
    x = torch.randn(32, 64, generator=g).clamp(-1, 1) * scale
    idx = torch.randint(0, x.numel(), (len(values),), generator=g)
    x.view(-1)[idx] = torch.tensor(values)
    qt = recipe.quantizer(role).quantize(x.to(dtype) if torch.isfinite(x.to(dtype)).all() else x)
    for columnwise in (False, True):
        for out in (torch.float32, torch.bfloat16):
            assert torch.isfinite(qt.dequantize(out, columnwise=columnwise)).all(), (columnwise, out)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current", "current-pow2", "block", "block-f32", "mxfp8",
                                                 "nvfp4"])
def test_layer_outputs_and_gradients_are_finite(recipe):
    torch.manual_seed(0)
    layer = moe(ffn_hidden_size=32, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    x = (torch.randn(32, 16) * 100).requires_grad_()
    with qmoe.autocast(recipe=recipe):
        y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
