"""Recipes to and from config files: dicts, JSON or YAML text, or a path to either.

Strings for enums are parsed here, once, at the boundary; everything inside qmoe sees enums.
"""
from __future__ import annotations

import enum
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

from qmoe.contracts.formats import ScaleMode
from qmoe.recipes.recipe import RECIPES, Format, Recipe

_ENUMS = {"fp8_format": Format, "scale_mode": ScaleMode}


def _parse_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is in the test extra
        raise ValueError("this config is not JSON, and reading YAML needs PyYAML: pip install pyyaml") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"config is neither valid JSON nor valid YAML: {e}") from e


def load_config(source) -> Any:
    """A parsed config from a dict, a JSON/YAML string, or a path to a .json/.yaml file."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                    and os.path.splitext(source)[1].lower() in (".json", ".yaml", ".yml")):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        return _parse_text(path.read_text())
    if isinstance(source, str):
        return _parse_text(source)
    raise ValueError(f"a recipe config is a dict, a JSON/YAML string or a file path, got {type(source).__name__}")


def _parse_enum(enum_cls: type[enum.Enum], key: str, value):
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        for member in enum_cls:
            if value.lower() in (member.name.lower(), str(member.value).lower()):
                return member
    choices = ", ".join(repr(str(m.value)) for m in enum_cls)
    raise ValueError(f"config key {key!r}: invalid value {value!r}; expected one of {choices}")


def recipe_from_config(config) -> Recipe:
    """Build a recipe from `{"name": ..., **fields}` given as a dict, JSON/YAML text or a file path.

    >>> recipe_from_config({"name": "nvfp4", "disable_rht": True})
    NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=False, disable_2d_quantization=False,
                      align_size=128)
    """
    cfg = load_config(config)
    if not isinstance(cfg, dict):
        raise ValueError(f"a recipe config must be a mapping with a 'name' key, got {type(cfg).__name__}")
    cfg = dict(cfg)
    if "name" not in cfg:
        raise ValueError(f"recipe config has no 'name' key; expected one of {', '.join(RECIPES)}")
    name = cfg.pop("name")
    if name not in RECIPES:
        raise ValueError(f"unknown recipe name {name!r}; expected one of {', '.join(RECIPES)}")
    cls = RECIPES[name]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(map(repr, unknown))} for recipe {name!r}; "
                         f"valid keys: {', '.join(sorted(known))}")
    kwargs = {k: _parse_enum(_ENUMS[k], k, v) if k in _ENUMS else v for k, v in cfg.items()}
    return cls(**kwargs)


def recipe_to_config(recipe: Recipe) -> dict:
    """The dict (JSON/YAML-ready: enums as strings) that `recipe_from_config` turns back into `recipe`."""
    if not isinstance(recipe, Recipe) or type(recipe).config_name not in RECIPES:
        raise ValueError(f"not a qmoe recipe: {recipe!r}")
    out = {"name": type(recipe).config_name}
    for f in fields(recipe):
        v = getattr(recipe, f.name)
        out[f.name] = v.value if isinstance(v, enum.Enum) else v
    return out
