"""Delayed scaling and `qmoe.autocast` (NUMERICS.md "Delayed scaling").

A scripted sequence of amaxes goes through the library, and a ten-line model of NUMERICS.md
(`expected_scales`) predicts every scale: window max or most recent, margin, history length,
zero-amax steps leaving the slot alone. A 2-process gloo run proves the MAX all-reduce.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qmoe
from qmoe import GroupedTensor
from qmoe.autocast import RecipeState, autocast_state
from qmoe.quant import Float8CurrentQuantizer
from qmoe.recipes import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

F32 = np.float32
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def expected_scales(amaxes, history_len: int, margin: int = 0, algo: str = "max", fmt_max: float = E4M3_MAX):
    """The scale after each step, per NUMERICS.md: a step whose amax is 0 changes nothing; otherwise
    its amax joins a window of the last `history_len` (non-zero) steps and
    scale = (fmt_max / amax) / 2**margin in fp32, amax the window max or the newest."""
    window, scale, out = [], F32(1), []
    for a in amaxes:
        if a != 0:
            window = (window + [F32(a)])[-history_len:]
            amax = max(window) if algo == "max" else window[-1]
            scale = F32(F32(fmt_max) / amax) / F32(2.0 ** margin)
        out.append(F32(scale))
    return out


def with_amax(a: float, rows: int = 3, k: int = 8) -> torch.Tensor:
    """A tensor whose max|x| is exactly `a` (all its values are a times powers of two)."""
    x = torch.full((rows, k), a) * torch.exp2(-(torch.arange(rows * k, dtype=torch.float32) % 5)).reshape(rows, k)
    x[1::2] *= -1
    return x


AMAXES = [3.0, 0.0, 5.0, 1.0, 0.5, 0.25, None, 0.125, 7.0, 2.0]  # None: the step quantizes nothing
SCRIPTS = [
    pytest.param(DelayedScaling(amax_history_len=3), id="window3-max"),
    pytest.param(DelayedScaling(amax_history_len=1), id="window1"),
    pytest.param(DelayedScaling(amax_history_len=4, margin=2, amax_compute_algo="most_recent"), id="recent-margin2"),
    pytest.param(DelayedScaling(margin=1, fp8_format=Format.E4M3), id="default-window-margin1"),
]


def fmt_max_for(recipe, role):
    return E5M2_MAX if recipe.fp8_format is Format.HYBRID and role == "grad_output" else E4M3_MAX


def check_scale(q, want, step):
    assert q.scale.dtype == torch.float32 and q.scale.dim() == 0
    assert q.scale.item() == want, f"step {step}: scale {q.scale.item()!r}, expected {want!r}"


@pytest.mark.parametrize("recipe", SCRIPTS)
def test_scripted_amaxes_through_autocast_region_exits(recipe):
    q = recipe.quantizer("input")
    want = expected_scales([a or 0.0 for a in AMAXES], recipe.amax_history_len, recipe.margin,
                           recipe.amax_compute_algo)
    previous = F32(1)
    for step, a in enumerate(AMAXES):
        with qmoe.autocast(recipe=recipe):
            if a is not None:
                qt = q.quantize(with_amax(a))
                # inside the region the scale in force is the one from the previous step
                assert qt.rowwise_scale_inv.item() == F32(1) / previous
                q.quantize(with_amax(a / 4))  # a second call in the same step: the step's amax is the max
            check_scale(q, previous, step)  # nothing changes before the region exits
        check_scale(q, want[step], step)
        previous = want[step]


@pytest.mark.parametrize("recipe", SCRIPTS)
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_scripted_amaxes_through_update_scale(recipe, role):
    """Outside autocast: forward slots update on `update_scale()`; a grad_output slot used outside a
    backward pass updates at once (then `update_scale()` finds nothing new)."""
    q = recipe.quantizer(role)
    want = expected_scales([a or 0.0 for a in AMAXES], recipe.amax_history_len, recipe.margin,
                           recipe.amax_compute_algo, fmt_max_for(recipe, role))
    for step, a in enumerate(AMAXES):
        if a is not None:
            q.quantize(with_amax(a))
        q.update_scale()
        check_scale(q, want[step], step)


def test_history_rolls_newest_to_the_end_and_zero_steps_leave_it_alone():
    recipe = DelayedScaling(amax_history_len=4)
    q = recipe.quantizer("input")
    for a in (1.0, 2.0, 3.0):
        q.quantize(with_amax(a))
        q.update_scale()
    hist = q.amax_history.clone()
    assert hist.shape == (4,) and hist.dtype == torch.float32
    assert hist[-3:].tolist() == [1.0, 2.0, 3.0]  # newest at the end of the window
    scale = q.scale.clone()
    q.quantize(torch.zeros(4, 8))  # an expert that got no tokens this step
    q.update_scale()
    assert torch.equal(q.amax_history, hist) and torch.equal(q.scale, scale)
    q.update_scale()  # a step without any quantize call
    assert torch.equal(q.amax_history, hist) and torch.equal(q.scale, scale)
    for _ in range(3):  # the window of 4 still holds 3.0 after three more steps ...
        q.quantize(with_amax(0.5))
        q.update_scale()
        assert q.scale.item() == F32(448) / F32(3.0)
    q.quantize(with_amax(0.5))  # ... and drops it after the fourth
    q.update_scale()
    assert q.scale.item() == F32(448) / F32(0.5)
    assert q.amax_history[-4:].tolist()[1:] == [0.5, 0.5, 0.5]


def test_fresh_state_and_non_finite_amax_keep_the_scale():
    q = DelayedScaling().quantizer("input")
    qt = q.quantize(with_amax(10.0))
    assert qt.rowwise_scale_inv.item() == 1.0  # fresh slot: scale 1
    assert q.amax_history.shape == (1024,)
    q.update_scale()
    scale = q.scale.item()
    assert scale == F32(448) / F32(10.0)
    for length in (1, 4):
        for bad in (float("inf"), -float("inf"), float("nan")):
            q2 = DelayedScaling(amax_history_len=length).quantizer("input")
            q2.quantize(with_amax(2.0))
            q2.update_scale()
            hist = q2.amax_history.clone()
            x = with_amax(1.0)
            x[0, 0] = bad
            q2.quantize(x)
            q2.update_scale()  # not recorded: counted, and nothing else changes
            case = (length, bad)
            assert q2.scale.item() == F32(448) / F32(2.0), case
            assert torch.equal(q2.amax_history, hist), case
            assert q2.nonfinite_steps.item() == 1, case
            q2.quantize(with_amax(8.0))  # the next finite step recovers at once
            q2.update_scale()
            assert q2.scale.item() == F32(448) / F32(8.0), case
            assert q2.nonfinite_steps.item() == 1, case


def test_one_non_finite_step_does_not_freeze_the_window():
    """Issue 22 item 2: after one inf step the scale follows the finite amaxes, not the inf."""
    q = DelayedScaling(amax_history_len=16, amax_compute_algo="max").quantizer("input")
    for a in (10.0, float("inf"), 10.0, 12.0):
        q.quantize(torch.full((4, 8), a))
        q.update_scale()
    assert q.scale.item() == F32(448) / F32(12.0)
    assert q.nonfinite_steps.item() == 1
    assert torch.isfinite(q.amax_history).all()


class _QuantizeGrad(torch.autograd.Function):
    """Identity whose backward quantizes the incoming gradient twice (like dgrad and wgrad) and
    notes the slot's scale while the backward pass is still running."""

    @staticmethod
    def forward(ctx, x, q, scales_seen_in_backward):
        ctx.q, ctx.seen = q, scales_seen_in_backward
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.q.quantize(g)
        ctx.q.quantize(g * 0.5)
        ctx.seen.append(ctx.q.scale.item())
        return g, None, None


