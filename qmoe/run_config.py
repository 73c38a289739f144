"""The config file `qmoe compare` and `qmoe report` share, and their `--device`, checked before any work.

One schema for both commands, so one file drives either:

    recipes: [bf16, mxfp8, {name: nvfp4, disable_rht: true}]   # names or recipe mappings
    shape: {tokens: 512, hidden: 256, ffn: 512, experts: 8, top_k: 2}
    seed: 0
    steps: 3

- `recipes`: a non-empty list; each entry is "fp32", "bf16", a recipe name (delayed, current,
  block, mxfp8, nvfp4) or a `recipe_from_config` mapping. `report` quantizes tensors, so it skips
  the high-precision entries.
- `shape` (also accepted under its older name `shapes`, not both): any of tokens, hidden, ffn,
  experts, top_k, positive integers. `report` reads tokens, hidden and ffn. A dimension must suit
  the chosen recipes only (NVFP4 quantizes 16-value blocks: hidden and ffn, and for `report` tokens,
  must be multiples of 16 when NVFP4 is chosen).
- `seed`: an integer >= 0. `steps` (`compare` only; `report` ignores it): timed steps, >= 1.

Every error is a ValueError naming the key, raised while the file is read.
"""
from __future__ import annotations

from pathlib import Path

import torch

from qmoe.recipes import NVFP4BlockScaling, Recipe, recipe_from_config
from qmoe.recipes.config import load_config
from qmoe.recipes.recipe import RECIPES

HIGH_PRECISION_NAMES = ("fp32", "bf16")
CONFIG_KEYS = ("recipes", "shape", "seed", "steps")
SHAPE_KEYS = ("tokens", "hidden", "ffn", "experts", "top_k")
_NVFP4_BLOCK = 16


def parse_recipe(entry):
    """A config's recipe entry -> "fp32" / "bf16" or a Recipe."""
    if isinstance(entry, Recipe):
        return entry
    name = entry if isinstance(entry, str) else entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str) or (name not in HIGH_PRECISION_NAMES and name not in RECIPES):
        what = f"unknown recipe name {name!r}" if isinstance(name, str) else f"unknown entry {entry!r}"
        raise ValueError(f"config key 'recipes': {what}; expected a name "
                         f"({', '.join([*HIGH_PRECISION_NAMES, *RECIPES])}) or a mapping with one")
    if name in HIGH_PRECISION_NAMES:
        if isinstance(entry, dict) and len(entry) > 1:
            raise ValueError(f"config key 'recipes': {name!r} takes no other keys, got {sorted(entry)}")
        return name
    return recipe_from_config({"name": entry} if isinstance(entry, str) else entry)


def check_shape(shape, recipes=(), dims_quantized=("hidden", "ffn")) -> dict:
    """Validate a shape mapping for the chosen recipes; `dims_quantized` are the dimensions a
    16-value NVFP4 block runs along (report adds tokens: it quantizes the columnwise copy too)."""
    if not isinstance(shape, dict):
        raise ValueError(f"config key 'shape' must be a mapping with keys {', '.join(SHAPE_KEYS)}, got {shape!r}")
    bad = sorted(set(shape) - set(SHAPE_KEYS))
    if bad:
        raise ValueError(f"config key 'shape': unknown shape key(s) {bad}; valid: {', '.join(SHAPE_KEYS)}")
    for k, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config key 'shape': {k}={v!r} must be a positive integer")
    top_k, experts = shape.get("top_k"), shape.get("experts")
    if top_k is not None and experts is not None and top_k > experts:
        raise ValueError(f"config key 'shape': top_k={top_k} exceeds experts={experts}")
    if any(isinstance(r, NVFP4BlockScaling) for r in recipes):
        for k in dims_quantized:
            if k in shape and shape[k] % _NVFP4_BLOCK:
                raise ValueError(f"config key 'shape': {k}={shape[k]} must be a multiple of {_NVFP4_BLOCK} for "
                                 f"nvfp4 (it quantizes {_NVFP4_BLOCK}-value blocks along it); leave nvfp4 out "
                                 f"of 'recipes' to run other sizes")
    return dict(shape)


def _check_int(key, v, minimum):
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"config key {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def load_run_config(source, default_recipes=None, dims_quantized=("hidden", "ffn")) -> dict:
    """Read and check a config (path, text or dict) -> {recipes?, shape?, seed?, steps?}.

    The shape is checked against the config's recipes, or `default_recipes` when it names none.
    """
    cfg = load_config(source)
    if not isinstance(cfg, dict):
        raise ValueError(f"a config is a mapping with optional keys {', '.join(CONFIG_KEYS)}, got "
                         f"{type(cfg).__name__}")
    if "shapes" in cfg:
        if "shape" in cfg:
            raise ValueError("config keys 'shape' and 'shapes' name the same thing; give one ('shape')")
        cfg = {("shape" if k == "shapes" else k): v for k, v in cfg.items()}
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid: {', '.join(CONFIG_KEYS)}")
    out = {}
    if "recipes" in cfg:
        if not isinstance(cfg["recipes"], list) or not cfg["recipes"]:
            raise ValueError(f"config key 'recipes' must be a non-empty list of recipe names or {{name: ...}} "
                             f"mappings, got {cfg['recipes']!r}")
        out["recipes"] = [parse_recipe(e) for e in cfg["recipes"]]
    if "shape" in cfg:
        chosen = out.get("recipes", default_recipes or ())
        out["shape"] = check_shape(cfg["shape"], [r for r in chosen if isinstance(r, Recipe)], dims_quantized)
    if "seed" in cfg:
        out["seed"] = _check_int("seed", cfg["seed"], 0)
    if "steps" in cfg:
        out["steps"] = _check_int("steps", cfg["steps"], 1)
    return out


def parse_device(device, flag: str = "--device") -> torch.device:
    """`--device` -> a usable torch.device (default: cuda if available, else cpu); ValueError naming
    the flag for a name torch does not know, CUDA on a machine without it, or a missing GPU index."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{flag} {device!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} {device!r}: qmoe runs on cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {device!r}: this machine (or this torch build) has no CUDA device; "
                             f"use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {device!r}: there are {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered from 0")
    return dev


def check_output_path(path, flag: str) -> None:
    """An output file's folder must exist before the run starts (not after it, with a traceback)."""
    if path is None:
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: folder {str(folder)!r} does not exist")
