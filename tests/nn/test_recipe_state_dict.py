"""Recipe state in state_dict(): checkpoint and resume bit for bit, one state per recipe.

Delayed scaling keeps amax histories and scales per quantizer slot; they travel in every qmoe
module's `state_dict()` (`_extra_state`), so a loop saved after N steps (model, optimizer,
RNG) and resumed repeats the uninterrupted run's next steps exactly, for every recipe.
"""
import io
import warnings

import pytest
import torch

import qmoe
from qmoe.recipes import DelayedScaling, MXFP8BlockScaling
from tests.nn.loop_cases import TinyModel, batch, loss_of
from tests.nn.recipe_cases import QUANTIZED

RECIPES = [pytest.param(None, id="bf16")] + QUANTIZED
DELAYED = DelayedScaling(amax_history_len=4)


def _train(model, opt, recipe, steps, amp=None):
    """Run `steps` (list of step indices); returns the losses."""
    losses = []
    device = next(model.parameters()).device
    for step in steps:
        x, target = batch(step, device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
                loss = loss_of(model, x, target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _save(model, opt) -> bytes:
    buf = io.BytesIO()
    # NVFP4's stochastic rounding draws from the tensor device's default generator: its state is
    # part of a resumable run, as for dropout
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(),
                "cuda_rng": cuda_rng}, buf)
    return buf.getvalue()


