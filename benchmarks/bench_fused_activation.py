"""Expert activation fused into FC2's input quantization vs the activation, then the quantizer.

Run: `qmoe bench fused_activation [--quick]` (GPU only).

At the DeepSeek-V3 expert shard (65536 permuted rows over 32 experts, F 2048, swiglu, bf16 h
[R, 4096]), per recipe, in one run on one GPU (triton.testing.do_bench medians of CUDA-graph
replays, the device time a graphed step spends; the eager calls' times, host work included, too):
- separate: `a = expert_activation(h, probs)`, then `GroupedTensor.quantize(a)` rowwise and
  columnwise (what FC2 needs for fprop and wgrad);
- fused: `GroupedTensor.quantize(ActivatedRows(h, probs, "swiglu"))`: the quantize kernels apply
  the activation as they load h, and a is never written.
Both give the same bits (tests/nn/test_fused_activation.py). min_bytes of the fused pass: h read
once per launch (per-tensor recipes launch an amax pass first, so twice), the quantized copies
written. Writes benchmarks/results/fused_activation.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness import capture_graph, copy_gbps, median_ms, run_header, write_results

RECIPES = ["current", "block", "mxfp8", "nvfp4"]
ROWS, FFN, EXPERTS = 65536, 2048, 32
QUICK_SCALE = 8


def _out_bytes(gt) -> int:
    return sum(t.numel() * t.element_size() for t in (gt.rowwise_data, gt.rowwise_scale_inv, gt.columnwise_data,
                                                     gt.columnwise_scale_inv) if t is not None)


def bench_recipe(name, h, probs, splits, gbps) -> dict:
    from qmoe.ops import expert_activation
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import recipe_from_config
    from qmoe.contracts.carriers import ActivatedRows

    config = {"name": name}
    if name == "nvfp4":
        config["disable_stochastic_rounding"] = True
    q = recipe_from_config(config).quantizer("input")

    def separate():
        a = expert_activation(h, probs, "swiglu")
        return GroupedTensor.quantize(a, splits, q, rowwise=True, columnwise=True, validate=False)

    def fused():
        return GroupedTensor.quantize(ActivatedRows(h, probs, "swiglu"), splits, q, rowwise=True, columnwise=True,
                                      validate=False)

    want, got = separate(), fused()
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in
               ((want.rowwise_data, got.rowwise_data), (want.columnwise_data, got.columnwise_data)))
    passes = 2 if name in ("current", "nvfp4") else 1  # an amax launch reads h before the cast
    min_bytes = passes * h.numel() * h.element_size() + probs.numel() * 4 + _out_bytes(got)
    row = dict(recipe=name, R=h.shape[0], F=h.shape[1] // 2, activation="swiglu", dtype="bf16",
               separate_eager_ms=median_ms(separate), fused_eager_ms=median_ms(fused), same_bits=same,
               min_bytes=min_bytes)
    for which, fn in (("separate", separate), ("fused", fused)):  # device time, as a graphed step sees it
        graph, why = capture_graph(fn)
        row[f"{which}_ms"] = median_ms(graph.replay) if graph is not None else row[f"{which}_eager_ms"]
        if why:
            row[f"{which}_not_graphed"] = why
        del graph
    row["speedup"] = row["separate_ms"] / row["fused_ms"]
    row["fused_frac_copy"] = min_bytes / (gbps * 1e9) * 1e3 / row["fused_ms"]
    print(f"{name:>8}: separate {row['separate_ms']:.3f} ms  fused {row['fused_ms']:.3f} ms  x{row['speedup']:.2f}  "
          f"fused at {100 * row['fused_frac_copy']:.0f}% of copy bandwidth  same bits: {same}  "
          f"(eager {row['separate_eager_ms']:.3f} / {row['fused_eager_ms']:.3f} ms)", flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qmoe bench fused_activation", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"rows / {QUICK_SCALE}: a smoke run")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "fused_activation.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("qmoe bench fused_activation needs a CUDA GPU (the fused kernels run on sm90+); none found",
              file=sys.stderr)
        return 2
    header = run_header("benchmarks.bench_fused_activation", argv)
    r = ROWS // (QUICK_SCALE if args.quick else 1)
    torch.manual_seed(0)
    h = (torch.randn(r, 2 * FFN, device="cuda") * 3).bfloat16()
    probs = torch.rand(r, device="cuda")
    splits = torch.full((EXPERTS,), r // EXPERTS, device="cuda")
    gbps = copy_gbps()
    rows = [bench_recipe(name, h, probs, splits, gbps) for name in RECIPES]
    result = dict(
        suite="fused_activation",
        method="triton.testing.do_bench medians, ms, rowwise + columnwise GroupedTensor of act(h) * probs; "
               "separate = expert_activation then GroupedTensor.quantize, fused = GroupedTensor.quantize of "
               "ActivatedRows; *_ms: replays of each captured in a CUDA graph (device time), *_eager_ms: "
               "the calls themselves (host work included); fused_frac_copy = min_bytes / copy bandwidth "
               "(same run) / fused_ms",
        quick=args.quick, copy_gbps=gbps, rows=rows,
    )
    write_results(args.out, header, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