def test_backward_slot_updates_after_the_backward_pass():
    recipe = DelayedScaling(amax_history_len=2)
    q = recipe.quantizer("grad_output")
    amaxes = (4.0, 0.0, 8.0, 2.0, 1.0)
    want = expected_scales(amaxes, 2, fmt_max=E5M2_MAX)
    during, after = [], []
    for a in amaxes:
        x = torch.ones(3, 8, requires_grad=True)
        with qmoe.autocast(recipe=recipe):
            y = _QuantizeGrad.apply(x, q, during)
        (y * with_amax(a)).sum().backward()  # the gradient reaching the function is with_amax(a)
        after.append(q.scale.item())
    assert after == want
    assert during == [F32(1)] + want[:-1], "the scale changed before the backward pass ended"


def test_grouped_slots_are_per_group():
    """One slot per group: a group without rows this step keeps its scale and its history."""
    recipe = DelayedScaling(amax_history_len=2, fp8_format=Format.E4M3)
    q = recipe.quantizer("input")
    steps = [([2, 0, 3], [1.0, 0.0, 4.0]), ([0, 4, 1], [0.0, 2.0, 0.5]), ([1, 1, 1], [8.0, 0.0, 0.25])]
    per_group = [[amaxes[g] for _, amaxes in steps] for g in range(3)]
    want = [expected_scales(a, 2) for a in per_group]  # want[g][step]
    for step, (splits, amaxes) in enumerate(steps):
        x = torch.cat([with_amax(a, rows=s) if s else torch.zeros(0, 8) for s, a in zip(splits, amaxes)])
        with qmoe.autocast(recipe=recipe):
            gt = GroupedTensor.quantize(x, splits, q)
            previous = [F32(1)] * 3 if step == 0 else [want[g][step - 1] for g in range(3)]
            assert gt.rowwise_scale_inv.tolist() == [F32(1) / p for p in previous]
        assert q.scale.shape == (3,)
        assert q.scale.tolist() == [want[g][step] for g in range(3)], f"step {step}"


