"""Whole Hugging Face models: swap every supported MoE block for a qmoe layer, and back.

`convert` keeps what the decoder layer expects from the block it replaces (found by calling the
original block once on a one-token input): a tensor (transformers 5.x; and DeepSeek-V3 in 4.x)
or a pair (4.x Mixtral / Qwen: the router logits, which the decoder collects for the
load-balancing loss; gpt-oss: router scores, which its decoder discards, so None). Recent
transformers record router logits with a forward hook on the class named in the model's
`_can_record_outputs["router_logits"]` (the router class in 5.x, the block class in late 4.x);
the wrapper keeps a `RouterLogitsTap` that is an instance of that class, called with the qmoe
router's logits, so `output_router_logits=True` and the HF auxiliary loss work unchanged.

The original block stays attached to its wrapper, its tensors moved to the meta device (no
memory); `restore` rebuilds it on the layer's device and writes the trained weights into it.

A converted model pickles (`torch.save(model)`, `copy.deepcopy`): the tap's class, made at run
time, pickles as the HF class it extends; and transformers' recording hooks, closures that pickle
cannot take, are dropped from the model when it is pickled and marked uninstalled, so transformers
installs them again at the next forward that records outputs (of the saved copy and of the
original alike).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from qmoe.hf.blocks import FAMILIES, family_of, from_hf, router_of, to_hf, unsupported
from qmoe.nn.moe import MoELayer


class RouterLogitsTap(nn.Module):
    """Returns its input (the router logits [T, E]) at every index of a tuple, so that transformers'
    output-recording hook (on the class this tap is made an instance of) sees them at any index."""

    def __init__(self, width: int):
        nn.Module.__init__(self)  # never the HF router's __init__: no parameters of its own
        self.width = width

    def forward(self, logits: torch.Tensor):
        return (logits,) * self.width

    def __reduce_ex__(self, protocol):
        # pickle finds classes by name and `_tap_class` makes this one at run time: name the HF class
        recorded = getattr(type(self), "_qmoe_recorded_class", None)
        if recorded is None:
            return super().__reduce_ex__(protocol)
        return _rebuild_tap, (recorded, self.width), self.__getstate__()


@functools.cache
def _tap_class(target: type) -> type:
    # A subclass of the recorded class (isinstance matches), with the tap's methods first.
    return type(f"{target.__name__}LogitsTap", (RouterLogitsTap, target), {"_qmoe_recorded_class": target})


def _rebuild_tap(target: type, width: int) -> RouterLogitsTap:
    return _tap_class(target)(width)


class HFMoEBlock(nn.Module):
    """A qmoe `MoELayer` in an HF decoder layer's place: `layer` holds the weights, `forward`
    returns what the original block returned (see the module docstring)."""

    def __init__(self, layer: MoELayer, block: nn.Module, returns: str, recorded: type | None = None):
        super().__init__()
        self.layer = layer
        self.family = family_of(block)
        self.returns = returns  # "tensor" | "logits" (pair with router logits) | "none" (pair with None)
        self.gate = _tap_class(recorded)(3) if recorded is not None else None
        # kept outside the module tree: not a parameter holder, not in state_dict
        self.__dict__["hf_block"] = block

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        y = self.layer(hidden_states)
        logits = self.layer.router.logits
        if self.gate is not None:
            self.gate(logits)
        if self.returns == "tensor":
            return y
        return y, (logits if self.returns == "logits" else None)


def _return_kind(block: nn.Module) -> str:
    """How the block's forward returns: "tensor", or a pair ("logits" or "none")."""
    family = family_of(block)
    param = next(block.parameters())
    with torch.no_grad():
        out = block(torch.zeros(1, 1, router_of(block).weight.shape[1], dtype=param.dtype, device=param.device))
    if isinstance(out, torch.Tensor):
        return "tensor"
    return "none" if family == "gpt_oss" else "logits"


def _is_output_capturing_hook(fn) -> bool:
    """A forward hook transformers installed to record outputs (a closure: pickle cannot take it)."""
    return (getattr(fn, "__module__", "") or "").startswith("transformers") \
        and "output_captur" in getattr(fn, "__qualname__", "")


def _drop_output_capturing_hooks(root: nn.Module) -> None:
    """Remove transformers' recording hooks under `root` (and from the HF blocks its wrappers keep)
    and mark them uninstalled, so transformers installs them again on the next recording forward."""
    modules = list(root.modules())
    for wrapper in [m for m in modules if isinstance(m, HFMoEBlock)]:
        modules.extend(wrapper.hf_block.modules())
        wrapper.__dict__["hf_router_hooked"] = False
    for module in modules:
        for key, fn in list(module._forward_hooks.items()):
            if _is_output_capturing_hook(fn):
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False


