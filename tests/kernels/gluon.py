"""What the tests of qmoe's Gluon kernels share: a pretend sm90 device for their dispatch, the
check of its compile-failure fallback, seeded grouped GEMM operands (m-grouped and wgrad)."""

import warnings

import pytest
import torch


def pretend_sm90(monkeypatch, module, env: str):
    """`module` (a Gluon kernel module with a FAILED record) dispatches as on an sm90 GPU: the
    capability check answers sm90, no compile has failed yet, and its switch `env` is unset."""
    from qmoe.kernels import _gluon_sm90

    monkeypatch.setattr(_gluon_sm90, "is_sm90", lambda index: True)
    monkeypatch.setattr(module, "FAILED", {})
    monkeypatch.delenv(env, raising=False)
    return module


def assert_a_compile_failure_falls_back_once(monkeypatch, module, launcher: str, dispatch, fallback):
    """With `module.<launcher>` failing as a Gluon compile would, dispatch() returns `fallback`
    (the caller's cue to run the Triton kernel) and warns; a second call neither retries nor warns:
    the launcher ran once and module.FAILED holds one failure."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no such Gluon op")

    monkeypatch.setattr(module, launcher, broken)
    with pytest.warns(RuntimeWarning, match="did not compile"):
        assert dispatch() is fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # recorded: neither a second attempt nor a second warning
        assert dispatch() is fallback
    assert len(calls) == 1 and len(module.FAILED) == 1


def _exact_values(shape, g):
    """+-(1 + j/8) * 2^e, e in {0, 1}: quantized in any block, every value's code lies within 2^3 of
    its block's largest, so a 128-term dot product of codes needs at most 21 bits and fp32 holds it
    exactly, whatever the order of its sums."""
    mant = 1 + torch.randint(0, 8, shape, generator=g).float() / 8
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return sign * mant * torch.exp2(torch.randint(0, 2, shape, generator=g).float())


def grouped_operands(recipe, layout: str, k: int, n: int, device, splits, pad: int, seed: int, exact: bool = False):
    """A grouped GEMM's quantized operands: activations (fprop: x [rows, k]; dgrad: dy [rows, n]) with
    `pad` zero rows past the last group, and the weights [E, n, k] in both orientations. Seeded: the
    same arguments give the same values. `exact`: values whose products of codes sum exactly in
    fp32 in any order (Triton's interpreter computes a dot as a BLAS matmul, whose order of sums
    depends on the matrix shape and the CPU), instead of normal ones."""
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor

    g = torch.Generator().manual_seed(seed)
    rows, cols = sum(splits) + pad, k if layout == "fprop" else n
    x = _exact_values((rows, cols), g) if exact else torch.randn(rows, cols, generator=g)
    x[sum(splits):] = 0
    w = _exact_values((len(splits), n, k), g) if exact else torch.randn(len(splits), n, k, generator=g) / k ** 0.5
    role = "input" if layout == "fprop" else "grad_output"
    a = GroupedTensor.quantize(x.to(device), torch.tensor(splits), recipe.quantizer(role), columnwise=False,
                               validate=False)
    b = quantize_weights(w.to(device), recipe.quantizer("weight"), rowwise=True, columnwise=True)
    return a, b


def wgrad_operands(recipe, splits, n: int, k: int, seed: int = 5, nan_at=()):
    """A wgrad's quantized operands on the GPU: dy [T, n] and x [T, k] over token groups `splits`,
    columnwise copies only. T is the tokens rounded up to 16 (TMA rows); the tokens past the last
    group hold +-1e4, which must never reach a group's sum. nan_at: tokens whose dy gets a NaN."""
    from qmoe.quant import GroupedTensor

    g = torch.Generator(device="cuda").manual_seed(seed)
    total = -(-sum(splits) // 16) * 16
    dy = torch.randn(total, n, generator=g, device="cuda")
    x = torch.randn(total, k, generator=g, device="cuda") * 3
    dy[sum(splits):] = 1e4
    x[sum(splits):] = -1e4
    for t in nan_at:
        dy[t, 0] = float("nan")
    sizes = torch.tensor(splits, device="cuda")
    dyq = GroupedTensor.quantize(dy, sizes, recipe.quantizer("grad_output"), rowwise=False, validate=False)
    xq = GroupedTensor.quantize(x, sizes, recipe.quantizer("input"), rowwise=False, validate=False)
    return dyq, xq
