"""qmoe.dispatch: every op family's table pairs a kernel with its reference twin of the same name,
the backend choice picks between them, and a missing kernel is a clear UnsupportedError."""
import inspect
import subprocess
import sys

import pytest
import torch

import qmoe
from qmoe import dispatch
from qmoe.dispatch import Dispatch

TABLES = [v for v in vars(dispatch).values() if isinstance(v, Dispatch)]


def test_every_table_pairs_twins_of_the_same_name():
    assert {t.family for t in TABLES} == {"quantize", "quantize_nvfp4", "grouped_quantize", "delayed_scaling",
                                          "activation", "bias", "grouped_gemm", "router", "aux_loss", "permute"}
    for table in TABLES:
        for name, (kernel, reference) in table.table.items():
            assert kernel is not None, f"{table.family}.{name}: Triton is installed here, the kernel must be"
            kernel = inspect.unwrap(kernel)  # a few run the reference where the kernel does not cover the arguments
            assert kernel.__name__ == name and kernel.__module__ == f"qmoe.kernels.{table.family}"
            if reference is not None:
                assert reference.__name__ == name and reference.__module__ == f"qmoe.reference.{table.family}"


def test_backend_choice_picks_kernel_or_reference(monkeypatch):
    kernel, reference = dispatch.GROUPED_GEMM.table["m_grouped_gemm"]
    x = torch.zeros(1)
    assert dispatch.GROUPED_GEMM.pick("m_grouped_gemm", x) is reference  # CPU tensors
    monkeypatch.setenv("QMOE_BACKEND", "triton")
    assert dispatch.GROUPED_GEMM.pick("m_grouped_gemm", x) is kernel
    monkeypatch.setenv("QMOE_BACKEND", "reference")
    assert dispatch.GROUPED_GEMM.pick("m_grouped_gemm", x) is reference


def test_missing_kernel_raises_unsupported_naming_the_op(monkeypatch):
    def ref(x):
        return x

    table = Dispatch("family", {"op": (None, ref)})
    monkeypatch.setenv("QMOE_BACKEND", "triton")
    with pytest.raises(qmoe.UnsupportedError,
                       match=r"family\.op is not supported on device cpu.*QMOE_BACKEND=reference"):
        table.pick("op", torch.zeros(1))
    with pytest.raises(qmoe.UnsupportedError, match=r"family\.op"):
        table.kernel("op")
    monkeypatch.setenv("QMOE_BACKEND", "reference")
    assert table.pick("op", torch.zeros(1)) is ref


def test_kernel_only_launcher_has_no_reference_path():
    with pytest.raises(qmoe.UnsupportedError, match=r"router\.route_forward"):
        dispatch.ROUTER.pick("route_forward", torch.zeros(1))


def test_import_without_triton_runs_the_reference_and_refuses_kernels():
    """Where Triton is absent (it is a Linux-only dependency) qmoe imports, the reference runs, and
    asking for the kernels raises UnsupportedError instead of an ImportError deep in an op."""
    code = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import os, torch, qmoe
from qmoe import dispatch
assert dispatch.k_grouped_gemm is None
probs, routing_map = qmoe.ops.topk_route(torch.randn(8, 4), 2)
assert routing_map.sum().item() == 16
os.environ["QMOE_BACKEND"] = "triton"
try:
    qmoe.ops.expert_activation(torch.randn(4, 8), None, "swiglu")
except qmoe.UnsupportedError as e:
    assert "activation.scaled_activation_forward" in str(e), e
else:
    raise AssertionError("no UnsupportedError")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_configurations_a_kernel_does_not_cover_run_the_reference(monkeypatch):
    """MXFP8 with 16-value blocks, FP8 scales of more amaxes than one program holds: the kernels'
    path hands these to the reference twin (on the CPU, Triton's kernels would not run at all)."""
    from qmoe.contracts.formats import E4M3, ScaleMode
    from qmoe.reference import quantize as reference

    monkeypatch.setenv("QMOE_BACKEND", "triton")
    x = torch.randn(4, 64)
    got = dispatch.QUANTIZE.pick("quantize_mxfp8", x)(x, E4M3, ScaleMode.ROUND_UP, True, False, 16)
    want = reference.quantize_mxfp8(x, E4M3, ScaleMode.ROUND_UP, True, False, 16)
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got[:2], want[:2]))
    amax = torch.rand(5000) * 10
    got = dispatch.QUANTIZE.pick("compute_fp8_scale", amax)(amax, 448.0)
    assert torch.equal(got, reference.compute_fp8_scale(amax, 448.0))
