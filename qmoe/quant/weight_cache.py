"""Quantized weights kept from one forward to the next while nothing that decides their bits changes.

A layer trained with gradient accumulation runs several micro-batches per optimizer step, and
activation checkpointing runs each forward twice: every one of those forwards quantizes the
same weights into the same bits. A `WeightCache` keeps one layer's quantized weights (the
rowwise copy for fprop, the columnwise copy for dgrad, one GroupedTensor) and hands them back
while the bits of a fresh quantize could not differ. A kept result is reused when:

- the weights are the same tensors (held by weak reference), with the same version (autograd's
  in-place counter, `Tensor._version`: an optimizer step, `load_state_dict`, any `copy_` under
  no_grad bumps it), storage address, dtype, shape, strides and device;
- the quantizer is the same object (a module keeps one per recipe, `RecipeState`) and its
  `Quantizer.reuse_key` is unchanged: nothing for the stateless formats, the weight amax
  reduction group for current scaling, the scale tensor and its version for delayed scaling;
- the kept result holds every orientation asked for.

Delayed scaling: the scale a weight is quantized with is the slot's, and the slot's history
rolls and its scale is rewritten (its version bumped) whenever the outermost `qmoe.autocast`
region exits. Whether the new scale has the same value is known only on the device, so the
next region's forward quantizes again: weights are reused within one region (micro-batches
accumulated inside one `qmoe.autocast`) and never across a scale update. A reuse redoes the
quantize call's side effect, recording the weight's amax (`Quantizer.reuse_replay`), so the
amax histories are those of a run without the cache.

CUDA graphs: a capture that read kept weights would bake them into every replay, whatever the
weights are then, so inside a plain capture the cache is not consulted (the captured quantize
runs at each replay). A cache that has seen a capture drops its eager entry and stays off
outside captures: replays (of an optimizer step, of a region exit) change weights and scales
without bumping the version counters. Gradient accumulation under graphs keeps the weights
with two captures of the same step (`capture_weights`, which `qmoe.graph.capture(...,
keep_weights=True)` drives):
- one under `capture_weights("keep")`: its quantize is captured and its result kept, so every
  replay of that graph quantizes the weights of its time into the kept buffers;
- others under `capture_weights("reuse")`: they read those buffers instead of quantizing (and,
  for delayed scaling, record the kept weights' amax, as the eager reuse does).
Replay the "keep" graph for the first micro-batch after every change of the weights (an
optimizer step, a load) or of the quantizer's scale (a delayed-scaling update, at the exit of
the outermost `qmoe.autocast` region: `WeightCache.graph_stamp` tells), the "reuse" graphs
after it. So delayed scaling reuses only within one region that spans the micro-batches.

Not consulted at all (every call quantizes, nothing is stored) where a kept result could
differ from a fresh quantize or could not be kept:
- inside a CUDA-graph capture outside `capture_weights` (above);
- in compiled code (torch.compile), which cannot hold this state;
- in delayed scaling's recompute (`qmoe.checkpoint`), which quantizes with the first run's
  scale from the `ForwardLog`;
- for weights that are inference tensors (they keep no version counter).

What it cannot see: writes that bypass the version counter: through `.data`, into a flat buffer
the parameters are views of, by the replay of a captured optimizer step, and parameter sharding
that refills the weights at every forward (FSDP2's `fully_shard`, ZeRO-3: the unsharded weight
is the same tensor, its version unchanged, its storage refilled, at an address that may repeat).
After such writes call `clear()` (`clear_weight_caches(model)`), at least after every optimizer
step, or leave the cache off (the modules' `cache_quantized_weights` is off by default).

Memory: one entry per cache. A miss drops the entry before it quantizes, so the cache never
holds two copies; a forward that hits saves the kept columnwise copy for its backward instead
of a copy of its own. The rowwise copy, freed after fprop without the cache, stays held.
"""
from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from qmoe.contracts.scales import gemm_scale
from qmoe.quant.grouped import GroupedTensor
from qmoe.quant.quantizer import Quantizer


def _layout(t: torch.Tensor) -> tuple:
    """Where and how a tensor's values lie (storage address, dtype, shape, strides, device)."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


def _fingerprint(t: torch.Tensor) -> tuple:
    """What a tensor's contents are known by without reading them (version counter and layout)."""
    return (t._version,) + _layout(t)


