"""The NVFP4 cast's E2M1 rounding (qmoe.kernels._e2m1.e2m1_codes) gives the reference's
codes (qmoe.reference.quantize_nvfp4.e2m1_codes) for every input: round to nearest even and
stochastic rounding with the same uniforms, through Triton's interpreter on every bfloat16
value, the grid points, the midpoints and their fp32 neighbours, and on the GPU for every fp32
value in [-6, 6]. Its direct rounding to grid values (e2m1_round, for copies held as values)
gives those codes' values, bit for bit (+0 for code 0)."""

import pytest
import torch
import triton
import triton.language as tl

from qmoe.contracts.formats import e2m1_decode
from qmoe.kernels._e2m1 import e2m1_codes, e2m1_round
from qmoe.reference import quantize_nvfp4 as R4
from tests.kernels.interpret import INTERPRETING, inside, launcher, assert_passed_under_interpreter

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_BLOCK = 1024
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # the E2M1 magnitudes


@triton.jit
def _codes_kernel(y_ptr, u_ptr, out_ptr, grid_ptr, n, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    y = tl.load(y_ptr + offs, mask=ok, other=0.0)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, e2m1_codes(y, STOCHASTIC, u).to(tl.uint8), mask=ok)
    tl.store(grid_ptr + offs, e2m1_round(y, STOCHASTIC, u), mask=ok)


def _kernel_codes(y: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    grid = torch.empty(y.shape, dtype=torch.float32, device=y.device)
    uu = u if u is not None else torch.zeros_like(y)
    _codes_kernel[(triton.cdiv(y.numel(), _BLOCK),)](y, uu, out, grid, y.numel(), STOCHASTIC=u is not None,
                                                     BLOCK=_BLOCK)
    return out, grid


def _assert_same(y: torch.Tensor, u: torch.Tensor | None):
    (got, grid), want = _kernel_codes(y, u), R4.e2m1_codes(y, u)
    for what, bad in (("codes", got != want),
                      ("grid values", grid.view(torch.int32) != e2m1_decode(want).view(torch.int32))):
        bad = bad.nonzero().flatten()
        if bad.numel():
            i = bad[0]
            pytest.fail(f"{bad.numel()} {what} differ; first: y={y[i].item()!r} (bits "
                        f"{y[i].view(torch.int32).item():#x}), u={None if u is None else u[i].item()}: got code "
                        f"{got[i].item()} / value {grid[i].item()}, want code {want[i].item()}")


def _special_values(device) -> torch.Tensor:
    """Every bfloat16 value clamped to [-6, 6] (NaNs kept), the E2M1 grid and its midpoints (the
    ties) with their fp32 neighbours, subnormals and signed zeros, each with both signs."""
    bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = torch.where(bf16.isnan(), bf16, bf16.clamp(-6.0, 6.0))
    grid = torch.tensor(GRID)
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([2.0 ** -149, 2.0 ** -126, 1e-30, 0.999999])])
    near = [points]
    for direction in (7.0, -1.0):
        q = points
        for _ in range(3):
            q = torch.nextafter(q, torch.tensor(direction))
            near.append(q)
    points = torch.cat(near).clamp(0.0, 6.0)
    return torch.cat([bf16, points, -points]).to(device)


def _random_values(n: int, device, seed: int) -> torch.Tensor:
    """n fp32 values with random bits in [0, 6], both signs."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 0x40C00001, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 31
    return (bits | sign).view(torch.float32).to(device)


def _uniforms(y: torch.Tensor, seed: int) -> torch.Tensor:
    """Uniforms in [0, 1) with 24 bits, as the cast draws them, plus the exact probability of
    rounding up for a quarter of the values (u == p must round down: up only when u < p)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << 24, y.shape, generator=g).float().to(y.device) / float(1 << 24)
    a = y.abs().clamp(max=6.0)
    grid = torch.tensor(GRID, device=y.device)
    lo_code = (torch.bucketize(a.nan_to_num(0.0).contiguous(), grid, right=True) - 1).clamp(0, 7)
    lo, hi = grid[lo_code], grid[(lo_code + 1).clamp(max=7)]
    p = torch.where(hi > lo, (a - lo) / (hi - lo), torch.zeros_like(a))
    exact = torch.arange(y.numel(), device=y.device) % 4 == 0
    return torch.where(exact & ~p.isnan(), p, u)


def _check_all(device):
    y = torch.cat([_special_values(device), _random_values(1 << 16, device, seed=0)])
    _assert_same(y, None)
    _assert_same(y, _uniforms(y, seed=1))
    _assert_same(y, torch.zeros_like(y))  # u = 0: up whenever p > 0
    _assert_same(y, torch.full_like(y, 1.0 - 2.0 ** -24))  # the largest uniform: up only when p is larger


@launcher
def test_e2m1_codes_under_the_interpreter():
    assert_passed_under_interpreter(__file__, r"\b1 passed, 3 skipped")


@inside
def test_e2m1_codes_equal_the_reference():
    _check_all("cpu")


@pytest.mark.skipif(INTERPRETING, reason="runs on the GPU")
@on_gpu
@pytest.mark.gpu
def test_e2m1_codes_equal_the_reference_on_the_gpu():
    _check_all("cuda")


@pytest.mark.skipif(INTERPRETING, reason="runs on the GPU")
@on_gpu
@pytest.mark.gpu
def test_e2m1_codes_of_every_fp32_value():
    """Every fp32 bit pattern from +0 to 6.0 and its negative, in chunks, RNE and stochastic."""
    top, chunk = 0x40C00000, 1 << 27
    g = torch.Generator(device="cuda").manual_seed(0)
    for start in range(0, top + 1, chunk):
        bits = torch.arange(start, min(start + chunk, top + 1), device="cuda", dtype=torch.int32)
        for sign in (0, -(1 << 31)):
            y = (bits | sign).view(torch.float32)
            _assert_same(y, None)
            u = torch.randint(0, 1 << 24, y.shape, device="cuda", generator=g).float() / float(1 << 24)
            _assert_same(y, u)