def _load(blob: bytes, device="cpu"):
    ckpt = torch.load(io.BytesIO(blob), weights_only=False)
    model = TinyModel(device, seed=123)  # other initial weights: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete checkpoint loads silently
        model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    torch.set_rng_state(ckpt["rng"])
    if ckpt["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
    return model, opt


def _resume_case(recipe, device="cpu", amp=None):
    model = TinyModel(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, recipe, range(3), amp)
    blob = _save(model, opt)
    want = _train(model, opt, recipe, range(3, 6), amp)
    resumed, ropt = _load(blob, device)
    got = _train(resumed, ropt, recipe, range(3, 6), amp)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {3 + step}: loss {a.item()} != {b.item()}"
    for (name, p), q in zip(resumed.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(resumed.moe.router.expert_bias, model.moe.router.expert_bias)


@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_repeats_the_uninterrupted_run_bit_for_bit(recipe):
    _resume_case(recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_repeats_the_uninterrupted_run_bit_for_bit_on_gpu(recipe):
    _resume_case(recipe, "cuda", amp=torch.bfloat16)


def _delayed_states(model, recipe=DELAYED):
    states = {name: {role: q.state_dict() for role, q in m.recipe_state.get(recipe).items()}
              for name, m in model.named_modules() if hasattr(m, "recipe_state")}
    assert len(states) == 3  # FC1, FC2, the head
    return states


def test_state_dict_carries_delayed_scaling_state():
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    _train(model, opt, DELAYED, range(2))
    sd = model.state_dict()
    state = sd["moe.experts.fc1._extra_state"]
    (entry,) = state["recipes"]
    assert qmoe.recipes.recipe_from_config(entry["recipe"]) == DELAYED
    fc1_input = entry["quantizers"]["input"]
    assert fc1_input["amax_history"].shape == (4, 4) and fc1_input["scale"].shape == (4,)
    assert (fc1_input["scale"] != 1).any(), "two steps moved the scales off their fresh value"
    head = sd["head._extra_state"]["recipes"][0]["quantizers"]
    assert head["grad_output"]["scale"].shape == (1,)  # a one-group grouped GEMM

    fresh = TinyModel(seed=7)
    fresh.load_state_dict(sd)
    got, want = _delayed_states(fresh), _delayed_states(model)
    assert got.keys() == want.keys()
    for name in want:
        for role in want[name]:
            for key, t in want[name][role].items():
                assert torch.equal(got[name][role][key], t), (name, role, key)


def test_eval_under_another_recipe_keeps_the_training_recipe_state():
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    _train(model, opt, DELAYED, range(2))
    twin = TinyModel(seed=5)
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.SGD(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(opt.state_dict())
    with torch.no_grad(), qmoe.autocast(recipe=MXFP8BlockScaling()):  # an evaluation pass
        model.eval()
        model(batch(99)[0])
        model.train()
    with torch.no_grad(), qmoe.autocast(recipe=DelayedScaling(amax_history_len=8)):  # another delayed recipe
        model(batch(98)[0])
    assert torch.equal(torch.stack(_train(model, opt, DELAYED, range(2, 4))),
                       torch.stack(_train(twin, twin_opt, DELAYED, range(2, 4))))
    # both recipes' states are in the state_dict, and the other delayed one keeps its own
    recipes = [qmoe.recipes.recipe_from_config(e["recipe"]) for e in model.state_dict()["head._extra_state"]["recipes"]]
    assert recipes == [DELAYED, DelayedScaling(amax_history_len=8)]


def test_state_dict_without_recipe_state_loads_with_a_warning_and_fresh_state():
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    _train(model, opt, DELAYED, range(2))
    old = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    target = TinyModel(seed=3)
    _train(target, torch.optim.SGD(target.parameters(), lr=1e-2), DELAYED, range(1))
    with pytest.warns(UserWarning, match="no recipe state"):
        target.load_state_dict(old)  # strict: the missing entries are not an error
    assert all(not s for states in _delayed_states(target).values() for s in states.values())
    for p, q in zip(target.parameters(), model.parameters()):
        assert torch.equal(p, q)

    # a state_dict saved under another recipe: the delayed state this module held starts fresh, with a warning
    other = TinyModel(seed=4)
    _train(other, torch.optim.SGD(other.parameters(), lr=1e-2), MXFP8BlockScaling(), range(1))
    with pytest.warns(UserWarning, match="no recipe state for delayed"):
        model.load_state_dict(other.state_dict())
    assert all(not s for states in _delayed_states(model).values() for s in states.values())


def test_bad_recipe_state_raises():
    layer = qmoe.nn.Linear(32, 32)
    sd = layer.state_dict()
    sd["_extra_state"] = {"version": 99, "recipes": []}
    with pytest.raises(ValueError, match="recipe state"):
        layer.load_state_dict(sd)
    sd["_extra_state"] = {"version": 1, "recipes": [{"recipe": {"name": "delayed", "amax_history_len": 4},
                                                       "quantizers": {"input": {"scale": torch.ones(()),
                                                                                "amax_history": torch.zeros(8)}}}]}
    with pytest.raises(ValueError, match="amax_history_len=4"):
        layer.load_state_dict(sd)


def test_model_copied_or_saved_whole_after_a_forward():
    """copy.deepcopy and torch.save of a whole model after a forward (EMA copies, eval copies):
    the MoE layer's aux loss and the router's logits hold that forward's graph; the copy keeps
    their values, detached, and the same recipe state."""
    import copy

    model = TinyModel()
    x, target = batch(0)
    with qmoe.autocast(recipe=DELAYED):
        loss_of(model, x, target).backward()
        loss = loss_of(model, x, target)  # a forward whose backward has not run yet
    assert loss.grad_fn is not None
    assert model.moe.aux_loss.grad_fn is not None and model.moe.router.logits.grad_fn is not None
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    twins = (copy.deepcopy(model), torch.load(buf, weights_only=False))
    want = model.state_dict()
    for twin in twins:
        assert twin.moe.aux_loss.grad_fn is None and torch.equal(twin.moe.aux_loss, model.moe.aux_loss)
        assert torch.equal(twin.moe.router.logits, model.moe.router.logits)
        state = twin.state_dict()
        assert state.keys() == want.keys()
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert torch.equal(state[key], want[key]), key
    model.eval()  # no expert-bias update; MXFP8 keeps no state: the forwards leave the model as it is
    with torch.no_grad(), qmoe.autocast(recipe=MXFP8BlockScaling()):
        for twin in twins:
            assert torch.equal(twin.eval()(x), model(x))
