"""Every autotune config of the FP8 / MXFP8 cast kernels gives the reference's bits, under Triton's
interpreter (TRITON_INTERPRET=1) on the CPU, each config forced (`_cast_variants.forced_config`)
rather than the one the autotuner would pick.

The interpreter mis-rounds float -> fp8 casts, so the inputs are +-(1 + j/8) 2^e with e in a
window of 8 binades along any row or column: every power-of-two scale that brings a block amax
into (224, 448] keeps each scaled value an exact E4M3 number, and the codes must match the
reference bit for bit (scales and amaxes always). NaN and +-inf sit in the dense input: their
own codes (the interpreter casts NaN wrongly) and MXFP8 runs holding inf (scaled far below the
smallest subnormal) are left to the GPU tests (as are E5M2 codes); their scales are checked here. Cases: dense with
partial row tiles and ragged K, grouped with empty groups and group starts at odd rows (the
masked store paths), every orientation, and the expert activation fused into the load.
Runs in subprocesses so the interpreter switch never leaks into other tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("part", ["dense", "grouped"])
def test_every_config_under_interpreter(part):
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-W", "ignore", __file__, part], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{part}: every config passed" in proc.stdout


# ---------------------------------------------------------------- the checks (run in the subprocess)

def exact_input(m, k, seed=0, specials=True):
    """+-(1 + j/8) 2^e (a few zeros), e = [0, 3] + a row offset + a column offset in [-2, 2]."""
    import torch
    g = torch.Generator().manual_seed(seed)
    mant = 1 + torch.randint(0, 8, (m, k), generator=g).float() / 8
    e = (torch.randint(0, 4, (m, k), generator=g) + torch.randint(-2, 3, (m, 1), generator=g)
         + torch.randint(-2, 3, (1, k), generator=g))
    x = mant * torch.exp2(e.float()) * torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    x = torch.where(torch.rand(m, k, generator=g) < 0.03, torch.zeros_like(x), x)
    if specials:
        x[3, 5], x[7, 1], x[1, 7], x[m - 1, k - 1] = float("nan"), float("inf"), -float("inf"), 0.0
    return x


def runs_holding(bad, b):
    """Elements of a [r, c] mask's runs of b along the last axis that hold a True."""
    import torch
    r, c = bad.shape
    pad = torch.nn.functional.pad(bad, (0, -c % b)).reshape(r, -1, b)
    return pad.any(2, keepdim=True).expand(-1, -1, b).reshape(r, -1)[:, :c]


def same(got, want, what, skip=None):
    import torch
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype == torch.float32:
        ok = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    else:
        ok = got.view(torch.uint8) == want.view(torch.uint8)
    if skip is not None:
        ok |= skip
    assert bool(ok.all()), f"{what}: {(~ok).sum().item()} of {ok.numel()} differ at {(~ok).nonzero()[:4].tolist()}"


def families(splits):
    """(name, Autotuner, constexprs, kernel call(x, orient), reference call(x, orient), output names)."""
    import torch
    from qmoe.contracts.formats import E4M3, ScaleMode
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.kernels import quantize as K
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize as R
    blocks = ("row", "row_s", "col", "col_s")
    if splits is None:
        yield ("block1x128", K._fp8_block_kernel, dict(B=128, BLOCK_2D=False),
               lambda x, o: K.quantize_fp8_block(x, 1, 128, E4M3, True, 0.0, *o),
               lambda x, o: R.quantize_fp8_block(x, 1, 128, E4M3, True, 0.0, *o), blocks)
        yield ("block128x128", K._fp8_block_kernel, dict(B=128, BLOCK_2D=True),
               lambda x, o: K.quantize_fp8_block(x, 128, 128, E4M3, True, 0.0, *o),
               lambda x, o: R.quantize_fp8_block(x, 128, 128, E4M3, True, 0.0, *o), blocks)
        yield ("mxfp8", K._mxfp8_kernel, dict(B=32), lambda x, o: K.quantize_mxfp8(x, E4M3, ScaleMode.ROUND_UP, *o),
               lambda x, o: R.quantize_mxfp8(x, E4M3, ScaleMode.ROUND_UP, *o), blocks)
        yield ("tensorwise", K._fp8_tensorwise_kernel, {},
               lambda x, o: K.quantize_fp8_tensorwise(x, torch.tensor(0.5), E4M3, *o),
               lambda x, o: R.quantize_fp8_tensorwise(x, torch.tensor(0.5), E4M3, *o), ("row", "col", "amax"))
        return
    s = torch.tensor(splits)
    scales = torch.exp2(-torch.arange(len(splits)).float() % 3)
    yield ("block1x128", K._fp8_block_kernel, dict(B=128, BLOCK_2D=False),
           lambda x, o: KG.grouped_quantize_fp8_block(x, s, 1, 128, E4M3, True, 0.0, *o),
           lambda x, o: RG.grouped_quantize_fp8_block(x, s, 1, 128, E4M3, True, 0.0, *o), blocks)
    yield ("block128x128", K._fp8_block_kernel, dict(B=128, BLOCK_2D=True),
           lambda x, o: KG.grouped_quantize_fp8_block(x, s, 128, 128, E4M3, True, 0.0, *o),
           lambda x, o: RG.grouped_quantize_fp8_block(x, s, 128, 128, E4M3, True, 0.0, *o), blocks)
    yield ("mxfp8", K._mxfp8_kernel, dict(B=32),
           lambda x, o: KG.grouped_quantize_mxfp8(x, s, E4M3, ScaleMode.FLOOR, *o),
           lambda x, o: RG.grouped_quantize_mxfp8(x, s, E4M3, ScaleMode.FLOOR, *o), blocks)
    yield ("tensorwise", K._fp8_tensorwise_kernel, {},
           lambda x, o: KG.grouped_quantize_fp8_tensorwise(x, s, scales, E4M3, *o),
           lambda x, o: RG.grouped_quantize_fp8_tensorwise(x, s, scales, E4M3, *o), ("row", "col", "amax"))