def _same_key(a: tuple, b: tuple) -> bool:
    """Reuse keys compare numbers by value and everything else (tensors, process groups) by identity."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, (bool, int, float, str)) and isinstance(y, (bool, int, float, str)):
            if type(x) is not type(y) or x != y:
                return False
        elif x is not y:
            return False
    return True


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Role:
    """One `capture_weights` region: kept results remember the "keep" region they were made in."""

    def __init__(self, keep: bool):
        self.keep = keep


_ROLES: list[_Role] = []
CAPTURE_ROLES = ("keep", "reuse")


@contextlib.contextmanager
def capture_weights(role: str):
    """CUDA-graph captures inside this region keep ("keep") or reuse ("reuse") quantized weights.

    Under "keep", each weight cache consulted quantizes inside the capture and keeps that result:
    its buffers belong to the graph, and every replay rewrites them with the weights of its time.
    Under "reuse", each cache hands back what a "keep" capture kept (the graph reads those
    buffers), or quantizes inside the capture where it has none for these weights. Replay the
    "keep" graph first after every change of the weights or of a delayed-scaling scale (see the
    module docstring), the "reuse" graphs after it.

    >>> with capture_weights("keep"), torch.cuda.graph(first):
    ...     step()
    >>> with capture_weights("reuse"), torch.cuda.graph(later):
    ...     step()
    >>> first.replay(); later.replay(); later.replay(); optimizer.step()
    """
    if role not in CAPTURE_ROLES:
        raise ValueError(f"capture_weights(role={role!r}): role must be one of {CAPTURE_ROLES}")
    entry = _Role(keep=role == "keep")
    _ROLES.append(entry)
    try:
        yield
    finally:
        _ROLES.remove(entry)


@dataclass
class _Entry:
    sources: tuple  # weak references to the weights the result was quantized from
    prints: tuple  # their fingerprints then
    weight: tuple  # dtype, shape, device of the tensor handed to the quantizer
    quantizer: Quantizer
    key: tuple
    inference: bool  # made under torch.inference_mode: usable there only
    result: GroupedTensor
    replay: Callable[[], None] | None
    role: _Role | None = None  # the `capture_weights("keep")` region a captured result was kept in


class WeightCache:
    """One module's quantized weights, reused until the weights, the quantizer or its scale change.

    >>> cache = WeightCache()
    >>> w = cache.bind([layer.weight]).quantize(layer.weight, quantizer, rowwise=True, columnwise=True,
    ...                                          fresh=lambda r, c: quantize_weights(layer.weight, quantizer, r, c))
    """

    def __init__(self):
        self._entry: _Entry | None = None
        self._graph_entry: _Entry | None = None  # kept by a capture_weights("keep") capture
        self.captured = False  # saw a CUDA-graph capture: off for good outside captures
        self.clears = 0  # calls of clear(): the weights changed where no version counter shows it

    def bind(self, sources) -> "BoundWeightCache":
        """This cache for one call whose weight is made from `sources` (the module's Parameters)."""
        return BoundWeightCache(self, tuple(sources))

    def clear(self) -> None:
        """Drop the kept weights (after writes the version counters do not see, or to free the memory).

        A graph's kept buffers stay (the graph writes them at each replay); `clears` counts the
        calls, so a replayer knows to replay its "keep" graph next (`qmoe.graph.capture`)."""
        self._entry = None
        self.clears += 1

    @property
    def kept(self) -> GroupedTensor | None:
        """The kept quantized weights, or None."""
        return self._entry.result if self._entry is not None else None

    @property
    def kept_for_graphs(self) -> GroupedTensor | None:
        """The quantized weights a `capture_weights("keep")` capture kept, or None."""
        return self._graph_entry.result if self._graph_entry is not None else None

    def nbytes(self) -> int:
        """Bytes of the kept quantized weights (data, scales, amaxes and bf16 copies), graphs' included."""
        total = 0
        for gt in (self.kept, self.kept_for_graphs):
            if gt is None:
                continue
            tensors = [gt.rowwise_data, gemm_scale(gt, False), gt.columnwise_data, gemm_scale(gt, True), gt.amax,
                       gt.columnwise_amax]
            tensors += list((gt.bf16_copies or {}).values())
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return total

    def quantize(self, sources: tuple, weight: torch.Tensor, quantizer: Quantizer, rowwise: bool, columnwise: bool,
                 fresh: Callable[[bool, bool], GroupedTensor]) -> GroupedTensor:
        """The weights quantized as `fresh(rowwise, columnwise)` would quantize them: kept, or made (and kept)."""
        if torch.compiler.is_compiling():
            return fresh(rowwise, columnwise)
        if _capturing():
            self.captured, self._entry = True, None
            return self._in_capture(sources, weight, quantizer, rowwise, columnwise, fresh)
        if not self._usable(sources, weight):
            return fresh(rowwise, columnwise)
        key = quantizer.reuse_key(weight.device, weight.shape[0])
        if key is None:
            return fresh(rowwise, columnwise)
        prints = tuple(_fingerprint(s) for s in sources)
        shape = (weight.dtype, tuple(weight.shape), weight.device)
        inference = torch.is_inference_mode_enabled()
        e = self._entry
        if e is not None and self._matches(e, sources, prints, shape, quantizer, key, inference) \
                and (e.result.rowwise_data is not None or not rowwise) \
                and (e.result.columnwise_data is not None or not columnwise):
            if e.replay is not None:
                e.replay()
            return e.result
        self._entry = None  # never two copies: the old one goes before the new one is made
        result = fresh(rowwise, columnwise)
        result.bf16_copies = {}  # the emulated GEMMs' dequantize-first route keeps its bf16 weights here
        self._entry = _Entry(tuple(weakref.ref(s) for s in sources), prints, shape, quantizer, key, inference,
                             result, quantizer.reuse_replay())
        return result

    def _in_capture(self, sources, weight, quantizer, rowwise, columnwise, fresh) -> GroupedTensor:
        """Inside a CUDA-graph capture: keep or reuse under `capture_weights`, else quantize."""
        role = _ROLES[-1] if _ROLES else None
        if role is None or not self._storable(sources, weight):
            return fresh(rowwise, columnwise)
        key = quantizer.reuse_key(weight.device, weight.shape[0])
        if key is None:
            return fresh(rowwise, columnwise)
        layouts = tuple(_layout(s) for s in sources)  # versions move between replays unseen: not compared
        shape = (weight.dtype, tuple(weight.shape), weight.device)
        e = self._graph_entry
        hit = (e is not None and self._matches(e, sources, layouts, shape, quantizer, key, False)
               and (e.result.rowwise_data is not None or not rowwise)
               and (e.result.columnwise_data is not None or not columnwise))
        if not role.keep:
            if not hit:
                return fresh(rowwise, columnwise)
            if e.replay is not None:  # delayed scaling: the reuse graph records the kept weights' amax
                e.replay()
            view = copy.copy(e.result)  # a reuse graph's own bf16 copies stay its own: never kept
            view.bf16_copies = dict(e.result.bf16_copies)
            return view
        if hit and e.role is role:  # kept in this region already (a checkpoint's recompute, a second call)
            if e.replay is not None:
                e.replay()
            return e.result
        self._graph_entry = None
        result = fresh(rowwise, columnwise)
        result.bf16_copies = {}
        self._graph_entry = _Entry(tuple(weakref.ref(s) for s in sources), layouts, shape, quantizer, key, False,
                                   result, quantizer.reuse_replay(), role)
        return result

    def graph_stamp(self) -> tuple:
        """What the quantizer of the graphs' kept weights is known by on the host now (its reuse key:
        numbers by value, tensors and groups by identity). A delayed-scaling update changes it: a
        replayer then replays the "keep" graph, whose quantize reads the new scale."""
        e = self._graph_entry
        if e is None:
            return ()
        _, shape, device = e.weight
        key = e.quantizer.reuse_key(device, shape[0])
        return tuple(v if isinstance(v, (bool, int, float, str)) else id(v) for v in key or ())

    def _usable(self, sources, weight) -> bool:
        return not self.captured and self._storable(sources, weight)

    @staticmethod
    def _storable(sources, weight) -> bool:
        return bool(sources) and not weight.is_inference() and not any(s.is_inference() for s in sources)

    @staticmethod
    def _matches(e: _Entry, sources, prints, shape, quantizer, key, inference: bool) -> bool:
        return (e.quantizer is quantizer and e.prints == prints and e.weight == shape
                and (inference or not e.inference) and len(e.sources) == len(sources)
                and all(ref() is s for ref, s in zip(e.sources, sources)) and _same_key(e.key, key))

    # a copied or pickled module starts with an empty cache: the kept tensors belong to the original's weights
    def __getstate__(self):
        return {"_entry": None, "_graph_entry": None, "captured": self.captured, "clears": self.clears}

    def __setstate__(self, state):
        self.__init__()
        self.__dict__.update(state)

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new._entry = new._graph_entry = None
        return new

    def __repr__(self) -> str:
        return (f"WeightCache(kept={self.kept is not None}, kept_for_graphs={self.kept_for_graphs is not None}, "
                f"captured={self.captured})")


def weight_caches(module: torch.nn.Module) -> list[WeightCache]:
    """The `weight_cache` of `module` and of every module inside it."""
    return [m.weight_cache for m in module.modules() if isinstance(getattr(m, "weight_cache", None), WeightCache)]


def clear_weight_caches(module: torch.nn.Module) -> None:
    """Drop the kept weights of `module` and of every module inside it (their `weight_cache`)."""
    for cache in weight_caches(module):
        cache.clear()


@dataclass(frozen=True)
class BoundWeightCache:
    """A `WeightCache` with the weights of one call (`WeightCache.bind`); what `grouped_linear` takes."""

    cache: WeightCache
    sources: tuple

    def quantize(self, weight, quantizer, rowwise, columnwise, fresh) -> GroupedTensor:
        return self.cache.quantize(self.sources, weight, quantizer, rowwise, columnwise, fresh)