def _state_without_output_hooks(model: nn.Module) -> dict:
    """`model.__getstate__` for converted models: pickling starts here, before any submodule's hooks."""
    _drop_output_capturing_hooks(model)
    return nn.Module.__getstate__(model)


def _owner_recording_logits(model: nn.Module, name: str):
    """The innermost module above `name` that declares `_can_record_outputs` (an HF PreTrainedModel)."""
    owner = None
    for prefix, module in model.named_modules():
        if getattr(type(module), "_can_record_outputs", None) and (name.startswith(prefix + ".") or not prefix):
            owner = module
    return owner


def _recorded_class(owner) -> type | None:
    """The class whose outputs `owner` records as router logits (None if it records none)."""
    specs = (getattr(type(owner), "_can_record_outputs", None) or {}).get("router_logits") if owner else None
    for spec in specs if isinstance(specs, list) else [specs]:
        target = getattr(spec, "target_class", spec)
        if isinstance(target, type) and issubclass(target, nn.Module) and not getattr(spec, "layer_name", None):
            return target
    return None


def _hooks_installed(owner) -> bool:
    return owner is not None and bool(getattr(owner, "_output_capturing_hooks_installed", False))


def _install_router_logits_hook(owner, modules) -> None:
    """transformers installs its recording hooks once, on the first forward: a module that joins the
    model later (the tap at convert, the HF block at restore) gets its router-logits hook here."""
    target = _recorded_class(owner)
    if target is None or not _hooks_installed(owner):
        return
    from transformers.utils.output_capturing import install_output_capuring_hook  # 5.x, where hooks persist
    specs = type(owner)._can_record_outputs["router_logits"]
    index = next(getattr(s, "index", 0) for s in (specs if isinstance(specs, list) else [specs])
                 if getattr(s, "target_class", s) is target)
    for module in modules:
        if module is not None and isinstance(module, target):
            install_output_capuring_hook(module, "router_logits", index)


def convert(model: nn.Module) -> nn.Module:
    """Replace every supported MoE block of `model` (a transformers `PreTrainedModel`) in place.

    Each block becomes an `HFMoEBlock` wrapping `qmoe.hf.from_hf(block)`; the model's outputs
    (logits, loss, router logits and the HF auxiliary loss) are those of the original, now
    computed by qmoe, so `qmoe.autocast(recipe=...)` around the forward quantizes the experts.
    Returns the model. Raises `qmoe.UnsupportedError` if it holds no supported block.

    >>> model = qmoe.hf.convert(AutoModelForCausalLM.from_pretrained(path))
    >>> with qmoe.autocast(recipe=MXFP8BlockScaling()):
    ...     loss = model(input_ids, labels=input_ids).loss
    """
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in FAMILIES]
    if not targets:
        raise unsupported(type(model).__name__, "the model has no supported MoE block",
                          f"qmoe.hf converts {', '.join(FAMILIES)}")
    for name, block in targets:
        owner = _owner_recording_logits(model, name)
        wrapper = HFMoEBlock(from_hf(block), block, _return_kind(block), _recorded_class(owner))
        _install_router_logits_hook(owner, [wrapper.gate])
        wrapper.__dict__["hf_router_hooked"] = _hooks_installed(owner)  # the HF router has its hook
        block.to("meta")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)
        if owner is not None:
            owner.__dict__["__getstate__"] = functools.partial(_state_without_output_hooks, owner)
    # an instance attribute, so only this model (and a saved copy of it) changes how it pickles
    model.__dict__["__getstate__"] = functools.partial(_state_without_output_hooks, model)
    return model


def restore(model: nn.Module) -> nn.Module:
    """Put the original HF blocks back, holding the qmoe layers' (trained) weights. Returns the model.

    Afterwards the model is a plain transformers model again: `save_pretrained`, generation and
    HF tooling see the trained weights.
    """
    for name, wrapper in [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoEBlock)]:
        block = wrapper.hf_block
        block.to_empty(device=wrapper.layer.router.weight.device)
        to_hf(wrapper.layer, block)
        block.train(wrapper.training)
        if not wrapper.hf_router_hooked:
            _install_router_logits_hook(_owner_recording_logits(model, name), [block, *block.modules()])
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, block)
    for module in model.modules():  # and transformers' own pickling back
        if isinstance(module.__dict__.get("__getstate__"), functools.partial) \
                and module.__dict__["__getstate__"].func is _state_without_output_hooks:
            del module.__dict__["__getstate__"]
    return model
