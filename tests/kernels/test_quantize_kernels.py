"""Triton quantize kernels against the reference (qmoe.reference), on the GPU.

Bit for bit (codes as raw bytes, scales as raw bits, NaN payloads aside) for every
deterministic path: FP8 per tensor / 1x128 / 128x128, MXFP8, NVFP4 1x16 / 16x16, their
dequantization, and every grouped variant (odd sizes, empty groups, odd NVFP4 byte
boundaries). RHT: exact on inputs whose transform is exact in fp32, close otherwise.
Stochastic rounding: reproducible with a seed and unbiased. Grouped quantization runs under
`torch.cuda.set_sync_debug_mode("error")` and replays from a CUDA graph with new data and
new split sizes, equal to eager.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from qmoe import GroupedTensor
from qmoe.contracts.formats import E4M3, E5M2, ScaleMode, unpack_e2m1
from qmoe.kernels import grouped_quantize as KG
from qmoe.kernels import quantize as K
from qmoe.kernels import quantize_nvfp4 as K4
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from qmoe.reference import grouped_quantize as RG
from qmoe.reference import quantize as R
from qmoe.reference import quantize_nvfp4 as R4
from tests.kernels.scale_inputs import edge_amaxes

pytestmark = pytest.mark.gpu


DEV = "cuda"
ORIENTS = [(True, True), (True, False), (False, True)]
ORIENT_IDS = ["both", "row", "col"]
SHAPES = [(1, 2), (37, 130), (256, 384), (300, 200)]


# ---------------------------------------------------------------- inputs and comparisons

def make_input(m, k, dtype=torch.bfloat16, seed=0, kind="mixed"):
    """Random [m, k]: 'normal' values; 'wide' magnitudes 1e-30..1e30 (fp16: 1e-7..6e4) with zeros;
    'mixed' = normal rows, wide rows and a few NaN / +-inf."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEV) * 3
    lo, hi = (-7.0, 4.7) if dtype == torch.float16 else (-30.0, 30.0)
    wide = torch.pow(10.0, torch.rand(m, k, generator=g, device=DEV) * (hi - lo) + lo)
    wide = wide * torch.sign(torch.randn(m, k, generator=g, device=DEV))
    wide = torch.where(torch.rand(m, k, generator=g, device=DEV) < 0.05, torch.zeros_like(wide), wide)
    if kind == "wide":
        x = wide
    elif kind == "mixed":
        x = torch.where((torch.arange(m, device=DEV) % 3 == 1)[:, None], wide, x)
        r = torch.rand(m, k, generator=g, device=DEV)
        x = torch.where(r < 0.004, float("nan"), x)
        x = torch.where((r >= 0.004) & (r < 0.008), float("inf"), x)
        x = torch.where((r >= 0.008) & (r < 0.012), float("-inf"), x)
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same(got, want, what=""):
    """Equal raw bytes, except that two NaNs are equal whatever their sign and payload."""
    if want is None:
        assert got is None, f"{what}: expected None"
        return
    assert got is not None, f"{what}: got None"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.dtype in (torch.float32, torch.bfloat16, torch.float16):
        as_int = {4: torch.int32, 2: torch.int16}[got.element_size()]
        same = (got.view(as_int) == want.view(as_int)) | (torch.isnan(got) & torch.isnan(want))
    else:
        same = bits(got) == bits(want)
        if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # NaN stays NaN; its sign is no contract
            same |= torch.isnan(got.float()) & torch.isnan(want.float())
    if not bool(same.all()):
        bad = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {(~same).sum().item()} of {same.numel()} differ, e.g. at {bad}: "
                             f"{[got[tuple(i)].item() for i in bad]} vs {[want[tuple(i)].item() for i in bad]}")


def assert_all_same(got: tuple, want: tuple, names):
    for g, w, n in zip(got, want, names):
        assert_same(g, w, n)


# ---------------------------------------------------------------- FP8 per tensor

