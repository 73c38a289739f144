"""The quantize kernels on CPU, under Triton's interpreter (TRITON_INTERPRET=1), at tiny sizes.

The interpreter mis-rounds float -> fp8 casts (ties and carries into the next binade), so FP8
codes are proven on the GPU (test_quantize_kernels.py). Here, against the reference, bit for
bit: tensor and group amaxes, FP8 block scales (1x128, 128x128, power-of-two and fp32), E8M0
exponents of both MX scale modes, grouped scale layouts with empty and odd groups, and NVFP4
codes, E4M3 scales and amaxes on inputs whose block scales are exact and differ from block to
block (each 16-run's amax is the tensor amax times its own power of two), including odd group
boundaries in the packed columnwise data and the RHT (fp32).
The expert activation fused into the grouped quantizers (an ActivatedRows input) gives every
output bit for bit as quantizing the activation kernel's output does (both interpreted).
Runs in a subprocess so the interpreter switch never leaks into other tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-W", "ignore", __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all interpreter checks passed" in proc.stdout


# ---------------------------------------------------------------- the checks (run in the subprocess)

def _same(got, want, what):
    import torch
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype == torch.float32:
        same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    else:
        same = got.view(torch.uint8) == want.view(torch.uint8)
    assert bool(same.all()), f"{what}: {(~same).sum().item()} of {same.numel()} differ"


def _inputs():
    import torch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 200, generator=g) * torch.exp(torch.randn(40, 200, generator=g) * 4)
    x[3, 5], x[10, 150], x[20, 7], x[30, 0] = float("nan"), float("inf"), -float("inf"), 0.0
    x[25] = 0.0
    return x


def _exact_nvfp4_input(m, k, seed=1, splits=None):
    """Blocks whose amaxes differ and whose E4M3 block scales are exact: every 16-run along either
    axis (within each group) holds +-8 * 2^-j, j = (column // 16) % 4, and nothing larger (a +-8
    diagonal in every 16x16 tile, full rows of +-8 where a group's 16-row runs start, everything
    else within +-7, all scaled by 2^-j). The tensor amax is 8 and the block scales are 448 * 2^-j:
    a kernel that used the tensor amax, or another block's, for a block would differ."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).clamp(-7.0, 7.0)
    pm8 = torch.where(torch.rand(m, k, generator=g) < 0.5, -8.0, 8.0)
    mark = (torch.arange(m)[:, None] % 16) == (torch.arange(k)[None, :] % 16)
    start = 0
    for size in (splits or [m]):
        mark[start:start + size:16] = True
        start += size
    return torch.where(mark, pm8, x) * torch.exp2(-(torch.arange(k) // 16 % 4).float())


def _exact_rht_input(m, k, seed=4):
    """For the RHT copy, whose values are sums of 16: +-8 * 2^-j, constant over each 16-row run of
    a column (the transform of a constant run has a fixed shape, so its amax scales with it) and
    j = (row // 16 + column // 16) % 4, so block amaxes differ and every E4M3 block scale is exact."""
    import torch
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(m // 16, k, generator=g) < 0.5, -8.0, 8.0).repeat_interleave(16, 0)
    j = (torch.arange(m)[:, None] // 16 + torch.arange(k)[None, :] // 16) % 4
    return sign * torch.exp2(-j.float())


def check_fp8_scales():
    import torch
    from qmoe.contracts.formats import E4M3, E5M2, ScaleMode
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.kernels import quantize as K
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize as R
    x = _inputs()
    _same(K.tensor_amax(x), R.tensor_amax(x), "amax")
    amax = torch.tensor([0.0, 1e-40, 1.0, 3.3, 3e38, float("inf"), float("nan")])
    for p2 in (False, True):
        _same(K.compute_fp8_scale(amax, E4M3.max, p2, 1e-3), R.compute_fp8_scale(amax, E4M3.max, p2, 1e-3), "scale")
    from tests.kernels.scale_inputs import edge_amaxes
    edges = edge_amaxes()
    for fmt in (E4M3, E5M2):
        for p2 in (False, True):
            for eps in (0.0, 1e-3):
                _same(K.compute_fp8_scale(edges, fmt.max, p2, eps), R.compute_fp8_scale(edges, fmt.max, p2, eps),
                      f"scale {fmt} p2={p2} eps={eps} at every binade")
    for br, p2 in ((1, True), (1, False), (128, True)):
        k = K.quantize_fp8_block(x, br, 128, E4M3, p2, 0.0, True, True)
        r = R.quantize_fp8_block(x, br, 128, E4M3, p2, 0.0, True, True)
        _same(k[1], r[1], f"block {br} row scales")
        _same(k[3], r[3], f"block {br} col scales")
    for fmt in (E4M3, E5M2):
        for mode in ScaleMode:
            k = K.quantize_mxfp8(x, fmt, mode, True, True)
            r = R.quantize_mxfp8(x, fmt, mode, True, True)
            _same(k[1], r[1], f"mx {fmt} {mode} row e8m0")
            _same(k[3], r[3], f"mx {fmt} {mode} col e8m0")
    splits = torch.tensor([0, 13, 1, 0, 26])
    xg = x[:40]
    _same(KG.grouped_tensor_amax(xg, splits), RG.grouped_tensor_amax(xg, splits), "grouped amax")
    _same(KG.grouped_quantize_fp8_tensorwise(xg, splits, torch.ones(5), E4M3, True, True)[2],
          RG.grouped_quantize_fp8_tensorwise(xg, splits, torch.ones(5), E4M3, True, True)[2], "grouped cast amax")
    for br in (1, 128):
        k = KG.grouped_quantize_fp8_block(xg, splits, br, 128, E4M3, True, 0.0, True, True)
        r = RG.grouped_quantize_fp8_block(xg, splits, br, 128, E4M3, True, 0.0, True, True)
        _same(k[1], r[1], f"grouped block {br} row scales")
        _same(k[3], r[3], f"grouped block {br} col scales")
    k = KG.grouped_quantize_mxfp8(xg, splits, E4M3, ScaleMode.ROUND_UP, True, True)
    r = RG.grouped_quantize_mxfp8(xg, splits, E4M3, ScaleMode.ROUND_UP, True, True)
    _same(k[1], r[1], "grouped mx row e8m0")
    _same(k[3], r[3], "grouped mx col e8m0")


def check_nvfp4():
    import torch
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.kernels import quantize_nvfp4 as K4
    from qmoe.reference import grouped_quantize as RG
    from qmoe.reference import quantize_nvfp4 as R4
    names = ("row", "row_scale", "amax", "col", "col_scale", "col_amax")
    x = _exact_nvfp4_input(32, 64)
    for block_2d, rht in ((False, False), (True, False), (False, True)):
        xi = _exact_rht_input(32, 64) if rht else x
        for got, want, n in zip(K4.quantize_nvfp4(xi, block_2d, True, True, rht),
                                R4.quantize_nvfp4(xi, block_2d, True, True, rht), names):
            _same(got, want, f"nvfp4 2d={block_2d} rht={rht} {n}")
    r = R4.quantize_nvfp4(x, False, True, True)
    _same(K4.dequantize_nvfp4(r[3], r[4], r[5]), R4.dequantize_nvfp4(r[3], r[4], r[5]), "nvfp4 dequantize")
    sizes = [3, 0, 13, 1, 31]  # odd starts: bytes shared by two groups
    xg, splits = _exact_nvfp4_input(48, 32, seed=2, splits=sizes), torch.tensor(sizes)
    for block_2d in (False, True):
        for got, want, n in zip(KG.grouped_quantize_nvfp4(xg, splits, block_2d, True, True),
                                RG.grouped_quantize_nvfp4(xg, splits, block_2d, True, True), names):
            _same(got, want, f"grouped nvfp4 2d={block_2d} {n}")
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = K4.quantize_nvfp4(x, False, True, True, True, True, g1)
    b = K4.quantize_nvfp4(x, False, True, True, True, True, g2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]), "stochastic rounding must be reproducible"


def check_fused_activation():
    import torch
    from qmoe.contracts.formats import E4M3, ScaleMode
    from qmoe.kernels import activation as KA
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.contracts.carriers import ActivatedRows
    g = torch.Generator().manual_seed(5)
    splits = torch.tensor([0, 40, 64, 6, 50])
    quantizers = {
        "amax": lambda x: (KG.grouped_tensor_amax(x, splits),),
        "tensorwise": lambda x: KG.grouped_quantize_fp8_tensorwise(x, splits, torch.rand(5, generator=g) + 0.5,
                                                                   E4M3, True, True),
        "block1x128": lambda x: KG.grouped_quantize_fp8_block(x, splits, 1, 128, E4M3, True, 0.0, True, True),
        "block128x128": lambda x: KG.grouped_quantize_fp8_block(x, splits, 128, 128, E4M3, False, 0.0, True, True),
        "mxfp8": lambda x: KG.grouped_quantize_mxfp8(x, splits, E4M3, ScaleMode.ROUND_UP, True, True),
        "nvfp4": lambda x: KG.grouped_quantize_nvfp4(x, splits, False, True, True),
        "nvfp4-2d-rht": lambda x: KG.grouped_quantize_nvfp4(x, splits, True, True, True),
    }
    cases = [("swiglu", None, torch.float32, True), ("swiglu", 16, torch.bfloat16, True),
             ("clamped_qgeglu", None, torch.bfloat16, False), ("gelu", None, torch.float32, True),
             ("relu2", None, torch.float16, True)]
    for activation, k, dtype, with_probs in cases:
        width = 128 * (2 if activation in ("swiglu", "geglu", "clamped_qgeglu") else 1)
        h = (torch.randn(160, width, generator=g) * 3).to(dtype)
        probs = torch.rand(160, generator=g) if with_probs else None
        a = KA.scaled_activation_forward(h, probs, activation, k)
        fused = ActivatedRows(h, probs, activation, k)
        for name, quantize in quantizers.items():
            state = g.get_state()
            want = quantize(a)
            g.set_state(state)  # the same random scales for both calls
            got = quantize(fused)
            for i, (x, y) in enumerate(zip(got, want)):
                if x is not None:
                    _same(x, y, f"fused {activation} k={k} {dtype} {name} output {i}")


def check_non_finite():
    """NUMERICS.md "Non-finite values" in the kernels: per-tensor amaxes over finite values (the
    amax delayed scaling records keeps inf/NaN), and dequantize saturates at the output's range."""
    import torch
    from qmoe.contracts.formats import E4M3
    from qmoe.kernels import grouped_quantize as KG
    from qmoe.kernels import quantize as K
    from qmoe.kernels import quantize_nvfp4 as K4
    from qmoe.reference import quantize as R
    from qmoe.reference import quantize_nvfp4 as R4
    x = _inputs()
    def finite_max(t):
        return t.abs()[torch.isfinite(t)].max()

    assert K.tensor_amax(x) == finite_max(x)
    assert torch.equal(KG.grouped_tensor_amax(x, torch.tensor([4, 36])),  # NaN in row 3, +-inf in 10 and 20
                       torch.stack([finite_max(x[:4]), finite_max(x[4:])]))
    assert torch.isnan(K.quantize_fp8_tensorwise(x, torch.ones(()), E4M3)[2])  # what delayed scaling records
    k4 = K4.quantize_nvfp4(x[:32, :64], False, True, True, True)  # NaN at [3, 5], inf at [10, 150]
    _same(k4[2], R4.quantize_nvfp4(x[:32, :64], False, True, False)[2], "nvfp4 tensor amax")
    assert torch.isfinite(k4[2]) and torch.isfinite(k4[5])  # the RHT copy's (its fp32 sums: checked above)
    top = torch.full((4, 64), 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 448
    top[1] = torch.tensor(0xFE, dtype=torch.uint8).view(torch.float8_e4m3fn)  # -448
    e8m0 = torch.full((4, 2), 254, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^127
    codes = torch.full((4, 32), 0x77, dtype=torch.uint8)  # E2M1 6.0 twice
    sb = torch.full((4, 4), 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        big = torch.finfo(dtype).max
        pairs = ((K.dequantize_fp8_tensorwise(top, torch.tensor(2.0 ** 120), dtype),
                  R.dequantize_fp8_tensorwise(top, torch.tensor(2.0 ** 120), dtype)),
                 (K.dequantize_fp8_block(top, torch.full((4, 1), 2.0 ** 120), 1, 128, dtype),
                  R.dequantize_fp8_block(top, torch.full((4, 1), 2.0 ** 120), 1, 128, dtype)),
                 (K.dequantize_mxfp8(top, e8m0, dtype), R.dequantize_mxfp8(top, e8m0, dtype)),
                 (K4.dequantize_nvfp4(codes, sb, torch.tensor(3.4e38), False, dtype),
                  R4.dequantize_nvfp4(codes, sb, torch.tensor(3.4e38), False, dtype)))
        for i, (k, r) in enumerate(pairs):
            assert torch.equal(k, r), (i, dtype)
            assert torch.isfinite(k).all(), (i, dtype)
            assert k.abs().max() == big or (i == 3 and dtype == torch.float32), (i, dtype)  # NVFP4: ~amax


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_non_finite()
    check_fp8_scales()
    check_nvfp4()
    check_fused_activation()
    print("all interpreter checks passed")
