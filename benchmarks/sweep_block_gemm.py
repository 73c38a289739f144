"""FP8 block grouped GEMM (1x128 activations x 128x128 weights): the Triton kernel qmoe ran before
("current"), what m_grouped_gemm dispatches now ("dispatched": the warp-specialised Gluon kernel
of qmoe/kernels/_block_gemm_ws.py where it applies), the Gluon kernel's other schedules and
tiles, and the dense F.scaled_mm peer, side by side at DeepSeek-V3 FC1 (fprop, even and uneven
splits; dgrad), FC2 fprop and Mixtral FC1 fprop; and wgrad (k-grouped, both operands 1x128-scaled
along the tokens) at DeepSeek-V3 FC1 / FC2 and Mixtral FC1: the Triton kernel against the
warp-specialised Gluon kernel of qmoe/kernels/_block_wgrad_ws.py, and at Qwen3 FC1's 128 small groups.

Every variant is checked against the current kernel's bf16 output (max abs / rel difference,
bit equality, and NUMERICS.md's GEMM bound ||out - ref|| / ||ref|| <= 1e-3 against the same
kernel) and timed with benchmarks.harness.median_ms; a variant that fails to compile or run is
recorded with its error. The results file is rewritten before and after every variant, so a
run that hangs (a deadlocked kernel; the watchdog ends the process) leaves the variant it was
running marked "started"; --skip leaves variants out by name.

    PYTHONPATH=. python3 -m benchmarks.sweep_block_gemm --out $OUT/block_gemm.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 -m benchmarks.sweep_block_gemm --tiny --out /tmp/block_gemm.json
"""
from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

from benchmarks.harness import environ_set, median_ms, run_header, write_results

SHAPES = {  # name: (experts, mean rows per expert, K, N) as in benchmarks/bench_gemm.py
    "dsv3-fc1": (32, 2048, 7168, 4096),
    "dsv3-fc2": (32, 2048, 2048, 7168),
    "mixtral-fc1": (8, 4096, 4096, 28672),
    "qwen3-fc1": (128, 512, 2048, 1536),
}
CASES = [("dsv3-fc1", "fprop", "uneven"), ("dsv3-fc1", "dgrad", "uneven"), ("dsv3-fc1", "wgrad", "uneven"),
         ("dsv3-fc2", "fprop", "uneven"), ("mixtral-fc1", "fprop", "uneven"), ("dsv3-fc1", "fprop", "even"),
         ("dsv3-fc1", "wgrad", "uneven16"), ("dsv3-fc1", "wgrad", "even"), ("dsv3-fc2", "wgrad", "uneven16"),
         ("mixtral-fc1", "wgrad", "uneven16"), ("dsv3-fc1", "fprop", "uneven16"), ("dsv3-fc1", "dgrad", "uneven16"),
         ("dsv3-fc2", "fprop", "uneven16"), ("mixtral-fc1", "fprop", "uneven16"), ("qwen3-fc1", "wgrad", "uneven16")]
TINY = {"dsv3-fc1": (4, 100, 256, 256), "dsv3-fc2": (4, 100, 256, 256), "mixtral-fc1": (2, 150, 256, 384),
        "qwen3-fc1": (6, 60, 256, 128)}
PAD_ROWS = 48  # rows past the last group (static buffers): written as zeros; tokens stay a multiple of 16 (TMA)


def variants(extra: bool = False):
    """name -> keyword arguments of the launcher. "current": the Triton kernel qmoe dispatched before
    the Gluon kernel (its default tiles, forced through `config`); "dispatched": what
    m_grouped_gemm runs now. `extra` adds the persistent Triton TMA variants; Triton's own
    Hopper warp specialisation (`tl-autows`) is never run on a GPU: it deadlocked there."""
    v = {"current": None, "dispatched": None}
    for pipe, stages in ((0, 5), (2, 5), (3, 5), (2, 6)):
        v[f"gluon-ws pipe{pipe} s{stages}"] = dict(kind="ws", pipe=pipe, stages=stages)
    for group_m in (4, 16):
        v[f"gluon-ws pipe2 s5 gm{group_m}"] = dict(kind="ws", pipe=2, stages=5, group_m=group_m)
    for pipe, stages, c_bufs in ((0, 4, 1), (3, 4, 1), (0, 3, 2), (3, 3, 2)):
        v[f"gluon-ws n256 pipe{pipe} s{stages} c{c_bufs}"] = dict(kind="ws", bn=256, pipe=pipe, stages=stages,
                                                                  c_bufs=c_bufs)
    # the activation scales streamed by TMA with the codes
    v["gluon-ws pipe2 s5 scales-tma"] = dict(kind="ws", pipe=2, stages=5, scales_tma=True)
    for pipe, c_bufs in ((0, 2), (3, 2), (3, 1)):
        v[f"gluon-ws n256 pipe{pipe} s3 c{c_bufs} scales-tma"] = dict(kind="ws", bn=256, pipe=pipe, stages=3,
                                                                      c_bufs=c_bufs, scales_tma=True)
    if extra:
        v["tl w8 s4"] = dict(kind="tl", warps=8, stages=4)  # the current body, persistent over TMA descriptors
        v["tl-split w8 s4"] = dict(kind="tl", split=True, warps=8, stages=4)
    return v


