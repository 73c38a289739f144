"""Sweep: current scaling with the producers' amaxes (one read of each operand) vs its own amax pass.

    PYTHONPATH=. python3 -m benchmarks.sweep_current_amax --out $OUT/current_amax.json
    TRITON_INTERPRET=1 QMOE_BACKEND=triton PYTHONPATH=. python3 -m benchmarks.sweep_current_amax --tiny \\
        --out /tmp/current_amax.json                                                      # CPU check

Shape: the DeepSeek-V3 expert-parallel shard of bench_moe / bench_linear (8192 tokens, 32 experts,
top-8, hidden 7168, ffn 2048, SwiGLU, bf16, align 16: R = 66016 permuted rows).

Kernel rows, each a pair: the producer alone without and with its amax (the permute of FC1's
input, the unpermute backward of FC2's grad_output, the activation backward of FC1's grad_output,
the activation forward of FC2's input), and the current-scaling quantize of what it produced,
rowwise + columnwise, measuring its amax (an amax pass, then the cast) vs taking the producer's
(the cast alone). FC2's input: the activation fused into the quantize (amax pass and cast both
read h) vs the activation kernel with its amax, then the cast. Every variant is first checked
against the baseline bit for bit (rows, codes, scales; the producer's amax against the
quantizer's own amax pass) and records pass / fail. GB/s counts the bytes the operation must
move once (read its input once, write its outputs), so the fraction of copy bandwidth is the
issue's roofline measure.

Layer rows: MoELayer forward + backward under Float8CurrentScaling, eager and captured
(qmoe.graph.capture), with the amaxes measured (Float8CurrentQuantizer.takes_amax off), handed
over (the default), and handed over with FC2's activation run before its quantize
(fuses_activation off, so the activation's amax is handed over too); output and every gradient
checked against the measured variant bit for bit. Stops timing (rows record why) past --budget s.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from benchmarks.harness import error_line, run_header, write_results

SHAPE = dict(tokens=8192, experts=32, top_k=8, hidden=7168, ffn=2048, align=16)
TINY = dict(tokens=48, experts=4, top_k=2, hidden=64, ffn=32, align=16)
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _median_ms(fn, device, rep: int = 40) -> float:
    if device.type == "cuda":
        from benchmarks.harness import median_ms
        return median_ms(fn, warmup=max(10, rep // 6), rep=rep)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b, what: str) -> str | None:
    """None when a and b hold the same bits, else why not."""
    if (a is None) != (b is None):
        return f"{what}: one is missing"
    if a is None:
        return None
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_raw(a), _raw(b)):
        return f"{what} differs"
    return None


def _same_grouped(a, b, what: str) -> str | None:
    for f in FIELDS:
        why = _same(getattr(a, f), getattr(b, f), f"{what} {f}")
        if why:
            return why
    return None


@contextlib.contextmanager
def _switches(takes_amax: bool, fuses_activation: bool):
    """The current-scaling quantizer taking producers' amaxes or not, and fusing FC2's activation or not."""
    from qmoe.quant.quantizer import Float8CurrentQuantizer as Q
    saved = Q.takes_amax, Q.fuses_activation
    Q.takes_amax, Q.fuses_activation = takes_amax, fuses_activation
    try:
        yield
    finally:
        Q.takes_amax, Q.fuses_activation = saved


class Sweep:
    def __init__(self, shape: dict, device: torch.device, budget_s: float):
        self.shape, self.device, self.budget_s, self.start = shape, device, budget_s, time.monotonic()
        self.rows: list[dict] = []
        self.copy = None
        if device.type == "cuda":
            from benchmarks.harness import copy_gbps
            self.copy = copy_gbps()

    def over_budget(self) -> bool:
        return time.monotonic() - self.start > self.budget_s

    def pair(self, op: str, nbytes: int, baseline, variant, check) -> None:
        """Rows `op`/baseline and `op`/variant: checked (check(baseline_out, variant_out) -> None or why), timed."""
        rows = [dict(op=op, variant=v, ms=None, gbps=None, fraction_of_copy=None, same_bits=None, error=None)
                for v in ("measured", "producer")]
        if self.over_budget():
            for row in rows:
                row["error"] = "not run: time budget spent"
                self.rows.append(row)
            print(f"{op:<34} not run: time budget spent", flush=True)
            return
        outs = []
        for row, fn in zip(rows, (baseline, variant)):
            try:
                outs.append(fn())
            except Exception as e:  # noqa: BLE001 - a failing variant is a result
                row["error"] = error_line(e)
                outs.append(None)
        if outs[0] is not None and outs[1] is not None:
            try:
                why = check(outs[0], outs[1])
            except Exception as e:  # noqa: BLE001
                why = error_line(e)
            rows[1]["same_bits"] = why is None
            rows[1]["error"] = rows[1]["error"] or why
            rows[0]["same_bits"] = True
        del outs
        for row, fn in zip(rows, (baseline, variant)):
            if row["error"] and row["same_bits"] is not False:
                continue
            if self.over_budget():
                row["error"] = row["error"] or "not timed: time budget spent"
                continue
            try:
                row["ms"] = _median_ms(fn, self.device)
                row["gbps"] = nbytes / (row["ms"] * 1e-3) / 1e9
                row["fraction_of_copy"] = row["gbps"] / self.copy if self.copy else None
            except Exception as e:  # noqa: BLE001
                row["error"] = error_line(e)
        for row in rows:
            self.rows.append(row)
            note = row["error"] or ("same bits" if row["same_bits"] else "")
            print(f"{op:<34} {row['variant']:<9} {_fmt(row['ms'])} {_fmt(row['gbps'], '>8.0f')} "
                  f"{_fmt(row['fraction_of_copy'], '>6.2f')}  {note}", flush=True)


def _fmt(v, spec=">9.3f"):
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else format("-", ">" +
                                                                                                    spec[1:].split(".")[0])


def kernel_rows(sweep: Sweep) -> None:
    from qmoe.contracts.carriers import ActivatedRows, RowsWithAmax
    from qmoe.kernels import activation as ka
    from qmoe.kernels import permute as kp
    from qmoe.kernels.grouped_quantize import grouped_tensor_amax
    from qmoe.ops.grouped_linear_paths import absorb_tail
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8CurrentScaling

    s, dev, bf16 = sweep.shape, sweep.device, torch.bfloat16
    t, e, k, h, f, align = s["tokens"], s["experts"], s["top_k"], s["hidden"], s["ffn"], s["align"]
    gen = torch.Generator(device=dev).manual_seed(0)
    chosen = torch.randn(t, e, device=dev, generator=gen).topk(k, dim=1).indices
    routing_map = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, chosen, True)
    row_id_map, split_sizes = kp.permute_index(routing_map, k, align)
    r = -(-row_id_map.num_rows // align) * align
    row_id_map = row_id_map._replace(num_rows=r)
    splits = absorb_tail(split_sizes.long(), r)
    offsets = torch.cat((splits.new_zeros(1), splits.cumsum(0)))
    recipe = Float8CurrentScaling()
    q_in, q_grad = recipe.quantizer("input"), recipe.quantizer("grad_output")

    def amax_ok(rows_amax):
        return _same(rows_amax.amax, grouped_tensor_amax(rows_amax.rows, splits), "the producer's amax")

    def quantize(x, q):
        return GroupedTensor.quantize(x, splits, q, rowwise=True, columnwise=True, validate=False)

    # FC1's input: the permute, then its quantize
    x = torch.randn(t, h, device=dev, generator=gen, dtype=torch.float32).to(bf16)
    sweep.pair("permute (FC1 input)", 2 * (t + r) * h,
               lambda: kp.permute_rows(x, row_id_map), lambda: kp.permute_rows(x, row_id_map, with_amax=True),
               lambda a, b: _same(a, b.rows, "rows") or amax_ok(b))
    xp = kp.permute_rows(x, row_id_map, with_amax=True)
    sweep.pair("quantize FC1 input row+col", 4 * r * h, lambda: quantize(xp.rows, q_in), lambda: quantize(xp, q_in),
               lambda a, b: _same_grouped(a, b, "codes"))
    sweep.pair("FC1 input amax: pass vs handed", 2 * r * h, lambda: grouped_tensor_amax(xp.rows, splits),
               lambda: xp.amax.clone(), lambda a, b: _same(a, b, "amax"))

    # FC2's grad_output: the unpermute backward, then its quantize
    g = torch.randn(t, h, device=dev, generator=gen, dtype=torch.float32).to(bf16)
    y_stub = torch.empty(1, h, dtype=bf16, device=dev).expand(r, h)  # no merging probs: y is never read
    sweep.pair("unpermute backward (FC2 grad)", 2 * (t + r) * h,
               lambda: kp.unpermute_rows_backward(g, y_stub, row_id_map)[0],
               lambda: kp.unpermute_rows_backward(g, y_stub, row_id_map, with_amax=True)[0],
               lambda a, b: _same(a, b.rows, "grad_y") or amax_ok(b))
    gy = kp.unpermute_rows_backward(g, y_stub, row_id_map, with_amax=True)[0]
    sweep.pair("quantize FC2 grad_output row+col", 4 * r * h, lambda: quantize(gy.rows, q_grad),
               lambda: quantize(gy, q_grad), lambda a, b: _same_grouped(a, b, "codes"))

    # FC1's grad_output: the activation backward (FC2's dgrad -> dh), then its quantize
    hh = torch.randn(r, 2 * f, device=dev, generator=gen, dtype=torch.float32).to(bf16)
    probs = torch.rand(r, device=dev, generator=gen)
    da = torch.randn(r, f, device=dev, generator=gen, dtype=torch.float32).to(bf16)
    sweep.pair("activation backward (FC1 grad)", 2 * r * (2 * f + f + 2 * f),
               lambda: ka.scaled_activation_backward(hh, probs, da, "swiglu", None, True)[0],
               lambda: ka.scaled_activation_backward(hh, probs, da, "swiglu", None, True, amax_offsets=offsets)[0],
               lambda a, b: _same(a, b.rows, "dh") or amax_ok(b))
    dh = ka.scaled_activation_backward(hh, probs, da, "swiglu", None, True, amax_offsets=offsets)[0]
    sweep.pair("quantize FC1 grad_output row+col", 4 * r * 2 * f, lambda: quantize(dh.rows, q_grad),
               lambda: quantize(dh, q_grad), lambda a, b: _same_grouped(a, b, "codes"))

    # FC2's input: the activation fused into the quantize (amax pass + cast, both from h) vs the
    # activation with its amax, then the cast alone
    activated = ActivatedRows(hh, probs, "swiglu")
    sweep.pair("activation forward (FC2 input)", 2 * r * (2 * f + f),
               lambda: ka.scaled_activation_forward(hh, probs, "swiglu"),
               lambda: ka.scaled_activation_forward(hh, probs, "swiglu", amax_offsets=offsets),
               lambda a, b: _same(a, b.rows, "a") or amax_ok(b))
    sweep.pair("FC2 input: fused vs act+cast", 2 * r * 2 * f + 2 * r * f,
               lambda: quantize(activated, q_in),
               lambda: quantize(RowsWithAmax(*ka.scaled_activation_forward(hh, probs, "swiglu", amax_offsets=offsets)),
                                q_in),
               lambda a, b: _same_grouped(a, b, "codes"))


class LayerRows:
    """MoELayer forward + backward under current scaling, one row per (mode, variant)."""

    VARIANTS = {"measured": (False, True), "producer": (True, True), "producer, activation first": (True, False)}

    def __init__(self, sweep: Sweep):
        import qmoe
        from qmoe.recipes import Float8CurrentScaling

        s, dev = sweep.shape, sweep.device
        self.sweep, self.qmoe, self.recipe = sweep, qmoe, Float8CurrentScaling()
        torch.manual_seed(0)
        self.layer = qmoe.nn.MoELayer(s["hidden"], s["ffn"], s["experts"], s["top_k"], params_dtype=torch.bfloat16,
                                      device=dev)
        self.x = torch.randn(s["tokens"], s["hidden"], device=dev, dtype=torch.bfloat16, requires_grad=True)
        self.dy = torch.randn(s["tokens"], s["hidden"], device=dev, dtype=torch.bfloat16)
        self.params = list(self.layer.parameters())
        self.baseline = None  # the measured variant's first eager step: output and every gradient

    def _step(self, call):
        def step():
            for p in self.params:
                p.grad = None
            self.x.grad = None
            with self.qmoe.autocast(recipe=self.recipe):
                y = call(self.x)
            y.backward(self.dy)
            return y
        return step

    def run(self, mode: str, variant: str) -> None:
        sweep, dev = self.sweep, self.sweep.device
        row = dict(op="MoELayer fwd+bwd", mode=mode, variant=variant, ms=None, same_bits=None, error=None)
        sweep.rows.append(row)
        try:
            if sweep.over_budget():
                raise RuntimeError("not run: time budget spent")
            if mode == "graphed" and dev.type != "cuda":
                raise RuntimeError("CUDA graphs need a GPU")
            with _switches(*self.VARIANTS[variant]):
                call = self.layer
                if mode == "graphed":
                    sample = self.x.detach().clone().requires_grad_(True)
                    with self.qmoe.autocast(recipe=self.recipe):
                        call = self.qmoe.graph.capture(self.layer, (sample,))
                step = self._step(call)
                y = step().detach().clone()
                got = [y, self.x.grad.clone()] + [p.grad.clone() for p in self.params]
                if self.baseline is None and variant == "measured" and mode == "eager":
                    self.baseline = got
                if self.baseline is not None:
                    why = next((w for w in (_same(a, b, f"tensor {i}")
                                            for i, (a, b) in enumerate(zip(got, self.baseline))) if w), None)
                    row["same_bits"], row["error"] = why is None, why
                del got, y
                row["ms"] = _median_ms(step, dev, rep=300)
                del call, step
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            row["error"] = row["error"] or error_line(e)
        print(f"{'MoELayer fwd+bwd ' + mode:<34} {variant:<26} {_fmt(row['ms'])}  "
              f"{row['error'] or ('same bits' if row['same_bits'] else '')}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU run, TRITON_INTERPRET=1)")
    parser.add_argument("--budget", type=float, default=95.0, help="seconds after which nothing more is timed")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else SHAPE
    header = run_header("benchmarks.sweep_current_amax", argv)
    sweep = Sweep(shape, device, args.budget)
    print(f"{'op':<34} {'variant':<9} {'ms':>9} {'GB/s':>8} {'copy':>6}  note")
    layer = None

    def part(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - set-up failures are results too
            sweep.rows.append(dict(op=name, error=error_line(e)))
            print(f"{name}: {error_line(e)}", flush=True)

    def layer_runs(*runs):
        nonlocal layer
        layer = layer or LayerRows(sweep)
        for mode, variant in runs:
            layer.run(mode, variant)

    # most telling first: the time budget may stop the rest
    part("layer", lambda: layer_runs(("eager", "measured"), ("eager", "producer")))
    part("kernels", lambda: kernel_rows(sweep))
    part("layer", lambda: layer_runs(("graphed", "measured"), ("graphed", "producer"),
                                     ("eager", "producer, activation first"),
                                     ("graphed", "producer, activation first")))
    passed = all(r.get("same_bits") is not False and not (r.get("error") and "same_bits" not in r)
                 for r in sweep.rows)
    write_results(args.out, header, dict(
        suite="sweep_current_amax", shape=shape, tiny=args.tiny, copy_gbps=sweep.copy, all_same_bits=passed,
        elapsed_s=round(time.monotonic() - sweep.start, 1),
        method=("kernel rows: median ms (benchmarks.harness.median_ms) of each operation, measured = the producer "
                "without its amax / the quantize measuring its own amax, producer = with the producer's amax; gbps = "
                "bytes moved once (input read once, outputs written) / time; fraction_of_copy against "
                "harness.copy_gbps; same_bits: the producer variant's outputs (rows, codes, scales) equal the "
                "measured variant's and its amax equals the kernel amax pass of its rows (int32 bits). layer rows: "
                "MoELayer forward + backward under Float8CurrentScaling, eager and qmoe.graph.capture replay, "
                "Float8CurrentQuantizer.takes_amax / fuses_activation switched per variant; same_bits: output and "
                "every gradient equal the measured variant's first step"),
        rows=sweep.rows))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
