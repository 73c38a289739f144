"""The scaled-activation kernels == their reference on CPU, through Triton's interpreter, small sizes.

As in test_bias_interpret.py: `TRITON_INTERPRET` must be set before Triton decorates the kernels,
so the one test that runs in the normal session starts a fresh interpreter with TRITON_INTERPRET=1
and QMOE_BACKEND=triton on this same file; there the comparisons run.

Tolerances (NUMERICS-style: both sides compute in fp32 and round once to h's dtype):
- fp32 outputs differ by the fp32 roundings of two formulas (the kernel's sigmoid-form gelu vs
  torch's tanh form, its own sigmoid): rtol 1e-5, plus an absolute 1e-6 of the tensor's largest
  magnitude for torch's 1 + tanh cancellation on gelu's negative tail.
- bf16 / fp16 outputs: fp32 values a few ulps apart may round to neighbours: rtol one ulp of the
  output format (2^-7, 2^-10), and the same absolute term.
- dprobs (fp32 sums over F in different orders): 1e-5 of sum_j |da * act| per row.
- dh with and without the dprobs reduction come from the same elementwise code: bit for bit.
"""
import warnings

import pytest
import torch

from qmoe.contracts.carriers import is_glu
from tests.kernels.activation_inputs import activation_inputs
from tests.kernels.interpret import INTERPRETING, inside, launcher, assert_passed_under_interpreter  # noqa: F401

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
RTOL = {FP32: 1e-5, BF16: 2.0 ** -7, FP16: 2.0 ** -10}


@launcher
def test_activation_kernels_under_the_interpreter():
    # everything passed there; the one skip is this launcher test itself
    assert_passed_under_interpreter(__file__, r"\b\d+ passed, 1 skipped in ")


@pytest.fixture(autouse=True)
def _quiet_numpy():
    # exp overflows to inf in the interpreter's numpy for large |x|; the sigmoid then saturates as on the GPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _assert_close(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    finite = want.float()[torch.isfinite(want.float())]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=RTOL[want.dtype] if want.dtype in RTOL else 1e-5,
                               atol=1e-6 * scale + 1e-30, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _assert_dprobs_close(got, want, h, da, activation, k):
    from qmoe.reference import activation as reference
    act = reference.scaled_activation_forward(h.float(), None, activation, k)
    tol = 1e-5 * (da.float() * act).abs().sum(1)
    assert got.dtype == torch.float32 and got.shape == want.shape
    bad = ~((got == want) | ((got - want).abs() <= tol) | (torch.isnan(got) & torch.isnan(want)))
    assert not bool(bad.any()), f"dprobs: rows {bad.nonzero().flatten().tolist()}: {got[bad]} vs {want[bad]}"


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _compare(h, probs, da, activation, k, what=""):
    from qmoe.kernels import activation as kernels
    from qmoe.reference import activation as reference
    _assert_close(kernels.scaled_activation_forward(h, probs, activation, k),
                  reference.scaled_activation_forward(h, probs, activation, k), f"{what} a")
    dh, dprobs = kernels.scaled_activation_backward(h, probs, da, activation, k)
    dh_want, dprobs_want = reference.scaled_activation_backward(h, probs, da, activation, k)
    _assert_close(dh, dh_want, f"{what} dh")
    if probs is None:
        assert dprobs is None and dprobs_want is None
    else:
        _assert_dprobs_close(dprobs, dprobs_want, h, da, activation, k)
    dh_only, none = kernels.scaled_activation_backward(h, probs, da, activation, k, need_dprobs=False)
    assert none is None
    assert torch.equal(_bits(dh_only), _bits(dh)), f"{what}: dh of the 2-D launch != dh of the reducing launch"


# (activation, dtype, rows, F, glu_interleave_size, probs): the small-problem tile is 16 rows x 128
# columns; the reducing backward takes one row per program here and 256 columns per step.
CASES = [
    ("swiglu", FP32, 37, 300, None, True),  # 3 column tiles, 2 reduction steps, masked tails
    ("swiglu", BF16, 37, 40, 4, True),
    ("swiglu", FP16, 20, 64, None, False),
    ("geglu", FP32, 18, 24, 1, True),  # gate / linear alternate every column
    ("geglu", BF16, 33, 136, None, True),
    ("clamped_qgeglu", FP32, 21, 32, 8, True),
    ("clamped_qgeglu", BF16, 17, 16, 16, False),  # one block: the same as the plain layout
    ("clamped_qgeglu", FP16, 9, 264, 4, True),
    ("relu2", FP32, 35, 130, None, True),
    ("relu2", BF16, 16, 257, 4, True),  # the interleave size is ignored for pointwise activations
    ("gelu", FP16, 19, 72, None, True),
    ("gelu", FP32, 16, 257, None, False),
    ("gelu", BF16, 1, 1, None, True),
]
IDS = [f"{a}-{str(d).split('.')[-1]}-R{r}-F{f}-k{k}-{'p' if p else 'nop'}" for a, d, r, f, k, p in CASES]


@inside
@pytest.mark.parametrize("activation, dtype, rows, f, k, with_probs", CASES, ids=IDS)
def test_kernels_match_reference(activation, dtype, rows, f, k, with_probs):
    h, probs, da = activation_inputs(activation, dtype, rows, f, seed=rows + f)
    _compare(h, probs if with_probs else None, da, activation, k)


