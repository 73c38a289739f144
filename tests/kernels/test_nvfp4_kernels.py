"""The NVFP4 kernels on the GPU: bit for bit against the reference in every config.

- The random Hadamard transform is exactly rounded (`_tiles.rht16`), so the columnwise RHT copy,
  its scales and amax equal the reference's on normal, wide-range and mixed (NaN, inf) inputs,
  in bf16, fp16 and fp32, dense and grouped.
- Every exposed config of the quantize and amax launches (tile, warps, column tiles per program, columns a thread loads)
  gives the same bits: the reference's for round-to-nearest, and one another's for stochastic
  rounding with one seed (each value's draw depends only on its position).
- `_arith.rcp_rn`, the reciprocal without a division slow path, is 1/p rounded to nearest for
  every fp32 significand at the exponents that matter (subnormal to the top of the range).
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from qmoe.kernels import grouped_quantize as KG
from qmoe.kernels import quantize_nvfp4 as K4
from qmoe.kernels._arith import rcp_rn
from qmoe.reference import grouped_quantize as RG
from qmoe.reference import quantize_nvfp4 as R4
from tests.kernels.test_quantize_kernels import assert_all_same, make_input

pytestmark = pytest.mark.gpu

DEV = "cuda"
NAMES = ("row", "row_s", "amax", "col", "col_s", "col_amax")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["normal", "wide", "mixed"])
def test_rht_copy_exact(kind, dtype):
    x = make_input(512, 384, dtype, seed=30, kind=kind)
    assert_all_same(K4.quantize_nvfp4(x, False, True, True, rht=True),
                    R4.quantize_nvfp4(x, False, True, True, rht=True), NAMES)
    s = torch.tensor([128, 0, 48, 336], device=DEV)
    assert_all_same(KG.grouped_quantize_nvfp4(x, s, False, True, True, rht=True),
                    RG.grouped_quantize_nvfp4(x, s, False, True, True, rht=True), NAMES)


def _roles(x, xg, splits, odd_splits):
    """What each config must reproduce: (name, call)."""
    return (("input RHT", lambda: K4.quantize_nvfp4(x, False, True, True, True)),
            ("weight 16x16", lambda: K4.quantize_nvfp4(x, True, True, True)),
            ("grouped input RHT", lambda: KG.grouped_quantize_nvfp4(xg, splits, False, True, True, True)),
            ("grouped odd groups", lambda: KG.grouped_quantize_nvfp4(xg, odd_splits, False, True, True)),
            ("grad RHT + SR", lambda: K4.quantize_nvfp4(x, False, True, True, True, True,
                                                        torch.Generator(device=DEV).manual_seed(3))))


def test_every_config_same_bits():
    x = make_input(640, 1056, torch.bfloat16, seed=31, kind="mixed")  # several tiles, partial ones on both axes
    xg = make_input(1024, 512, torch.bfloat16, seed=32, kind="normal")
    splits = torch.tensor([256, 0, 32, 512, 224], device=DEV)
    odd_splits = torch.tensor([3, 0, 301, 1, 463, 256], device=DEV)
    want = {"input RHT": R4.quantize_nvfp4(x, False, True, True, True),
            "weight 16x16": R4.quantize_nvfp4(x, True, True, True),
            "grouped input RHT": RG.grouped_quantize_nvfp4(xg, splits, False, True, True, True),
            "grouped odd groups": RG.grouped_quantize_nvfp4(xg, odd_splits, False, True, True)}
    pairs = [(cast, K4._SMALL) for cast in [K4._SMALL] + K4.CAST_CONFIGS] + [(K4._SMALL, a) for a in K4.AMAX_CONFIGS]
    for cast, amax in pairs:
        with K4.forced_configs(cast=cast, amax=amax):
            for name, call in _roles(x, xg, splits, odd_splits):
                got = call()
                want.setdefault(name, got)  # stochastic rounding: the first config's bits
                assert_all_same(got, want[name], [f"{name} {cast} / {amax}: {n}" for n in NAMES])


@triton.jit
def _rcp_kernel(p_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, rcp_rn(tl.load(p_ptr + i, mask=i < N, other=1.0)), mask=i < N)


@pytest.mark.parametrize("exponent", [-149, -140, -127, -126, -64, -63, -1, 0, 63, 126, 127])
def test_rcp_rn_every_significand(exponent):
    mant = torch.arange(1 << 23, device=DEV, dtype=torch.int32)
    if exponent < -126:  # subnormal p: the significands scaled down
        p = (mant.view(torch.float32) * 2.0 ** (exponent + 149)).clamp_min(2.0 ** -149)
    else:
        p = ((mant | ((exponent + 127) << 23)).view(torch.float32))
    out = torch.empty_like(p)
    _rcp_kernel[(triton.cdiv(p.numel(), 1024),)](p, out, p.numel(), BLOCK=1024)
    want = torch.ones_like(p) / p
    same = out.view(torch.int32) == want.view(torch.int32)
    assert bool(same.all()), f"{(~same).sum().item()} reciprocals differ, e.g. p={p[~same][:4].tolist()}"
