"""The Triton producers' amaxes on CPU, through Triton's interpreter, at tiny sizes.

The permute, the unpermute backward and the activation kernels reduce each group's amax of the
rows they write (atomic max of |x|'s float bits). Bit for bit it must be what the quantizer's
own amax pass (`grouped_tensor_amax`, the kernel) measures on those rows, for the consumer's
groups: finite values only, 0 for an empty group, rows of dropped tokens and padding ignored;
the rows themselves must be those written without the amax. And a current-scaling MoELayer on
these kernels must skip the amax passes the producers replace, with the same operands.

As in test_routing_interpret.py, the one test of the normal session re-runs this file in a
fresh interpreter with TRITON_INTERPRET=1 and QMOE_BACKEND=triton.
"""
import warnings

import pytest
import torch

from tests.kernels.interpret import INTERPRETING, inside, launcher, assert_passed_under_interpreter  # noqa: F401

SPECIALS = (float("nan"), float("inf"), float("-inf"))


@launcher
def test_amax_producers_under_the_interpreter():
    assert_passed_under_interpreter(__file__, r"\b\d+ passed, 1 skipped in ")


@pytest.fixture(autouse=True)
def _quiet_numpy():
    with warnings.catch_warnings():  # inf - inf and exp overflow in the interpreter's numpy
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _measured(rows, splits):
    """The quantizer's own amax pass (the kernel) over the consumer's groups."""
    from qmoe.kernels.grouped_quantize import grouped_tensor_amax
    return grouped_tensor_amax(rows, splits)


def _same_amax(got, want, what):
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, (what, got, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{what}: {got} != {want}"


def _same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.view(raw), want.view(raw)), what


def _sprinkle(x, gen):
    x = x.clone()
    flat = x.view(-1)
    for i, pos in enumerate(range(0, flat.numel(), 13)):
        flat[pos] = SPECIALS[(i + int(torch.randint(0, 3, (), generator=gen))) % 3]
    x[int(torch.randint(0, x.shape[0], (), generator=gen))] = float("nan")
    return x


# (tokens, experts, top_k, align, hidden, dtype, non-finite values): empty expert 0 always; tokens
# routed to no expert; a hidden size over one program's columns (4096 bytes); over 128 experts
BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
PERMUTE_CASES = [(7, 4, 2, 1, 8, BF16, True), (9, 5, 3, 4, 40, FP32, True), (9, 5, 3, 4, 40, FP16, False),
                 (5, 3, 2, 2, 1100, BF16, True), (5, 3, 2, 2, 1100, FP32, False), (3, 130, 2, 2, 4, BF16, True)]


@inside
@pytest.mark.parametrize("t,e,k,align,h,dtype,special", PERMUTE_CASES, ids=[str(c[:5]) + str(c[5])[6:] + str(c[6])
                                                                          for c in PERMUTE_CASES])
def test_permute_and_unpermute_backward_amax(t, e, k, align, h, dtype, special):
    from qmoe.kernels import permute as kernels
    from qmoe.ops.grouped_linear_paths import absorb_tail
    from qmoe.reference import permute as reference
    gen = torch.Generator().manual_seed(t * 100 + e + h)
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        chosen = int(torch.randint(0, k + 1, (), generator=gen))
        routing_map[i, 1 + torch.randperm(e - 1, generator=gen)[:chosen]] = True
    row_id_map, split_sizes = kernels.permute_index(routing_map, k, align)
    row_id_map = reference.with_num_rows(row_id_map, row_id_map.num_rows + 3)
    groups = absorb_tail(split_sizes.long(), row_id_map.num_rows)  # the experts' GEMMs' groups
    x = torch.randn(t, h, generator=gen) * 10.0 ** torch.randint(-4, 5, (t, 1), generator=gen)
    x = (_sprinkle(x, gen) if special else x).to(dtype)

    out, amax = kernels.permute_rows(x, row_id_map, with_amax=True)
    _same_bits(out, kernels.permute_rows(x, row_id_map), "permuted rows")
    _same_amax(amax, _measured(out, groups), "permute's amax")
    _same_amax(amax, reference.permute_rows(x, row_id_map, with_amax=True).amax, "the reference twin's amax")

    g = torch.randn(t, h, generator=gen) * 10.0 ** torch.randint(-4, 5, (t, 1), generator=gen)
    g = (_sprinkle(g, gen) if special else g).to(dtype)
    probs = torch.rand(t, e, generator=gen) * routing_map
    for merging in (None, probs):
        (grad_y, amax), grad_p = kernels.unpermute_rows_backward(g, out, row_id_map, merging, with_amax=True)
        want_y, want_p = kernels.unpermute_rows_backward(g, out, row_id_map, merging)
        _same_bits(grad_y, want_y, "grad_y")
        _same_amax(amax, _measured(grad_y, groups), "unpermute backward's amax")