@inside
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "clamped_qgeglu", "relu2", "gelu"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_special_values_match_reference(activation, dtype):
    """NaN, +-inf, huge and tiny magnitudes, signed zeros: the same NaNs, infinities and zeros as torch."""
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e20, -1e20, 1e4, -1e4,
                             100.0, -100.0, 7.0, -7.0, 1e-30, -1e-30, 0.0, -0.0])
    n = specials.numel()
    rows = torch.cat([specials.roll(i) for i in range(n)]).reshape(n, n)[:, :16]  # every value in every column
    h = (torch.cat((rows, rows.flip(0)), 1) if is_glu(activation) else rows).to(dtype)
    gen = torch.Generator().manual_seed(1)
    probs = torch.rand(n, generator=gen)
    da = torch.randn(n, 16, generator=gen).to(dtype)
    _compare(h, probs, da, activation, None, "specials")
    if is_glu(activation):
        _compare(h, probs, da, activation, 4, "specials interleaved")


@inside
def test_stridedactivation_inputs():
    """Rows at any stride (views into wider buffers) are read in place; a column-strided h or da
    is copied first. Either way the values equal the contiguous case."""
    from qmoe.kernels import activation as kernels
    h, probs, da = activation_inputs("swiglu", BF16, 23, 48, seed=5)
    wide_h = torch.zeros(23, 96 + 8, dtype=BF16)
    wide_h[:, 3:99] = h
    wide_da = torch.zeros(23, 48 + 16, dtype=BF16)
    wide_da[:, :48] = da
    p2 = torch.stack((probs, -probs), 1)[:, 0]  # stride 2
    views = dict(h=wide_h[:, 3:99], da=wide_da[:, :48], probs=p2)
    assert views["h"].stride() == (104, 1) and views["probs"].stride() == (2,)
    _compare(views["h"], views["probs"], views["da"], "swiglu", 8, "row-strided")
    h_cols, da_cols = h.t().contiguous().t(), da.t().contiguous().t()  # column stride R
    assert h_cols.stride(1) != 1
    _compare(h_cols, probs, da_cols, "swiglu", 8, "column-strided")
    for got, want in zip(kernels.scaled_activation_backward(views["h"], views["probs"], views["da"], "swiglu", 8),
                         kernels.scaled_activation_backward(h, probs, da, "swiglu", 8)):
        assert torch.equal(got, want)


@inside
@pytest.mark.parametrize("activation, k", [("swiglu", None), ("geglu", 2), ("gelu", None)])
def test_reducing_backward_with_row_blocks_and_many_steps(activation, k, monkeypatch):
    """The dprobs launch with 4-row blocks (a masked last block) and 16-column steps (a masked last step)."""
    import triton

    from qmoe.kernels import activation as kernels
    monkeypatch.setattr(kernels, "_reducing_config",
                        lambda rows: triton.Config({"BM": 4, "BN": 16}, num_warps=4, num_stages=1))
    h, probs, da = activation_inputs(activation, FP32, 37, 40, seed=6)
    _compare(h, probs, da, activation, k, "BM4-BN16")


@inside
@pytest.mark.parametrize("rows, f", [(0, 8), (5, 0), (0, 0)])
def test_empty_shapes(rows, f):
    from qmoe.kernels import activation as kernels
    h, probs, da = torch.zeros(rows, 2 * f), torch.rand(rows), torch.zeros(rows, f)
    assert kernels.scaled_activation_forward(h, probs, "swiglu").shape == (rows, f)
    dh, dprobs = kernels.scaled_activation_backward(h, probs, da, "swiglu")
    assert dh.shape == (rows, 2 * f) and torch.equal(dprobs, torch.zeros(rows))


@inside
def test_op_and_grouped_mlp_use_the_kernels_and_match_reference(monkeypatch):
    """expert_activation (QMOE_BACKEND=triton here) runs the kernels forward and backward and equals
    the reference backend, alone and inside GroupedMLP."""
    import qmoe
    from qmoe.dispatch import ACTIVATION
    from qmoe.ops import expert_activation
    calls = []
    for name in ("scaled_activation_forward", "scaled_activation_backward"):  # log the kernels the table hands out
        kernel, reference = ACTIVATION.table[name]
        monkeypatch.setitem(ACTIVATION.table, name,
                            (lambda *a, f=kernel, n=name: calls.append(n) or f(*a), reference))

    def run():
        torch.manual_seed(0)
        h, probs, da = activation_inputs("clamped_qgeglu", FP32, 24, 16, seed=7)
        h.requires_grad_(True)
        probs.requires_grad_(True)
        a = expert_activation(h, probs, "clamped_qgeglu", 4)
        a.backward(da)
        mlp = qmoe.nn.GroupedMLP(3, 8, 16, activation="swiglu", glu_interleave_size=8, grouped_path="split")
        x, p = torch.randn(24, 8), torch.rand(24, requires_grad=True)
        y = mlp(x, torch.tensor([10, 0, 14]), p)
        y.square().sum().backward()
        return [a.detach(), h.grad, probs.grad, y.detach(), p.grad, mlp.fc1.weight.grad]

    got = run()
    assert calls.count("scaled_activation_forward") == 2 and calls.count("scaled_activation_backward") == 2
    monkeypatch.setenv("QMOE_BACKEND", "reference")
    want = run()
    assert len(calls) == 4
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()), msg=lambda m: f"{i}: {m}")
