"""NVFP4's Gluon cast (qmoe/kernels/_cast_nvfp4_gl.py, launched by _cast_transpose_gl) gives the
reference's bits, and nvfp4_op dispatches it exactly where it applies.

On the GPU: both orientations and either alone, codes and the rows' exact values, NaN and +-inf,
rows and columns that are not tile multiples, a row count off 8 (the columnwise codes leave as
bytes); groups that are empty, odd (bytes two groups share, ORed in), or off 8 rows, against the
reference; the Hadamard transform, bit for bit where its sums are exact and to fp32 rounding
elsewhere (as the Triton kernel's); a fused GLU activation against the Triton kernel; enough tiles
that every persistent program walks several. Gluon has no interpreter: the dispatch decisions and
the fallback are checked on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.gluon import assert_a_compile_failure_falls_back_once, pretend_sm90
from tests.kernels.test_block_cast_gl import _Rows
from tests.kernels.interpret import INTERPRETING

on_gpu = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
# empty, odd (shared bytes), off 8 rows, partial tiles; an even total (a columnwise copy needs one)
SPLITS = [0, 37, 1, 0, 130, 64, 0, 29, 300, 16, 8, 33]
ORIENTS = {"both": (True, True), "rows": (True, False), "cols": (False, True)}


def _gl():
    from qmoe.kernels import _cast_transpose_gl as ct
    return ct


def _input(m, k, seed):
    from tests.kernels.test_quantize_kernels import make_input
    return make_input(m, k, torch.bfloat16, seed=seed, kind="mixed")


@pytest.fixture
def launches(monkeypatch):
    """Counts the Gluon kernel's launches (a dispatch that silently fell back would launch none)."""
    ct, calls = _gl(), []
    real = ct.launch
    monkeypatch.setattr(ct, "launch", lambda *args, **kwargs: calls.append(kwargs.get("nv")) or real(*args, **kwargs))
    return calls


def _same(got, want, what):
    from tests.kernels.test_quantize_kernels import assert_all_same
    assert_all_same(got, want, [f"{what}: {n}" for n in ("row", "row_s", "amax", "col", "col_s", "col_amax")])


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("orient", list(ORIENTS))
def test_dense_bits_equal_the_reference(orient, launches):
    from qmoe.kernels import quantize_nvfp4 as K4
    from qmoe.reference import quantize_nvfp4 as R4

    shapes = ((300, 384), (130, 144), (2048, 4096))  # partial tiles; rows off 8; several tiles per program
    for i, (m, k) in enumerate(shapes):
        x = _input(m, k, seed=20 + i)
        got = K4.quantize_nvfp4(x, False, *ORIENTS[orient])
        _same(got, R4.quantize_nvfp4(x, False, *ORIENTS[orient]), f"{m}x{k}")
        assert len(launches) == i + 1 and launches[-1] is not None, _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("values", [(), ("rowwise",)], ids=["codes", "row-values"])
@pytest.mark.parametrize("orient", list(ORIENTS))
def test_grouped_bits_equal_the_reference(orient, values, launches):
    """Codes and the rows' exact values over groups that are empty, odd or off 8 rows."""
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.reference import grouped_quantize as RG

    x = _input(sum(SPLITS), 272, seed=7)
    sizes = torch.tensor(SPLITS)
    got = KG.grouped_quantize_nvfp4(x, sizes.cuda(), False, *ORIENTS[orient], values=values)
    want = RG.grouped_quantize_nvfp4(x, sizes, False, *ORIENTS[orient], values=values)
    _same(got, want, f"grouped {values}")
    assert len(launches) == 1, _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_the_hadamard_transform_matches_the_reference(grouped, launches):
    """Bit for bit on inputs whose transform is exact in fp32; elsewhere its sums round in another
    order than the float64 reference's (as the Triton kernel's tensor-core products do): the amax
    to fp32 rounding, a few codes one step apart, the dequantized copy as close as NUMERICS.md's
    RHT tolerance (tests/kernels/test_quantize_kernels.py::test_nvfp4_rht_close)."""
    from qmoe.contracts.formats import unpack_e2m1
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.reference import grouped_quantize as RG
    from tests.kernels.test_quantize_kernels import exact_rht_input

    sizes = torch.tensor([0, 48, 256, 16, 0, 192])  # multiples of 16, as the transform needs

    def both(x):
        if grouped:
            return (KG.grouped_quantize_nvfp4(x, sizes.cuda(), False, True, True, rht=True),
                    RG.grouped_quantize_nvfp4(x, sizes, False, True, True, rht=True))
        return (KG.grouped_quantize_nvfp4(x, torch.tensor([512], device="cuda"), False, True, True, rht=True),
                RG.grouped_quantize_nvfp4(x, torch.tensor([512]), False, True, True, rht=True))

    got, want = both(exact_rht_input(512, 208, torch.bfloat16))
    _same(got, want, "exact sums")
    got, want = both(torch.randn(512, 512, device="cuda").bfloat16())
    torch.testing.assert_close(got[5], want[5], rtol=1e-6, atol=0)
    moved = (unpack_e2m1(got[3]) != unpack_e2m1(want[3])).float().mean().item()
    assert moved < 2e-3, f"{moved:.2%} of the transformed codes differ from the reference"
    assert len(launches) == 2 and all(n is not None and n.numel() == 2 * len(got[2]) for n in launches), _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [None, 128], ids=["halves", "k128"])
