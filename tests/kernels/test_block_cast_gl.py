"""The Gluon FP8 block and MXFP8 cast (qmoe/kernels/_cast_transpose_gl.py) gives the reference's
bits, and fp8_block_op / mxfp8_op dispatch it exactly where it applies.

On the GPU: 1x128 and 128x128 blocks, both orientations and the columnwise copy alone, bf16 /
fp16 / fp32 inputs with NaN and +-inf, rows and columns that are not tile multiples, groups that
are empty or start off a 16-row boundary (whose columnwise codes take the masked store), and
persistent programs that loop over many tiles through every slot of the load ring, in either
tile order (bands of row tiles, the last one cut short, included); MXFP8 of bf16 with both scale
modes, blocks cut by K and groups that are not multiples of 32 rows. Gluon has no interpreter:
the dispatch decisions and the fallbacks are checked on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from qmoe.contracts.formats import E4M3, E5M2
from tests.kernels.gluon import assert_a_compile_failure_falls_back_once, pretend_sm90
from tests.kernels.interpret import INTERPRETING

on_gpu = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
SPLITS = [0, 37, 1, 0, 130, 64, 0, 29, 300]  # empty groups, starts off 16 rows, partial tiles
# the tile order in bands of row tiles (3: the last band of an odd tile count is cut short), or
# in column strips (0: a program's tiles are consecutive row tiles, the grouped dispatch's order)
KERNELS = {"plain": dict(tile_group=1), "banded": dict(tile_group=3), "banded3": dict(tile_group=2, stages=3),
           "strips": dict(tile_group=0)}
# groups that start on 16 rows inside a 128-byte line of the columnwise copy (at 48, 448, 704, 1488,
# 1504), with runs of whole row tiles whose shared lines leave whole, a group of whole tiles only
# (256), one shorter than a tile (16), partial last tiles, an empty group; M a multiple of 16
LINE_SPLITS = [48, 400, 256, 0, 784, 16, 336]


def _gl():
    from qmoe.kernels import _cast_transpose_gl as ct
    return ct


def _input(m, k, dtype, seed):
    from tests.kernels.test_quantize_kernels import make_input
    return make_input(m, k, dtype, seed=seed, kind="mixed")


@pytest.fixture
def launches(monkeypatch):
    """Counts the Gluon kernel's launches (a dispatch that silently fell back would launch none)."""
    ct, calls = _gl(), []
    real = ct.launch
    monkeypatch.setattr(ct, "launch", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


def _same(got, want, what):
    from tests.kernels.test_quantize_kernels import assert_all_same
    assert_all_same(got, want, [f"{what}: {n}" for n in ("row", "row_s", "col", "col_s")])


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_dispatched_bits_equal_the_reference(dtype, launches):
    from qmoe.kernels import quantize as K
    from qmoe.reference import quantize as R

    for i, (m, k, fmt, p2, eps) in enumerate(((300, 384, E4M3, True, 0.0), (129, 136, E5M2, False, 1e-4),
                                               (1, 16, E4M3, True, 0.0))):
        x = _input(m, k, dtype, seed=10 + i)
        got = K.quantize_fp8_block(x, 1, 128, fmt, p2, eps, True, True)
        _same(got, R.quantize_fp8_block(x, 1, 128, fmt, p2, eps, True, True), f"{m}x{k} {dtype}")
        assert len(launches) == i + 1, _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("rowwise", [True, False], ids=["both", "col"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_mode_bits_equal_the_reference(block_rows, rowwise, dtype, kernel):
    """Modes and kernels the dispatch leaves aside still give the reference's bits (sweeps time them)."""
    from qmoe.kernels import quantize as K
    from qmoe.reference import quantize as R

    for i, (m, k, fmt, p2, eps) in enumerate(((300, 384, E4M3, True, 0.0), (129, 136, E5M2, False, 1e-4),
                                               (1, 16, E4M3, True, 0.0))):
        x = _input(m, k, dtype, seed=10 + i)
        outs = _fresh_outputs(K.fp8_block_op(x, None, 1, block_rows, 128, fmt.dtype, fmt.max, p2, eps, rowwise,
                                             True))
        _gl().launch(x, None, 1, block_rows > 1, K.fp8_meta(fmt), fmt.max, p2, eps, rowwise, True, *outs,
                     **KERNELS[kernel])
        want = R.quantize_fp8_block(x, block_rows, 128, fmt, p2, eps, rowwise, True)
        _same(tuple(o if w is not None else None for o, w in zip(outs, want)), want, f"{m}x{k} {dtype}")


@on_gpu
@pytest.mark.gpu
def test_grouped_bits_equal_the_reference(launches):
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.reference import grouped_quantize as RG

    splits = torch.tensor(SPLITS, device="cuda")
    x = _input(sum(SPLITS), 264, torch.bfloat16, seed=3)
    got = KG.grouped_quantize_fp8_block(x, splits, 1, 128, E4M3, True, 0.0, True, True)
    _same(got, RG.grouped_quantize_fp8_block(x, splits, 1, 128, E4M3, True, 0.0, True, True), "grouped")
    assert len(launches) == 1, _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("rowwise", [True, False], ids=["both", "col"])
def test_grouped_every_mode_bits_equal_the_reference(block_rows, rowwise, kernel):
    from qmoe.kernels import quantize as K
    from qmoe.kernels._layout import device_splits
    from qmoe.reference import grouped_quantize as RG

    splits = torch.tensor(SPLITS, device="cuda")
    x = _input(sum(SPLITS), 264, torch.bfloat16, seed=4)
    s = device_splits(splits, x)
    outs = _fresh_outputs(K.fp8_block_op(x, s, len(SPLITS), block_rows, 128, torch.float8_e4m3fn, E4M3.max, True,
                                         0.0, rowwise, True))
    _gl().launch(x, s, len(SPLITS), block_rows > 1, K.fp8_meta(E4M3), E4M3.max, True, 0.0, rowwise, True, *outs,
                 **KERNELS[kernel])
    want = RG.grouped_quantize_fp8_block(x, splits, block_rows, 128, E4M3, True, 0.0, rowwise, True)
    _same(tuple(o if w is not None else None for o, w in zip(outs, want)), want, "grouped")


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mx", [False, True], ids=["fp8", "mxfp8"])
@pytest.mark.parametrize("programs", [1, 3, 7, 16, None])
@pytest.mark.parametrize("tail", [[], [13]], ids=["m16", "m_odd"])
def test_column_strips_write_the_lines_groups_share(mx, programs, tail):
    """Column strips, with programs whose runs of tiles start and end anywhere in a group: the
    lines two row tiles share leave whole and carry the previous tile's rows; with M not a multiple
    of 16 (a last group of 13 rows) every tile takes the runs instead. Both orientations and the
    columnwise copy alone, 1x128 and 128x128 blocks, MXFP8."""
    from qmoe.contracts.formats import ScaleMode
    from qmoe.kernels import quantize as K
    from qmoe.kernels._layout import device_splits
    from qmoe.reference import grouped_quantize as RG

    sizes = LINE_SPLITS + tail
    splits = torch.tensor(sizes, device="cuda")
    x = _input(sum(sizes), 392, torch.bfloat16, seed=programs or 0)
    s = device_splits(splits, x)
    for block_rows, rowwise in ((1, True), (1, False), (128, True)) if not mx else ((32, True), (32, False)):
        if mx:
            outs = _fresh_outputs(K.mxfp8_op(x, s, len(sizes), torch.float8_e4m3fn, E4M3.max, E4M3.emax, True, 32,
                                             rowwise, True))
            _gl().launch(x, s, len(sizes), False, K.fp8_meta(E4M3), E4M3.max, False, 0.0, rowwise, True, *outs,
                         programs=programs, mx=(E4M3.emax, True), tile_group=0)
            want = RG.grouped_quantize_mxfp8(x, splits, E4M3, ScaleMode.ROUND_UP, rowwise, True)
        else:
            outs = _fresh_outputs(K.fp8_block_op(x, s, len(sizes), block_rows, 128, torch.float8_e4m3fn, E4M3.max,
                                                 True, 0.0, rowwise, True))
            _gl().launch(x, s, len(sizes), block_rows > 1, K.fp8_meta(E4M3), E4M3.max, True, 0.0, rowwise, True,
                         *outs, programs=programs, tile_group=0)
            want = RG.grouped_quantize_fp8_block(x, splits, block_rows, 128, E4M3, True, 0.0, rowwise, True)
        _same(tuple(o if w is not None else None for o, w in zip(outs, want)), want,
              f"strips, {programs} programs, {block_rows} rows a block, rowwise={rowwise}")


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("programs,stages,warps,band", [(1, 2, 8, 1), (3, 3, 8, 1), (5, 4, 4, 1), (7, 3, 4, 1),
                                                        (3, 2, 8, 4), (5, 2, 8, 16), (7, 3, 8, 3), (1, 2, 8, 0),
                                                        (5, 3, 8, 0), (7, 4, 4, 0)])
@pytest.mark.parametrize("grouped", [False, True])
def test_persistent_programs_walk_every_tile(programs, stages, warps, band, grouped):
    """Few programs, many tiles each: every slot of the ring is reused with its barrier phases."""
    from qmoe.kernels import quantize as K
    from qmoe.kernels._layout import device_splits
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize as R

    m, k = 1100, 1000
    x = _input(m, k, torch.bfloat16, seed=programs)
    splits = torch.tensor([200, 0, 517, 383], device="cuda") if grouped else None
    for block_rows in (1, 128):
        got = K.fp8_block_op(x, None if splits is None else device_splits(splits, x), 4 if grouped else 1,
                             block_rows, 128, torch.float8_e4m3fn, E4M3.max, True, 0.0, True, True)
        outs = _fresh_outputs(got)
        _gl().launch(x, None if splits is None else device_splits(splits, x), 4 if grouped else 1, block_rows > 1,
                     K.fp8_meta(E4M3), E4M3.max, True, 0.0, True, True, *outs, stages=stages, warps=warps,
                     programs=programs, tile_group=band)
        want = (RG.grouped_quantize_fp8_block(x, splits, block_rows, 128, E4M3, True, 0.0, True, True) if grouped
                else R.quantize_fp8_block(x, block_rows, 128, E4M3, True, 0.0, True, True))
        _same(tuple(outs), want, f"{programs} programs, {stages} stages, bands of {band}, {block_rows}x128")


def _fresh_outputs(outs):
    """New outputs shaped like fp8_block_op's, filled with a pattern a missed store would leave."""
    fresh = []
    for t in outs:
        f = torch.empty_like(t)  # the same strides (FP8 block scales: steps-major)
        if t.dtype == torch.float32:  # scale entries no group uses are zero there
            f.copy_(torch.where(t == 0, t, torch.full_like(t, 77.0)))
            fresh.append(f)
            continue
        f.view(torch.uint8).fill_(0x5A)
        if t.dtype == torch.float8_e8m0fnu and t.numel():  # the same for E8M0 scale bytes
            b = t.view(torch.uint8)
            f.view(torch.uint8).copy_(torch.where(b == 0, b, torch.full_like(b, 0x5A)))
        fresh.append(f)
    return fresh


# ---------------------------------------------------------------- the dispatch (CPU)

class _Rows:
    """Stands in for x in `unsupported`: device, dtype, strides and data pointer only."""

    def __init__(self, device="cuda", dtype=torch.bfloat16, k=7168, ptr=1 << 20, stride=None):
        self.device, self.dtype = torch.device(device, 0) if device == "cuda" else torch.device(device), dtype
        self.shape, self._stride, self._ptr = (4096, k), (stride or k, 1), ptr

    def dim(self):
        return 2

    def stride(self, i=None):
        return self._stride if i is None else self._stride[i]

    def data_ptr(self):
        return self._ptr

    def element_size(self):
        return torch.finfo(self.dtype).bits // 8


@pytest.fixture
def sm90(monkeypatch):
    ct = _gl()
    if ct.gluon is None:
        pytest.skip("this triton has no Gluon")
    return pretend_sm90(monkeypatch, ct, "QMOE_BLOCK_CAST")


def test_the_gluon_cast_is_dispatched_only_where_it_applies(sm90, monkeypatch):
    from qmoe.kernels import _gluon_sm90

    ct = sm90
    assert ct.unsupported(_Rows(), 128) is None
    assert ct.unsupported(_Rows(dtype=torch.float32), 128) is None
    assert "128 only" in ct.unsupported(_Rows(), 64)
    assert ct.unsupported(_Rows(), 128, act=0) is None  # a GLU of bf16 h in whole-tile halves
    assert ct.unsupported(_Rows(), 128, act=2, glu_block=256) is None
    assert "pointwise" in ct.unsupported(_Rows(), 128, act=3)
    assert "interleaved" in ct.unsupported(_Rows(), 128, act=0, glu_block=64)
    assert "bf16 only" in ct.unsupported(_Rows(dtype=torch.float32), 128, act=0)
    assert "dtype" in ct.unsupported(_Rows(dtype=torch.float8_e4m3fn), 128)
    assert "aligned" in ct.unsupported(_Rows(k=260), 128)  # rows of 520 bytes: no TMA
    assert "aligned" in ct.unsupported(_Rows(ptr=(1 << 20) + 8), 128)
    assert "aligned" in ct.unsupported(_Rows(stride=7172), 128)
    assert "not a CUDA device" in ct.unsupported(_Rows(device="cpu"), 128)
    monkeypatch.setenv("QMOE_BLOCK_CAST", "triton")
    assert ct.unsupported(_Rows(), 128) == "QMOE_BLOCK_CAST=triton"
    monkeypatch.delenv("QMOE_BLOCK_CAST")
    monkeypatch.setattr(_gluon_sm90, "is_sm90", lambda index: False)
    assert "sm90" in ct.unsupported(_Rows(), 128)


def test_a_failed_compile_falls_back_with_one_warning(sm90, monkeypatch):
    outs = [torch.empty(0) for _ in range(4)]  # row, row_s, col, col_s: never written
    args = (_Rows(), None, 1, False, 128, -1, 0, None, None, 448.0, True, 0.0, True, *outs)
    assert_a_compile_failure_falls_back_once(monkeypatch, sm90, "launch", lambda: sm90.launch_dispatched(*args),
                                             False)


def test_fp8_block_op_asks_the_gluon_cast_for_every_columnwise_copy(monkeypatch):
    """1x128 and 128x128 blocks with a columnwise copy, rowwise codes or not; the Triton kernel is
    the faster one for rowwise codes alone, and a forced Triton config (tests, sweeps) is never
    replaced either."""
    from qmoe.kernels import quantize as K
    from qmoe.kernels._cast_variants import BLOCK128_CONFIGS, forced_config

    asked = []
    monkeypatch.setattr(K._block_cast_gl, "launch_dispatched",
                        lambda *args: asked.append((args[3], args[12])) or True)  # (two_d, rowwise)
    monkeypatch.setattr(K, "launch_cast", lambda *args, **kwargs: asked.append("triton"))
    x = torch.zeros(256, 256)
    op = K.fp8_block_op
    for block_rows in (1, 128):
        op(x, None, 1, block_rows, 128, torch.float8_e4m3fn, E4M3.max, True, 0.0, True, True)
        op(x, None, 1, block_rows, 128, torch.float8_e4m3fn, E4M3.max, True, 0.0, False, True)
    assert asked == [(False, True), (False, False), (True, True), (True, False)]
    with forced_config(K._fp8_block_kernel, BLOCK128_CONFIGS[0]):
        op(x, None, 1, 1, 128, torch.float8_e4m3fn, E4M3.max, True, 0.0, True, True)
    op(x, None, 1, 1, 128, torch.float8_e4m3fn, E4M3.max, True, 0.0, True, False)
    op(x, None, 1, 128, 128, torch.float8_e4m3fn, E4M3.max, True, 0.0, True, False)
    assert asked[4:] == ["triton"] * 3


# ---------------------------------------------------------------- MXFP8 (bf16 only)

@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["round_up", "floor"])
def test_mxfp8_dispatched_bits_equal_the_reference(mode, launches):
    """Blocks cut by K (136 = 4.25 blocks), a single row, both orientations and the columnwise copy alone."""
    from qmoe.contracts.formats import ScaleMode
    from qmoe.kernels import quantize as K
    from qmoe.reference import quantize as R

    mode = ScaleMode(mode)
    cases = ((300, 384, E4M3, True), (129, 136, E5M2, True), (1, 16, E4M3, False), (257, 4096, E5M2, False))
    for i, (m, k, fmt, rowwise) in enumerate(cases):
        x = _input(m, k, torch.bfloat16, seed=20 + i)
        got = K.quantize_mxfp8(x, fmt, mode, rowwise, True)
        _same(got, R.quantize_mxfp8(x, fmt, mode, rowwise, True), f"mxfp8 {m}x{k} {fmt.name} rowwise={rowwise}")
        assert len(launches) == i + 1, _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rowwise", [True, False], ids=["both", "col"])
def test_mxfp8_grouped_bits_equal_the_reference(rowwise, launches):
    """Groups whose sizes are not multiples of 32 start their 32-row scale blocks afresh."""
    from qmoe.contracts.formats import ScaleMode
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.reference import grouped_quantize as RG

    splits = torch.tensor(SPLITS, device="cuda")
    x = _input(sum(SPLITS), 264, torch.bfloat16, seed=5)
    got = KG.grouped_quantize_mxfp8(x, splits, E4M3, ScaleMode.ROUND_UP, rowwise, True)
    _same(got, RG.grouped_quantize_mxfp8(x, splits, E4M3, ScaleMode.ROUND_UP, rowwise, True), "mxfp8 grouped")
    assert len(launches) == 1, _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("programs,stages,warps,band", [(1, 2, 8, 1), (5, 4, 4, 1), (7, 3, 4, 3), (3, 2, 8, 8),
                                                        (5, 3, 8, 0)])
def test_mxfp8_persistent_programs_walk_every_tile(programs, stages, warps, band):
    from qmoe.contracts.formats import ScaleMode
    from qmoe.kernels import quantize as K
    from qmoe.kernels._layout import device_splits
    from qmoe.reference import grouped_quantize as RG

    x = _input(1100, 1000, torch.bfloat16, seed=programs)
    splits = torch.tensor([200, 0, 517, 383], device="cuda")
    s = device_splits(splits, x)
    outs = _fresh_outputs(K.mxfp8_op(x, s, 4, torch.float8_e4m3fn, E4M3.max, E4M3.emax, True, 32, True, True))
    _gl().launch(x, s, 4, False, K.fp8_meta(E4M3), E4M3.max, False, 0.0, True, True, *outs,
                 stages=stages, warps=warps, programs=programs, mx=(E4M3.emax, True), tile_group=band)
    want = RG.grouped_quantize_mxfp8(x, splits, E4M3, ScaleMode.ROUND_UP, True, True)
    _same(tuple(outs), want, f"mxfp8: {programs} programs, {stages} stages, {warps} warps, bands of {band}")


# ---------------------------------------------------------------- fused GLU activations (FC2's input)

@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [None, 128, 256], ids=["halves", "k128", "k256"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "clamped_qgeglu"])
@pytest.mark.parametrize("block", ["1x128", "128x128", "mxfp8"])
@pytest.mark.parametrize("rowwise", [True, False], ids=["both", "col"])
def test_fused_activation_bits_equal_the_triton_kernel(block, activation, interleave, rowwise, launches):
    """act(h) * probs cast by the Gluon kernel (the activated tile through shared memory) has the
    bits of the Triton kernel, which applies the activation as it loads (and is checked against the
    reference elsewhere): grouped and not, an output width off 128 (its gate tile runs on into the
    linear half, which must not count), the halves interleaved in whole tiles."""
    from benchmarks.harness import environ_set
    from qmoe.contracts.carriers import glu_block
    from qmoe.kernels import quantize as K
    from qmoe.kernels._layout import device_splits
    from qmoe.kernels.activation import activation_code

    act, k = activation_code(activation), glu_block(activation, interleave)
    f = 200 if interleave is None else 2 * interleave
    for splits in (None, torch.tensor(SPLITS, device="cuda")):
        m = 300 if splits is None else sum(SPLITS)
        h = _input(m, 2 * f, torch.bfloat16, seed=f + act) * 0.5
        probs = torch.rand(m, device="cuda")
        s, groups = (None, 1) if splits is None else (device_splits(splits, h), len(SPLITS))

        def cast():
            if block == "mxfp8":
                return K.mxfp8_op(h, s, groups, torch.float8_e4m3fn, E4M3.max, E4M3.emax, True, 32, rowwise, True,
                                  probs, act, k)
            return K.fp8_block_op(h, s, groups, 128 if block == "128x128" else 1, 128, torch.float8_e4m3fn,
                                  E4M3.max, True, 0.0, rowwise, True, probs, act, k)

        before = len(launches)
        got = cast()
        assert len(launches) == before + 1, _gl().FAILED
        with environ_set("QMOE_BLOCK_CAST", "triton"):
            want = cast()
        what = f"{block} {activation} interleave={interleave} {'grouped' if splits is not None else 'dense'}"
        _same(tuple(g if g.numel() else None for g in got), tuple(w if w.numel() else None for w in want), what)


def test_the_mxfp8_cast_is_dispatched_only_where_it_applies(sm90):
    ct = sm90
    assert ct.unsupported(_Rows(), 32, mx=True) is None
    assert "32 only" in ct.unsupported(_Rows(), 128, mx=True)
    assert "dtype" in ct.unsupported(_Rows(dtype=torch.float16), 32, mx=True)
    assert "dtype" in ct.unsupported(_Rows(dtype=torch.float32), 32, mx=True)
    assert ct.unsupported(_Rows(), 32, act=1, mx=True) is None
    assert "pointwise" in ct.unsupported(_Rows(), 32, act=4, mx=True)
    assert "aligned" in ct.unsupported(_Rows(k=260), 32, mx=True)


def test_a_failed_mxfp8_compile_falls_back_with_one_warning(sm90, monkeypatch):
    outs = [torch.empty(0) for _ in range(4)]
    args = (_Rows(), None, 1, 32, -1, 0, None, None, 448.0, 8, True, True, True, *outs)
    assert_a_compile_failure_falls_back_once(monkeypatch, sm90, "launch", lambda: sm90.launch_dispatched_mx(*args),
                                             False)


def test_mxfp8_op_asks_the_gluon_cast_only_for_a_columnwise_copy(monkeypatch):
    from qmoe.kernels import quantize as K

    asked = []
    monkeypatch.setattr(K._block_cast_gl, "launch_dispatched_mx", lambda *args: asked.append(args[11]) or True)
    monkeypatch.setattr(K, "launch_cast", lambda *args, **kwargs: asked.append("triton"))
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    for rowwise, columnwise in ((True, True), (False, True), (True, False)):
        K.mxfp8_op(x, None, 1, torch.float8_e4m3fn, E4M3.max, E4M3.emax, True, 32, rowwise, columnwise)
    assert asked == [True, False, "triton"]


@pytest.mark.parametrize("gluon_runs", [True, False], ids=["gluon", "compile-failure"])
def test_mxfp8_op_values_come_from_the_gluon_cast_or_as_codes(monkeypatch, gluon_runs):
    """Asked for exact values, mxfp8_op hands the Gluon cast bf16 [M, K] buffers and no scales, even for
    rowwise values alone; where that launch fails it falls back to codes from the Triton kernel."""
    from qmoe.kernels import quantize as K

    asked = []

    def gluon(*args):
        asked.append((args[11], args[12], args[-1], args[13].dtype, tuple(args[13].shape), args[14].numel(),
                      args[15].dtype, tuple(args[15].shape), args[16].numel()))
        return gluon_runs

    monkeypatch.setattr(K._block_cast_gl, "writes_values", lambda *args: True)
    monkeypatch.setattr(K._block_cast_gl, "launch_dispatched_mx", gluon)
    monkeypatch.setattr(K, "launch_cast", lambda *args, **kwargs: asked.append("triton"))
    x = torch.zeros(256, 192, dtype=torch.bfloat16)
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    row, row_s, col, col_s = K.mxfp8_op(x, None, 1, fp8, E4M3.max, E4M3.emax, True, 32, True, True, None, -1, 0,
                                        True, False)
    assert asked[0] == (True, True, (True, False), bf16, (256, 192), 0, fp8, (192, 256), 256 * 192 // 32)
    row, row_s, col, col_s = K.mxfp8_op(x, None, 1, fp8, E4M3.max, E4M3.emax, True, 32, True, False, None, -1, 0,
                                        True, True)  # rowwise values alone also go to the Gluon cast
    assert asked[-1 if gluon_runs else -2][:3] == (True, False, (True, False))
    if gluon_runs:
        assert row.dtype == bf16 and row.shape == (256, 192) and row_s.numel() == 0
    else:
        assert asked[-1] == "triton"
        assert row.dtype == fp8 and row_s.numel() == 256 * 192 // 32


def test_values_are_asked_only_where_the_gluon_cast_will_run(sm90, monkeypatch):
    """writes_values answers for the real call even inside a fake-tensor pass (so a compiled graph's
    outputs have the dtypes the real launch gives), and no otherwise."""
    from qmoe.kernels import _launch

    ct = sm90
    assert ct.writes_values(_Rows())
    monkeypatch.setattr(_launch._FAKE, "on", True, raising=False)
    assert ct.writes_values(_Rows())
    assert ct.unsupported(_Rows(), 32, mx=True) is not None  # a kernel launch itself is still declined there
    monkeypatch.setattr(_launch._FAKE, "on", False, raising=False)
    assert not ct.writes_values(_Rows(dtype=torch.float32))
    assert not ct.writes_values(_Rows(k=260))
    monkeypatch.setenv("QMOE_BLOCK_CAST", "triton")
    assert not ct.writes_values(_Rows())
