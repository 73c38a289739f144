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


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"config key {k!r} is given twice; keep one")
        out[k] = v
    return out


def _yaml_loader():
    """PyYAML's safe loader, refusing duplicate keys (which it would resolve to the last silently) and
    reading 1e-3 as the number it is (YAML 1.1 wants a dot in a float: 1.0e-3)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"config key {key!r} is given twice (line {key_node.start_mark.line + 1}); keep one")
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                           lambda loader, node: dict(mapping(loader, node, deep=True)))
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
                                 list("-+0123456789."))
    return Loader


def _parse_text(text: str) -> Any:
    stripped = text.lstrip()
    # '{"' opens JSON (YAML's flow style {name: block} does not quote): report JSON's error rather
    # than let YAML accept what JSON refuses (a trailing comma, say)
    looks_json = stripped[:1] in ("{", "[") and stripped[1:].lstrip()[:1] in ('"', "{", "]", "}")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        if looks_json:
            raise ValueError(f"config is not valid JSON: {e}") from None
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is in the test extra
        raise ValueError("this config is not JSON, and reading YAML needs PyYAML: pip install pyyaml") from e
    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ValueError(f"config is neither valid JSON nor valid YAML: {e}") from None


_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


def load_config(source) -> Any:
    """A parsed config from a dict, a JSON/YAML string, or a path to a .json/.yaml/.yml file."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str) and "\n" not in source and not source.lstrip().startswith(("{", "[")):
        ext = os.path.splitext(source)[1].lower()
        if ext in _CONFIG_SUFFIXES or (ext and ":" not in source):  # one line naming a file: a path
            source = Path(source)
    if isinstance(source, Path):
        if source.suffix.lower() not in _CONFIG_SUFFIXES:
            raise ValueError(f"config file {str(source)!r}: use a .json, .yaml or .yml file")
        if not source.is_file():
            raise ValueError(f"config file {str(source)!r} does not exist")
        return _parse_text(source.read_text())
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
    if not isinstance(name, str) or name not in RECIPES:
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
