"""qmoe.capabilities and backend selection."""
import pytest
import torch

import qmoe
from qmoe.backend import use_kernels
from qmoe.dispatch import QUANTIZE
from qmoe.contracts.errors import UnsupportedError
from qmoe.reference import quantize as ref_quantize


def test_cpu_runs_every_recipe_on_the_reference():
    caps = qmoe.capabilities("cpu")
    assert set(caps) == {"delayed", "current", "block", "mxfp8", "nvfp4"}
    assert all(c.backend == "reference" and c.why for c in caps.values())


def test_cpu_tensors_use_the_reference(monkeypatch):
    x = torch.zeros(2, 2)
    assert not use_kernels(x)
    assert QUANTIZE.pick("quantize_mxfp8", x) is ref_quantize.quantize_mxfp8


def test_bad_backend_override_is_an_error(monkeypatch):
    monkeypatch.setenv("QMOE_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="QMOE_BACKEND"):
        use_kernels(torch.zeros(1))


def test_unsupported_error_names_op_recipe_device_and_fix():
    e = UnsupportedError("m_grouped_gemm", recipe="nvfp4", device="cuda:0", why="no kernel",
                         fix='grouped_path="split"')
    assert all(s in str(e) for s in ("m_grouped_gemm", "nvfp4", "cuda:0", "no kernel", 'grouped_path="split"'))


@pytest.mark.gpu
def test_sm90_reports_emulated_fp4_and_native_fp8():
    caps = qmoe.capabilities("cuda")
    assert caps["nvfp4"].hardware in ("emulated", "native")
    assert caps["current"].hardware == "native"
