"""Where does a compiled graph first depart from eager? Every qmoe kernel op, call by call.

Every Triton launcher is a KernelOp (qmoe/kernels/_triton_utils.py), called by eager code and by
compiled graphs alike. This records each op call's tensor inputs and outputs in an eager run and
in a compiled run of one case of tests/ops/test_ops_compile_gpu.py, pairs the k-th call of each
op in both runs, and reports, in eager's call order:

- calls whose inputs already differ (the torch glue between the ops departs: which argument, by
  how much, and both runs' strides);
- calls whose inputs are equal but outputs differ (the op itself behaves differently).

    PYTHONPATH=. python -m benchmarks.diagnose_compile --case grouped_gemm_scaled_bias --backend aot_eager

On the CPU, `TRITON_INTERPRET=1 QMOE_BACKEND=triton ... --device cpu` runs the same kernels in
Triton's interpreter.
"""
from __future__ import annotations

import argparse
import gc
import importlib
from collections import defaultdict

import torch

KERNEL_MODULES = ("quantize", "quantize_nvfp4", "grouped_quantize", "activation", "router", "permute", "bias",
                  "grouped_gemm")


def kernel_ops() -> list:
    from qmoe.kernels._triton_utils import KernelOp

    for name in KERNEL_MODULES:
        importlib.import_module(f"qmoe.kernels.{name}")
    return [o for o in gc.get_objects() if isinstance(o, KernelOp)]


def _snapshot(value):
    """Tensors as (clone, stride); containers element by element; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone(), tuple(value.stride())
    if isinstance(value, (tuple, list)):
        return [_snapshot(v) for v in value]
    return value


class Recorder:
    """Wraps every KernelOp's function; `log` (when set) collects (op, inputs, outputs) per call."""

    def __init__(self, ops):
        self.log = None
        for op in ops:
            op.fn = self._wrap(op.name, op.fn)

    def _wrap(self, name, inner):
        def recorded(*args):
            out = inner(*args)
            if self.log is not None:
                self.log.append((name, _snapshot(list(args)), _snapshot(out)))
            return out
        return recorded

    def run(self, fn, *args):
        self.log = []
        try:
            result = fn(*args)
        finally:
            log, self.log = self.log, None
        return result, log


def _by_occurrence(log):
    seen, keyed = defaultdict(int), []
    for name, inputs, outputs in log:
        keyed.append(((name, seen[name]), inputs, outputs))
        seen[name] += 1
    return keyed


def _differences(a, b, where=""):
    """[(path, description)] where two snapshots differ."""
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], torch.Tensor):
        (ta, sa), (tb, sb) = a, b
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            return [(where, f"shape/dtype {tuple(ta.shape)} {ta.dtype} vs {tuple(tb.shape)} {tb.dtype}")]
        if torch.equal(ta, tb):
            return [] if sa == sb else [(where, f"equal values, strides {sa} vs {sb}")]
        diff = (ta.double() - tb.double()).abs() if ta.is_floating_point() else (ta != tb).double()
        at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
        return [(where, f"max diff {diff.max().item():.3g} at {at}, {int((diff > 0).sum())} of {ta.numel()} "
                        f"differ, strides {sa} vs {sb}")]
    if isinstance(a, list):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += _differences(x, y, f"{where}[{i}]")
        return out
    return [] if a == b else [(where, f"{a!r} vs {b!r}")]


def compare(eager_log, compiled_log) -> list[str]:
    compiled = {key: (i, o) for key, i, o in _by_occurrence(compiled_log)}
    lines = []
    for key, inputs, outputs in _by_occurrence(eager_log):
        if key not in compiled:
            lines.append(f"{key[0]} call {key[1]}: not called by the compiled run")
            continue
        c_inputs, c_outputs = compiled.pop(key)
        bad_in = _differences(inputs, c_inputs, "arg")
        bad_out = _differences(outputs, c_outputs, "out")
        if bad_in:
            lines.append(f"{key[0]} call {key[1]}: INPUTS differ: " + "; ".join(f"{w}: {d}" for w, d in bad_in))
        elif bad_out:
            lines.append(f"{key[0]} call {key[1]}: equal inputs, OUTPUTS differ: "
                         + "; ".join(f"{w}: {d}" for w, d in bad_out))
    lines += [f"{k[0]} call {k[1]}: called only by the compiled run" for k in compiled]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="grouped_gemm_scaled_bias")
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)

    from tests.ops import test_ops_compile_gpu as cases

    cases.DEV = args.device
    recorder = Recorder(kernel_ops())
    fn, t = cases.CASES[args.case], cases._inputs()
    want, eager_log = recorder.run(cases._run, fn, t)
    compiled = torch.compile(fn, backend=args.backend, fullgraph=True)
    cases._run(compiled, t)  # compile outside the recorded run
    got, compiled_log = recorder.run(cases._run, compiled, t)
    print(f"{args.case} ({args.backend}, {args.device}): {len(eager_log)} op calls eager, {len(compiled_log)} compiled")
    for name, g, w in zip([f"result{i}" for i in range(len(want))], got, want):
        print(f"  {name}: {'equal' if torch.equal(g, w) else 'DIFFERS'}")
    lines = compare(eager_log, compiled_log)
    print("\n".join(lines) if lines else "every op call saw equal inputs and gave equal outputs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
