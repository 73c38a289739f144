"""FastLauncher (kernels/_triton_utils.py): launches that skip JITFunction.run compute what
JITFunction.run's would, for every change of specialization, and step aside for launch hooks.

On the CPU the fast path is off (Triton's interpreter), so these run on the GPU only; every
kernel test of the GPU suite also launches through it.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from qmoe.kernels import _triton_utils as utils

pytestmark = pytest.mark.gpu


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, alpha, SQUARE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    if SQUARE:
        x = x * x
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, y, alpha, square, block):
    out = torch.empty_like(y)
    n = y.numel()
    utils.wrapped(_axpy)[(triton.cdiv(n, block),)](x, y, out, n, alpha, square, BLOCK=block)
    return out


def _want(x, y, alpha, square):
    xf = x.float()
    return (alpha * (xf * xf if square else xf) + y.float()).to(y.dtype)


@pytest.fixture
def counted(monkeypatch):
    """Counts the launches that go through JITFunction.run."""
    calls = []
    run = _axpy.run

    def counting(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(_axpy, "run", counting)
    utils._FAST_LAUNCHERS.pop(_axpy, None)
    return calls


def test_fast_launches_are_on_for_this_triton():
    assert utils._FAST_LAUNCH and utils._no_launch_hooks(), "expected on Triton >= 3.6 with no launch hook"
    assert isinstance(utils.wrapped(_axpy), utils.FastLauncher)


def test_every_specialization_change_computes_the_right_result(counted):
    torch.manual_seed(0)
    base = torch.randn(4099, device="cuda")
    other = torch.randn(4099, device="cuda")
    cases = [
        (base, other, 2.0, False, 128),                 # aligned, n % 16 == 3
        (base, other, -1.5, False, 128),                # same specialization, another float
        (base[1:], other[1:], 2.0, False, 128),         # misaligned pointers: Triton recompiles
        (base[:16], other[:16], 2.0, False, 128),       # n a multiple of 16
        (base[:1], other[:1], 2.0, False, 128),         # n == 1
        (base, other, 2.0, True, 128),                  # a positional constexpr changes
        (base, other, 2.0, False, 256),                 # a keyword constexpr changes
        (base.bfloat16(), other.bfloat16(), 2.0, False, 128),  # dtypes change
    ]
    for x, y, alpha, square, block in cases:
        for _ in range(3):  # the first launch of a specialization compiles, the others are fast
            got = _launch(x, y, alpha, square, block)
            torch.testing.assert_close(got, _want(x, y, alpha, square), rtol=1e-2 if y.dtype == torch.bfloat16 else 0,
                                       atol=1e-2 if y.dtype == torch.bfloat16 else 1e-6)
    fast = utils._FAST_LAUNCHERS[_axpy]
    # cases 1 and 2 share one specialization; each other case adds one
    assert len(fast.compiled) == len(cases) - 1
    assert len(counted) == len(fast.compiled), "repeat launches must skip JITFunction.run"


def test_launch_hooks_send_launches_through_jit(counted):
    from triton import knobs
    x, y = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    _launch(x, y, 1.0, False, 128)
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    chain = knobs.runtime.launch_enter_hook  # an (empty) hook chain on Triton 3.6+
    chain.add(hook)
    try:
        torch.testing.assert_close(_launch(x, y, 3.0, False, 128), _want(x, y, 3.0, False))
    finally:
        chain.remove(hook)
    assert len(counted) == 2 and seen, "a hooked launch must go through JITFunction.run (and its hook)"


def test_fast_launches_follow_the_current_stream_and_graph_capture():
    x, y = torch.randn(1 << 20, device="cuda"), torch.randn(1 << 20, device="cuda")
    _launch(x, y, 1.0, False, 1024)  # compiled outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _launch(x, y, 0.5, False, 1024)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, _want(x, y, 0.5, False))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _launch(x, y, 0.25, False, 1024)
    x.mul_(-1)
    graph.replay()
    torch.testing.assert_close(captured, _want(x, y, 0.25, False))
