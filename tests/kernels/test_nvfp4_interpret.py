"""The NVFP4 kernels on CPU, under Triton's interpreter (TRITON_INTERPRET=1), bit for bit.

- Arithmetic pieces against torch / the reference on edge values: E4M3 block scales (ties,
  subnormals, saturation, NaN), E2M1 codes (grid points, ties, their neighbours, +-0, inf, NaN),
  the reciprocal without a division slow path, the exactly rounded Hadamard transform (bf16,
  fp16, fp32; normal, wide-range, inf / NaN / zero / tiny runs) and the faster Philox.
- Every exposed config of the quantize and amax launches: codes, scales and amaxes of an input
  (RHT) and a weight (16x16) equal to the reference on random data with NaN and inf, grouped
  with empty and odd groups; stochastic rounding with one seed gives the same bits in every
  config (each value's draw depends on its position only).
- The columnwise amax after the Hadamard transform has the same bits whatever the launch: every
  amax config, the small-problem config, and the fused activation (an ActivatedRows input)
  against the activation computed first, on fp32 and bf16.
Runs in a subprocess so the interpreter switch never leaks into other tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_nvfp4_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-W", "ignore", __file__], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all nvfp4 interpreter checks passed" in proc.stdout


# ---------------------------------------------------------------- the checks (run in the subprocess)

NAMES = ("row", "row_s", "amax", "col", "col_s", "col_amax")


def _same(got, want, what):
    import torch
    assert (got is None) == (want is None), what
    if got is None:
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype == torch.float32:
        same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    else:
        same = got.view(torch.uint8) == want.view(torch.uint8)
    assert bool(same.all()), f"{what}: {(~same).sum().item()} of {same.numel()} differ"


def _all_same(got, want, what):
    for g, w, n in zip(got, want, NAMES):
        _same(g, w, f"{what} {n}")


if os.environ.get("TRITON_INTERPRET") == "1":  # the subprocess: the small kernels the checks launch
    import triton
    import triton.language as tl

    from qmoe.kernels._arith import rcp_rn
    from qmoe.kernels._nvfp4_tiles import e2m1_codes, e4m3_rne, pack8
    from qmoe.kernels._tiles import philox4x, rht16

    @triton.jit
    def _elementwise_kernel(a_ptr, b_ptr, out_ptr, OP: tl.constexpr):
        i = tl.arange(0, 256)
        a = tl.load(a_ptr + i)
        if OP == 0:
            out = e4m3_rne(a)[1]
        elif OP == 1:
            out = e4m3_rne(a)[0]
        elif OP == 2:  # packed as stored (-0 cleared there), then unpacked
            w = pack8(tl.reshape(e2m1_codes(a, tl.load(b_ptr + i), False, 0.0), (32, 8)), 32)
            out = tl.reshape((w[:, None] >> (4 * tl.arange(0, 8))[None, :]) & 0xF, (256,))
        else:
            out = rcp_rn(a)
        tl.store(out_ptr + i, out)

    @triton.jit
    def _rht_kernel(x_ptr, y_ptr, N: tl.constexpr, SIGN_MASK: tl.constexpr):
        offs = tl.arange(0, N)[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(y_ptr + offs, rht16(tl.load(x_ptr + offs), N, SIGN_MASK))

    @triton.jit
    def _philox_kernel(seed_ptr, offs_ptr, a_ptr, b_ptr):
        i = tl.arange(0, 128)
        o = tl.load(offs_ptr + i)
        a0, a1, a2, a3 = tl.randint4x(tl.load(seed_ptr), o)
        b0, b1, b2, b3 = philox4x(tl.load(seed_ptr), o)
        tl.store(a_ptr + i, a0 ^ (a1 << 1) ^ (a2 << 2) ^ (a3 << 3))
        tl.store(b_ptr + i, b0 ^ (b1 << 1) ^ (b2 << 2) ^ (b3 << 3))


def _elementwise(op, a, b, out_dtype):
    """op in {e4m3_bits, e4m3_value, e2m1, rcp} applied by a one-program kernel to 256 values."""
    import torch
    out = torch.empty(256, dtype=out_dtype)
    _elementwise_kernel[(1,)](a, b, out, ["e4m3_bits", "e4m3_value", "e2m1", "rcp"].index(op))
    return out


def _grid_values():
    """fp32 values around every E2M1 and E4M3 rounding point, and specials (256)."""
    import torch
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)
    mids = torch.tensor([.25, .75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
    pts = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(9.0)),
                     torch.tensor([6.5, 1e30, float("inf"), float("nan"), 2 ** -130, 2 ** -149])])
    g = torch.Generator().manual_seed(0)
    rest = torch.rand(256 - 2 * len(pts), generator=g) * 7
    v = torch.cat([pts, -pts, rest])
    return v


def check_arithmetic():
    import torch
    from qmoe.contracts.formats import E4M3
    from qmoe.reference import quantize_nvfp4 as R4
    from qmoe.reference.quantize import cast_satfinite

    # E4M3 of block amaxes: RNE, saturating, subnormals, NaN
    g = torch.Generator().manual_seed(1)
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every value
    mid = ((e4[:-1] + e4[1:]) / 2)[::2]  # ties
    v = torch.cat([e4, mid, torch.tensor([500.0, 3e38, float("inf"), float("nan"), 2.0 ** -12])])
    v = torch.cat([v, torch.rand(256 - len(v), generator=g) * 460])
    got = _elementwise("e4m3_bits", v, v, torch.uint8)
    _same(got, cast_satfinite(v, E4M3).view(torch.uint8), "e4m3 bits")
    got = _elementwise("e4m3_value", v, v, torch.float32)
    _same(got, cast_satfinite(v, E4M3).float(), "e4m3 value")

    # E2M1 round to nearest even, sign and -0 (codes packed, as stored)
    y = _grid_values()
    a = y.abs().clamp(max=6.0)
    mag = R4.e2m1_round_nearest(a)
    mag = torch.where(torch.isnan(y), torch.zeros_like(mag), mag)
    want = torch.where((y < 0) & (mag != 0), mag | 8, mag).to(torch.int32)
    lim = torch.where(torch.isnan(y), 0.0, 6.0)  # a NaN comes only in a NaN block, whose clamp is 0

    got = _elementwise("e2m1", y, lim, torch.int32)
    _same(got.view(torch.float32), want.view(torch.float32), "e2m1 codes")

    # 1 / p rounded to nearest without a division slow path
    exps = torch.randint(-149, 128, (256,), generator=g).float()
    p = (torch.rand(256, generator=g) + 1) * torch.exp2(exps)
    p[:8] = torch.tensor([1.0, 2.0 ** -149, 2.0 ** -126, 3.4e38, 2.0 ** 127, 1.5, 3.0, 2.0 ** -64])
    got = _elementwise("rcp", p, p, torch.float32)
    _same(got, torch.ones(256) / p, "rcp_rn")


def check_hadamard_and_philox():
    import torch
    from qmoe.kernels._tiles import RHT_SIGN_MASK
    from qmoe.reference.quantize_nvfp4 import random_hadamard_transform

    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        small, big = (1e-7, 6e4) if dtype == torch.float16 else (1e-30, 3e38)
        for kind in ("normal", "wide", "special"):
            x = torch.randn(64, 16, generator=g)
            if kind == "wide":
                lo, hi = (-7.0, 4.7) if dtype == torch.float16 else (-30.0, 30.0)
                x = torch.pow(10.0, torch.rand(64, 16, generator=g) * (hi - lo) + lo) * torch.sign(x)
                x[torch.rand(64, 16, generator=g) < 0.05] = 0
            elif kind == "special":
                x[0, 3] = float("inf")
                x[1, 3], x[1, 5] = float("inf"), -float("inf")
                x[2, 7] = float("nan")
                x[3] = 0
                x[4] *= small  # tiny runs (bf16 subnormals excepted: the interpreter converts them wrongly)
                x[5, 2] = big
                x[6], x[6, 0] = small, 1.0  # a span wider than the fp32 split's
                if dtype == torch.float32:
                    x[7] *= 1e-40
            x = x.to(dtype)
            y = torch.empty(64, 16)
            _rht_kernel[(1,)](x, y, 64, RHT_SIGN_MASK)
            _same(y, random_hadamard_transform(x.float()), f"rht16 {dtype} {kind}")

    seed = torch.randint(0, 2 ** 62, (1,), generator=g)
    offs = torch.randint(0, 2 ** 40, (128,), generator=g)
    a, b = torch.empty(128, dtype=torch.int32), torch.empty(128, dtype=torch.int32)
    _philox_kernel[(1,)](seed, offs, a, b)
    assert torch.equal(a, b), "philox4x must be tl.randint4x"


def _mixed(m, k, seed):
    """bf16 [m, k]: normal values of varied magnitude, a zero row, NaN and +-inf."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g))
    r = torch.rand(m, k, generator=g)
    x[r < 0.003] = float("nan")
    x[(r >= 0.003) & (r < 0.006)] = float("inf")
    x[(r >= 0.006) & (r < 0.009)] = -float("inf")
    x[3] = 0.0
    return x.to(torch.bfloat16)


