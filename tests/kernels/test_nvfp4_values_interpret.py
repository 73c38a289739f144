"""The NVFP4 cast's exact values (`grouped_quantize_nvfp4(values=...)`): q * s_b in bf16, [sum M, K]
in x's layout, the columnwise copy's in the Hadamard domain as its codes.

Against the reference bit for bit on inputs whose block scales are exact (and, for the RHT, whose
transform is exact in fp32: the kernel's tensor-core product matches the float64 reference only
there), with empty, odd and 16-row groups; with stochastic rounding, against the kernel's own
codes from the same random stream; and the dequantize-first GEMMs give the same bits from values
as from codes, the tensor factor applied to their accumulators either way. On the CPU through
Triton's interpreter and on the GPU.
"""
import pytest
import torch

from tests.kernels.interpret import assert_passed_under_interpreter, inside, launcher
from tests.kernels.test_quantize_interpret import _exact_nvfp4_input, _exact_rht_input

COPIES = [("rowwise",), ("columnwise",), ("rowwise", "columnwise")]


@launcher
def test_nvfp4_values_under_the_interpreter():
    assert_passed_under_interpreter(__file__, r"\b\d+ passed, \d+ skipped(, \d+ warnings)? in ")


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8) if t.element_size() == 1 else t


def check_values_are_the_references(device, scale=1):
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.reference import grouped_quantize as RG

    sizes = [3 * scale, 0, 13 * scale, 1, 31 * scale]  # odd starts: codes would share bytes, values never do
    cases = [(_exact_nvfp4_input(sum(sizes), 64, seed=2, splits=sizes), sizes, False, False),
             (_exact_nvfp4_input(sum(sizes), 64, seed=2, splits=sizes), sizes, True, False)]
    rht_sizes = [16 * scale, 0, 48 * scale]
    cases.append((_exact_rht_input(sum(rht_sizes), 64), rht_sizes, False, True))
    for x, sizes, block_2d, rht in cases:
        splits = torch.tensor(sizes)
        for values in COPIES:
            got = KG.grouped_quantize_nvfp4(x.to(device), splits.to(device), block_2d, True, True, rht, values=values)
            want = RG.grouped_quantize_nvfp4(x, splits, block_2d, True, True, rht, values=values)
            for i, (g, w) in enumerate(zip(got, want)):
                what = f"2d={block_2d} rht={rht} values={values} output {i}"
                assert (g is None) == (w is None), what
                if g is None:
                    continue
                assert g.dtype == w.dtype and g.shape == w.shape, (what, g.dtype, w.dtype, g.shape, w.shape)
                assert torch.equal(_bits(g.cpu()), _bits(w)), what
            assert got[0].dtype == (torch.bfloat16 if "rowwise" in values else torch.uint8)
            assert got[3].dtype == (torch.bfloat16 if "columnwise" in values else torch.uint8)


def check_stochastic_values_are_the_codes(device, rows=64):
    """Gradients (RHT, stochastic rounding): values from one seed dequantize as the codes from it."""
    from qmoe import GroupedTensor
    from qmoe.recipes import NVFP4BlockScaling

    q = NVFP4BlockScaling().quantizer("grad_output")
    x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(1)) * 3).to(device)
    splits = [rows // 4, 0, rows - rows // 4]
    q.generator = torch.Generator(device=device).manual_seed(7)
    codes = GroupedTensor.quantize(x, splits, q)
    q.generator = torch.Generator(device=device).manual_seed(7)
    held = GroupedTensor.quantize(x, splits, q, values=("rowwise", "columnwise"))
    assert sorted(held.values) == ["columnwise", "rowwise"]
    for columnwise in (False, True):
        assert torch.equal(held.dequantize(torch.float32, columnwise=columnwise),
                           codes.dequantize(torch.float32, columnwise=columnwise)), columnwise


def check_gemms_read_values_as_codes(device, rows=(32, 0, 64, 32)):
    from qmoe import GroupedTensor
    from qmoe.kernels.grouped_gemm import k_grouped_gemm_with, m_grouped_gemm_with
    from qmoe.ops import quantize_weights
    from qmoe.recipes import NVFP4BlockScaling

    g = torch.Generator().manual_seed(3)
    e, n, k, t = len(rows), 32, 64, sum(rows)
    x, dy = torch.randn(t, k, generator=g).to(device), torch.randn(t, n, generator=g).to(device)
    w = (torch.randn(e, n, k, generator=g) / 8).to(device)
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)

    def quantized(values):
        return (GroupedTensor.quantize(x, list(rows), recipe.quantizer("input"), values=values),
                GroupedTensor.quantize(dy, list(rows), recipe.quantizer("grad_output"), values=values),
                quantize_weights(w, recipe.quantizer("weight"), columnwise=True, values=values))

    (xc, dc, wc), (xv, dv, wv) = quantized(()), quantized(("rowwise", "columnwise"))
    assert xv.values and dv.values and wv.values
    pairs = [(m_grouped_gemm_with(xv, wv, route="dequant"), m_grouped_gemm_with(xc, wc, route="dequant")),
             (m_grouped_gemm_with(dv, wv, b_columnwise=True, route="dequant"),
              m_grouped_gemm_with(dc, wc, b_columnwise=True, route="dequant")),
             (k_grouped_gemm_with(dv, xv, out_dtype=torch.float32, route="dequant"),
              k_grouped_gemm_with(dc, xc, out_dtype=torch.float32, route="dequant"))]
    for i, (got, want) in enumerate(pairs):
        assert torch.equal(got, want), f"GEMM {i}"


@inside
def test_the_values_are_the_references():
    check_values_are_the_references("cpu")


@inside
def test_stochastic_values_are_the_codes_values():
    check_stochastic_values_are_the_codes("cpu")


@inside
def test_the_gemms_give_the_same_bits_from_values():
    check_gemms_read_values_as_codes("cpu")


@pytest.mark.gpu
def test_on_the_gpu():
    check_values_are_the_references("cuda", scale=9)
    check_stochastic_values_are_the_codes("cuda", rows=4096)
    check_gemms_read_values_as_codes("cuda", rows=(512, 0, 1024, 384))
