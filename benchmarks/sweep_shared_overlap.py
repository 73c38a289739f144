"""Sweep: MoELayer's shared expert in line vs overlapped on a side CUDA stream (overlap_shared_experts).

    PYTHONPATH=. python3 -m benchmarks.sweep_shared_overlap --out $OUT/shared_overlap.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 -m benchmarks.sweep_shared_overlap --tiny --out /tmp/s.json  # CPU

The layer is a DeepSeek-V3 expert-parallel shard (8192 tokens, 32 experts, top-8, hidden 7168,
ffn 2048) with DeepSeek-V3's one shared expert of the routed experts' size (Fs = 2048). For bf16
and FP8 delayed scaling, eager and captured by `qmoe.graph.capture`, it times forward + backward
with the option off and on (same weights, input and upstream gradient) and first checks that the
two give the same bits (output, input gradient, every parameter gradient), recording pass/fail
per variant. Eager also gets forward-only times, and the two halves on their own (the routed
layer without its shared expert, and the shared MLP alone), whose max is what a perfect overlap
would take. A variant that fails is recorded and the sweep goes on.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from benchmarks.harness import error_line, run_header, write_results

SHAPE = dict(tokens=8192, experts=32, top_k=8, hidden=7168, ffn=2048, shared_ffn=2048)
TINY = dict(tokens=64, experts=8, top_k=2, hidden=128, ffn=128, shared_ffn=128)
RECIPES = ("bf16", "delayed")


def _median_ms(fn, device) -> float:
    if device.type == "cuda":
        from benchmarks.harness import median_ms
        return median_ms(fn, warmup=20, rep=100)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _recipe(name):
    from qmoe.recipes import recipe_from_config
    return None if name == "bf16" else recipe_from_config({"name": name})


def _step_fn(layer, call, x, dy, recipe):
    """Forward + backward of `call` (the layer, or its captured graphs) with gradients reset first."""
    import qmoe
    params = list(layer.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            y = call(x)
        y.backward(dy)
        return y
    return step


def _forward_fn(call, x, recipe):
    import qmoe

    def forward():
        with torch.no_grad(), qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            return call(x)
    return forward


def _bits(layer, step, x) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient of one step."""
    y = step().detach().clone()
    return [y, x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


def _same_bits(a, b) -> tuple[bool, str]:
    for i, (p, q) in enumerate(zip(a, b)):
        if not torch.equal(p, q):
            what = ("output", "input gradient")[i] if i < 2 else f"parameter gradient {i - 2}"
            return False, f"{what} differs: max |diff| {(p.float() - q.float()).abs().max().item():.3g}"
    return len(a) == len(b), ""


def _variant_rows(base, recipe_name, mode, x, dy, device) -> list[dict]:
    """Two rows (overlap off, on) of one recipe and mode; each copy of `base` starts from the same state."""
    import qmoe

    recipe = _recipe(recipe_name)
    rows, bits, layers = [], {}, {}
    for overlap in (False, True):
        row = dict(recipe=recipe_name, mode=mode, overlap_shared_experts=overlap, step_ms=None, forward_ms=None,
                   same_bits_as_off=None, error=None)
        rows.append(row)
        try:
            if mode == "graphed" and device.type != "cuda":
                raise RuntimeError("CUDA graphs need a GPU")
            layer = copy.deepcopy(base)
            layer.overlap_shared_experts = overlap
            call = layer
            if mode == "graphed":
                sample = x.detach().clone().requires_grad_(True)
                with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
                    call = qmoe.graph.capture(layer, (sample,))
            step = _step_fn(layer, call, x, dy, recipe)
            bits[overlap] = _bits(layer, step, x)  # the first step of both copies, from the same state
            layers[overlap] = (layer, call, step)
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            row["error"] = error_line(e)
    if False in bits and True in bits:
        same, why = _same_bits(bits[True], bits[False])
        rows[1]["same_bits_as_off"] = same
        rows[1]["error"] = rows[1]["error"] or (why or None)
        rows[0]["same_bits_as_off"] = True
    for row, overlap in zip(rows, (False, True)):
        if overlap not in layers:
            continue
        layer, call, step = layers[overlap]
        try:
            row["step_ms"] = _median_ms(step, device)
            if mode == "eager":
                row["forward_ms"] = _median_ms(_forward_fn(call, x, recipe), device)
        except Exception as e:  # noqa: BLE001
            row["error"] = error_line(e)
    del layers, bits
    return rows


def _part_rows(base, recipe_name, x, dy, device) -> list[dict]:
    """The halves alone, eager: the routed layer without its shared expert, and the shared MLP."""

    recipe = _recipe(recipe_name)
    rows = []
    routed = copy.deepcopy(base)
    shared = routed.shared_experts
    routed.overlap_shared_experts = False
    routed.shared_experts = None
    for part, module in (("routed only", routed), ("shared only", shared)):
        row = dict(recipe=recipe_name, mode="eager", part=part, step_ms=None, forward_ms=None, error=None)
        try:
            row["step_ms"] = _median_ms(_step_fn(module, module, x, dy, recipe), device)
            row["forward_ms"] = _median_ms(_forward_fn(module, x, recipe), device)
        except Exception as e:  # noqa: BLE001
            row["error"] = error_line(e)
        rows.append(row)
    del routed
    return rows


def _fmt(v, spec=">9.3f"):
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else format("-", ">9")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU run, TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    import qmoe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else SHAPE
    header = run_header("benchmarks.sweep_shared_overlap", argv)
    torch.manual_seed(0)
    base = qmoe.nn.MoELayer(shape["hidden"], shape["ffn"], shape["experts"], shape["top_k"],
                            shared_expert_ffn_hidden_size=shape["shared_ffn"], params_dtype=torch.bfloat16,
                            device=device)
    x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=torch.bfloat16)
    rows = []
    print(f"{'recipe':<8} {'mode':<8} {'variant':<12} {'step ms':>9} {'fwd ms':>9}  note")
    for recipe_name in RECIPES:
        for mode in ("eager", "graphed"):
            for row in _variant_rows(base, recipe_name, mode, x, dy, device):
                rows.append(row)
                note = row["error"] or ("same bits" if row["same_bits_as_off"] else "")
                variant = "overlap on" if row["overlap_shared_experts"] else "overlap off"
                print(f"{recipe_name:<8} {mode:<8} {variant:<12} {_fmt(row['step_ms'])} {_fmt(row['forward_ms'])}  "
                      f"{note}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for row in _part_rows(base, recipe_name, x, dy, device):
            rows.append(row)
            print(f"{recipe_name:<8} {'eager':<8} {row['part']:<12} {_fmt(row['step_ms'])} {_fmt(row['forward_ms'])}  "
                  f"{row['error'] or ''}", flush=True)
    passed = all(r.get("same_bits_as_off") is not False for r in rows)
    write_results(args.out, header, dict(
        suite="sweep_shared_overlap", shape=shape, tiny=args.tiny, all_same_bits=passed,
        method=("step_ms: median ms of forward + backward (gradients reset, fixed upstream gradient) by "
                "benchmarks.harness.median_ms; forward_ms: forward under no_grad; mode graphed: the layer captured "
                "by qmoe.graph.capture and replayed; same_bits_as_off: the overlap-on copy's first step equals "
                "the overlap-off copy's (output and every gradient, torch.equal); part rows: the routed layer "
                "without its shared expert and the shared MLP alone (eager), max of the two = a perfect overlap"),
        rows=rows))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
