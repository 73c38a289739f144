"""NVFP4's Gluon cast (qmoe/kernels/_cast_nvfp4_gl.py, launched by _cast_transpose_gl) gives the
reference's bits, and nvfp4_op dispatches it exactly where it applies.

On the GPU: 1 x 16 and 16 x 16 blocks, both orientations and either alone, codes and exact
values, NaN and +-inf, rows and columns that are not tile multiples, a row count off 8 (the
columnwise codes leave as bytes); groups that are empty, odd (bytes two groups share, ORed in),
or off 8 rows, against the reference; a fused GLU activation against the Triton kernel; enough
tiles that every persistent program walks several. Gluon has no interpreter: the dispatch
decisions and the fallback are checked on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.gluon import assert_a_compile_failure_falls_back_once, pretend_sm90
from tests.kernels.test_block_cast_gl import _Rows
from tests.kernels.interpret import INTERPRETING

on_gpu = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
SPLITS = [0, 37, 1, 0, 130, 64, 0, 29, 300, 16, 8, 33]  # empty, odd (shared bytes), off 8 rows, partial tiles; an even total
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
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_dense_bits_equal_the_reference(block_2d, orient, launches):
    from qmoe.kernels import quantize_nvfp4 as K4
    from qmoe.reference import quantize_nvfp4 as R4

    shapes = ((300, 384), (130, 144), (2048, 4096))  # partial tiles; rows off 8; several tiles per program
    for i, (m, k) in enumerate(shapes):
        x = _input(m, k, seed=20 + i)
        got = K4.quantize_nvfp4(x, block_2d, *ORIENTS[orient])
        _same(got, R4.quantize_nvfp4(x, block_2d, *ORIENTS[orient]), f"{m}x{k}")
        assert len(launches) == i + 1 and launches[-1] is not None, _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("values", [(), ("rowwise",), ("rowwise", "columnwise")], ids=["codes", "rows", "both"])
@pytest.mark.parametrize("orient", list(ORIENTS))
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_grouped_bits_equal_the_reference(block_2d, orient, values, launches):
    """Codes and exact values over groups that are empty, odd or off 8 rows."""
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.reference import grouped_quantize as RG

    if "columnwise" in values and not block_2d:
        pytest.skip("1 x 16 columnwise values are the Triton kernel's (test_the_cast_is_dispatched_only_where...)")
    x = _input(sum(SPLITS), 272, seed=7)
    sizes = torch.tensor(SPLITS)
    got = KG.grouped_quantize_nvfp4(x, sizes.cuda(), block_2d, *ORIENTS[orient], values=values)
    want = RG.grouped_quantize_nvfp4(x, sizes, block_2d, *ORIENTS[orient], values=values)
    _same(got, want, f"grouped {values}")
    assert len(launches) == 1, _gl().FAILED


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [None, 128], ids=["halves", "k128"])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_fused_activation_bits_equal_the_triton_kernel(block_2d, interleave, launches):
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
            return K4.nvfp4_op(h, s, groups, block_2d, True, True, False, None, probs, act, k)

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
    assert ct.unsupported_nvfp4(_Rows(), False, False, False, False) is None
    assert ct.unsupported_nvfp4(_Rows(), True, False, False, True) is None  # 16 x 16 values: the rows' values
    assert "Hadamard" in ct.unsupported_nvfp4(_Rows(), False, True, False, False)
    assert "stochastic" in ct.unsupported_nvfp4(_Rows(), False, False, True, False)
    assert "columnwise copy as values" in ct.unsupported_nvfp4(_Rows(), False, False, False, True)
    assert "multiples of 16" in ct.unsupported_nvfp4(_Rows(k=520), False, False, False, False)
    assert "dtype" in ct.unsupported_nvfp4(_Rows(dtype=torch.float32), False, False, False, False)
    monkeypatch.setenv("QMOE_NVFP4_CAST", "triton")
    assert ct.unsupported_nvfp4(_Rows(), False, False, False, False) == "QMOE_NVFP4_CAST=triton"


def test_a_failed_compile_falls_back_with_one_warning(sm90, monkeypatch):
    args = (_Rows(), None, 1, False, -1, 0, None, None, True, True, None, None, None, None, (False, False))
    assert_a_compile_failure_falls_back_once(monkeypatch, sm90, "launch", lambda: sm90.launch_dispatched_nv(*args),
                                             False)


@pytest.mark.parametrize("rht,stochastic,gluon", [(False, False, True), (True, False, False), (False, True, False)],
                         ids=["nearest", "rht", "stochastic"])
def test_nvfp4_op_asks_the_gluon_cast_where_it_applies(monkeypatch, rht, stochastic, gluon):
    """After the amax launch, round-to-nearest casts without the transform go to the Gluon cast,
    which writes every output; the Triton kernel runs where it does not apply."""
    from qmoe.kernels import quantize_nvfp4 as K4

    asked = []
    monkeypatch.setattr(K4._block_cast_gl, "unsupported_nvfp4",
                        lambda x, block_2d, rht, stochastic, col_values, *a: "no" if rht or stochastic else None)
    monkeypatch.setattr(K4._block_cast_gl, "launch_dispatched_nv", lambda *args: asked.append("gluon") or True)
    monkeypatch.setattr(K4, "launch", lambda kernel, *args, **kwargs: asked.append(kernel.fn.__name__))
    x = torch.randn(64, 64)
    seeds = torch.zeros(2, dtype=torch.int64) if stochastic else None
    K4.nvfp4_op(x, None, 1, False, True, True, rht, seeds)
    assert asked == ["_nvfp4_amax_kernel", "gluon" if gluon else "_nvfp4_kernel"]