def wgrad_variants():
    """wgrad (k-grouped): "current" is the Triton kernel (its tiles forced through `config`),
    "dispatched" what k_grouped_gemm runs now (the Gluon kernel of qmoe/kernels/_block_wgrad_ws.py
    where it applies), then the Gluon kernel's schedules and stage counts."""
    v = {"current": None, "dispatched": None}
    for pipe, stages, group_m, tail in ((0, 4, 8, "desc"), (0, 4, 8, "loads"), (1, 4, 8, "loads"), (0, 3, 8, "desc"),
                                        (0, 4, 16, "desc")):
        v[f"gluon-wg pipe{pipe} s{stages} gm{group_m} tail-{tail}"] = dict(
            kind="wg", pipe=pipe, stages=stages, group_m=group_m, tail=tail)
    for pipe, tail in ((0, "desc"), (0, "loads"), (1, "loads"), (1, "desc")):  # the step-major scales by TMA
        v[f"gluon-wg pipe{pipe} s4 gm8 tail-{tail} scales-tma"] = dict(
            kind="wg", pipe=pipe, stages=4, group_m=8, tail=tail, scales_tma=True)
    # 128 x 256 tiles (consumer, producer regs)
    for pipe, regs in ((3, (240, 24)), (0, (240, 24)), (3, (232, 40))):
        v[f"gluon-wg n256 pipe{pipe} s3 gm8 regs{regs[0]}"] = dict(
            kind="wg", bn=256, pipe=pipe, stages=3, group_m=8, tail="desc", scales_tma=True, consumer_regs=regs[0],
            producer_regs=regs[1])
    return v


def uneven_splits(experts: int, rows: int, seed: int, empty: bool) -> list[int]:
    """Token counts around `rows` per expert (relative spread ~35%; expert experts // 3 empty
    when `empty`), summing to experts * rows: group boundaries fall inside 128-row tiles."""
    g = torch.Generator().manual_seed(seed)
    w = (1 + 0.35 * torch.randn(experts, generator=g)).clamp(min=0.1)
    if empty:
        w[experts // 3] = 0
    s = (w / w.sum() * experts * rows).floor().long()
    s[-1] += experts * rows - int(s.sum())
    return [int(v) for v in s]


def _operands(e, splits, k, n, layout, device, seed, recipe=None):
    """A case's quantized operands under `recipe` (default: FP8 block scaling)."""
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8BlockScaling

    recipe = recipe or Float8BlockScaling()
    g = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: GB of operands
    t = sum(splits) + PAD_ROWS
    # quantized by the reference backend: the same bits as the kernels, without their compiles and autotuning
    if layout == "wgrad":  # dW = dy^T x: both operands' columnwise copies (block: 1x128 along tokens)
        ops = []
        for cols, role in ((n, "grad_output"), (k, "input")):
            x = torch.randn(t, cols, generator=g, device=device).to(torch.bfloat16)
            x[sum(splits):] = 0
            with environ_set("QMOE_BACKEND", "reference"):
                ops.append(GroupedTensor.quantize(x, torch.tensor(splits), recipe.quantizer(role), rowwise=False,
                                                  validate=False))
            del x
        return tuple(ops)
    w = (torch.randn(e, n, k, generator=g, device=device) / k ** 0.5).to(torch.bfloat16)
    if layout == "fprop":
        x = torch.randn(t, k, generator=g, device=device).to(torch.bfloat16)
        role = "input"
    else:  # dgrad: dx = dy W, contraction over the weights' N
        x = torch.randn(t, n, generator=g, device=device).to(torch.bfloat16)
        role = "grad_output"
    x[sum(splits):] = 0
    with environ_set("QMOE_BACKEND", "reference"):
        a = GroupedTensor.quantize(x, torch.tensor(splits), recipe.quantizer(role), columnwise=False, validate=False)
        b = quantize_weights(w, recipe.quantizer("weight"), rowwise=layout == "fprop", columnwise=layout == "dgrad")
    return a, b


def _runner(name, kw, a, b, layout, programs, info):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    columnwise = layout == "dgrad"
    if layout == "wgrad":
        if name == "dispatched":
            return lambda: gg.k_grouped_gemm_with(a, b)
        if kw is None:
            return lambda: gg.k_grouped_gemm_with(a, b, config=gg.k_tile_config(Scaling.BLOCK))
        from qmoe.kernels._block_wgrad_ws import launch_block_wgrad_ws
        kw = {key: v for key, v in kw.items() if key != "kind"}
        a_op, b_op = gg.tokens_operand(a, Scaling.BLOCK), gg.tokens_operand(b, Scaling.BLOCK)
        n_w, k_w = a.shape[1], b.shape[1]
        out = torch.empty((a.num_groups, n_w, k_w), dtype=torch.bfloat16, device=a_op.data.device)
        return lambda: launch_block_wgrad_ws(a_op, b_op, a.offsets, n_w, k_w, a.num_groups, out, programs=programs,
                                             info=info, **kw)
    if name == "dispatched":
        return lambda: gg.m_grouped_gemm_with(a, b, b_columnwise=columnwise)
    if kw is None:  # the Triton kernel with its default tiles (a config bypasses the Gluon dispatch)
        cfg = gg.tile_configs(Scaling.BLOCK, small_m=False)[0]
        return lambda: gg.m_grouped_gemm_with(a, b, b_columnwise=columnwise, config=cfg)
    a_op = gg.activation_operand(a, Scaling.BLOCK)
    b_op, n_out, k = gg.weight_operand(b, Scaling.BLOCK, columnwise)
    args = (a_op, b_op, a.offsets, a.shape[0], n_out, k, b.num_groups, torch.bfloat16)
    kw = dict(kw)
    kind = kw.pop("kind")
    if kind == "ws":
        from qmoe.kernels._block_gemm_ws import launch_block_gemm_ws
        return lambda: launch_block_gemm_ws(*args, b_columnwise=columnwise, programs=programs, info=info, **kw)
    from qmoe.kernels._block_gemm_tl import launch_block_gemm_tl
    return lambda: launch_block_gemm_tl(*args, b_columnwise=columnwise, programs=programs, info=info, **kw)


def _compare(out, ref) -> dict:
    d = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max().clamp(min=1e-30)
    rel_fro = float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))
    return dict(exact=bool(torch.equal(out, ref)), max_abs=float(d.max()), max_rel=float(d.max() / scale),
                rel_fro=rel_fro, within_numerics=rel_fro <= 1e-3 and bool(torch.isfinite(out).all()))