# ---------------------------------------------------------------- autocast state

def test_nested_autocast_restores_the_outer_state_and_updates_at_the_outermost_exit():
    outer, inner = DelayedScaling(amax_history_len=4), MXFP8BlockScaling()
    assert autocast_state().active_recipe is None and not autocast_state().enabled
    q = outer.quantizer("input")
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a real group object; none is initialised: one rank
    with qmoe.autocast(recipe=outer, amax_reduction_group=group):
        assert autocast_state().active_recipe == outer and autocast_state().amax_reduction_group is group
        with qmoe.autocast(recipe=inner):
            state = autocast_state()
            assert state.active_recipe == inner and state.amax_reduction_group is group  # inherited
            q.quantize(with_amax(2.0))
            with qmoe.autocast(enabled=False):
                assert autocast_state().active_recipe is None and not autocast_state().enabled
            assert autocast_state().active_recipe == inner
        assert q.scale.item() == 1.0, "an inner region's exit must not update delayed scaling"
        assert autocast_state().active_recipe == outer
    assert q.scale.item() == F32(448) / F32(2.0)
    assert autocast_state().active_recipe is None and autocast_state().depth == 0


def test_autocast_enabled_false_and_defaults():
    with qmoe.autocast(enabled=False):
        state = autocast_state()
        assert not state.enabled and state.active_recipe is None
        assert isinstance(state.recipe, DelayedScaling)  # the default recipe, inactive
    with qmoe.autocast():
        assert autocast_state().active_recipe == DelayedScaling()
    with pytest.raises(TypeError):
        qmoe.autocast(recipe={"name": "mxfp8"})
    with pytest.raises(TypeError):
        qmoe.autocast(enabled=1)


def test_autocast_state_restored_after_an_exception():
    with pytest.raises(RuntimeError):
        with qmoe.autocast(recipe=MXFP8BlockScaling()):
            raise RuntimeError("boom")
    assert autocast_state().active_recipe is None and autocast_state().depth == 0


