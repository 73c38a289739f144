"""MoE layer benchmark: qmoe.nn.MoELayer forward + backward per recipe against a plain PyTorch MoE.

Run: `qmoe bench moe [--quick] [--shapes ...] [--recipes ...]` or
`PYTHONPATH=. python -m benchmarks.bench_moe`.

Per shape, one run measures the plain PyTorch bf16 dropless MoE (`benchmarks/plain_moe.py`,
SwiGLU experts on `torch._grouped_mm`, BASELINES.md's peer) and qmoe's MoELayer in bf16 and
under every recipe, all with the same bf16 weights, input and upstream gradient. A step is
forward + backward (input, router and expert weight gradients). Reported per row: the eager
median step time, the median replay time of the whole step captured in one CUDA graph
(`torch.cuda.CUDAGraph`; when capture fails the error is recorded instead), tokens/s from the
eager time, peak memory of the eager steps, and ratios to the peer and to qmoe bf16.
`--recompute-activation` adds, after each recipe's row, the same layer with
`recompute_activation=True` (FC2's input rebuilt in the backward instead of kept): its memory
saved and its time against the default row.
`--shared-expert` adds, per shape, the layer with one shared expert of the routed experts' size
(DeepSeek-V3: `shared_expert_ffn_hidden_size` = ffn) run in line and then with
`overlap_shared_experts=True` (on a side CUDA stream), in bf16 and FP8 block scaling (or --recipes).
The weight options add rows after each quantized recipe's row as `--recompute-activation` does:
`--weight-cache` (`cache_quantized_weights=True`, rows marked +wc), timed over optimizer steps of
`--micro-batches` forward + backward steps each, inside one `qmoe.autocast` region per optimizer
step (the weights' versions bumped after every step, as an optimizer step bumps them: the first
micro-batch quantizes, the others reuse; delayed scaling updates at the step's end), reported
per micro-batch; graphed, the step is captured twice (`qmoe.quant.capture_weights`: one graph
keeps the weights, one reuses them) and each optimizer step replays the first once;
`--recompute-weight-columnwise` (+rw: dgrad's weight copy quantized again in
the backward instead of kept); with both flags also +wc+rw.
Writes benchmarks/results/moe.json.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys

import torch

from benchmarks.harness import error_line, run_header, warmup_stream, write_results

# (tokens, experts, top_k, hidden, ffn)
SHAPES = {
    "deepseek-v3-ep8": dict(tokens=8192, experts=32, top_k=8, hidden=7168, ffn=2048),
    "mixtral": dict(tokens=16384, experts=8, top_k=2, hidden=4096, ffn=14336),
    "qwen3-30b-a3b": dict(tokens=16384, experts=128, top_k=8, hidden=2048, ffn=768),
}
RECIPES = ("bf16", "delayed", "current", "block", "mxfp8", "nvfp4")
QUICK_SHAPES = ("deepseek-v3-ep8",)
TARGETS = ("deepseek-v3-ep8 and mixtral: delayed and current >= 1.4x qmoe bf16, block >= 1.25x, MXFP8 >= 0.9x, "
           "NVFP4 >= 0.8x; qwen3-30b-a3b: every FP8 recipe >= 1.1x; FP8 peak memory <= 1.0x qmoe bf16 by default, "
           "<= 0.85x with an option; qmoe bf16 >= 1.0x the plain PyTorch MoE; graphed >= eager")


def _time_ms(fn, warmup: int, iters: int) -> float:
    """Median of per-iteration CUDA-event times, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _step_fn(module, x, dy, recipe):
    """One forward + backward of `module` under `recipe` (None: high precision), grads reset first."""
    import qmoe

    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            y = module(x)
        y.backward(dy)
    return step