@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["normal", "wide", "mixed"])
def test_amax_and_scale(fmt, dtype, kind):
    x = make_input(300, 200, dtype, seed=1, kind=kind)
    assert_same(K.tensor_amax(x), R.tensor_amax(x), "amax")
    amax = torch.cat([R.tensor_amax(x).reshape(1), torch.tensor([0.0, 1e-40, 3e38, float("inf"), float("nan"), 5.5],
                                                                device=DEV)])
    amax = torch.cat([amax, edge_amaxes(DEV)])
    for p2 in (False, True):
        for eps in (0.0, 1e-3):
            assert_same(K.compute_fp8_scale(amax, fmt.max, p2, eps), R.compute_fp8_scale(amax, fmt.max, p2, eps),
                        f"scale p2={p2} eps={eps}")


@pytest.mark.parametrize("orient", ORIENTS, ids=ORIENT_IDS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_tensorwise(shape, fmt, orient):
    for dtype, kind in ((torch.bfloat16, "mixed"), (torch.float32, "wide"), (torch.float16, "normal")):
        x = make_input(*shape, dtype, seed=2, kind=kind)
        for scale in (R.compute_fp8_scale(R.tensor_amax(x), fmt.max), torch.tensor(3.0e5, device=DEV)):
            got = K.quantize_fp8_tensorwise(x, scale, fmt, *orient)
            want = R.quantize_fp8_tensorwise(x, scale, fmt, *orient)
            assert_all_same(got, want, ("row", "col", "amax"))


# ---------------------------------------------------------------- FP8 blocks

BLOCK_CASES = [  # (block_rows, power_2_scale, fmt, eps)
    (1, True, E4M3, 0.0), (1, False, E4M3, 0.0), (1, True, E5M2, 1e-4),
    (128, True, E4M3, 0.0), (128, False, E4M3, 0.0), (128, True, E5M2, 0.0)]


@pytest.mark.parametrize("orient", ORIENTS, ids=ORIENT_IDS)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}x128-p2{c[1]}-{c[2]}-eps{c[3]}")
def test_fp8_block(case, orient):
    br, p2, fmt, eps = case
    for i, (shape, dtype, kind) in enumerate((((300, 260), torch.bfloat16, "mixed"),
                                              ((129, 128), torch.float32, "wide"),
                                              ((1, 7), torch.bfloat16, "normal"))):
        x = make_input(*shape, dtype, seed=3 + i, kind=kind)
        got = K.quantize_fp8_block(x, br, 128, fmt, p2, eps, *orient)
        want = R.quantize_fp8_block(x, br, 128, fmt, p2, eps, *orient)
        assert_all_same(got, want, ("row", "row_si", "col", "col_si"))


# ---------------------------------------------------------------- every autotune config

CONFIG_CASES = {  # name: (kernel family, format, block rows / scale mode, power_2_scale); other formats and
    # modes run through the same code with other constants (the plain-tile tests above cover them)
    "block1x128-e4m3": ("block", E4M3, 1, True), "block128x128-e4m3-f32": ("block", E4M3, 128, False),
    "mxfp8-e4m3": ("mx", E4M3, ScaleMode.ROUND_UP, None), "tensorwise-e5m2": ("tensorwise", E5M2, None, None)}