def check_every_config():
    import torch
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.kernels import quantize_nvfp4 as K4
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize_nvfp4 as R4
    x = _mixed(48, 144, seed=3)  # K: a partial 16-block and a partial tile
    xg = _mixed(80, 96, seed=4)
    rht_splits, odd_splits = torch.tensor([0, 48, 0, 32]), torch.tensor([3, 0, 13, 1, 31, 0, 32])
    want = {"input": RG.grouped_quantize_nvfp4(xg, rht_splits, False, True, True, True),
            "weight": R4.quantize_nvfp4(x, True, True, True),
            "odd": RG.grouped_quantize_nvfp4(xg, odd_splits, False, True, True)}
    sr = None
    for cast in [K4._SMALL] + K4.CAST_CONFIGS:
        with K4.forced_configs(cast=cast, amax=K4.AMAX_CONFIGS[0]):
            what = f"config {cast.kwargs} w{cast.num_warps}"
            _all_same(KG.grouped_quantize_nvfp4(xg, rht_splits, False, True, True, True), want["input"],
                      f"{what} grouped input (RHT)")
            _all_same(K4.quantize_nvfp4(x, True, True, True), want["weight"], f"{what} weight 16x16")
            _all_same(KG.grouped_quantize_nvfp4(xg, odd_splits, False, True, True), want["odd"],
                      f"{what} grouped odd groups")
            got = K4.quantize_nvfp4(x[:32, :128], False, True, True, True, True, torch.Generator().manual_seed(7))
            if sr is None:
                sr = got
            _all_same(got, sr, f"{what} stochastic rounding against the first config")