def _graphed_ms(step, warmup: int, iters: int, micro_batches: int = 1, region=contextlib.nullcontext):
    """Capture the whole step (forward + backward) in one CUDA graph and time its replay.

    micro_batches > 1 (the weight cache): capture it twice, under `capture_weights("keep")` and
    `("reuse")`, and time optimizer steps (warmup and iters count them) of one replay of the first
    and micro_batches - 1 of the second, per micro-batch. `region()` is open around the captures:
    the `qmoe.autocast` region of the optimizer step, so the step's own region is nested and no
    delayed-scaling update is captured (it runs once per optimizer step, at that region's exit,
    outside the timed replays). Returns (ms, None) or (None, "why capture failed")."""
    from qmoe.quant.weight_cache import capture_weights

    inner = []  # the step's own error: a failed capture's exit raises a vaguer one on top

    def guarded():
        try:
            step()
        except Exception as e:  # noqa: BLE001
            inner.append(e)
            raise
    try:
        side = warmup_stream()
        side.wait_stream(torch.cuda.current_stream())
        graphs = []
        with region():  # one region: no scale update between the captures either
            with torch.cuda.stream(side):  # capture wants warmed-up allocations made off the main stream
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            for role in ("keep", "reuse") if micro_batches > 1 else (None,):
                graphs.append(torch.cuda.CUDAGraph())
                with capture_weights(role) if role else contextlib.nullcontext(), \
                        torch.cuda.graph(graphs[-1], pool=graphs[0].pool() if len(graphs) > 1 else None):
                    guarded()
        first, later = graphs[0], graphs[-1]

        def cycle():
            first.replay()
            for _ in range(micro_batches - 1):
                later.replay()
        return _time_ms(cycle, warmup, iters) / micro_batches, None
    except Exception as e:  # noqa: BLE001 - a layer that cannot be captured is a result, not a crash
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None, error_line(inner[0] if inner else e)


def _optimizer_steps(step, module, micro_batches: int, recipe):
    """`micro_batches` steps inside one `qmoe.autocast` region (`_step_region`), then every
    parameter's version bumped as an optimizer step bumps it (the values stay: the timing does not
    depend on them), so the weight cache quantizes again."""
    params = list(module.parameters())

    def cycle():
        with _step_region(recipe)():
            for _ in range(micro_batches):
                step()
        for p in params:
            torch.autograd.graph.increment_version(p)
    return cycle


def _step_region(recipe):
    """The optimizer step's `qmoe.autocast` region around its micro-batches: delayed scaling
    updates its scales once per step, at this region's exit, so the weight cache can reuse the
    weights within the step (with a region per micro-batch the scale moves every time)."""
    import qmoe

    return lambda: qmoe.autocast(recipe=recipe, enabled=recipe is not None)


def _fresh_caches(module) -> None:
    """New, empty weight caches: one that has seen a capture stays off outside captures, and later
    rows measure the same layer."""
    from qmoe.quant import WeightCache
    for m in module.modules():
        if isinstance(getattr(m, "weight_cache", None), WeightCache):
            m.weight_cache = WeightCache()


def _cache_gib(module) -> float:
    from qmoe.quant.weight_cache import weight_caches
    return sum(c.nbytes() for c in weight_caches(module)) / 2 ** 30