# groups of rows: tiles inside one group and across several (BM 16 rows), an empty group, and
# rows past the last group (no group: ignored); int32 and int64 offsets
ACTIVATION_CASES = [("swiglu", None, [3, 0, 9, 1, 20], 2, 72, BF16, torch.int64),
                    ("swiglu", None, [3, 0, 9, 1, 20], 0, 72, FP32, torch.int32),
                    ("geglu", 4, [40], 0, 8, BF16, torch.int64), ("relu2", None, [0, 17, 5], 6, 300, FP32, torch.int64),
                    ("clamped_qgeglu", None, [2, 2], 1, 16, BF16, torch.int32)]


@inside
@pytest.mark.parametrize("activation,k,splits,tail,f,dtype,offsets_dtype", ACTIVATION_CASES,
                         ids=[f"{c[0]}-{str(c[5])[6:]}" for c in ACTIVATION_CASES])
def test_activation_amax(activation, k, splits, tail, f, dtype, offsets_dtype):
    from qmoe.contracts.carriers import is_glu
    from qmoe.kernels import activation as kernels
    from qmoe.reference.quantize import group_amax
    gen = torch.Generator().manual_seed(f + len(splits))
    s = torch.tensor(splits)
    offsets = torch.cat((s.new_zeros(1), s.cumsum(0))).to(offsets_dtype)
    rows = sum(splits) + tail
    h = _sprinkle(torch.randn(rows, (2 if is_glu(activation) else 1) * f, generator=gen) * 3, gen).to(dtype)
    probs = torch.rand(rows, generator=gen)
    a, amax = kernels.scaled_activation_forward(h, probs, activation, k, amax_offsets=offsets)
    _same_bits(a, kernels.scaled_activation_forward(h, probs, activation, k), "a")
    _same_amax(amax, group_amax(a, offsets), "a's amax")
    if not tail:
        _same_amax(amax, _measured(a, s), "a's amax (the quantizer's pass)")
    da = torch.randn(rows, f, generator=gen).to(dtype)
    for need_dprobs in (True, False):
        (dh, amax), dprobs = kernels.scaled_activation_backward(h, probs, da, activation, k, need_dprobs,
                                                               amax_offsets=offsets)
        want_dh, want_dprobs = kernels.scaled_activation_backward(h, probs, da, activation, k, need_dprobs)
        _same_bits(dh, want_dh, "dh")
        assert (dprobs is None) == (want_dprobs is None)
        if dprobs is not None:
            _same_bits(dprobs, want_dprobs, "dprobs")
        _same_amax(amax, group_amax(dh, offsets), "dh's amax")
        if not tail:
            _same_amax(amax, _measured(dh, s), "dh's amax (the quantizer's pass)")


@inside
@pytest.mark.parametrize("fuse", [True, False], ids=["fused-activation", "activation-first"])
def test_moe_layer_on_the_kernels_casts_only(monkeypatch, fuse):
    """Current scaling on the kernels: the producers' amaxes replace the amax passes of FC1's
    input and of both grad_outputs (and of FC2's input when the activation runs first), with
    the same outputs and gradients bit for bit."""
    import qmoe
    from qmoe.quant.quantizer import Float8CurrentQuantizer
    from qmoe.recipes import Float8CurrentScaling
    from tests.quant.test_rows_with_amax import counting_amax_passes
    monkeypatch.setattr(Float8CurrentQuantizer, "fuses_activation", fuse)
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(64, 32, 4, 2, params_dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)  # finite: the producers' non-finite cases are above
    g = torch.randn(16, 64, dtype=torch.bfloat16)

    def run():
        for p in layer.parameters():
            p.grad = None
        xr = x.clone().requires_grad_(True)
        with counting_amax_passes() as calls:
            with qmoe.autocast(recipe=Float8CurrentScaling()):
                y = layer(xr)
            y.backward(g)
        return [y.detach(), xr.grad] + [p.grad for p in layer.parameters()], len(calls)

    got, passes = run()
    monkeypatch.setattr(Float8CurrentQuantizer, "takes_amax", False)
    want, want_passes = run()
    assert want_passes == 6  # two weights, FC1's and FC2's inputs, two grad_outputs
    assert passes == (3 if fuse else 2), passes  # the weights (and FC2's fused input: FC1's GEMM made h)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), f"tensor {i}"
