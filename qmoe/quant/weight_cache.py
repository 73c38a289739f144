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

Not consulted at all (every call quantizes, nothing is stored) where a kept result could
differ from a fresh quantize or could not be kept:
- inside a CUDA-graph capture: a capture that read kept weights would bake them into every
  replay, whatever the weights are then; the captured quantize runs at each replay instead. A
  cache that has seen a capture drops its entry and stays off: replays (of an optimizer step,
  of a region exit) change weights and scales without bumping the version counters;
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

import copy
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from qmoe.quant.grouped import GroupedTensor
from qmoe.quant.quantizer import Quantizer


def _fingerprint(t: torch.Tensor) -> tuple:
    """What a tensor's contents are known by without reading them (version counter and layout)."""
    return (t._version, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


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


class WeightCache:
    """One module's quantized weights, reused until the weights, the quantizer or its scale change.

    >>> cache = WeightCache()
    >>> w = cache.bind([layer.weight]).quantize(layer.weight, quantizer, rowwise=True, columnwise=True,
    ...                                          fresh=lambda r, c: quantize_weights(layer.weight, quantizer, r, c))
    """

    def __init__(self):
        self._entry: _Entry | None = None
        self.captured = False  # saw a CUDA-graph capture: off for good (see the module docstring)

    def bind(self, sources) -> "BoundWeightCache":
        """This cache for one call whose weight is made from `sources` (the module's Parameters)."""
        return BoundWeightCache(self, tuple(sources))

    def clear(self) -> None:
        """Drop the kept weights (after writes the version counters do not see, or to free the memory)."""
        self._entry = None

    @property
    def kept(self) -> GroupedTensor | None:
        """The kept quantized weights, or None."""
        return self._entry.result if self._entry is not None else None

    def nbytes(self) -> int:
        """Bytes of the kept quantized weights (data, scales, amaxes and bf16 copies)."""
        gt = self.kept
        if gt is None:
            return 0
        tensors = [getattr(gt, name) for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                                                   "columnwise_scale_inv", "amax", "columnwise_amax")]
        tensors += list((gt.bf16_copies or {}).values())
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def quantize(self, sources: tuple, weight: torch.Tensor, quantizer: Quantizer, rowwise: bool, columnwise: bool,
                 fresh: Callable[[bool, bool], GroupedTensor]) -> GroupedTensor:
        """The weights quantized as `fresh(rowwise, columnwise)` would quantize them: kept, or made (and kept)."""
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

    def _usable(self, sources, weight) -> bool:
        if self.captured or torch.compiler.is_compiling():
            return False
        if _capturing():
            self.captured, self._entry = True, None
            return False
        return bool(sources) and not weight.is_inference() and not any(s.is_inference() for s in sources)

    @staticmethod
    def _matches(e: _Entry, sources, prints, shape, quantizer, key, inference: bool) -> bool:
        return (e.quantizer is quantizer and e.prints == prints and e.weight == shape
                and (inference or not e.inference) and len(e.sources) == len(sources)
                and all(ref() is s for ref, s in zip(e.sources, sources)) and _same_key(e.key, key))

    # a copied or pickled module starts with an empty cache: the kept tensors belong to the original's weights
    def __getstate__(self):
        return {"_entry": None, "captured": self.captured}

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new._entry = None
        return new

    def __repr__(self) -> str:
        return f"WeightCache(kept={self.kept is not None}, captured={self.captured})"


def clear_weight_caches(module: torch.nn.Module) -> None:
    """Drop the kept weights of `module` and of every module inside it (their `weight_cache`)."""
    for m in module.modules():
        cache = getattr(m, "weight_cache", None)
        if isinstance(cache, WeightCache):
            cache.clear()


@dataclass(frozen=True)
class BoundWeightCache:
    """A `WeightCache` with the weights of one call (`WeightCache.bind`); what `grouped_linear` takes."""

    cache: WeightCache
    sources: tuple

    def quantize(self, weight, quantizer, rowwise, columnwise, fresh) -> GroupedTensor:
        return self.cache.quantize(self.sources, weight, quantizer, rowwise, columnwise, fresh)