def _measure(module, x, dy, recipe, warmup: int, iters: int, graphed: bool, micro_batches: int = 1) -> dict:
    """Eager and graphed step times and the eager peak memory of one module under one recipe.

    micro_batches > 1: time optimizer steps of that many forward + backward steps (`_optimizer_steps`)
    and report the time per micro-batch."""
    one = step = _step_fn(module, x, dy, recipe)
    if micro_batches > 1:
        step = _optimizer_steps(step, module, micro_batches, recipe)
        warmup, iters = max(1, -(-warmup // micro_batches)), max(2, -(-iters // micro_batches))
    _drop_grads(module, x)  # earlier runs' gradients (a graph's pool included) are not this run's memory
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated() / 2 ** 30  # weights, inputs (and any other layer held)
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad) / 2 ** 30
    torch.cuda.reset_peak_memory_stats()
    eager = _time_ms(step, warmup, iters) / micro_batches
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    # what the step itself needs beyond what any training of this model holds (weights, their
    # gradients, the input): saved activations, quantized copies, workspaces
    out = dict(eager_ms=eager, peak_gib=peak, work_gib=peak - resident - grads - x.numel() * x.element_size() / 2 ** 30,
               held_gib=_held_gib(module, x, dy, recipe), graphed_ms=None, graph_error=None,
               cache_gib=_cache_gib(module), micro_batches=micro_batches)
    if graphed and micro_batches > 1:  # the weight cache: a graph that keeps the weights, one that reuses them
        out["graphed_ms"], out["graph_error"] = _graphed_ms(one, warmup, iters, micro_batches,
                                                            _step_region(recipe))
        _fresh_caches(module)
    elif graphed:
        out["graphed_ms"], out["graph_error"] = _graphed_ms(step, warmup, iters)
    _drop_grads(module, x)
    return out


def _held_gib(module, x, dy, recipe) -> float:
    """Memory a forward leaves allocated for its backward (saved activations, quantized copies,
    the output): what every layer of a model holds at once before the backward starts."""
    import qmoe

    _drop_grads(module, x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = module(x)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - before) / 2 ** 30
    y.backward(dy)
    del y
    _drop_grads(module, x)
    return held


def _drop_grads(module, x):
    for p in module.parameters():
        p.grad = None
    x.grad = None
    _free()


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _recipe_row(layer, x, dy, recipe, warmup, iters, graphed, base: dict, bf16: dict | None,
                micro_batches: int = 1) -> dict:
    """One row: `base` (the shape, recipe, path, peer) with this layer's measurements; `bf16`: the
    qmoe bf16 row the ratios are taken against (None: none yet)."""
    row = dict(base, eager_ms=None, graphed_ms=None, tokens_per_s=None, peak_gib=None, work_gib=None,
               speedup_vs_peer=None, ratio_vs_qmoe_bf16=None, graphed_ratio_vs_qmoe_bf16=None, graph_error=None,
               error=None, **{name: getattr(layer, name) for name in OPTIONS})
    try:
        row.update(_measure(layer, x, dy, recipe, warmup, iters, graphed, micro_batches))
        row["tokens_per_s"] = x.shape[0] / (row["eager_ms"] / 1e3)
        if row["peer_ms"]:
            row["speedup_vs_peer"] = row["peer_ms"] / row["eager_ms"]
        _ratios(row, bf16)
    except Exception as e:  # noqa: BLE001 - one recipe failing must not stop the others
        row["error"] = error_line(e)
    _free()
    return row


def _ratios(row: dict, bf16: dict | None) -> None:
    """row's speed against qmoe bf16's (`bf16`: its row, or row itself), eager and graphed."""
    if bf16 and bf16["eager_ms"] and row["eager_ms"]:
        row["ratio_vs_qmoe_bf16"] = bf16["eager_ms"] / row["eager_ms"]
    if bf16 and bf16["graphed_ms"] and row["graphed_ms"]:
        row["graphed_ratio_vs_qmoe_bf16"] = bf16["graphed_ms"] / row["graphed_ms"]


# the layer options rows can switch on, with their marks in the printed table
OPTIONS = {"recompute_activation": "rc", "cache_quantized_weights": "wc", "recompute_weight_columnwise": "rw"}


def _variants(recompute: bool, weight_cache: bool, recompute_weight: bool, quantized: bool) -> list[dict]:
    """The option sets measured after a recipe's default row."""
    out = [{"recompute_activation": True}] if recompute else []
    if quantized:  # the weight options act on quantized weights only
        out += [{"cache_quantized_weights": True}] if weight_cache else []
        out += [{"recompute_weight_columnwise": True}] if recompute_weight else []
        if weight_cache and recompute_weight:
            out.append({"cache_quantized_weights": True, "recompute_weight_columnwise": True})
    return out


def inputs(shape: dict, device="cuda", **options):
    """The seeded layer (bf16 weights, `options`), its input x (requiring grad) and upstream gradient."""
    import qmoe

    t, h = shape["tokens"], shape["hidden"]
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(h, shape["ffn"], shape["experts"], shape["top_k"], params_dtype=torch.bfloat16,
                             device=device, **options)
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    return layer, x, dy


def bench_shape(rows, name, shape, recipes, warmup, iters, graphed, device="cuda", recompute=False,
                weight_cache=False, recompute_weight=False, micro_batches=4):
    from benchmarks.plain_moe import PlainMoE
    from qmoe.compare import resolve_path
    from qmoe.recipes import recipe_from_config

    layer, x, dy = inputs(shape, device)
    # the peer: same weights, so the same routing and expert loads
    peer = dict(peer_ms=None, peer_graphed_ms=None, peer_peak_gib=None, peer_error=None, peer_graph_error=None,
                peer_impl=None)
    layer_gib = sum(p.numel() * p.element_size() for p in layer.parameters()) / 2 ** 30
    try:
        moe = PlainMoE.from_moe_layer(layer, dtype=torch.bfloat16)
        peer["peer_impl"] = "torch._grouped_mm" if moe.use_grouped_mm else "per-expert loop"
        m = _measure(moe, x, dy, None, warmup, iters, graphed=graphed and moe.use_grouped_mm)
        # qmoe's layer stays resident meanwhile: its weights are not the peer's memory
        peer.update(peer_ms=m["eager_ms"], peer_graphed_ms=m["graphed_ms"], peer_peak_gib=m["peak_gib"] - layer_gib,
                    peer_graph_error=m["graph_error"])
        del moe
    except Exception as e:  # noqa: BLE001
        peer["peer_error"] = error_line(e)
    _free()
    print(f"{name}: plain PyTorch MoE ({peer['peer_impl']}): eager {_fmt(peer['peer_ms'], '.3f')} ms, graphed "
          f"{_fmt(peer['peer_graphed_ms'], '.3f')} ms, peak {_fmt(peer['peer_peak_gib'], '.2f')} GiB"
          + (f"  ({peer['peer_error'] or peer['peer_graph_error']})"
             if peer["peer_error"] or peer["peer_graph_error"] else ""), flush=True)
    bf16 = None
    for rname in recipes:
        recipe = None if rname == "bf16" else recipe_from_config({"name": rname})
        base = dict(shape=name, recipe=rname, **shape, peer_ms=peer["peer_ms"],
                    path=resolve_path("bf16" if recipe is None else recipe, layer, device),
                    **{k: v for k, v in peer.items() if k != "peer_ms"})
        row = _recipe_row(layer, x, dy, recipe, warmup, iters, graphed, base, bf16)
        if rname == "bf16":
            bf16 = row
            _ratios(row, bf16)
        rows.append(row)
        _print_row(row)
        for options in _variants(recompute, weight_cache, recompute_weight, recipe is not None):
            for option, value in options.items():
                setattr(layer, option, value)
            try:
                again = _recipe_row(layer, x, dy, recipe, warmup, iters, graphed, base, bf16,
                                    micro_batches if options.get("cache_quantized_weights") else 1)
            finally:
                for option in options:
                    setattr(layer, option, False)
            if row["error"] is None and again["error"] is None:
                again["held_gib_saved_vs_default"] = row["held_gib"] - again["held_gib"]
                again["peak_gib_saved_vs_default"] = row["peak_gib"] - again["peak_gib"]
                again["time_ratio_vs_default"] = again["eager_ms"] / row["eager_ms"]
            rows.append(again)
            _print_row(again)


SHARED_EXPERT_RECIPES = ("bf16", "block")


def bench_shared_expert(rows, name, shape, recipes, warmup, iters, graphed, device="cuda"):
    """Rows of the layer with a shared expert (Fs = ffn), overlap off then on, per recipe; the on
    row carries time_ratio_overlap_vs_inline = its eager_ms / the off row's."""
    from qmoe.compare import resolve_path
    from qmoe.recipes import recipe_from_config

    layer, x, dy = inputs(shape, device, shared_expert_ffn_hidden_size=shape["ffn"])
    bf16 = None
    for rname in recipes:
        recipe = None if rname == "bf16" else recipe_from_config({"name": rname})
        base = dict(shape=name, recipe=rname, **shape, peer_ms=None, shared_expert_ffn=shape["ffn"],
                    path=resolve_path("bf16" if recipe is None else recipe, layer, device))
        inline = None
        for overlap in (False, True):
            layer.overlap_shared_experts = overlap
            row = _recipe_row(layer, x, dy, recipe, warmup, iters, graphed, dict(base, overlap_shared_experts=overlap),
                              bf16)
            if rname == "bf16" and not overlap:
                bf16 = row
                _ratios(row, bf16)
            if overlap and inline is not None and inline["error"] is None and row["error"] is None:
                row["time_ratio_overlap_vs_inline"] = row["eager_ms"] / inline["eager_ms"]
                if row["graphed_ms"] and inline["graphed_ms"]:
                    row["graphed_ratio_overlap_vs_inline"] = row["graphed_ms"] / inline["graphed_ms"]
            if not overlap:
                inline = row
            rows.append(row)
            _print_row(row)
    del layer, x, dy
    _free()


def _fmt(v, spec):
    """format(v, spec), or a right-aligned '-' of the same width for a missing value."""
    return format(v, spec) if isinstance(v, (int, float)) else format("-", spec.split(".")[0] or "")


HEADER = (f"{'shape':<16} {'recipe':<14} {'eager ms':>9} {'graph ms':>9} {'tok/s':>10} {'peak GiB':>9} "
          f"{'work GiB':>9} {'held GiB':>9} {'peer ms':>9} {'vs peer':>8} {'vs bf16':>8} {'graphed':>8}  note")


def _print_row(r):
    note = r["error"] or (f"graph: {r['graph_error']}" if r["graph_error"] else r["path"])
    on = [option for option in OPTIONS if r.get(option)]
    recipe = r["recipe"] + "".join(f"+{OPTIONS[option]}" for option in on) + \
        ("+sh" if r.get("shared_expert_ffn") else "") + ("+ov" if r.get("overlap_shared_experts") else "")
    if r.get("held_gib_saved_vs_default") is not None:
        note += (f"; {'+'.join(on)}: {r['held_gib_saved_vs_default']:.3f} GiB less held for the backward, "
                 f"{r['peak_gib_saved_vs_default']:.3f} GiB less peak, {r['time_ratio_vs_default']:.2f}x the time")
        if r.get("cache_quantized_weights"):
            note += f", {r['cache_gib']:.3f} GiB kept weights, per micro-batch of {r['micro_batches']}"
    if r.get("time_ratio_overlap_vs_inline") is not None:
        note += f"; overlap: {r['time_ratio_overlap_vs_inline']:.3f}x the in-line time (eager)"
        if r.get("graphed_ratio_overlap_vs_inline") is not None:
            note += f", {r['graphed_ratio_overlap_vs_inline']:.3f}x graphed"
    print(f"{r['shape']:<16} {recipe:<14} {_fmt(r['eager_ms'], '>9.3f')} {_fmt(r['graphed_ms'], '>9.3f')} "
          f"{_fmt(r['tokens_per_s'], '>10.0f')} {_fmt(r['peak_gib'], '>9.2f')} {_fmt(r.get('work_gib'), '>9.2f')} "
          f"{_fmt(r.get('held_gib'), '>9.2f')} "
          f"{_fmt(r['peer_ms'], '>9.3f')} "
          f"{_fmt(r['speedup_vs_peer'], '>7.2f')}x {_fmt(r['ratio_vs_qmoe_bf16'], '>7.2f')}x "
          f"{_fmt(r.get('graphed_ratio_vs_qmoe_bf16'), '>7.2f')}x  {note}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qmoe bench moe", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_SHAPES)}, fewer iterations")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="shapes to run (default: all)")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), help="recipes to run (default: all)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5, --quick 2)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 20, --quick 5)")
    parser.add_argument("--no-graph", action="store_true", help="skip CUDA-graph capture")
    parser.add_argument("--recompute-activation", action="store_true",
                        help="after each recipe, the same layer with recompute_activation=True (rows marked +rc)")
    parser.add_argument("--weight-cache", action="store_true",
                        help="after each quantized recipe, the layer with cache_quantized_weights=True, timed per "
                             "micro-batch over optimizer steps of --micro-batches steps (rows marked +wc)")
    parser.add_argument("--recompute-weight-columnwise", action="store_true",
                        help="after each quantized recipe, the layer with recompute_weight_columnwise=True (+rw); "
                             "with --weight-cache also both (+wc+rw)")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="forward + backward steps per optimizer step in the +wc rows (default 4)")
    parser.add_argument("--shared-expert", action="store_true",
                        help="per shape, also the layer with a shared expert (Fs = ffn), overlap_shared_experts off "
                             f"and on (rows marked +sh, +sh+ov), in {' and '.join(SHARED_EXPERT_RECIPES)} or --recipes")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "moe.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench moe needs a CUDA GPU (qmoe's kernels run on sm90+); none found", file=sys.stderr)
        return 2
    from qmoe.backend import use_kernels
    header = run_header("benchmarks.bench_moe", argv)
    shapes = args.shapes or (list(QUICK_SHAPES) if args.quick else list(SHAPES))
    recipes = args.recipes or list(RECIPES)
    if "bf16" not in recipes:
        print("note: without bf16 in --recipes, ratio_vs_qmoe_bf16 stays empty", file=sys.stderr)
    else:
        recipes = ["bf16"] + [r for r in recipes if r != "bf16"]  # bf16 first: the others' ratios need it
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    iters = args.iters if args.iters is not None else (5 if args.quick else 20)
    if not use_kernels(torch.empty(1, device="cuda")):
        print("warning: qmoe runs its pure-torch reference on this device (sm < 90 or QMOE_BACKEND=reference)",
              file=sys.stderr)
    print(HEADER)
    rows = []
    for name in shapes:  # the file is rewritten after every shape: partial results survive a time limit
        bench_shape(rows, name, SHAPES[name], recipes, warmup, iters, not args.no_graph,
                    recompute=args.recompute_activation, weight_cache=args.weight_cache,
                    recompute_weight=args.recompute_weight_columnwise, micro_batches=args.micro_batches)
        if args.shared_expert:
            bench_shared_expert(rows, name, SHAPES[name], recipes if args.recipes else SHARED_EXPERT_RECIPES,
                                warmup, iters, not args.no_graph)
        _write(args, header, rows, warmup, iters)
    print(f"wrote {args.out}")
    return 0


