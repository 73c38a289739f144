"""The delayed-scaling update kernel == its reference, bit for bit: on the CPU through Triton's
interpreter (as in test_bias_interpret.py, this file re-runs itself with TRITON_INTERPRET=1) and
on the GPU (marked gpu).

Windows of 1 to 5000 rows (the kernel rolls them in place, in steps of up to 4096 entries: one
step for most windows, several for long ones) and 1 to 40 slots (up to 32 a program),
per-tensor [L] and grouped [L, G] histories and a group slot's strided view; slots that recorded
nothing (newest 0), NaN and inf amaxes in the newest row (not recorded: row 0 cleared, window and
scale kept, `nonfinite_steps` counted) and deeper in the window (a state loaded from elsewhere),
margins and both amax algorithms.
"""

import pytest
import torch

from tests.kernels.interpret import inside, launcher, assert_passed_under_interpreter

CASES = [  # (window rows, slots or None for a per-tensor [L] history, margin, algo)
    (1, None, 0, "max"), (2, 3, 0, "max"), (7, 1, 2, "most_recent"), (300, 40, 0, "max"),
    (1024, 5, 1, "max"), (129, None, 0, "most_recent"), (5, 33, 3, "max"), (5000, None, 0, "max"),
    (5000, 6, 0, "most_recent"),
]


def _state(length, slots, seed, device):
    g = torch.Generator().manual_seed(seed)
    shape = (length,) if slots is None else (length, slots)
    hist = torch.exp(torch.randn(shape, generator=g) * 4)  # amaxes over many binades
    hist[torch.rand(shape, generator=g) < 0.2] = 0.0  # steps a slot skipped
    if slots is not None and slots >= 3:
        hist[0, 0] = 0.0  # recorded nothing this step: kept as it is
        hist[0, 1] = float("nan")  # newest NaN: not recorded, counted, scale kept
        hist[-1, 2] = float("inf") if length > 1 else hist[-1, 2]  # inf deeper in the window
    if slots is not None and slots >= 4:
        hist[0, 3] = float("inf")  # newest inf: the same
    if slots is None and length == 129:
        hist[0] = float("inf")
    if slots is not None and slots >= 5 and length > 1:
        hist[1:, 4] = float("nan")  # NaN in an older row: the window's max is NaN
    scale = torch.rand(shape[1:], generator=g) + 0.5
    count = torch.randint(0, 5, shape[1:], generator=g, dtype=torch.int32)
    return hist.to(device), scale.to(device), count.to(device)


def _bits(t):
    return t.contiguous().view(torch.int32)


def check_update(device):
    from qmoe.kernels.delayed_scaling import update_amax_history as kernel
    from qmoe.reference.delayed_scaling import update_amax_history as reference

    for i, (length, slots, margin, algo) in enumerate(CASES):
        for fmt_max in (448.0, 57344.0):
            hist, scale, count = _state(length, slots, i, device)
            want_h, want_s, want_c = hist.clone(), scale.clone(), count.clone()
            before, counted = hist.clone(), count.clone()
            reference(want_h, want_s, fmt_max, margin, algo, want_c)
            kernel(hist, scale, fmt_max, margin, algo, count)
            case = (length, slots, margin, algo, fmt_max)
            assert torch.equal(_bits(hist), _bits(want_h)), case
            assert torch.equal(_bits(scale), _bits(want_s)), case
            assert torch.equal(count, want_c), case
            bad = ~torch.isfinite(before[0])
            assert torch.equal(want_c, counted + bad.int()), case
            assert torch.isfinite(want_h[0]).all() and (want_h[0][bad] == 0).all(), case
            kernel(hist, scale, fmt_max, margin, algo)  # without a counter: the same update, nothing counted
    # a group slot's view (strided window, 0-dim scale), as a for_group quantizer updates it
    hist, scale, count = _state(9, 6, 99, device)
    want_h, want_s, want_c, counted = hist.clone(), scale.clone(), count.clone(), count.clone()
    reference(want_h[:, 3], want_s[3], 448.0, 0, "max", want_c[3])
    kernel(hist[:, 3], scale[3], 448.0, 0, "max", count[3])
    assert torch.equal(_bits(hist), _bits(want_h)) and torch.equal(_bits(scale), _bits(want_s))
    assert torch.equal(count, want_c) and want_c[3] == counted[3] + 1


@launcher
def test_delayed_scaling_update_under_the_interpreter():
    assert_passed_under_interpreter(__file__, r"\b1 passed, 2 skipped(, \d+ warnings?)? in ")


@inside
def test_update_kernel_matches_reference_on_cpu():
    check_update("cpu")


@pytest.mark.gpu
def test_update_kernel_matches_reference_on_gpu():
    check_update("cuda")
