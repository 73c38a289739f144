"""The exact dequantize passes of the MXFP8 and NVFP4 GEMM route, tile against tile, same run.

On Hopper the emulated recipes' grouped GEMMs dequantize both operands to bf16 first
(qmoe/kernels/grouped_gemm.py, "dequant" route), and those passes are a large part of their
layer step. This sweep times each pass the layer runs, at DeepSeek-V3 FC1's shapes (32 experts
x 2048 tokens, 7168 -> 4096): the activations' rowwise copy, the weights' rowwise copy (fprop)
and columnwise copy (dgrad, written transposed), and the activations' token-grouped columnwise
copy (wgrad, `token_major` as torch._grouped_mm takes it), for every tile in TILES (rows,
columns, warps per program). Each tile's output is compared with the dispatched tile's, bit for
bit; frac_copy is (codes + scales read + bf16 written) over the time, against the device copy.

    PYTHONPATH=. python3 -m benchmarks.sweep_dequantize --out $OUT/dequantize.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.harness import (add_tiny_flag, copy_gbps, environ_set, error_line, gpu_or_tiny, median_ms, run_header,
                                write_results)

TILES = [(64, 256, 8), (32, 64, 4), (32, 128, 4), (64, 128, 4), (32, 256, 4), (128, 128, 8), (64, 512, 8),
         (16, 512, 4)]
SHAPE = dict(experts=32, tokens=2048, k=7168, n=4096)
# which of grouped_gemm.DEQUANT_TILES each pass dispatches
KINDS = {"activations rowwise": "rows", "weights rowwise": "rows", "weights columnwise": "transposed",
         "activations tokens": "tokens"}
TINY = dict(experts=3, tokens=96, k=256, n=128)


def operands(recipe_name: str, shape: dict, device: str):
    """The layer's quantized input (both copies, grouped) and weights (both copies)."""
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import MXFP8BlockScaling, NVFP4BlockScaling

    recipe = {"mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}[recipe_name]()
    e, t, k, n = shape["experts"], shape["tokens"], shape["k"], shape["n"]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(e * t, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(e, n, k, generator=g, device=device) / k ** 0.5).to(torch.bfloat16)
    with environ_set("QMOE_BACKEND", "reference"):  # the same bits as the kernels, without their compiles
        xq = GroupedTensor.quantize(x, torch.full((e,), t), recipe.quantizer("input"), validate=False)
        wq = quantize_weights(w, recipe.quantizer("weight"), rowwise=True, columnwise=True)
    return xq, wq


def passes(xq, wq, scaling):
    """{name: (call(tile) -> bf16 tensor, elements)} for the dequantize passes of one layer step."""
    from qmoe.kernels import grouped_gemm as gg

    rows, k = xq.shape
    e = wq.num_groups
    n_w, k_w = wq.shape[0] // e, wq.shape[1]
    a_op = gg.activation_operand(xq, scaling)
    w_row, _, _ = gg.weight_operand(wq, scaling, False)
    w_col, _, _ = gg.weight_operand(wq, scaling, True)
    t_op = gg.tokens_operand(xq, scaling)
    return {
        "activations rowwise": (lambda tile: gg._dequantized(a_op, scaling, rows, k, rows, k, (rows, k), (k, 1),
                                                             tile=tile), rows * k),
        "weights rowwise": (lambda tile: gg._dequantized(w_row, scaling, e * n_w, k_w, n_w, k_w, (e, n_w, k_w),
                                                         (k_w, 1), tile=tile), e * n_w * k_w),
        "weights columnwise": (lambda tile: gg._dequantized(w_col, scaling, k_w, e * n_w, k_w, n_w, (e, n_w, k_w),
                                                            (1, k_w), tile=tile), e * n_w * k_w),
        "activations tokens": (lambda tile: gg._dequantized_tokens(xq, t_op, scaling, tile=tile, token_major=True),
                               rows * k),
    }


def moved_bytes(elements: int, recipe_name: str) -> int:
    """Codes and scales read once, bf16 written once."""
    if recipe_name == "mxfp8":
        return elements + elements // 32 + 2 * elements
    return elements // 2 + elements // 16 + 2 * elements


def run(args, on_gpu: bool, header) -> list[dict]:
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels.grouped_gemm import DEQUANT_TILES

    device = "cuda" if on_gpu else "cpu"
    copy = copy_gbps(args.rep) if on_gpu else None
    rows = []

    def save():
        write_results(args.out, header, {"suite": "sweep_dequantize", "copy_gbps": copy, "rows": rows}, indent=1,
                      quiet=True)

    for recipe_name in args.recipes:
        scaling = Scaling.MX if recipe_name == "mxfp8" else Scaling.NVFP4
        xq, wq = operands(recipe_name, TINY if args.tiny else SHAPE, device)
        for name, (call, elements) in passes(xq, wq, scaling).items():
            dispatched = tuple(DEQUANT_TILES[KINDS[name]])
            tiles = [dispatched] + [t for t in TILES if t != dispatched]
            want = call(dispatched)
            for tile in tiles:
                row = dict(recipe=recipe_name, dequantize=name, tile=list(tile), dispatched=tile == dispatched)
                try:
                    got = call(tile)
                    row["exact"] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
                    del got
                    if on_gpu:
                        ms = median_ms(lambda: call(tile), 5, args.rep)
                        gbps = moved_bytes(elements, recipe_name) / ms / 1e6
                        row.update(ms=round(ms, 4), gbps=round(gbps, 1), frac_copy=round(gbps / copy, 3))
                except Exception as err:  # a tile that fails to compile or run is a result too
                    row["error"] = error_line(err, 300)
                rows.append(row)
                save()
                print(row, flush=True)
            del want
        del xq, wq
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sweep_dequantize", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipes", nargs="+", default=["mxfp8", "nvfp4"], choices=["mxfp8", "nvfp4"])
    p.add_argument("--rep", type=int, default=40, help="do_bench budget per tile (ms)")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    on_gpu = gpu_or_tiny(args.tiny)
    if on_gpu is None:
        return 2
    rows = run(args, on_gpu, run_header("benchmarks.sweep_dequantize", argv))
    bad = [r for r in rows if not r.get("exact") or "error" in r]
    print(f"{len(rows)} rows, {len(bad)} not exact or failed; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