def _write(args, header, rows, warmup, iters) -> None:
    from qmoe.backend import use_kernels
    result = dict(
        suite="moe",
        qmoe_backend="triton" if use_kernels(torch.empty(1, device="cuda")) else "reference",
        method=(f"forward + backward of one MoE layer (bf16 weights and activations, fp32 router; grads of input, "
                f"router and experts); medians of {iters} CUDA-event-timed steps after {warmup} warm-up steps. "
                f"eager_ms: eager steps; graphed_ms: replays of the whole step captured in one torch.cuda.CUDAGraph "
                f"(graph_error when capture fails; +wc rows: captured twice, under qmoe.quant.capture_weights('keep') "
                f"and ('reuse'), one replay of the first and micro_batches - 1 of the second per optimizer step, per "
                f"micro-batch); tokens_per_s from eager_ms; peak_gib: torch.cuda."
                f"max_memory_allocated over the eager steps (weights, grads and inputs included; peer_peak_gib "
                f"excludes the qmoe layer's weights, resident meanwhile); work_gib: peak_gib less what was resident "
                f"before the steps (weights, inputs), the parameters' gradients and dx: the step's own working memory "
                f"(saved activations, quantized copies, workspaces); held_gib: torch.cuda.memory_allocated after "
                f"one forward less before it: what the layer holds for its backward (saved activations, quantized "
                f"copies, the output), which a model of many layers holds for all of them at once; "
                f"peer: benchmarks/plain_moe.py, plain PyTorch bf16 MoE on torch._grouped_mm, same weights, same run; "
                f"speedup_vs_peer = peer_ms / eager_ms; ratio_vs_qmoe_bf16 = qmoe bf16 eager_ms / eager_ms "
                f"(> 1 is faster than qmoe bf16), graphed_ratio_vs_qmoe_bf16 the same of graphed_ms (printed as "
                f"'vs bf16' and 'graphed'); recompute_activation, cache_quantized_weights, "
                f"recompute_weight_columnwise: the layer's options (True rows come from --recompute-activation, "
                f"--weight-cache, --recompute-weight-columnwise, right after the same recipe's default row, same "
                f"layer and inputs): held_gib_saved_vs_default and peak_gib_saved_vs_default = the default row's "
                f"held_gib / peak_gib less this row's; time_ratio_vs_default = this eager_ms / default eager_ms; "
                f"cache_gib: the kept quantized (and bf16) weights after the row; micro_batches: the forward + "
                f"backward steps per optimizer step (parameter versions bumped after each, values unchanged) over "
                f"which a +wc row is timed, eager_ms being per micro-batch; shared_expert_ffn rows "
                f"(--shared-expert): the layer with a shared expert of that size, overlap_shared_experts off then on "
                f"(same layer and inputs; no peer; ratio_vs_qmoe_bf16 against the shared-expert bf16 in-line row); "
                f"time_ratio_overlap_vs_inline / graphed_ratio_overlap_vs_inline = the on row's eager_ms / graphed_ms "
                f"over the off row's (< 1: overlap is faster)"),
        quick=args.quick, targets=TARGETS, rows=rows,
    )
    write_results(args.out, header, result, quiet=True)


if __name__ == "__main__":
    sys.exit(main())