def _time(fn, on_gpu: bool) -> float:
    if on_gpu:
        return median_ms(fn, warmup=10, rep=40)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _dense_peer(t, n, k):
    """ms of dense F.scaled_mm 1x128 x 128x128 at the same work (the cuBLAS ceiling), or None."""
    from benchmarks.bench_gemm import _peer_dense_block
    return _peer_dense_block(t - t % 128, n, k, "cuda")


def torch_grouped_block_probe() -> dict:
    """Does this torch's F.scaled_grouped_mm take 1x128 x 128x128 block scales (the dependency
    route)? A small grouped call with those recipes: its result or its error, recorded."""
    import torch.nn.functional as F

    row = dict(variant="torch F.scaled_grouped_mm BlockWise1x128 x BlockWise128x128 (probe)", shape="probe")
    try:
        e, m, k, n = 2, 256, 256, 256
        a = torch.randn(e * m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(e, n, k, device="cuda").to(torch.float8_e4m3fn).transpose(1, 2)  # [E, K, N], K-major
        sa = torch.ones(k // 128, e * m, device="cuda").t()
        sb = torch.ones(e, n // 128, k // 128, device="cuda")
        offs = torch.tensor([m, 2 * m], device="cuda", dtype=torch.int32)
        out = F.scaled_grouped_mm(a, b, sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                                  offs=offs, output_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        row.update(status="ok", out_shape=list(out.shape))
    except Exception as err:  # the expected answer on sm90: no grouped implementation for these recipes
        row.update(status="error", error=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}")
    return row


def run(args, header) -> list[dict]:
    on_gpu = torch.cuda.is_available() and not args.tiny
    device = "cuda" if on_gpu else "cpu"
    shapes = TINY if args.tiny else SHAPES
    programs = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 3
    wanted = variants(extra=args.extra)
    if args.variants:
        wanted = {k: v for k, v in wanted.items() if k == "current" or any(s in k for s in args.variants)}
    wanted_wgrad = wgrad_variants()
    if args.variants:
        wanted_wgrad = {k: v for k, v in wanted_wgrad.items() if k == "current" or any(s in k for s in args.variants)}
    if args.skip:  # e.g. a variant that hung in an earlier run (its row says "started")
        wanted = {k: v for k, v in wanted.items() if k == "current" or not any(s in k for s in args.skip)}
        wanted_wgrad = {k: v for k, v in wanted_wgrad.items() if k == "current" or not any(s in k for s in args.skip)}
    rows, start = [], time.monotonic()
    if on_gpu:
        rows.append(torch_grouped_block_probe())
        print(rows[-1])

    def save(partial=None):
        write_results(args.out, header, {"suite": "sweep_block_gemm", "programs": programs,
                                         "rows": rows + ([partial] if partial else [])}, indent=1, quiet=True)

    for ci, (shape, layout, split_kind) in enumerate(CASES):
        if args.cases and not any(c in f"{shape}:{layout}:{split_kind}" for c in args.cases):
            continue
        e, m, k, n = shapes[shape]
        empty = shape.startswith("dsv3")  # 32 experts per rank: one may get no token
        splits = [m] * e if split_kind == "even" else uneven_splits(e, m, seed=ci, empty=empty)
        if split_kind == "uneven16":  # as the layer's permute pads them (align_size 16): groups start on 16 tokens
            splits = [v // 16 * 16 for v in splits]
            splits[-1] += e * m - sum(splits)
        a, b = _operands(e, splits, k, n, layout, device, seed=ci)
        t = sum(splits)
        k_c, n_c = (k, n) if layout == "fprop" else (n, k)
        flops = 2.0 * t * n_c * k_c
        case = dict(shape=shape, layout=layout, splits=split_kind, experts=e, rows=t, pad_rows=PAD_ROWS, K=k_c, N=n_c,
                    min_split=min(splits), max_split=max(splits))
        if layout == "wgrad":  # dW [experts, n, k] over each expert's tokens
            case.update(K=None, N=None, dW=[e, n, k])
        ref = None
        if on_gpu and layout == "fprop":
            ms = _dense_peer(t, n_c, k_c)
            rows.append(dict(case, variant="F.scaled_mm dense (peer)", status="ok" if ms else "error", ms=ms,
                             tflops=round(flops / ms / 1e9, 1) if ms else None))
        for name, kw in (wanted_wgrad if layout == "wgrad" else wanted).items():
            if time.monotonic() - start > args.budget_s and name not in ("current", "dispatched"):
                rows.append(dict(case, variant=name, status="skipped", error="time budget spent"))
                continue
            row = dict(case, variant=name, status="started")
            save(row)
            info = {}
            try:
                fn = _runner(name, kw, a, b, layout, programs, info)
                out = fn()
                if on_gpu:
                    torch.cuda.synchronize()
                if name == "current":
                    ref = out
                row.update(_compare(out, ref) if ref is not None else {})
                if layout == "wgrad":  # an expert without tokens gets exact zeros
                    row["empty_experts_zero"] = all(bool((out[i] == 0).all()) for i, m in enumerate(splits) if m == 0)
                else:
                    row["pad_rows_zero"] = bool((out[t:] == 0).all())
                ms = _time(fn, on_gpu)
                row.update(status="ok", ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), **info)
            except Exception as err:  # compile or launch failure: recorded, the sweep goes on
                if on_gpu:
                    torch.cuda.synchronize()
                row.update(status="error", error=f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"
                           if str(err).strip() else type(err).__name__, **info)
            rows.append(row)
            save()
            print(f"{shape:12s} {layout:6s} {split_kind:7s} {name:22s} {row['status']:7s} "
                  f"{row.get('tflops', '-')!s:>8} TF/s exact={row.get('exact', '-')} rel={row.get('rel_fro', '-')}"
                  f"{'  ' + row['error'] if 'error' in row else ''}", flush=True)
        same = [r for r in rows if (r.get("shape"), r.get("layout"), r.get("splits")) == (shape, layout, split_kind)]
        cur = next((r for r in same if r["variant"] == "current" and r.get("tflops")), None)
        for r in same:
            if cur and r is not cur and r.get("tflops"):
                r["vs_current"] = round(r["tflops"] / cur["tflops"], 3)
        del a, b, ref
        if on_gpu:
            torch.cuda.empty_cache()
        save()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sweep_block_gemm", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU: run with TRITON_INTERPRET=1)")
    p.add_argument("--variants", nargs="*", help="only variants whose name contains one of these (current always)")
    p.add_argument("--skip", nargs="*", help="leave out variants whose name contains one of these")
    p.add_argument("--cases", nargs="*", help="only cases whose shape:layout:splits name contains one of these "
                                              "(e.g. wgrad, mixtral-fc1:fprop)")
    p.add_argument("--extra", action="store_true", help="also the persistent Triton TMA variants (tl ...)")
    p.add_argument("--budget-s", type=float, default=100.0, help="skip the variants left after this many seconds")
    p.add_argument("--watchdog-s", type=float, default=115.0, help="end the process (a hung kernel) after this long")
    args = p.parse_args(argv)
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    header = run_header("benchmarks.sweep_block_gemm", argv)
    rows = run(args, header)
    faulthandler.cancel_dump_traceback_later()
    ok = [r for r in rows if r.get("status") == "ok"]
    print(f"\n{len(ok)} of {len(rows)} rows ran; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
