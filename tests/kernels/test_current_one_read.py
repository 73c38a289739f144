"""Current scaling's grouped cast in one read (`grouped_quantize_fp8_current`): every team layout,
the waiting members' way and the way of a member that gives up waiting, against the amax launch,
`compute_fp8_scale` and the cast launch it replaces.

On the CPU, under Triton's interpreter (programs run one after another, so every member but a
team's last gives up waiting and takes the group's amax alone): amaxes and scales bit for bit
against the reference, codes bit for bit against the two-launch kernels (the interpreter rounds
fp8 casts its own way, the same way in both). On the GPU: codes and scales against the
reference, with teams that all wait, and with members that never wait (patience 0).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ((1, 1), (3, 1), (1, 3), (2, 2))  # (teams, programs per team)


def test_one_read_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-W", "ignore", __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "one-read checks passed" in proc.stdout


def _inputs(device="cpu", rows=44, k=200, seed=0):
    """Rows over five groups (one empty, odd sizes, four rows past the last group), values over
    many binades, NaN and +-inf in one group, a group of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, k, generator=g) * 4)
    x[3, 5], x[10, 150], x[12, 7] = float("nan"), float("inf"), -float("inf")
    x[14:15] = 0.0
    splits = torch.tensor([13, 0, 1, 9, 17])
    return x.to(device=device, dtype=torch.bfloat16), splits.to(device)


def _same(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype == torch.float32:
        same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    else:
        same = got.view(torch.uint8) == want.view(torch.uint8)
    assert bool(same.all()), f"{what}: {(~same).sum().item()} of {same.numel()} differ"


def _cases(x, splits):
    """(what, input, power_2_scale, amax_epsilon): plain rows, scale options, the fused SwiGLU."""
    from qmoe.contracts.carriers import ActivatedRows
    probs = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(1)).to(x.device)
    return (("rows", x, False, 0.0), ("pow2", x, True, 0.0), ("eps", x, False, 1e3),
            ("swiglu", ActivatedRows(x, probs, "swiglu", None), False, 0.0))


def _check_layouts(want, patience_of, device):
    """want(case) -> (row, col, scales, amax) the one-read cast must give for each layout."""
    from qmoe.contracts.formats import E4M3
    from qmoe.kernels import grouped_quantize as KG
    x, splits = _inputs(device)
    used = int(splits.sum())
    for what, xin, p2, eps in _cases(x, splits):
        row_w, col_w, scale_w, amax_w = want(xin, splits, p2, eps)
        for layout in LAYOUTS:
            row, col, scales, amax = KG.grouped_quantize_fp8_current(xin, splits, E4M3, p2, eps, True, True,
                                                                    teams=layout, patience=patience_of(layout))
            tag = f"{what} {layout}"
            _same(scales, scale_w, f"{tag} scales")
            _same(amax, amax_w, f"{tag} amax")
            _same(row[:used], row_w[:used], f"{tag} rows")
            _same(col[:, :used], col_w[:, :used], f"{tag} columns")


def check_interpreted():
    """The one-read cast against the reference's amaxes and scales and the kernels' two launches."""
    from qmoe.contracts.formats import E4M3
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize as R

    def want(xin, splits, p2, eps):
        amax = KG.grouped_tensor_amax(xin, splits)  # the activation's bits are the kernels' (interpreted)
        if isinstance(xin, torch.Tensor):
            _same(amax, RG.grouped_tensor_amax(xin, splits), "the amax launch")
        scales = R.compute_fp8_scale(amax, E4M3.max, p2, eps)
        row, col, _ = KG.grouped_quantize_fp8_tensorwise(xin, splits, scales, E4M3, True, True)
        return row, col, scales, amax

    _check_layouts(want, lambda layout: 3, "cpu")
    # the layout the launcher picks by itself, and the two launches where groups outgrow the budget
    x, splits = _inputs()
    assert KG.current_teams(44, 200, 5, 2, x.device) == (5, 1)
    assert KG.current_teams(44, 200, 5, 2, x.device, l2_bytes=1024) is None
    assert KG.current_teams(0, 200, 5, 2, x.device) is None
    print("one-read checks passed")


@pytest.mark.gpu
@pytest.mark.parametrize("patience", [4096, 0], ids=["teams-wait", "members-alone"])
def test_one_read_matches_reference_on_gpu(patience):
    from qmoe.contracts.formats import E4M3
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize as R
    from qmoe.ops.activation import activation_forward
    from qmoe.contracts.carriers import ActivatedRows

    def want(xin, splits, p2, eps):
        rows = activation_forward(*xin) if isinstance(xin, ActivatedRows) else xin
        rows, splits_cpu = rows.cpu(), splits.cpu()
        amax = RG.grouped_tensor_amax(rows, splits_cpu)
        scales = R.compute_fp8_scale(amax, E4M3.max, p2, eps)
        row, col, _ = RG.grouped_quantize_fp8_tensorwise(rows, splits_cpu, scales, E4M3, True, True)
        return row.cuda(), col.cuda(), scales.cuda(), amax.cuda()

    _check_layouts(want, lambda layout: patience, "cuda")


@pytest.mark.gpu
def test_layer_shapes_take_one_read_bit_for_bit():
    """Qwen3-sized expert weights (128 x 1536 x 2048: the launcher's own teams) and a group larger
    than the budget (two launches), against the reference."""
    from qmoe.contracts.formats import E4M3
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize as R

    g = torch.Generator(device="cuda").manual_seed(0)
    for e, n, k in ((128, 1536, 2048), (2, 4096, 4096)):
        w = torch.randn(e * n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        splits = torch.full((e,), n, device="cuda")
        assert (KG.current_teams(e * n, k, e, 2, w.device) is None) == (n * k * 2 > KG.CURRENT_L2_BYTES)
        row, col, scales, amax = KG.grouped_quantize_fp8_current(w, splits, E4M3, False, 0.0, True, True)
        amax_r = RG.grouped_tensor_amax(w, splits)
        scales_r = R.compute_fp8_scale(amax_r, E4M3.max)
        row_r, col_r, _ = RG.grouped_quantize_fp8_tensorwise(w, splits, scales_r, E4M3, True, True)
        _same(scales, scales_r, f"{e}x{n}x{k} scales")
        _same(row, row_r, f"{e}x{n}x{k} rows")
        _same(col, col_r, f"{e}x{n}x{k} columns")


if __name__ == "__main__":
    check_interpreted()
