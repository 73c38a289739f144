"""The Gluon block cast (qmoe/kernels/_cast_transpose_gl.py) against the Triton kernels, same run.

For 1x128 and 128x128 FP8 blocks and MXFP8 (round-up scales), rowwise + columnwise and
columnwise alone, on bf16 65536x7168, grouped 32 x 2048 x 7168 (one launch) and 32 uneven groups
of 16-row multiples around 2048 (as a layer's routing makes them, `uneven_sizes`): the Triton
kernels (autotuned, QMOE_BLOCK_CAST=triton), the dispatched path, and Gluon variants (ring
stages, warps, programs per SM; bf16 read as packed words or as fp32; the columnwise stage's
swizzle phase; the tile order's bands of row tiles). Every variant's bytes are checked against
the Triton kernel's (NaN sign aside); frac_copy is (input read once + outputs written once) /
time over the device copy bandwidth.

    PYTHONPATH=. python3 -m benchmarks.sweep_block_cast --out $OUT/block_cast.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 -m benchmarks.sweep_block_cast --tiny --out /tmp/block_cast.json

--tiny runs tiny shapes on the CPU under the interpreter, bits only: the Triton kernels and the
dispatched path (which is Triton's there); the Gluon variants need the GPU and record the error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from benchmarks.harness import (add_tiny_flag, copy_gbps, environ_set, error_line, gpu_or_tiny, median_ms, run_header,
                                write_results)
from benchmarks.sweep_quantize_tiles import make_input, mismatches, nbytes

# (rows, columns, groups, uneven group sizes)
SHAPES = {"65536x7168": (65536, 7168, 0, False), "32x2048x7168": (65536, 7168, 32, False),
          "32x~2048x7168 uneven": (65536, 7168, 32, True)}
TINY = {"256x384": (256, 384, 0, False), "3x128x384": (384, 384, 3, False)}
# (stages, warps, programs per SM, row tiles per band of the tile order, 0: column strips); bf16 read as words
VARIANTS = [dict(stages=s, warps=w, per_sm=p, packed=True, stage_phase=None, tile_group=g)
            for s, w, p, g in ((2, 8, 1, 1), (2, 8, 1, 8), (2, 8, 1, 16), (3, 8, 1, 1), (3, 8, 1, 8), (2, 8, 2, 8),
                               (2, 8, 1, 0), (3, 8, 1, 0))]


def variant_name(variant: dict) -> str:
    return "gluon s{stages} w{warps} x{per_sm}{}{}{}{}".format(
        f" band {variant['tile_group']}" if variant["tile_group"] > 1 else
        " strips" if variant["tile_group"] == 0 else "",
        f" maxnreg {variant['maxnreg']}" if variant.get("maxnreg") else "",
        "" if variant["packed"] else " fp32 reads",
        "" if variant["stage_phase"] is None else f" stage phase {variant['stage_phase']}", **variant)


def run(x, splits, block, rowwise, variant=None, outs=None):
    """The public op's outputs for `block` ("1x128", "128x128" or "mx32": MXFP8, round-up scales);
    variant None: the dispatched path, "triton": the Triton kernel, a dict: the Gluon kernel with
    these launch keywords into `outs` (allocated once, outside the timing: the other two allocate
    theirs, a zero fill of the grouped scales included)."""
    from qmoe.contracts.formats import E4M3
    from qmoe.kernels import _cast_transpose_gl as ct
    from qmoe.kernels import quantize as K

    groups = 1 if splits is None else splits.numel()
    mx = block == "mx32"
    if isinstance(variant, dict):
        ct.launch(x, splits, groups, block == "128x128", K.fp8_meta(E4M3), E4M3.max, True, 0.0, rowwise, True,
                  *outs, mx=(E4M3.emax, True) if mx else None, **variant)
        return outs
    with environ_set("QMOE_BLOCK_CAST", "triton") if variant == "triton" else contextlib.nullcontext():
        if mx:
            return K.mxfp8_op(x, splits, groups, torch.float8_e4m3fn, E4M3.max, E4M3.emax, True, 32, rowwise, True)
        return K.fp8_block_op(x, splits, groups, 128 if block == "128x128" else 1, 128, torch.float8_e4m3fn,
                              E4M3.max, True, 0.0, rowwise, True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("block_cast.json"))
    p.add_argument("--rep", type=int, default=40, help="do_bench budget per variant (ms)")
    p.add_argument("--variants", type=json.loads, default=None,
                   help="a JSON list of variants (launch keywords) to time instead of VARIANTS")
    p.add_argument("--blocks", nargs="+", default=["1x128", "128x128", "mx32"], choices=["1x128", "128x128", "mx32"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    add_tiny_flag(p)
    args = p.parse_args(argv)
    on_gpu = gpu_or_tiny(args.tiny)
    if on_gpu is None:
        return 2
    header = run_header("benchmarks.sweep_block_cast", argv)
    copy = copy_gbps(args.rep) if on_gpu else None
    print(f"device-to-device copy: {copy:.0f} GB/s" if copy else "tiny shapes: bits only", flush=True)
    rows = []
    shapes = TINY if args.tiny else {s: SHAPES[s] for s in args.shapes}
    for shape, (m, k, groups, uneven) in shapes.items():
        x, splits = make_input(m, k, groups, uneven, False, "cuda" if on_gpu else "cpu")
        for block in args.blocks:
            for rowwise in (True, False):
                case = dict(block=block, orientation="row+col" if rowwise else "col", shape=shape)
                want = run(x, splits, block, rowwise, "triton")
                outs = [torch.zeros_like(t) for t in want]  # grouped scales no group uses stay zero
                variants = [{**VARIANTS[0], **v} for v in args.variants or VARIANTS]  # --variants: over VARIANTS[0]
                variants = [v for v in variants if v["packed"] or block != "mx32"]  # MXFP8: bf16 words only
                for variant in ["triton", None] + variants:
                    name = {"triton": "triton", None: "dispatched"}.get(variant) if not isinstance(variant, dict) \
                        else variant_name(variant)
                    row = dict(case, variant=name)
                    try:
                        got = run(x, splits, block, rowwise, variant, outs)
                        row["mismatches"] = mismatches(got, want)
                        if on_gpu:
                            ms = median_ms(lambda: run(x, splits, block, rowwise, variant, outs), 10, args.rep)
                            row.update(ms=round(ms, 4), gbps=round(nbytes(x, got) / ms / 1e6, 1),
                                       frac_copy=round(nbytes(x, got) / ms / 1e6 / copy, 3))
                        del got
                    except Exception as err:  # a variant that fails is a result too
                        row["error"] = error_line(err, 300)
                    rows.append(row)
                    print(row, flush=True)
                del want
    write_results(args.out, header, {"suite": "block_cast", "copy_gbps": copy and round(copy, 1), "rows": rows})
    bad = [r for r in rows if r.get("mismatches") or "error" in r]
    print(f"{len(rows)} rows, {len(bad)} not exact or failed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