def check_rht_amax_any_launch():
    import torch
    from qmoe.contracts.carriers import ActivatedRows
    from qmoe.kernels import activation as KA
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.kernels import quantize_nvfp4 as K4
    from qmoe.reference.quantize_nvfp4 import finite_amax, random_hadamard_transform
    g = torch.Generator().manual_seed(5)
    splits = torch.tensor([32, 0, 16])
    for dtype in (torch.float32, torch.bfloat16):
        h = (torch.randn(48, 128, generator=g) * 2).to(dtype)
        probs = torch.rand(48, generator=g)
        act = KA.scaled_activation_forward(h, probs, "swiglu", None)
        want = torch.stack([finite_amax(random_hadamard_transform(act[a:b].float().t().contiguous()))
                            for a, b in ((0, 32), (32, 32), (32, 48))])
        for amax in [K4._SMALL] + K4.AMAX_CONFIGS:
            with K4.forced_configs(cast=K4._SMALL, amax=amax):
                for name, x in (("unfused", act), ("fused", ActivatedRows(h, probs, "swiglu", None))):
                    got = KG.grouped_quantize_nvfp4(x, splits, False, False, True, True)[5]
                    _same(got, want, f"{dtype} {name} RHT amax, amax config {amax.kwargs}")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_arithmetic()
    check_hadamard_and_philox()
    check_rht_amax_any_launch()
    check_every_config()
    print("all nvfp4 interpreter checks passed")