def config_calls(case, splits):
    """(Autotuner, constexprs, kernel call(x, orient), reference call(x, orient)) of a CONFIG_CASES entry."""
    family, fmt, arg, p2 = CONFIG_CASES[case]
    s = None if splits is None else torch.tensor(splits, device=DEV)
    if family == "block":
        meta = dict(B=128, BLOCK_2D=arg == 128)
        if s is None:
            return (K._fp8_block_kernel, meta, lambda x, o: K.quantize_fp8_block(x, arg, 128, fmt, p2, 1e-4, *o),
                    lambda x, o: R.quantize_fp8_block(x, arg, 128, fmt, p2, 1e-4, *o))
        return (K._fp8_block_kernel, meta,
                lambda x, o: KG.grouped_quantize_fp8_block(x, s, arg, 128, fmt, p2, 1e-4, *o),
                lambda x, o: RG.grouped_quantize_fp8_block(x, s, arg, 128, fmt, p2, 1e-4, *o))
    if family == "mx":
        if s is None:
            return (K._mxfp8_kernel, dict(B=32), lambda x, o: K.quantize_mxfp8(x, fmt, arg, *o),
                    lambda x, o: R.quantize_mxfp8(x, fmt, arg, *o))
        return (K._mxfp8_kernel, dict(B=32), lambda x, o: KG.grouped_quantize_mxfp8(x, s, fmt, arg, *o),
                lambda x, o: RG.grouped_quantize_mxfp8(x, s, fmt, arg, *o))
    scale = torch.tensor(3.0e-2, device=DEV)
    if s is None:
        return (K._fp8_tensorwise_kernel, {}, lambda x, o: K.quantize_fp8_tensorwise(x, scale, fmt, *o),
                lambda x, o: R.quantize_fp8_tensorwise(x, scale, fmt, *o))
    scales = torch.linspace(1e-2, 3.0, len(splits), device=DEV)
    return (K._fp8_tensorwise_kernel, {}, lambda x, o: KG.grouped_quantize_fp8_tensorwise(x, s, scales, fmt, *o),
            lambda x, o: RG.grouped_quantize_fp8_tensorwise(x, s, scales, fmt, *o))


@pytest.mark.parametrize("orient", ORIENTS, ids=ORIENT_IDS)
@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_every_autotune_config(case, orient):
    """Each config the autotuner could pick (plain tiles, row quads, K-major order, chunks,
    register caps), forced one at a time, gives the reference's bits: dense with partial tiles
    and ragged K, and grouped with empty groups and odd group starts."""
    from qmoe.kernels._cast_variants import configs_for, forced_config
    for splits, (m, k) in ((None, (300, 260)), (SPLITS["odd_empty"], (261, 200))):
        kernel, meta, run, ref = config_calls(case, splits)
        x = make_input(m, k, torch.bfloat16, seed=50, kind="mixed")
        want = ref(x, orient)
        configs = configs_for(kernel, m, k, **meta, ROWWISE=orient[0], COLWISE=orient[1])
        assert configs
        if not orient[0]:  # columnwise alone: the plain tile and the first row-quad config (fewer compiles)
            configs = [configs[0]] + [c for c in configs if c.kwargs["QUAD"]][:1]
        for cfg in configs:
            with forced_config(kernel, cfg):
                got = run(x, orient)
            assert_all_same(got, want, [f"{case} grouped={splits is not None} {cfg} output {i}" for i in range(4)])


# ---------------------------------------------------------------- MXFP8

@pytest.mark.parametrize("orient", ORIENTS, ids=ORIENT_IDS)
@pytest.mark.parametrize("mode", list(ScaleMode), ids=lambda m: m.value)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_mxfp8(fmt, mode, orient):
    for i, (shape, dtype, kind) in enumerate((((300, 200), torch.bfloat16, "mixed"), ((64, 96), torch.float32, "wide"),
                                              ((33, 31), torch.float16, "normal"))):
        x = make_input(*shape, dtype, seed=5 + i, kind=kind)
        got = K.quantize_mxfp8(x, fmt, mode, *orient)
        want = R.quantize_mxfp8(x, fmt, mode, *orient)
        assert_all_same(got, want, ("row", "row_s", "col", "col_s"))


# ---------------------------------------------------------------- NVFP4

NV_ORIENTS = [(True, True), (True, False), (False, True)]


@pytest.mark.parametrize("orient", NV_ORIENTS, ids=ORIENT_IDS)
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("kind", ["normal", "wide", "mixed"])
def test_nvfp4(block_2d, orient, kind):
    for shape, dtype in (((96, 160), torch.bfloat16), ((34, 50), torch.float32)):
        x = make_input(*shape, dtype, seed=7, kind=kind)
        got = K4.quantize_nvfp4(x, block_2d, *orient)
        want = R4.quantize_nvfp4(x, block_2d, *orient)
        assert_all_same(got, want, ("row", "row_s", "amax", "col", "col_s", "col_amax"))