def tail_past_groups(x, splits, skip):
    """FP8 per tensor with rows past the last group (a capacity tail of NaN): every config gives the
    groups' codes and amaxes as if the tail were not there."""
    import torch
    from qmoe.contracts.formats import E4M3
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.kernels import quantize as K
    from qmoe.kernels._cast_variants import configs_for, forced_config
    from qmoe.reference import grouped_quantize as RG
    m, k = x.shape
    s, scales = torch.tensor(splits), torch.exp2(-torch.arange(len(splits)).float() % 3)
    xt = torch.cat([x, torch.full((9, k), float("nan"))])
    want = RG.grouped_quantize_fp8_tensorwise(x, s, scales, E4M3, True, True)
    for cfg in configs_for(K._fp8_tensorwise_kernel, m + 9, k, ROWWISE=True, COLWISE=True):
        with forced_config(K._fp8_tensorwise_kernel, cfg):
            row, col, amax = KG.grouped_quantize_fp8_tensorwise(xt, s, scales, E4M3, True, True)
        same(row[:m], want[0], f"tail {cfg} row", skip["row"])
        same(col[:, :m], want[1], f"tail {cfg} col", skip["col"])
        same(amax, want[2], f"tail {cfg} amax")
    print("grouped tensorwise: rows past the last group", flush=True)


def check(part):
    import torch
    from qmoe.contracts.carriers import ActivatedRows
    from qmoe.kernels import activation as KA
    from qmoe.kernels._cast_variants import configs_for, forced_config
    splits = None if part == "dense" else [0, 37, 1, 0, 130, 64, 3]
    x = exact_input(136, 264) if splits is None else exact_input(sum(splits), 200, seed=1, specials=False)
    m, k = x.shape
    nonfinite = ~torch.isfinite(x)
    codes_skip = {"row": torch.isnan(x), "col": torch.isnan(x).T}
    mx_skip = {"row": runs_holding(nonfinite, 32), "col": runs_holding(nonfinite.T, 32)}
    orients = [(True, True), (True, False)] + ([(False, True)] if splits is None else [])
    for name, kernel, meta, run, ref, names in families(splits):
        skip = mx_skip if name == "mxfp8" else codes_skip
        for orient in orients:
            want = ref(x, orient)
            configs = configs_for(kernel, m, k, **meta, ROWWISE=orient[0], COLWISE=orient[1])
            if orient == (False, True):  # columnwise alone: the plain tile and the first row-quad config
                configs = [configs[0]] + [c for c in configs if c.kwargs["QUAD"]][:1]
            for cfg in configs:
                with forced_config(kernel, cfg):
                    got = run(x, orient)
                for a, b, n in zip(got, want, names):
                    if b is not None:
                        same(a, b, f"{part} {name} {orient} {cfg} {n}", skip.get(n))
            print(f"{part} {name} {orient}: {len(configs)} configs", flush=True)
    if splits is not None:  # the expert activation fused into the row-quad loads, against the same config unfused
        g = torch.Generator().manual_seed(2)
        h = (torch.randn(m, 2 * k, generator=g) * 3).to(torch.bfloat16)
        probs = torch.rand(m, generator=g)
        a = KA.scaled_activation_forward(h, probs, "swiglu", None)
        for name, kernel, meta, run, _, names in families(splits):
            cfg = [c for c in configs_for(kernel, m, k, **meta, ROWWISE=True, COLWISE=True) if c.kwargs["QUAD"]][0]
            with forced_config(kernel, cfg):
                for got, want, n in zip(run(ActivatedRows(h, probs, "swiglu", None), (True, True)),
                                        run(a, (True, True)), names):
                    same(got, want, f"fused swiglu {name} {cfg} {n}")
        print(f"{part}: fused activation", flush=True)
        tail_past_groups(x, splits, codes_skip)
    print(f"{part}: every config passed")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check(sys.argv[1])


def test_grouped_per_tensor_cast_refuses_more_groups_than_it_counts():
    """Its group lookup counts two rows' groups in the halves of one int32: 2^15 groups and more
    raise before anything is allocated or launched, naming the limit."""
    import torch
    from qmoe.contracts.errors import UnsupportedError
    from qmoe.kernels.quantize import MAX_TENSORWISE_GROUPS, fp8_tensorwise_op
    g = MAX_TENSORWISE_GROUPS
    with pytest.raises(UnsupportedError, match=str(g)):
        fp8_tensorwise_op(torch.zeros(4, 16), torch.ones(g), torch.zeros(g, dtype=torch.int64), g,
                          torch.float8_e4m3fn, 448.0, True, True)
