"""Sweep: quantized weights kept across micro-batches (`cache_quantized_weights`) and the weight
memory options, on one grouped linear's forward + backward per micro-batch.

Run: `PYTHONPATH=. python3 -m benchmarks.sweep_weight_cache --out $OUT/weight_cache.json`
(`--tiny` for a CPU run under TRITON_INTERPRET=1 QMOE_BACKEND=triton).

Per shape (bench_linear's Qwen3-30B-A3B FC1 and DeepSeek-V3 FC1 shard) and recipe, one
`qmoe.nn.GroupedLinear` (bf16 weights, dx and dW computed) runs optimizer steps of MICRO
forward + backward micro-batches, each micro-batch in its own `qmoe.autocast` region, in the
variants:
- off: every forward quantizes the weights (the reference);
- wc: `cache_quantized_weights=True` (the first micro-batch of a step quantizes, the others
  reuse; MXFP8 / NVFP4 on their dequantize-first route also keep the bf16 weights);
- wc-nobf16 (MXFP8, NVFP4): the cache without the bf16 copies, to split the two savings;
- wc-1region (delayed): the MICRO micro-batches inside one autocast region, where delayed
  scaling's scale stays put and the cache can reuse (across regions it never does);
- rw: `recompute_weight_columnwise=True` (dgrad's weight copy re-quantized in the backward);
- wc+rw: both.
Each variant is first checked bit for bit against `off` (outputs, dx and the accumulated dW of
two optimizer steps with real SGD updates): `bits_match`. Then timed with
`benchmarks.harness.median_ms` over steps whose optimizer update only bumps the weight's
version (the cache must quantize again; the values, and so the timing, do not matter):
`ms_per_microbatch`. Peak memory of one step (`peak_gib`, and `work_gib` beyond what was
resident before it: saved operands, kept weights, workspaces) and the cache's own bytes.
A global deadline skips what is left (recorded) so the sweep ends in time.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from benchmarks.bench_linear import SHAPES as LINEAR_SHAPES
from benchmarks.harness import error_line, median_ms, run_header, write_results

SHAPES = {"qwen3-fc1": LINEAR_SHAPES["qwen3-fc1"], "dsv3-fc1": LINEAR_SHAPES["dsv3-fc1"]}
# experts, rows per expert, K, N; under the interpreter the emulated GEMMs take their fused route at
# this size (the dequantize route's kept bf16 weights: tests/kernels/test_weight_bf16_copies_interpret.py)
TINY_SHAPES = {"tiny": (2, 32, 128, 128)}
RECIPES = ("delayed", "current", "block", "mxfp8", "nvfp4")
MICRO = 4
CHECK_STEPS = 2


def _variants(recipe: str) -> list[str]:
    extra = {"mxfp8": ["wc-nobf16"], "nvfp4": ["wc-nobf16"], "delayed": ["wc-1region"]}.get(recipe, [])
    return ["off", "wc", *extra, "rw", "wc+rw"]


class _Case:
    """One shape's inputs and a layer built per variant from the same weights."""

    def __init__(self, shape, device, micro: int):
        e, m, k, n = shape
        g = torch.Generator(device="cpu").manual_seed(0)
        self.device, self.micro = device, micro
        self.w0 = (torch.randn(e, n, k, generator=g) * k ** -0.5).to(device, torch.bfloat16)
        self.xs = [torch.randn(e * m, k, generator=g).to(device, torch.bfloat16) for _ in range(micro)]
        self.dys = [torch.randn(e * m, n, generator=g).to(device, torch.bfloat16) for _ in range(micro)]
        self.splits = torch.full((e,), m, dtype=torch.int64, device=device)
        self.shape = shape

    def layer(self, variant: str):
        import qmoe
        from qmoe.quant import WeightCache

        e, _, k, n = self.shape
        layer = qmoe.nn.GroupedLinear(e, k, n, bias=False, params_dtype=torch.bfloat16, device=self.device,
                                      cache_quantized_weights=variant.startswith("wc"),
                                      recompute_weight_columnwise=variant.endswith("rw"))
        with torch.no_grad():
            layer.weight.copy_(self.w0)
        if variant == "wc-nobf16":
            layer.weight_cache = _NoBf16Cache()
        assert isinstance(layer.weight_cache, WeightCache)
        return layer


def _no_bf16_cache_class():
    from qmoe.quant import WeightCache

    class NoBf16Cache(WeightCache):
        """The weight cache without the emulated GEMMs' bf16 copies (they are made every call)."""

        def quantize(self, *args, **kwargs):
            out = super().quantize(*args, **kwargs)
            out.bf16_copies = None
            return out
    return NoBf16Cache


def _NoBf16Cache():  # noqa: N802 - built lazily: qmoe is imported after the argument parsing
    return _no_bf16_cache_class()()


def _step(layer, case, recipe, variant, update):
    """One optimizer step: case.micro forward + backward micro-batches, then `update` (an SGD step or a
    version bump). Returns the outputs and dx of every micro-batch and the accumulated dW."""
    import qmoe

    seen = []
    one_region = variant == "wc-1region" or variant == "off-1region"
    outer = qmoe.autocast(recipe=recipe) if one_region else contextlib.nullcontext()
    with outer:
        for x0, dy in zip(case.xs, case.dys):
            x = x0.detach().requires_grad_(True)
            with contextlib.nullcontext() if one_region else qmoe.autocast(recipe=recipe):
                y = layer(x, case.splits)
            y.backward(dy)
            seen += [y.detach(), x.grad]
    seen.append(layer.weight.grad)
    update(layer)
    layer.weight.grad = None
    return seen