@pytest.mark.parametrize("order", ["row-then-both", "both-then-row"])
def test_autotuned_shape_in_every_orientation(order):
    """Shapes large enough to autotune, quantized in one orientation and then the other: a tile
    tuned for rowwise-only must never be reused where columnwise blocks need taller tiles (a
    regression: 1x128 and MXFP8 once failed to compile on the second call)."""
    from qmoe.kernels._launch import AUTOTUNE_MIN_ELEMENTS

    m, k = 2 * AUTOTUNE_MIN_ELEMENTS // 2048, 2048
    x = make_input(m, k, torch.bfloat16, seed=40, kind="normal")
    calls = {
        "block1x128": (lambda *o: K.quantize_fp8_block(x, 1, 128, E4M3, True, 0.0, *o),
                       lambda *o: R.quantize_fp8_block(x, 1, 128, E4M3, True, 0.0, *o)),
        "block128x128": (lambda *o: K.quantize_fp8_block(x, 128, 128, E4M3, True, 0.0, *o),
                         lambda *o: R.quantize_fp8_block(x, 128, 128, E4M3, True, 0.0, *o)),
        "mxfp8": (lambda *o: K.quantize_mxfp8(x, E4M3, ScaleMode.ROUND_UP, *o),
                  lambda *o: R.quantize_mxfp8(x, E4M3, ScaleMode.ROUND_UP, *o)),
        "nvfp4": (lambda *o: K4.quantize_nvfp4(x, False, *o), lambda *o: R4.quantize_nvfp4(x, False, *o)),
    }
    orients = [(True, False), (True, True)] if order == "row-then-both" else [(True, True), (True, False)]
    for name, (kernel, reference) in calls.items():
        for orient in orients:
            got, want = kernel(*orient), reference(*orient)
            assert_all_same(got, want, [f"{name} {orient}: {i}" for i in range(len(want))])