def test_fused_activation_bits_equal_the_triton_kernel(interleave, launches):
    """act(h) * probs through the Gluon kernel has the bits of the Triton kernel (which applies the
    activation as it loads, and is checked against the reference elsewhere), grouped and not."""
    from benchmarks.harness import environ_set
    from qmoe.contracts.carriers import glu_block
    from qmoe.kernels import quantize_nvfp4 as K4
    from qmoe.kernels._layout import device_splits
    from qmoe.kernels.activation import activation_code

    act, k = activation_code("swiglu"), glu_block("swiglu", interleave)
    f = 208 if interleave is None else 2 * interleave
    for splits in (None, torch.tensor(SPLITS, device="cuda")):
        m = 300 if splits is None else sum(SPLITS)
        h = _input(m, 2 * f, seed=f) * 0.5
        probs = torch.rand(m, device="cuda")
        s, groups = (None, 1) if splits is None else (device_splits(splits, h), len(SPLITS))

        def cast():
            return K4.nvfp4_op(h, s, groups, False, True, True, False, None, probs, act, k)

        before = len(launches)
        got = cast()
        assert len(launches) == before + 1, _gl().FAILED
        with environ_set("QMOE_NVFP4_CAST", "triton"):
            want = cast()
        assert len(launches) == before + 1
        _same(got, want, f"swiglu interleave={interleave} {'grouped' if splits is not None else 'dense'}")


@pytest.fixture
def sm90(monkeypatch):
    return pretend_sm90(monkeypatch, _gl(), "QMOE_NVFP4_CAST")


def test_the_cast_is_dispatched_only_where_it_applies(sm90, monkeypatch):
    ct = sm90
    assert ct.unsupported_nvfp4(_Rows(), False, False, False) is None
    assert "16 x 16" in ct.unsupported_nvfp4(_Rows(), True, False, False)
    assert "stochastic" in ct.unsupported_nvfp4(_Rows(), False, True, False)
    assert "columnwise copy as values" in ct.unsupported_nvfp4(_Rows(), False, False, True)
    assert "multiples of 16" in ct.unsupported_nvfp4(_Rows(k=520), False, False, False)
    assert "dtype" in ct.unsupported_nvfp4(_Rows(dtype=torch.float32), False, False, False)
    monkeypatch.setenv("QMOE_NVFP4_CAST", "triton")
    assert ct.unsupported_nvfp4(_Rows(), False, False, False) == "QMOE_NVFP4_CAST=triton"


def test_a_failed_compile_falls_back_with_one_warning(sm90, monkeypatch):
    args = (_Rows(), None, 1, False, -1, 0, None, None, True, True, None, None, None, None, False)
    assert_a_compile_failure_falls_back_once(monkeypatch, sm90, "launch", lambda: sm90.launch_dispatched_nv(*args),
                                             False)


@pytest.mark.parametrize("block_2d,stochastic,gluon", [(False, False, True), (True, False, False),
                                                      (False, True, False)], ids=["nearest", "16x16", "stochastic"])
def test_nvfp4_op_asks_the_gluon_cast_where_it_applies(monkeypatch, block_2d, stochastic, gluon):
    """After the amax launch, 1 x 16 casts rounded to nearest go to the Gluon cast (the transform's
    amaxes with them), which writes every output; the Triton kernel runs where it does not apply."""
    from qmoe.kernels import quantize_nvfp4 as K4

    asked = []
    monkeypatch.setattr(K4._block_cast_gl, "unsupported_nvfp4",
                        lambda x, block_2d, stochastic, *a: "no" if block_2d or stochastic else None)
    monkeypatch.setattr(K4._block_cast_gl, "launch_dispatched_nv",
                        lambda x, splits, groups, rht, act, glu, probs, amax, *a: asked.append(amax.numel()) or True)
    monkeypatch.setattr(K4, "launch", lambda kernel, *args, **kwargs: asked.append(kernel.fn.__name__))
    x = torch.randn(64, 64)
    seeds = torch.zeros(2, dtype=torch.int64) if stochastic else None
    for rht in (False, True):
        asked.clear()
        K4.nvfp4_op(x, None, 1, block_2d, True, True, rht and not block_2d, seeds)
        gluon_amaxes = 2 if rht and not block_2d else 1  # the rows', then the transformed columns'
        assert asked == ["_nvfp4_amax_kernel", gluon_amaxes if gluon else "_nvfp4_kernel"]