def _sgd(layer):
    with torch.no_grad():
        layer.weight.add_(layer.weight.grad, alpha=-0.5)


def _bump(layer):
    torch.autograd.graph.increment_version(layer.weight)


def _run_steps(case, recipe, variant):
    torch.manual_seed(1)  # NVFP4's stochastic rounding of dy: the same draws in every variant
    layer = case.layer(variant)
    return [t for _ in range(CHECK_STEPS) for t in _step(layer, case, recipe, variant, _sgd)]


def _timed(fn, tiny: bool) -> float:
    if not tiny:
        return median_ms(fn, warmup=5, rep=30)
    times = []
    for _ in range(1):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _measure(case, recipe, variant, tiny: bool) -> dict:
    layer = case.layer(variant)

    def one_step():
        _step(layer, case, recipe, variant, _bump)

    one_step()  # warm: compiles, and fills the cache as a step would
    out = dict(ms_per_microbatch=_timed(one_step, tiny) / case.micro, peak_gib=None, work_gib=None)
    if case.device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        one_step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out.update(peak_gib=peak / 2 ** 30, work_gib=(peak - before) / 2 ** 30)
    out["cache_gib"] = layer.weight_cache.nbytes() / 2 ** 30
    return out


def run(shapes: dict, recipes, tiny: bool, deadline: float, device, micro: int = MICRO) -> list[dict]:
    from qmoe.kernels.grouped_gemm import DEQUANT_MIN_ROWS
    from qmoe.recipes import recipe_from_config

    rows = []
    for name, shape in shapes.items():
        case = _Case(shape, device, micro)
        base = dict(shape=name, experts=shape[0], rows_per_expert=shape[1], k=shape[2], n=shape[3],
                    micro_batches=micro, dequant_route=shape[1] >= DEQUANT_MIN_ROWS)
        for rname in recipes:
            recipe = recipe_from_config({"name": rname})
            reference, off = None, None
            for variant in _variants(rname):
                row = dict(base, recipe=rname, variant=variant, bits_match=None, ms_per_microbatch=None,
                           peak_gib=None, work_gib=None, cache_gib=None, speedup_vs_off=None,
                           peak_saved_vs_off_gib=None, error=None)
                rows.append(row)
                if time.monotonic() > deadline:
                    row["error"] = "skipped: the sweep's time budget ran out"
                    continue
                try:
                    if variant == "off":
                        reference = _run_steps(case, recipe, "off")
                    want = reference if variant != "wc-1region" else _run_steps(case, recipe, "off-1region")
                    got = _run_steps(case, recipe, variant) if variant != "off" else reference
                    row["bits_match"] = len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
                    row.update(_measure(case, recipe, variant, tiny))
                    if variant == "off":
                        off = row
                    elif off is not None and off["ms_per_microbatch"]:
                        row["speedup_vs_off"] = off["ms_per_microbatch"] / row["ms_per_microbatch"]
                        if row["peak_gib"] is not None:
                            row["peak_saved_vs_off_gib"] = off["peak_gib"] - row["peak_gib"]
                except Exception as e:  # noqa: BLE001 - one variant failing must not stop the others
                    row["error"] = error_line(e)
                _print_row(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del case
    return rows


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else format("-", spec[0] + "8")


def _print_row(r):
    print(f"{r['shape']:<10} {r['recipe']:<8} {r['variant']:<11} {str(r['bits_match']):<6} "
          f"{_fmt(r['ms_per_microbatch'], '>8.3f')} {_fmt(r['speedup_vs_off'], '>7.2f')}x "
          f"{_fmt(r['peak_gib'], '>8.2f')} {_fmt(r['work_gib'], '>8.2f')} {_fmt(r['cache_gib'], '>8.3f')}  "
          f"{r['error'] or ''}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_weight_cache", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, CPU-friendly (TRITON_INTERPRET=1)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES))
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES))
    p.add_argument("--budget-s", type=float, default=95.0, help="stop starting new variants after this long")
    args = p.parse_args(argv)
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        print("the full sweep needs a CUDA GPU; use --tiny on the CPU", file=sys.stderr)
        return 2
    shapes = TINY_SHAPES if args.tiny else {k: SHAPES[k] for k in (args.shapes or SHAPES)}
    recipes = args.recipes or list(RECIPES)
    header = run_header("benchmarks.sweep_weight_cache", argv, device)
    print(f"{'shape':<10} {'recipe':<8} {'variant':<11} {'bits':<6} {'ms/mb':>8} {'vs off':>8} {'peak GiB':>8} "
          f"{'work GiB':>8} {'cache GiB':>9}")
    micro = 2 if args.tiny else MICRO
    rows = run(shapes, recipes, args.tiny, start + args.budget_s, device, micro)
    write_results(args.out, header, dict(
        suite="sweep_weight_cache", micro_batches=micro, check_steps=CHECK_STEPS,
        method=__doc__.split("\n\n", 2)[2].strip(), rows=rows))
    failed = [r for r in rows if r["bits_match"] is False]
    print(f"{len(rows)} rows, {len(failed)} with other bits than 'off', "
          f"{sum(r['error'] is not None for r in rows)} with errors; {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