def exact_rht_input(m, k, dtype):
    """Small integers times a power of two: every Hadamard sum is exact in fp32."""
    g = torch.Generator(device=DEV).manual_seed(11)
    return (torch.randint(-8, 9, (m, k), generator=g, device=DEV).float() * 0.125).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nvfp4_rht_exact_inputs(dtype):
    x = exact_rht_input(128, 96, dtype)
    got = K4.quantize_nvfp4(x, False, True, True, rht=True)
    want = R4.quantize_nvfp4(x, False, True, True, rht=True)
    assert_all_same(got, want, ("row", "row_s", "amax", "col", "col_s", "col_amax"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nvfp4_rht_close(dtype):
    """Tensor-core sums differ from the float64 reference by fp32 roundings: a few codes move one step."""
    x = make_input(256, 512, dtype, seed=12, kind="normal")
    got = K4.quantize_nvfp4(x, False, False, True, rht=True)
    want = R4.quantize_nvfp4(x, False, False, True, rht=True)
    torch.testing.assert_close(got[5], want[5], rtol=1e-6, atol=0)
    moved = (unpack_e2m1(got[3]) != unpack_e2m1(want[3])).float().mean().item()
    assert moved < 2e-3, f"{moved:.2%} of RHT codes differ from the reference"
    assert (bits(got[4]) != bits(want[4])).float().mean().item() < 2e-3
    deq_got = R4.dequantize_nvfp4(got[3], got[4], got[5])
    deq_want = R4.dequantize_nvfp4(want[3], want[4], want[5])
    assert ((deq_got - deq_want).norm() / deq_want.norm()).item() < 1e-2


def test_nvfp4_stochastic_rounding():
    x = make_input(128, 256, torch.bfloat16, seed=13, kind="normal")
    g1 = torch.Generator(device=DEV).manual_seed(5)
    g2 = torch.Generator(device=DEV).manual_seed(5)
    a = K4.quantize_nvfp4(x, False, True, True, rht=True, stochastic=True, generator=g1)
    b = K4.quantize_nvfp4(x, False, True, True, rht=True, stochastic=True, generator=g2)
    assert_all_same(a, b, ("row", "row_s", "amax", "col", "col_s", "col_amax"))
    c = K4.quantize_nvfp4(x, False, True, True, rht=True, stochastic=True, generator=g1)
    assert not torch.equal(a[0], c[0]), "a second draw from the generator must differ"
    # Scales are those of round-to-nearest; codes average to the scaled value (unbiased).
    rn = K4.quantize_nvfp4(x, False, True, False)
    assert_same(a[1], rn[1], "SR row scales")
    y = torch.full((64, 256), 0.3, device=DEV)
    y[:, ::16] = 6.0  # block amax 6 -> block scale pins y's scaled values at 0.3 * enc
    mean = torch.zeros(64, 256, device=DEV, dtype=torch.float64)
    n = 64
    for _ in range(n):
        r = K4.quantize_nvfp4(y, False, True, False, stochastic=True, generator=g1)
        mean += R4.dequantize_nvfp4(r[0], r[1], r[2]).double()
    mean /= n
    rn_val = R4.dequantize_nvfp4(*K4.quantize_nvfp4(y, False, True, False)[:3]).double()
    target = y.double()
    err_sr = (mean - target)[:, 1:16].mean().abs().item()
    err_rn = (rn_val - target)[:, 1:16].mean().abs().item()
    assert err_sr < 0.01 * target[0, 1].item() and err_rn > 5 * err_sr, (err_sr, err_rn)


# ---------------------------------------------------------------- dequantization

@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequantize(out_dtype):
    x = make_input(300, 260, torch.bfloat16, seed=14, kind="mixed")
    r = R.quantize_fp8_tensorwise(x, torch.tensor(1.5e-2, device=DEV), E4M3, True, True)
    si = torch.tensor(1 / 1.5e-2, device=DEV)
    assert_same(K.dequantize_fp8_tensorwise(r[0], si, out_dtype), R.dequantize_fp8_tensorwise(r[0], si, out_dtype))
    for br in (1, 128):
        r = R.quantize_fp8_block(x, br, 128, E4M3, True, 0.0, True, True)
        assert_same(K.dequantize_fp8_block(r[0], r[1], br, 128, out_dtype),
                    R.dequantize_fp8_block(r[0], r[1], br, 128, out_dtype), f"block {br} row")
        assert_same(K.dequantize_fp8_block(r[2], r[3], br, 128, out_dtype),
                    R.dequantize_fp8_block(r[2], r[3], br, 128, out_dtype), f"block {br} col")
    r = R.quantize_mxfp8(x, E5M2, ScaleMode.ROUND_UP, True, True)
    assert_same(K.dequantize_mxfp8(r[2], r[3], out_dtype), R.dequantize_mxfp8(r[2], r[3], out_dtype), "mx col")
    for block_2d in (False, True):
        r = R4.quantize_nvfp4(x.float().nan_to_num(0.0, 1e4, -1e4), block_2d, True, True)
        assert_same(K4.dequantize_nvfp4(r[3], r[4], r[5], block_2d, out_dtype),
                    R4.dequantize_nvfp4(r[3], r[4], r[5], block_2d, out_dtype), f"nvfp4 2d={block_2d}")


# ---------------------------------------------------------------- grouped

SPLITS = {"odd_empty": [0, 37, 1, 0, 130, 64, 0, 29], "one": [261], "aligned": [128, 0, 256, 64]}
NV_SPLITS = {"odd_bytes": [3, 0, 13, 16, 1, 31, 0, 30], "aligned": [128, 0, 32, 96], "one": [94]}


def grouped_input(splits, k, dtype=torch.bfloat16, seed=20, kind="mixed"):
    s = torch.tensor(splits, device=DEV)
    return make_input(int(sum(splits)), k, dtype, seed=seed, kind=kind), s


@pytest.mark.parametrize("orient", ORIENTS, ids=ORIENT_IDS)
@pytest.mark.parametrize("name", list(SPLITS))
def test_grouped_fp8(name, orient):
    x, s = grouped_input(SPLITS[name], 200)
    assert_same(KG.grouped_tensor_amax(x, s), RG.grouped_tensor_amax(x, s), "amax")
    scales = R.compute_fp8_scale(RG.grouped_tensor_amax(x, s), E4M3.max)
    assert_all_same(KG.grouped_quantize_fp8_tensorwise(x, s, scales, E4M3, *orient),
                    RG.grouped_quantize_fp8_tensorwise(x, s, scales, E4M3, *orient), ("row", "col", "amax"))
    for br, p2 in ((1, True), (128, True), (128, False)):
        assert_all_same(KG.grouped_quantize_fp8_block(x, s, br, 128, E4M3, p2, 0.0, *orient),
                        RG.grouped_quantize_fp8_block(x, s, br, 128, E4M3, p2, 0.0, *orient),
                        (f"{br} row", f"{br} row_s", f"{br} col", f"{br} col_s"))
    for mode in ScaleMode:
        assert_all_same(KG.grouped_quantize_mxfp8(x, s, E5M2, mode, *orient),
                        RG.grouped_quantize_mxfp8(x, s, E5M2, mode, *orient), ("row", "row_s", "col", "col_s"))


@pytest.mark.parametrize("orient", NV_ORIENTS, ids=ORIENT_IDS)
@pytest.mark.parametrize("name", list(NV_SPLITS))
def test_grouped_nvfp4(name, orient):
    x, s = grouped_input(NV_SPLITS[name], 96, kind="normal" if name == "one" else "mixed")
    for block_2d in (False, True):
        assert_all_same(KG.grouped_quantize_nvfp4(x, s, block_2d, *orient),
                        RG.grouped_quantize_nvfp4(x, s, block_2d, *orient),
                        ("row", "row_s", "amax", "col", "col_s", "col_amax"))


def test_grouped_nvfp4_rht_exact_inputs():
    splits = [32, 0, 16, 80]
    x, s = exact_rht_input(128, 64, torch.bfloat16), torch.tensor(splits, device=DEV)
    assert_all_same(KG.grouped_quantize_nvfp4(x, s, False, True, True, rht=True),
                    RG.grouped_quantize_nvfp4(x, s, False, True, True, rht=True),
                    ("row", "row_s", "amax", "col", "col_s", "col_amax"))


# ---------------------------------------------------------------- the op tier: host syncs and CUDA graphs

def deterministic_quantizers():
    yield "delayed", DelayedScaling().quantizer("grad_output")
    yield "current", Float8CurrentScaling().quantizer("input")
    yield "block1x128", Float8BlockScaling().quantizer("input")
    yield "block128x128", Float8BlockScaling().quantizer("weight")
    yield "mxfp8", MXFP8BlockScaling().quantizer("input")
    yield "nvfp4_rht", NVFP4BlockScaling().quantizer("input")
    yield "nvfp4_2d", NVFP4BlockScaling().quantizer("weight")


def grouped_parts(gt: GroupedTensor):
    return [t for t in (gt.rowwise_data, gt.rowwise_scale_inv, gt.columnwise_data, gt.columnwise_scale_inv,
                        gt.amax, gt.columnwise_amax) if t is not None]


def test_backend_picks_kernels():
    from qmoe.dispatch import GROUPED_QUANTIZE, QUANTIZE
    x = torch.zeros(2, 2, device=DEV)
    assert inspect.unwrap(QUANTIZE.pick("quantize_mxfp8", x)) is K.quantize_mxfp8
    assert GROUPED_QUANTIZE.pick("grouped_quantize_nvfp4", x) is KG.grouped_quantize_nvfp4


def test_grouped_quantize_never_syncs():
    x, s = grouped_input([0, 48, 16, 0, 64], 256, seed=30, kind="normal")
    quantizers = list(deterministic_quantizers()) + [("nvfp4_sr", NVFP4BlockScaling().quantizer("grad_output"))]
    for _, q in quantizers:  # warm up: compile outside the checked region
        GroupedTensor.quantize(x, s, q, validate=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, q in quantizers:
            GroupedTensor.quantize(x, s, q, rowwise=True, columnwise=True, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("name,q", list(deterministic_quantizers()), ids=lambda v: v if isinstance(v, str) else "")
def test_grouped_cuda_graph_replay(name, q):
    k, first, second = 256, [0, 48, 16, 0, 64], [64, 16, 0, 32, 16]
    x_static, s_static = grouped_input(first, k, seed=31, kind="normal")
    GroupedTensor.quantize(x_static, s_static, q, validate=False)  # compile and create state first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = GroupedTensor.quantize(x_static, s_static, q, validate=False)
    x_new, s_new = grouped_input(second, k, seed=32, kind="mixed")
    x_static.copy_(x_new)
    s_static.copy_(s_new)
    graph.replay()
    eager = GroupedTensor.quantize(x_new, s_new, q, validate=False)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(grouped_parts(captured), grouped_parts(eager))):
        assert_same(a, b, f"{name} part {i}")


def test_custom_ops_have_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(96, 160, device=DEV, dtype=torch.bfloat16)
        s = torch.empty(3, device=DEV, dtype=torch.int64)
        row, rs, col, cs = torch.ops.qmoe.quantize_mxfp8(x, s, 3, torch.float8_e4m3fn, 448.0, 8, True, 32, True, True)
        assert row.shape == (96, 160) and rs.shape == (96, 5) and col.shape == (160, 96) and cs.shape == (160, 6)
        out = torch.ops.qmoe.quantize_nvfp4(x, None, 1, False, True, True, True, None)
        assert [tuple(t.shape) for t in out] == [(96, 80), (96, 10), (1,), (160, 48), (160, 6), (1,)]
        row, rs, col, cs = torch.ops.qmoe.quantize_fp8_block(x, None, 1, 128, 128, torch.float8_e4m3fn, 448.0, True,
                                                             0.0, True, True)
        assert rs.shape == (1, 2) and cs.shape == (2, 1)


def _record_dispatch(monkeypatch, families):
    """Every function the families' tables hand out, wrapped to log (kernel or reference, name)."""
    ran = []

    def logged(fn, kind, name):
        def run(*args, **kwargs):
            ran.append((kind, name))
            return fn(*args, **kwargs)
        return fn and run

    for family in families:
        monkeypatch.setattr(family, "table", {name: (logged(k, "kernel", name), logged(r, "reference", name))
                                              for name, (k, r) in family.table.items()})
    return ran


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
                                    NVFP4BlockScaling(disable_rht=True)], ids=["current", "block", "mxfp8", "nvfp4"])
def test_quantizer_roundtrip_uses_kernels(recipe, monkeypatch):
    """The op tier end to end: recipe quantizers on the GPU run the Triton kernels, quantize and
    dequantize (no reference twin runs), and give the reference's bits (NUMERICS.md)."""
    from qmoe.dispatch import QUANTIZE, QUANTIZE_NVFP4
    x = make_input(256, 384, torch.bfloat16, seed=40, kind="normal")
    want = recipe.quantizer("input").quantize(x.cpu(), rowwise=True, columnwise=True)  # the reference, on the CPU
    ran = _record_dispatch(monkeypatch, (QUANTIZE, QUANTIZE_NVFP4))
    qt = recipe.quantizer("input").quantize(x, rowwise=True, columnwise=True)
    deq = qt.dequantize(torch.float32)
    assert ran and {kind for kind, _ in ran} == {"kernel"}, ran
    assert any(name.startswith("quantize") for _, name in ran) and ran[-1][1].startswith("dequantize"), ran
    for part in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax"):
        got = getattr(qt, part)
        assert_same(got if got is None else got.cpu(), getattr(want, part), part)
    assert_same(deq.cpu(), want.dequantize(torch.float32), "dequantized")
