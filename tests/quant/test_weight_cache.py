"""`WeightCache` and the quantizers' reuse keys, on their own (the layers' bits: tests/nn/test_weight_cache.py).

What decides whether a kept result may stand in for a quantize call: the quantizer's
`reuse_key` (nothing for stateless formats, the reduction group for current scaling, the scale
tensor and its version for delayed scaling, never for stochastic rounding or a recompute), and
what a reuse must redo (delayed scaling's amax record, the checkpoint log's scale entry).
"""
import pytest
import torch

from qmoe.ops.grouped_gemm import quantize_weights
from qmoe.quant.replay import ForwardLog, using_log
from qmoe.quant.weight_cache import WeightCache, _same_key
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)

E, N, K = 3, 32, 64


def _weights():
    return torch.nn.Parameter(torch.randn(E, N, K) / K ** 0.5)


def _kept(cache, w, q, rowwise=True, columnwise=True, calls=None):
    def fresh(r, c):
        if calls is not None:
            calls.append((r, c))
        return quantize_weights(w, q, rowwise=r, columnwise=c)
    return cache.bind([w]).quantize(w, q, rowwise, columnwise, fresh)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
                                    NVFP4BlockScaling()], ids=["current", "block", "mxfp8", "nvfp4"])
def test_stateless_weights_are_kept_until_they_change(recipe):
    q, w, cache, calls = recipe.quantizer("weight"), _weights(), WeightCache(), []
    first = _kept(cache, w, q, calls=calls)
    assert _kept(cache, w, q, calls=calls) is first
    assert _kept(cache, w, q, columnwise=False, calls=calls) is first  # a subset of the kept copies
    assert calls == [(True, True)]
    with torch.no_grad():
        w.add_(1)
    again = _kept(cache, w, q, calls=calls)
    fresh = quantize_weights(w, q, rowwise=True, columnwise=True)
    assert again is not first and len(calls) == 2
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax"):
        a, b = getattr(again, name), getattr(fresh, name)
        assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_reuse_keys():
    assert Float8BlockScaling().quantizer("weight").reuse_key("cpu", E) == ()
    current = Float8CurrentScaling().quantizer("weight")
    group = object()
    current.amax_reduction_group = group
    assert _same_key(current.reuse_key("cpu", E), (group,))
    assert not _same_key(current.reuse_key("cpu", E), (object(),))  # another group: other scales
    assert NVFP4BlockScaling().quantizer("grad_output").reuse_key("cpu", E) is None  # stochastic rounding
    assert NVFP4BlockScaling().quantizer("weight").reuse_key("cpu", E) == ()
    assert _same_key((1, 2.0, "a"), (1, 2.0, "a")) and not _same_key((1,), (True,)) and not _same_key((1,), (1, 2))


def test_delayed_scaling_keys_on_the_scale_and_its_version():
    q = DelayedScaling().quantizer("weight")
    key = q.reuse_key("cpu", E)
    scale, version, updates = key
    assert scale is q.state.scale and q.state.scale.shape == (E,)
    assert _same_key(q.reuse_key("cpu", E), key)
    q.update_scale()  # what a region exit does: the scale is rewritten, maybe to the same value
    assert not _same_key(q.reuse_key("cpu", E), key)
    recompute = ForwardLog()
    recompute.start_replay()
    with using_log(recompute):
        assert q.reuse_key("cpu", E) is None  # a recompute quantizes with the scale its log holds


def test_delayed_scaling_keys_on_updates_that_write_in_place(monkeypatch):
    """The update kernel stores the new scale in place (no version bump): the update count sees it."""
    import qmoe.quant.delayed as delayed

    real = delayed.DELAYED_SCALING

    class InPlace:  # the reference's update, writing through `.data` as a kernel's store does
        def pick(self, name, *tensors):
            fn = real.pick(name, *tensors)
            return lambda history, scale, *rest: fn(history.data, scale.data, *rest)
    monkeypatch.setattr(delayed, "DELAYED_SCALING", InPlace())
    q = DelayedScaling().quantizer("weight")
    quantize_weights(_weights(), q)
    key, version = q.reuse_key("cpu", E), q.scale._version
    q.update_scale()
    assert q.scale._version == version and not torch.equal(q.scale, torch.ones(E))  # moved, unseen
    assert not _same_key(q.reuse_key("cpu", E), key)


def test_a_delayed_reuse_redoes_the_quantize_calls_side_effects():
    """The amax record (the history is the one of quantizing afresh) and, in a checkpointed
    forward, one log entry, as the quantize it stands for makes: the recompute reads it back."""
    w, cache = _weights(), WeightCache()
    q = DelayedScaling().quantizer("weight")
    first = _kept(cache, w, q)
    amax = q.amax_history[0].clone()
    assert (amax > 0).all()
    with torch.no_grad():
        q.amax_history.zero_()  # the scale is untouched: the kept weights stay valid
    log = ForwardLog()
    with using_log(log):
        assert _kept(cache, w, q) is first
    assert torch.equal(q.amax_history[0], amax)
    assert len(log.entries) == 1 and torch.equal(log.entries[0][1], q.scale)


def test_orientations_missing_from_the_kept_result_quantize_again():
    q, w, cache, calls = MXFP8BlockScaling().quantizer("weight"), _weights(), WeightCache(), []
    rows = _kept(cache, w, q, columnwise=False, calls=calls)
    assert rows.columnwise_data is None
    both = _kept(cache, w, q, calls=calls)
    assert both is not rows and calls == [(True, False), (True, True)]
    assert cache.kept is both and cache.nbytes() > 0 and both.bf16_copies == {}


def test_the_cache_needs_its_weights_unchanged_and_alive():
    q, cache, calls = Float8CurrentScaling().quantizer("weight"), WeightCache(), []
    w = _weights()
    _kept(cache, w, q, calls=calls)
    other = torch.nn.Parameter(w.detach().clone())  # same values, version and shape: another tensor
    _kept(cache, other, q, calls=calls)
    _kept(cache, other, Float8CurrentScaling().quantizer("weight"), calls=calls)  # another quantizer
    assert len(calls) == 3
    with torch.inference_mode():
        frozen = torch.randn(E, N, K)
    _kept(cache, frozen, q, calls=calls)  # an inference tensor keeps no version: never kept
    assert len(calls) == 4 and cache.kept is not None and cache.kept.shape[0] == E * N
