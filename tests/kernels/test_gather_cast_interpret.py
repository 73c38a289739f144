"""Gathered rows (`GatheredRows`, the permute fused into FC1's input cast) through the Triton casts on
CPU, under Triton's interpreter, at tiny sizes.

Every grouped quantize kernel reads a gathered row from its token (`load_rows` with GATHER); the
result must be that of quantizing the permuted rows themselves, bit for bit: codes, scales and
amaxes, for each format, with padding rows (no source), tokens routed nowhere, groups off a
block boundary, NaN and +-inf in the tokens. The per-expert amax the permute hands current
scaling (`moe_permute(..., gather=True, with_amax=True)`) must be the permute kernel's own.

The interpreter rounds fp32 -> fp8 differently from the GPU, so codes are compared between the
two inputs of the same kernel (the GPU tests compare the Gluon cast); scales and amaxes do not
depend on that rounding.
"""
import warnings

import pytest
import torch

from tests.kernels.interpret import INTERPRETING, inside, launcher, assert_passed_under_interpreter  # noqa: F401

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
SPECIALS = (float("nan"), float("inf"), float("-inf"))


@launcher
def test_gathered_casts_under_the_interpreter():
    assert_passed_under_interpreter(__file__, r"\b\d+ passed, 1 skipped in ")


@pytest.fixture(autouse=True)
def _quiet_numpy():
    with warnings.catch_warnings():  # inf - inf in the interpreter's numpy
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _permuted(t, e, k, align, h, dtype, special, seed):
    """(tokens, the permute's GatheredRows, its permuted rows, the experts' groups)."""
    from qmoe.contracts.carriers import permuted_sources
    from qmoe.kernels import permute as kernels
    from qmoe.ops.grouped_linear_paths import absorb_tail
    from qmoe.contracts.carriers import GatheredRows
    from qmoe.reference.permute import with_num_rows
    gen = torch.Generator().manual_seed(seed)
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        chosen = int(torch.randint(0, k + 1, (), generator=gen))  # 0: a token routed nowhere
        routing_map[i, 1 + torch.randperm(e - 1, generator=gen)[:chosen]] = True  # expert 0 empty
    row_id_map, split_sizes = kernels.permute_index(routing_map, k, align)
    # rounded up to whole blocks, as the layer does (its zero tail joins the last group)
    row_id_map = with_num_rows(row_id_map, -(-row_id_map.num_rows // align) * align)
    x = torch.randn(t, h, generator=gen) * 10.0 ** torch.randint(-3, 4, (t, 1), generator=gen)
    if special:
        flat = x.view(-1)
        for i, pos in enumerate(range(0, flat.numel(), 11)):
            flat[pos] = SPECIALS[i % 3]
    x = x.to(dtype)
    rows = GatheredRows(x, permuted_sources(row_id_map), row_id_map)
    return x, rows, kernels.permute_rows(x, row_id_map), absorb_tail(split_sizes.long(), row_id_map.num_rows)


def _same(got, want, what):
    if got is None or want is None:
        assert got is None and want is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, what
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.view(raw), want.view(raw)), what


# (tokens, experts, top_k, align, hidden, dtype, non-finite values): padding rows (align > 1),
# groups off 32 / 128 rows, a hidden size that is not a tile multiple
CASES = [(9, 5, 3, 16, 96, BF16, True), (7, 4, 2, 1, 40, FP32, True), (11, 6, 2, 32, 64, FP16, False),
         (5, 3, 2, 16, 160, BF16, False)]
IDS = [f"{c[0]}x{c[4]}-align{c[3]}-{str(c[5])[6:]}" for c in CASES]


@inside
@pytest.mark.parametrize("t,e,k,align,h,dtype,special", CASES, ids=IDS)
def test_gathered_rows_cast_as_the_permuted_rows(t, e, k, align, h, dtype, special):
    from qmoe.contracts.formats import E4M3, ScaleMode
    from qmoe.kernels import grouped_quantize as gq
    x, gathered, permuted, groups = _permuted(t, e, k, align, h, dtype, special, seed=t * 7 + h)
    _same(gathered.materialize(), permuted, "the rows")
    _same(gq.grouped_tensor_amax(gathered, groups), gq.grouped_tensor_amax(permuted, groups), "group amax")
    scales = torch.rand(groups.numel()) * 4 + 0.25
    for got, want, what in zip(gq.grouped_quantize_fp8_tensorwise(gathered, groups, scales, E4M3, True, True),
                               gq.grouped_quantize_fp8_tensorwise(permuted, groups, scales, E4M3, True, True),
                               ("tensorwise rows", "tensorwise columns", "tensorwise amax")):
        _same(got, want, what)
    for got, want, what in zip(gq.grouped_quantize_fp8_block(gathered, groups, 1, 128, E4M3, True, 0.0, True, True),
                               gq.grouped_quantize_fp8_block(permuted, groups, 1, 128, E4M3, True, 0.0, True, True),
                               ("1x128 rows", "1x128 row scales", "1x128 columns", "1x128 column scales")):
        _same(got, want, what)
    for got, want, what in zip(gq.grouped_quantize_mxfp8(gathered, groups, E4M3, ScaleMode.ROUND_UP, True, True),
                               gq.grouped_quantize_mxfp8(permuted, groups, E4M3, ScaleMode.ROUND_UP, True, True),
                               ("MXFP8 rows", "MXFP8 row scales", "MXFP8 columns", "MXFP8 column scales")):
        _same(got, want, what)
    if align % 16 == 0:
        for got, want, what in zip(gq.grouped_quantize_nvfp4(gathered, groups, False, True, True, rht=True),
                                   gq.grouped_quantize_nvfp4(permuted, groups, False, True, True, rht=True),
                                   ("NVFP4 rows", "NVFP4 row scales", "NVFP4 amax", "NVFP4 columns (RHT)",
                                    "NVFP4 column scales", "NVFP4 column amax")):
            _same(got, want, what)


@inside
@pytest.mark.parametrize("t,e,k,align,h,dtype,special", CASES, ids=IDS)
def test_gathered_amax_is_the_permute_kernels(t, e, k, align, h, dtype, special):
    """moe_permute(gather=True, with_amax=True) hands over the permute kernel's per-expert amax."""
    from qmoe.kernels import permute as kernels
    from qmoe.ops import moe_permute
    from qmoe.reference import permute as reference
    x, _, _, _ = _permuted(t, e, k, align, h, dtype, special, seed=t * 7 + h)
    gen = torch.Generator().manual_seed(t)
    routing_map = torch.rand(t, e, generator=gen) < 0.4
    routing_map[:, 0] = False
    k = max(int(routing_map.sum(1).max()), 1)
    want = moe_permute(x, routing_map, align_size=align, top_k=k, with_amax=True)[0].amax
    got, _, _, _ = moe_permute(x, routing_map, align_size=align, top_k=k, with_amax=True, gather=True)
    _same(got.amax, want, "the gathered rows' amax")
    _same(kernels.row_amax(x), reference.row_amax(x), "row amax")
