"""Grouped linear (the experts' GEMMs) as one autograd Function: quantize, GEMM, bias, backward.

Dimensions: R packed rows (tokens of all experts, each group padded to the recipe's
align_size), E experts, K in features, N out features.

    y[rows of g] = x_g @ W_g^T (+ bias_g, times scales[row] with scale_bias)

A call is a `GroupedLinearPlan`: the path strategy (`qmoe.ops.grouped_linear_paths`: grouped,
or split, the cross-check and fallback), the recipe's quantizers (None: high precision), where
the input comes from and where weight gradients go. `GroupedLinearFunction` runs the plan's
named steps: quantize_input, quantize_weight, fprop, then quantize_grad, dgrad, wgrad. The
plan's fprop / dgrad / wgrad are the one place where operands reach the GEMMs. Weights are
quantized once per forward (rowwise for fprop plus columnwise for dgrad, in one call) and
reused by dgrad; backward keeps the quantized columnwise copies of x, not x itself.
`weight_cache` keeps the quantized weights from one call to the next while they cannot change
(`qmoe.quant.weight_cache`): micro-batches of one optimizer step and checkpoint recomputes
quantize them once. `recompute_weight_columnwise` keeps no columnwise weight copy between
forward and backward: the forward quantizes the rowwise copy only and the backward quantizes
dgrad's copy again, with the forward's scales (`GroupedLinearPlan.rebuild_weight`).

`input_activation` fuses the expert MLP's activation into FC2: the input is act(h) * probs,
quantized straight from h on the grouped path with a recipe (GroupedTensor.quantize of an
ActivatedRows), so the [R, F] activation output is neither written nor read back; the backward
turns FC2's dgrad into dh and dprobs with the activation's own backward. Elsewhere the
activation runs first (qmoe.ops.expert_activation): the results are the same.
`recompute_activation` keeps only h and probs for the backward, which rebuilds the weight
gradient's input operand from them (`GroupedLinearPlan.rebuild_input`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from qmoe.contracts.carriers import ActivatedRows, AmaxSlot, GatheredRows, RowIdMap, RowsWithAmax, permuted_sources
from qmoe.contracts.enums import Activation, GroupedPath, Scaling, parse_activation, parse_grouped_path
from qmoe.contracts.validate import check_flag, check_group_amax, check_scaled_activation_args, check_split_sizes
from qmoe.dispatch import BIAS, GROUPED_GEMM, PERMUTE
from qmoe.ops.activation import activation_backward, activation_forward, expert_activation
from qmoe.ops.amp import autocast_off
from qmoe.ops.grouped_linear_paths import PATHS, Groups, LinearPath, drop_rowwise
from qmoe.ops.permute import gathered_amax, gathered_rows, moe_unpermute
from qmoe.quant import QuantizedTensor
from qmoe.quant.quantizer import MXFP8Quantizer, NVFP4Quantizer
from qmoe.quant.replay import ForwardLog, active_log, using_log
from qmoe.quant.weight_cache import BoundWeightCache


# Test-only observer of the plan's steps (`observe_steps`); None, the default: one test per step.
_observer = None


@contextlib.contextmanager
def observe_steps(callback):
    """Test-only: inside the block, after each quantize and GEMM step of every grouped linear, call
    `callback(plan, step, inputs, output)`, so a test can check which operands each GEMM was
    handed (tests/ops/test_grouped_linear_wiring.py).

    step and inputs: "quantize_input" (x, or its ActivatedRows; Groups), "quantize_weight"
    (weight,), "quantize_grad" (dy, Groups), "fprop" (x operand, w operand), "dgrad" (dy
    operand, w operand), "wgrad" (dy operand, x operand); output: the quantized operand, or the
    GEMM's result. Quantize steps report under a recipe only. One module-level slot: not for
    threads or compiled regions.
    """
    global _observer
    previous, _observer = _observer, callback
    try:
        yield
    finally:
        _observer = previous


@dataclass
class GroupedLinearPlan:
    """How one grouped_linear call runs, decided at the op's boundary before any work.

    path: the strategy whose steps run. quantizers: {"input", "weight", "grad_output"} or None
    (plain GEMMs in x's dtype). quantized_input: x's rows quantized before dispatch, or None.
    activation / glu_interleave_size: set when x is h and the input is act(h) * probs, made
    inside the op: fused into the input's quantization where the path fuses under a recipe
    (`fuses_activation`), computed first otherwise. wgrad_sink: a list that takes the
    weight-gradient callables (delay_wgrad_compute), or None.
    recompute_activation: keep h and probs only; the backward rebuilds wgrad's input operand
    (the quantized columnwise copy of act(h) * probs, or that output itself without a recipe)
    instead of keeping it from the forward (`rebuild_input`).
    input_amax: x's per-group amax [E] from the kernel that wrote x (`RowsWithAmax`), or None.
    grad_output_amax: the `AmaxSlot` dy's producer fills in its backward, or None.
    grad_input_amax: an `AmaxSlot` this plan's backward fills with dx (the gradient of h with a
    fused activation) and its per-group amax, for the layer that produced h; or None.
    weight_cache: where the quantized weights are kept across calls (the grouped path, under a
    recipe), or None: quantized every call.
    recompute_weight_columnwise: keep the weight itself for dgrad (free: it is the parameter)
    instead of its quantized columnwise copy, which the backward makes again (`rebuild_weight`).
    gather: the `GatheredRows` (index and row_id_map; its source is the Function's x) that the
    input stands for, or None: quantized as gathered, its gradient sent back to the tokens.
    unpermute: a `GatheredRows` (index and row_id_map, no source) when the output's rows are summed
    back to their tokens inside the op (`moe_unpermute` without merging probs; the output is then
    [T, N], and the backward quantizes its gradient's rows gathered from the tokens' gradient, the
    rows the unpermute's backward would have copied), or None.
    """

    path: LinearPath
    quantizers: dict | None = None
    quantized_input: QuantizedTensor | None = None
    activation: Activation | None = None
    glu_interleave_size: int | None = None
    wgrad_sink: list | None = None
    recompute_activation: bool = False
    input_amax: torch.Tensor | None = None
    grad_output_amax: AmaxSlot | None = None
    grad_input_amax: AmaxSlot | None = None
    weight_cache: BoundWeightCache | None = None
    recompute_weight_columnwise: bool = False
    grad_enabled: bool = True  # torch.is_grad_enabled() at the call: the backward's copies are made only then
    gather: GatheredRows | None = None  # its source dropped: the Function's x, which autograd holds
    unpermute: GatheredRows | None = None

    def rows_of(self, x: torch.Tensor):
        """The input the Function's x stands for: x, or the rows gathered from it."""
        return x if self.gather is None else self.gather._replace(source=x)

    @property
    def fuses_activation(self) -> bool:
        return self.quantizers is not None and self.path.fuses_input_activation

    # ---- quantize steps: a recipe's operands, or plain tensors in x's dtype without one
    def quantize_input(self, x, probs, groups: Groups, wgrad: bool, rowwise: bool = True):
        rows = x.shape[0]
        if self.activation is not None:
            if self.fuses_activation:
                x = ActivatedRows(x, probs, self.activation.value, self.glu_interleave_size)
            else:
                x = activation_forward(x, probs, self.activation.value, self.glu_interleave_size)
        if self.quantizers is None:
            return x
        if self.input_amax is not None:  # the permute reduced it: the quantizer only casts
            x = RowsWithAmax(x, self.input_amax)
        quantizer = self.quantizers["input"]
        values = _values_only(quantizer, rows, groups.split_sizes.shape[0], groups.split_sizes,
                              "rowwise" if rowwise else "columnwise")
        out = self.path.quantize_input(x, groups, quantizer, wgrad, self.quantized_input, rowwise=rowwise,
                                       values=values)
        if _observer is not None:
            _observer(self, "quantize_input", (x, groups), out)
        return out

    def replay_log(self) -> ForwardLog | None:
        """A log a forward quantization keeps its state in (delayed scaling's scale) for the
        backward's rebuild (`rebuild_input`, `rebuild_weight`) to replay; None without a recipe, and
        in compiled code, which cannot hold one (delayed scaling, the one recipe that keeps such
        state, refuses compilation)."""
        if self.quantizers is None or torch.compiler.is_compiling():
            return None
        return ForwardLog(parent=active_log())

    def rebuild_input(self, h, probs, groups: Groups, log: ForwardLog | None):
        """wgrad's input operand rebuilt in the backward from h and probs (recompute_activation):
        the columnwise copy only, quantized as the forward did (same scales; no amax recorded
        again), so the weight gradient is the one the kept operand would give, bit for bit."""
        if log is None:
            return self.quantize_input(h, probs, groups, wgrad=True, rowwise=False)
        log.start_replay()
        with using_log(log):
            return self.quantize_input(h, probs, groups, wgrad=True, rowwise=False)

    def quantize_weight(self, weight: torch.Tensor, dtype: torch.dtype, dgrad: bool, rowwise: bool = True,
                        keep: bool = True, rows: int = 0):
        """fprop's rowwise W (unless rowwise=False) and, if `dgrad`, dgrad's columnwise copy: from
        the weight cache where there is one and `keep`, else quantized now. rows: the tokens the
        GEMM multiplies W with (whether its copy may come as exact values, `_values_only`)."""
        if self.quantizers is None:
            return weight.to(dtype)
        quantizer = self.quantizers["weight"]

        def fresh(rowwise: bool, columnwise: bool, values=()):
            return self.path.quantize_weight(weight, quantizer, columnwise, rowwise=rowwise, values=values)

        if keep and self.kept_weights:
            out = self.weight_cache.quantize(weight, quantizer, rowwise, dgrad, fresh)
        else:  # the copy its GEMM reads now (a columnwise one made with it is kept for the backward)
            out = fresh(rowwise, dgrad, _values_only(quantizer, rows, weight.shape[0], weight,
                                                     "rowwise" if rowwise else "columnwise"))
        if _observer is not None:
            _observer(self, "quantize_weight", (weight,), out)
        return out

    @property
    def kept_weights(self) -> bool:
        """Whether the quantized weights may come from (and stay in) the weight cache."""
        return self.weight_cache is not None and self.quantizers is not None and self.path.keeps_weights

    def weight_values_later(self, rows: int, weight: torch.Tensor) -> bool:
        """Whether dgrad's weight copy is made in the backward even without
        recompute_weight_columnwise: where it would come as exact values (`_values_only`: MXFP8's,
        the emulated GEMMs' dequantize-first route) and no weight cache keeps it, writing them from W
        there moves the bytes that keeping codes and dequantizing them would, and holds no copy in
        between."""
        return (self.quantizers is not None and not self.kept_weights and self.path.kind is GroupedPath.GROUPED
                and bool(_values_only(self.quantizers["weight"], rows, weight.shape[0], weight, "columnwise")))

    def rebuild_weight(self, weight, dtype: torch.dtype, log: ForwardLog | None, rows: int):
        """dgrad's weight operand made again in the backward (recompute_weight_columnwise): the
        columnwise copy only, quantized with the forward's scales (no amax recorded again), so dgrad
        gets the bits the kept copy would have had. Never stored in the weight cache (that would
        keep the copy this option exists not to keep)."""
        if log is None:
            return self.quantize_weight(weight, dtype, dgrad=True, rowwise=False, keep=False, rows=rows)
        log.start_replay()
        with using_log(log):
            return self.quantize_weight(weight, dtype, dgrad=True, rowwise=False, keep=False, rows=rows)

    def quantize_grad(self, dy: torch.Tensor, groups: Groups, dtype: torch.dtype, dgrad: bool, wgrad: bool,
                      amax: torch.Tensor | None = None):
        """amax: dy's per-group amax from its producer (`grad_output_amax`), or None."""
        if self.quantizers is None:
            return dy.to(dtype)
        if not (dgrad or wgrad):  # only the bias and scales take gradients: they read dy itself
            return None
        quantizer = self.quantizers["grad_output"]
        # a deferred wgrad (wgrad_sink) holds its copy until later: codes there, half the bytes
        copies = ("rowwise",) * dgrad + ("columnwise",) * (wgrad and self.wgrad_sink is None)
        values = _values_only(quantizer, dy.shape[0], groups.split_sizes.shape[0], groups.split_sizes, *copies)
        if amax is not None:
            dy = RowsWithAmax(dy, amax)
        out = self.path.quantize_grad(dy, groups, quantizer, dgrad, wgrad, values=values)
        if _observer is not None:
            _observer(self, "quantize_grad", (dy, groups), out)
        return out

    def output_grad(self, dy: torch.Tensor, amax: torch.Tensor | None):
        """(the GEMMs' dy [R, N], its per-group amax or None): dy itself, or with an unpermute the
        rows gathered from the tokens' gradient dy [T, N], their amax (where the gradient's
        quantizer takes one) the max of the tokens' row amaxes."""
        if self.unpermute is None:
            return dy, amax
        rows = self.unpermute._replace(source=dy)
        return rows, gathered_amax(rows) if self.quantizers["grad_output"].takes_amax else None

    # ---- GEMM steps: the one place where (quantized) operands reach the GEMMs
    def fprop(self, x, w, groups: Groups, out_dtype: torch.dtype) -> torch.Tensor:
        y = self.path.fprop(x, w, groups, out_dtype)
        if _observer is not None:
            _observer(self, "fprop", (x, w), y)
        return y

    def dgrad(self, dy, w, groups: Groups, x_shape: torch.Size, out_dtype: torch.dtype) -> torch.Tensor:
        dx = self.path.dgrad(dy, w, groups, x_shape, out_dtype)
        if _observer is not None:
            _observer(self, "dgrad", (dy, w), dx)
        return dx

    def wgrad(self, dy, x, groups: Groups, shape: tuple[int, int, int], w_dtype: torch.dtype) -> torch.Tensor:
        dw = self.path.wgrad(dy, x, groups, shape, w_dtype)
        if _observer is not None:
            _observer(self, "wgrad", (dy, x), dw)
        return dw


def _values_only(quantizer, rows: int, groups: int, on: torch.Tensor, *copies: str) -> tuple[str, ...]:
    """The copies (of `copies`, read once by the GEMM that follows) to cast as exact bf16 values
    (`GroupedTensor.quantize`'s values): where the GEMMs that run `on` this tensor's device multiply
    `rows` tokens over `groups` experts from their exact values (`reads_values`) and so need no
    codes, MXFP8's, and NVFP4's rowwise ones. NVFP4's columnwise copies stay codes: its cast is
    bound by instructions, not bytes, so writing their values costs it about what the dequantize
    pass they save costs, and they would hold 4x the codes' bytes until wgrad (or, for the
    weights' copy, casting W again in the backward would cost more than that pass)."""
    if isinstance(quantizer, NVFP4Quantizer):
        scaling, copies = Scaling.NVFP4, tuple(c for c in copies if c == "rowwise")
    else:
        scaling = Scaling.MX if isinstance(quantizer, MXFP8Quantizer) else None
    if scaling is not None and copies and GROUPED_GEMM.pick("reads_values", on)(scaling, rows, groups):
        return copies
    return ()


@dataclass
class _Needs:
    """Which inputs of GroupedLinearFunction.forward take a gradient."""

    x: bool
    weight: bool
    bias: bool
    scales: bool
    probs: bool

    @property
    def dgrad(self) -> bool:  # dprobs also comes from dgrad's output (the activation's backward)
        return self.x or self.probs


@dataclass
class _Saved:
    """What backward reads, by name. The tensors among `_AUTOGRAD` go through
    ctx.save_for_backward (version checks, saved-tensor hooks); the rest stays on the object.

    x_operand: wgrad's x (x itself, or its quantized columnwise copies), None without wgrad.
    w_operand: dgrad's W (W in x's dtype, or its quantized columnwise copies), None without dgrad
    or with recompute_weight_columnwise, which keeps `weight` instead.
    x_shape: dgrad's output shape (act(h)'s with a fused activation).
    """

    groups: Groups
    x_operand: object
    w_operand: object
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    scales: torch.Tensor | None
    h: torch.Tensor | None
    probs: torch.Tensor | None
    x_shape: torch.Size
    x_dtype: torch.dtype
    w_dtype: torch.dtype

    _AUTOGRAD = ("x_operand", "w_operand", "weight", "bias", "scales", "h", "probs")

    def stash(self, ctx) -> None:
        g = self.groups
        tensors = [getattr(self, name) for name in self._AUTOGRAD]
        ctx.save_for_backward(g.split_sizes, g.offsets, *(t if isinstance(t, torch.Tensor) else None
                                                           for t in tensors))
        g.split_sizes = g.offsets = None
        for name, t in zip(self._AUTOGRAD, tensors):
            if isinstance(t, torch.Tensor):
                setattr(self, name, None)
        ctx.saved = self

    @staticmethod
    def unstash(ctx) -> "_Saved":
        # a new object: torch.compile traces backward, where objects made in forward are read-only
        kept = ctx.saved
        split_sizes, offsets, *tensors = ctx.saved_tensors
        values = {name: getattr(kept, name) if t is None else t for name, t in zip(kept._AUTOGRAD, tensors)}
        groups = Groups(split_sizes, offsets, kept.groups.bounds, kept.groups.device)
        return _Saved(groups=groups, x_shape=kept.x_shape, x_dtype=kept.x_dtype, w_dtype=kept.w_dtype, **values)


class GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, plan: GroupedLinearPlan, x, split_sizes, weight, bias, scales, probs):
        # x is h when plan.activation is set (the input is act(h) * probs); probs is None otherwise
        # in forward's argument order; none under no_grad / inference_mode (no backward will run)
        grad = ctx.needs_input_grad if plan.grad_enabled else (False,) * 7
        needs = _Needs(x=grad[1], weight=grad[3], bias=grad[4], scales=grad[5], probs=grad[6])
        ctx.plan, ctx.needs = plan, needs
        rows = plan.rows_of(x)  # with a gather, x is the tokens and the input their permuted rows
        groups = plan.path.groups(split_sizes, rows)
        keep_input = needs.weight and not plan.recompute_activation
        ctx.input_log = log = plan.replay_log() if needs.weight and plan.recompute_activation else None
        with using_log(log) if log is not None else contextlib.nullcontext():
            x_op = plan.quantize_input(rows, probs, groups, wgrad=keep_input)
        rebuild_w = needs.dgrad and (plan.recompute_weight_columnwise
                                     or plan.weight_values_later(rows.shape[0], weight))
        ctx.rebuild_w = rebuild_w
        ctx.weight_log = log = plan.replay_log() if rebuild_w else None
        with using_log(log) if log is not None else contextlib.nullcontext():
            w_op = plan.quantize_weight(weight, x.dtype, dgrad=needs.dgrad and not rebuild_w, rows=rows.shape[0])
        y = plan.fprop(x_op, w_op, groups, out_dtype=x.dtype)
        if bias is not None:
            y = BIAS.pick("grouped_bias_forward", y)(y, bias, groups.offsets, scales)
        if plan.unpermute is not None:  # each token's rows summed: y [T, N]
            row_id_map = plan.unpermute.row_id_map
            y = PERMUTE.pick("unpermute_rows", y, row_id_map.rows)(y, row_id_map)
        activated = plan.activation is not None  # x is h; the GEMM's input is [R, K] = act(h) * probs
        _Saved(groups=groups,
               x_operand=drop_rowwise(x_op) if keep_input else None,
               w_operand=drop_rowwise(w_op, shared=plan.kept_weights) if needs.dgrad and not rebuild_w else None,
               weight=weight if rebuild_w else None,
               bias=bias, scales=scales, h=x if activated else None, probs=probs,
               x_shape=torch.Size((x.shape[0], weight.shape[2])) if activated else rows.shape,
               x_dtype=x.dtype, w_dtype=weight.dtype).stash(ctx)
        return y

    @staticmethod
    @autocast_off
    def backward(ctx, dy):
        plan, needs, saved = ctx.plan, ctx.needs, _Saved.unstash(ctx)
        # from here `saved` holds the operands alone, so each is freed once its GEMM has read it: the
        # backward's peak (the wgrad, after the dgrad) no longer holds dgrad's weight copy and
        # gradient copy; they live on only in a deferred wgrad. (Compiled code traces this backward
        # and manages its own buffers: ctx stays as it is there.)
        release = not torch.compiler.is_compiling()
        if release:
            ctx.saved = None
        groups = saved.groups
        dy_amax = plan.grad_output_amax.take(dy) if plan.grad_output_amax is not None else None
        dy, dy_amax = plan.output_grad(dy.contiguous(), dy_amax)
        dx = dw = dbias = dscales = dprobs = None
        g_op = plan.quantize_grad(dy, groups, saved.x_dtype, dgrad=needs.dgrad, wgrad=needs.weight, amax=dy_amax)
        if needs.dgrad:
            w_op = saved.w_operand
            if ctx.rebuild_w:
                w_op = plan.rebuild_weight(saved.weight, saved.x_dtype, ctx.weight_log, dy.shape[0])
            dx = plan.dgrad(g_op, w_op, groups, saved.x_shape, out_dtype=dy.dtype)
            if release:
                saved.w_operand = w_op = None
                g_op = drop_rowwise(g_op, shared=True)  # wgrad reads the columnwise copy
        if needs.weight:
            shape = (len(groups.split_sizes), dy.shape[1], saved.x_shape[1])
            x_op = saved.x_operand
            if plan.recompute_activation:
                x_op = plan.rebuild_input(saved.h, saved.probs, groups, ctx.input_log)

            def wgrad(g_op=g_op, x_op=x_op):
                return plan.wgrad(g_op, x_op, groups, shape, saved.w_dtype)

            if plan.wgrad_sink is not None:
                plan.wgrad_sink.append(wgrad)  # delay_wgrad_compute: the module runs it in backward_dw()
            else:
                dw = wgrad().to(saved.w_dtype)
        if saved.bias is not None and (needs.bias or needs.scales):
            if isinstance(dy, GatheredRows):  # the bias reads the rows themselves
                dy = gathered_rows(dy)
            dbias, dscales = BIAS.pick("grouped_bias_backward", dy)(dy, saved.bias, groups.offsets, saved.scales,
                                                                    needs.scales)
            dbias = dbias.to(saved.bias.dtype) if needs.bias else None
            dscales = dscales.to(saved.scales.dtype) if dscales is not None else None
        ctx.saved = None
        if plan.activation is not None and dx is not None:  # dx is the activation output's gradient
            slot = plan.grad_input_amax if needs.x else None
            dx, dprobs = activation_backward(saved.h, saved.probs, dx, plan.activation.value,
                                             plan.glu_interleave_size, needs.probs,
                                             amax_offsets=groups.offsets if slot is not None else None)
            if slot is not None:  # dh and its per-group amax, for the grad_output quantizer of h's layer
                slot.put(*dx)
                dx = dx.rows
        if plan.gather is not None and dx is not None:  # the permute's backward: each token's rows summed
            dx = PERMUTE.pick("permute_rows_backward", dx)(dx, plan.gather.row_id_map)
        return None, dx if needs.x else None, None, dw, dbias, dscales, dprobs


def grouped_linear(x: torch.Tensor, split_sizes: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   scales: torch.Tensor | None = None, quantizers: dict | None = None,
                   path: GroupedPath | str = GroupedPath.GROUPED, wgrad_sink: list | None = None,
                   quantized_input: QuantizedTensor | None = None,
                   input_activation: tuple | None = None, recompute_activation: bool = False, *,
                   input_amax: torch.Tensor | None = None, grad_output_amax: AmaxSlot | None = None,
                   grad_input_amax: AmaxSlot | None = None, weight_cache: BoundWeightCache | None = None,
                   recompute_weight_columnwise: bool = False, unpermute: RowIdMap | None = None) -> torch.Tensor:
    """y [R, N] = grouped x [R, K] @ weight[g]^T (+ bias[g] (* scales[row])).

    x may be the `GatheredRows` of `moe_permute(..., gather=True)`: under quantizers on the grouped
    path (without quantized_input or input_activation) the input's quantize kernels read each row
    from its token, and x's gradient goes to the tokens through the permute's backward; elsewhere
    the rows are copied first (`gathered_rows`). The same results and gradients bit for bit.

    unpermute: the `RowIdMap` of the permute that made x's rows: the output is
    `moe_unpermute(y, unpermute)` [T, N] (each token's rows summed, no merging probs; the
    combine of an MoE layer whose probs scale the experts' activations). Under quantizers on the
    grouped path it runs inside the op, whose backward quantizes the output gradient's rows
    gathered from the tokens' gradient (the [R, N] copy the unpermute's backward writes is never
    made; a current-scaling quantizer's amax comes from the tokens' rows); elsewhere
    `moe_unpermute` runs after the op. The same results and gradients bit for bit.

    split_sizes: [E] int on x's device; rows past their sum join the last group (absorb_tail).
    weight: [E, N, K]; bias: [E, N] or None; scales: [R] per-row bias scale or None.
    quantizers: {"input", "weight", "grad_output"} from the active recipe, or None (high precision).
    path: "grouped" or "split" (`GroupedPath`). wgrad_sink: a list to defer weight gradients into
    (callables returning [E, N, K] in the weight's dtype or fp32); None computes them in backward.
    quantized_input: x's rows already quantized rowwise (`Quantizer.quantize_for_dispatch`, e.g.
    before an expert-parallel all-to-all), used by the forward GEMM instead of quantizing x;
    x still takes the gradient, and the weight gradient's columnwise copy is quantized from x's
    values (pass the dequantized rows as x). Needs `quantizers`.
    input_activation: (activation, probs, glu_interleave_size): x is h ([R, 2K] for GLU
    activations, [R, K] otherwise) and the input is `expert_activation(h, probs, activation,
    glu_interleave_size)`; fused into the input's quantization on the grouped path with
    quantizers (see the module docstring). h and probs get their gradients.
    recompute_activation: with input_activation, keep only h and probs for the backward, which
    rebuilds the weight gradient's input operand (act(h) * probs, quantized columnwise under a
    recipe) from them instead of keeping it: less memory held between forward and backward, one
    more activation (and quantization) in the backward, the same gradients bit for bit.
    weight_cache: `WeightCache.bind(the weight's parameters)`: the quantized weights are kept
    there and reused while nothing that decides their bits changes (`qmoe.quant.weight_cache`);
    the grouped path under a recipe only. The same outputs and gradients bit for bit.
    recompute_weight_columnwise: keep the weight (a parameter: no memory) for the backward instead
    of its quantized columnwise copy, which dgrad's backward quantizes again with the forward's
    scales: one weight copy less held between forward and backward, one more (columnwise)
    weight quantization in the backward, the same gradients bit for bit.

    Amaxes from the kernels that produce the operands, for a current-scaling quantizer
    (`Quantizer.takes_amax`) on the grouped path, which then only casts (same bits):
    input_amax: [E] fp32, x's per-group amax (`moe_permute(..., with_amax=True)`; the groups
    are split_sizes', the tail rows past their sum zeros). grad_output_amax: an `AmaxSlot` that
    dy's producer fills in the backward (`moe_unpermute(..., grad_amax=slot)`, or another
    grouped_linear's grad_input_amax). grad_input_amax: an `AmaxSlot` this op's backward fills
    with x's gradient and its per-group amax, with input_activation (the activation backward
    reduces it): pass it as the grad_output_amax of the layer that produced x (h).
    Elsewhere (split path, other quantizers) they are ignored.
    """
    check_flag("recompute_activation", recompute_activation, "grouped_linear")
    check_flag("recompute_weight_columnwise", recompute_weight_columnwise, "grouped_linear")
    if weight_cache is not None and not isinstance(weight_cache, BoundWeightCache):
        raise TypeError(f"weight_cache must come from WeightCache.bind(parameters), got {type(weight_cache).__name__}")
    if recompute_activation and input_activation is None:
        raise ValueError("recompute_activation=True needs input_activation: it recomputes the input's activation")
    if unpermute is not None:
        if not isinstance(unpermute, RowIdMap):
            raise TypeError(f"unpermute must be the RowIdMap moe_permute returned, got {type(unpermute).__name__}")
        if grad_output_amax is not None:
            raise ValueError("unpermute and grad_output_amax exclude each other: the output gradient comes from "
                             "the unpermute inside the op, which reduces its amax itself")
    path = parse_grouped_path(path)
    if path not in PATHS:
        raise ValueError(f"path must be 'grouped' or 'split' (resolve 'auto' with select_grouped_path), "
                         f"got {path.value!r}")
    strategy = PATHS[path]
    gather = None
    if isinstance(x, GatheredRows):
        if x.row_id_map is None:
            raise TypeError("a GatheredRows input needs its row_id_map (moe_permute(..., gather=True) gives it): "
                            "its gradient goes back to the tokens through the permute's backward")
        if quantizers is not None and strategy.kind is GroupedPath.GROUPED and quantized_input is None \
                and input_activation is None:  # the quantize kernels gather as they load
            gather, x = x._replace(source=None), x.source
        else:  # the rows themselves: nothing here reads them as gathered
            x = gathered_rows(x)
    rows = x if gather is None else gather._replace(source=x)
    if unpermute is not None and (unpermute.num_rows != rows.shape[0] or unpermute.rows.device != x.device):
        raise ValueError(f"unpermute's RowIdMap holds {unpermute.num_rows} permuted rows on {unpermute.rows.device}, "
                         f"x {rows.shape[0]} rows on {x.device}: pass the RowIdMap of the permute that made x")
    # the split path reads the sizes anyway; device sizes on the grouped path stay unread (no host
    # sync) and are trusted
    check_split_sizes(split_sizes, device=x.device, num_rows=rows.shape[0],
                      read="always" if path is GroupedPath.SPLIT else "host", max_rows=True)
    _check_amax_args(x, split_sizes, input_amax, grad_output_amax, grad_input_amax, input_activation)
    if quantized_input is not None:
        if quantizers is None:
            raise ValueError("quantized_input needs a recipe's quantizers (run inside qmoe.autocast)")
        if not isinstance(quantized_input, QuantizedTensor) or quantized_input.shape_2d != tuple(x.shape):
            raise ValueError(f"quantized_input must be a QuantizedTensor of x's shape {tuple(x.shape)}, got "
                             f"{getattr(quantized_input, 'shape', type(quantized_input).__name__)}")
    activation = probs = glu = None
    if input_activation is not None:
        activation, probs, glu = input_activation
        check_scaled_activation_args(x, probs, activation, glu)
        if quantized_input is not None:
            raise ValueError("input_activation and quantized_input exclude each other: FC2's input is computed here")
        fuses = quantizers is not None and strategy.fuses_input_activation
        if not (fuses or recompute_activation):  # nothing to fuse into and nothing to rebuild: it runs first
            x, probs, activation, glu = expert_activation(x, probs, activation, glu), None, None, None
        else:
            activation = parse_activation(activation)
    grad_rows = None  # the output gradient's rows as the backward's quantize kernels gather them
    if unpermute is not None and quantizers is not None and strategy.kind is GroupedPath.GROUPED:
        index = gather.index if gather is not None and gather.row_id_map is unpermute else permuted_sources(unpermute)
        grad_rows = GatheredRows(None, index, unpermute)
    plan = GroupedLinearPlan(strategy, quantizers, quantized_input=quantized_input, activation=activation,
                             glu_interleave_size=glu, wgrad_sink=wgrad_sink, recompute_activation=recompute_activation,
                             input_amax=input_amax, grad_output_amax=grad_output_amax,
                             grad_input_amax=grad_input_amax if activation is not None else None,
                             weight_cache=weight_cache, recompute_weight_columnwise=recompute_weight_columnwise,
                             grad_enabled=torch.is_grad_enabled(), gather=gather, unpermute=grad_rows)
    if scales is not None and scales is probs:  # FC2's bias scaled by the probs it activates with
        scales = scales.view_as(scales)  # torch.compile refuses one tensor as two Function inputs
    y = GroupedLinearFunction.apply(plan, x, split_sizes, weight, bias, scales, probs)
    return moe_unpermute(y, unpermute) if unpermute is not None and grad_rows is None else y


def _check_amax_args(x, split_sizes, input_amax, grad_output_amax, grad_input_amax, input_activation) -> None:
    if input_amax is not None:
        if input_activation is not None:
            raise ValueError("input_amax and input_activation exclude each other: the input is computed here")
        check_group_amax("input_amax", input_amax, split_sizes.shape[0] if isinstance(split_sizes, torch.Tensor)
                         else len(split_sizes), x.device)
    for name, slot in (("grad_output_amax", grad_output_amax), ("grad_input_amax", grad_input_amax)):
        if slot is not None and not isinstance(slot, AmaxSlot):
            raise TypeError(f"{name} must be an AmaxSlot or None, got {type(slot).__name__}")