def test_recipe_change_rebuilds_quantizers():
    rs = RecipeState()
    r1 = DelayedScaling(amax_history_len=8)
    qs = rs.get(r1)
    assert set(qs) == {"input", "weight", "grad_output"}
    again = rs.get(DelayedScaling(amax_history_len=8))  # an equal recipe keeps quantizers and histories
    assert all(again[k] is qs[k] for k in qs)
    qs["input"].quantize(with_amax(4.0))
    qs["input"].update_scale()
    assert rs.get(r1)["input"].scale.item() == F32(448) / F32(4.0)

    r2 = dataclasses.replace(r1, margin=1)  # same class, different field
    qs2 = rs.get(r2)
    assert all(qs2[k] is not qs[k] for k in qs)
    assert qs2["input"].quantize(with_amax(4.0)).rowwise_scale_inv.item() == 1.0  # a fresh history
    qs2["input"].update_scale()
    assert qs2["input"].scale.item() == F32(448) / F32(4.0) / 2  # the new recipe's margin

    qs3 = rs.get(Float8CurrentScaling())
    assert all(qs3[k] is not qs2[k] for k in qs)
    assert all(isinstance(q, Float8CurrentQuantizer) for q in qs3.values())
    group = object()
    qs4 = rs.get(r1, group=group)
    assert all(q.amax_reduction_group is group for q in qs4.values())


# ---------------------------------------------------------------- all-reduce MAX over amax_reduction_group (gloo, CPU)

def _gloo_worker(rank: int, world: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
        reduced = recipe.quantizer("input")
        alone = dataclasses.replace(recipe, reduce_amax=False).quantizer("input")
        grouped = recipe.quantizer("weight")
        direct = recipe.quantizer("weight")
        backward = RecipeState(roles=("grad_output",)).get(recipe, group=group)["grad_output"]

        steps = {0: [(2.0, [5.0, 0.0]), (0.0, [1.0, 0.0])],  # rank 0 records no amax in step 2
                 1: [(3.0, [0.0, 7.0]), (1.0, [0.0, 0.0])]}[rank]
        for a, group_amaxes in steps:
            with qmoe.autocast(recipe=recipe, amax_reduction_group=group):
                reduced.quantize(with_amax(a) if a else torch.zeros(2, 8))
                alone.quantize(with_amax(a) if a else torch.zeros(2, 8))
                x = torch.cat([with_amax(g, rows=2) if g else torch.zeros(2, 8) for g in group_amaxes])
                GroupedTensor.quantize(x, [2, 2], grouped)
        direct.quantize(with_amax([0.5, 0.25][rank]))
        direct.update_scale(group)

        x = torch.ones(2, 8, requires_grad=True)
        with qmoe.autocast(recipe=recipe, amax_reduction_group=group):
            y = _QuantizeGrad.apply(x, backward, [])
        (y * with_amax([16.0, 64.0][rank], rows=2)).sum().backward()

        torch.save({name: q.scale for name, q in [("reduced", reduced), ("alone", alone), ("grouped", grouped),
                                                   ("direct", direct), ("backward", backward)]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_amax_all_reduce_max_over_two_gloo_ranks():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_gloo_worker, args=(2, _free_port(), out_dir), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + 120
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    pytest.fail("the 2-process gloo run did not finish within 120 s")
        finally:
            for p in ctx.processes:  # only the two workers this test started
                if p.is_alive():
                    p.kill()
        r0, r1 = (torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in (0, 1))

    for name in ("reduced", "grouped", "direct", "backward"):
        assert torch.equal(r0[name], r1[name]), f"{name}: ranks disagree: {r0[name]} vs {r1[name]}"
    # most_recent over the reduced newest amax: step 1 max(2, 3) = 3; step 2 max(0, 1) = 1 (rank 0 had none)
    assert r0["reduced"].item() == F32(448) / F32(1.0)
    assert r0["grouped"].tolist() == [F32(448) / F32(1.0), F32(448) / F32(7.0)]
    assert r0["direct"].item() == F32(448) / F32(0.5)
    assert r0["backward"].item() == F32(E5M2_MAX) / F32(64.0)
    # without reduce_amax each rank keeps its own: rank 0's empty step 2 leaves 448/2
    assert (r0["alone"].item(), r1["alone"].item()) == (F32(448) / F32(2.0), F32(448) / F32(1.0))
