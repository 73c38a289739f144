"""KernelOp: eager calls skip torch's dispatcher; torch.compile and fake tensors still see the op."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from qmoe.kernels._launch import KernelOp, wrapped


def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


TWICE = KernelOp("qmoe_test::twice", _twice)


def _dispatched_ops(fn) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_eager_calls_the_function_and_matches_the_op():
    x = torch.randn(5, 3)
    assert torch.equal(TWICE(x), x * 2)
    assert torch.equal(TWICE.op(x), x * 2)  # the registered op computes the same
    assert "qmoe_test::twice" not in _dispatched_ops(lambda: TWICE(x))
    assert "qmoe_test::twice" in _dispatched_ops(lambda: TWICE.op(x))


def test_fake_tensors_go_through_the_registered_op():
    with FakeTensorMode():
        y = TWICE(torch.empty(4, 2))
    assert isinstance(y, FakeTensor) and y.shape == (4, 2)


def test_compiled_graphs_contain_the_op():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: TWICE(x) + 1, backend=record, fullgraph=True)
    x = torch.randn(3)
    assert torch.equal(fn(x), x * 2 + 1)
    assert any("qmoe_test.twice" in gm.code for gm in graphs), [gm.code for gm in graphs]


def test_dispatcher_path_can_be_forced():
    x = torch.randn(2)
    KernelOp.direct = False
    try:
        assert torch.equal(TWICE(x), x * 2)
        assert "qmoe_test::twice" in _dispatched_ops(lambda: TWICE(x))
    finally:
        KernelOp.direct = True


class _RecordingKernel:
    """Stands in for a Triton kernel: `kernel[grid](*args)` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_launches_happen_in_eager_calls_and_never_in_the_fake_twin():
    kernel = _RecordingKernel()

    def _fill(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        wrapped(kernel)[(x.numel(),)](x, out, BLOCK=4)
        return out

    op = KernelOp("qmoe_test::fill", _fill)
    assert wrapped(kernel) is kernel  # outside a fake twin: the kernel itself
    op(torch.randn(3))
    assert [(g, kw) for g, _, kw in kernel.launches] == [((3,), {"BLOCK": 4})]
    with FakeTensorMode():
        y = op(torch.empty(5))
    assert isinstance(y, FakeTensor) and y.shape == (5,)
    assert len(kernel.launches) == 1  # the fake twin allocated its output and launched nothing


def test_small_problem_config_names_only_kernel_parameters():
    """launch() runs small problems with a fixed config: a name the kernel lacks is refused, under
    the interpreter too (which would ignore it, while a GPU compile raises)."""
    import triton

    from qmoe.kernels import _launch, quantize_nvfp4

    foreign = triton.Config({"BM": 32, "BK": 64, "K_TILES": 1}, num_warps=4)
    with pytest.raises(TypeError, match="K_TILES"):
        _launch.launch(quantize_nvfp4._dequantize_nvfp4_kernel, (1,), (), foreign, 1)
    for kernel in (quantize_nvfp4._dequantize_nvfp4_kernel, quantize_nvfp4._nvfp4_kernel,
                   quantize_nvfp4._nvfp4_amax_kernel):
        _launch._check_config(kernel.fn, tuple(quantize_nvfp4._SMALL.kwargs))
