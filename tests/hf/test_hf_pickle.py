"""A model converted by qmoe.hf.convert saves like any PyTorch model: `torch.save(model)` /
`torch.load(weights_only=False)`, `copy.deepcopy` and `state_dict()` round trips, after training
under a delayed-scaling recipe (so the recipe state travels too), on tiny random HF models.

After a forward, transformers 5.x hangs closures on the model as output-recording hooks; the
converted model drops them when pickled and transformers installs them again, so the router
logits (Mixtral's load-balancing loss) still reach transformers in the saved copy, in the
original, and after `restore`.
"""
import copy
import io

import pytest
import torch

import qmoe
import qmoe.hf
from qmoe.recipes import DelayedScaling
from tests.hf.test_hf_models import MODELS, _batch, _model

RECIPE = DelayedScaling(amax_history_len=4)


def _trained(name, steps=2):
    model = qmoe.hf.convert(_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = _batch()
    for _ in range(steps):
        with qmoe.autocast(recipe=RECIPE):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _outputs(model, seed=2, quantized=True):
    ids = _batch(seed)
    with torch.no_grad(), qmoe.autocast(recipe=RECIPE, enabled=quantized):
        return model(ids, labels=ids)


def _assert_same(got, want, name):
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.loss, want.loss)
    if name == "mixtral":  # the router logits reached transformers' load-balancing loss
        assert len(got.router_logits) == 2
        assert torch.equal(got.aux_loss, want.aux_loss)


def _recipe_states(model):
    return {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_save_and_load_of_a_converted_trained_model(name, tmp_path):
    model = _trained(name)
    assert any(s["recipes"] for s in _recipe_states(model).values())  # delayed-scaling histories to carry
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is type(model)
    assert sum(isinstance(m, qmoe.hf.HFMoEBlock) for m in loaded.modules()) == (2 if name == "mixtral" else 1)
    want = _outputs(model)  # the original still records router logits after pickling dropped its hooks
    _assert_same(_outputs(loaded), want, name)
    # the saved copy trains on identically (same parameters, same recipe state)
    for m in (model, loaded):
        with qmoe.autocast(recipe=RECIPE):
            m(_batch(), labels=_batch()).loss.backward()
    for (n, p), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == n2 and torch.equal(p.grad, p2.grad), n
    # and restores to an HF model (unquantized) whose router logits are recorded again
    want = _outputs(model, quantized=False)
    restored = qmoe.hf.restore(loaded)
    assert not any(isinstance(m, qmoe.hf.HFMoEBlock) for m in restored.modules())
    got = _outputs(restored, quantized=False)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    if name == "mixtral":
        assert len(got.router_logits) == 2
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)


def test_a_saved_model_saves_again_and_deepcopies():
    model = _trained("mixtral", steps=1)
    twice = copy.deepcopy(copy.deepcopy(model))
    _outputs(twice)  # transformers hooks the copy again ...
    _outputs(model)  # (the same delayed-scaling update on both)
    buf = io.BytesIO()
    torch.save(twice, buf)  # ... and the copy still pickles
    buf.seek(0)
    _assert_same(_outputs(torch.load(buf, weights_only=False)), _outputs(model), "mixtral")


@pytest.mark.parametrize("name", list(MODELS))
def test_state_dict_round_trip_into_a_fresh_converted_model(name, tmp_path):
    model = _trained(name)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    torch.manual_seed(123)
    fresh = qmoe.hf.convert(MODELS[name]().float())
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True), strict=True)
    for k, v in _recipe_states(model).items():
        assert repr(_recipe_states(fresh)[k]) == repr(v), k
    _assert_same(_outputs(fresh), _outputs(model), name)
