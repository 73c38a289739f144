"""Recipes (NUMERICS.md "Recipes and what each tensor role gets") and their config files."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                          NVFP4BlockScaling, ScaleMode, recipe_from_config, recipe_to_config)

ROLES = ("input", "weight", "grad_output")
FP8_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)


# ---------------------------------------------------------------- fields and defaults

DEFAULTS = [
    pytest.param(DelayedScaling, dict(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024,
                                      amax_compute_algo="max", reduce_amax=True, align_size=16), id="delayed"),
    pytest.param(Float8CurrentScaling, dict(fp8_format=Format.HYBRID, power_2_scale=False, amax_epsilon=0.0,
                                            align_size=16), id="current"),
    pytest.param(Float8BlockScaling, dict(fp8_format=Format.E4M3, use_f32_scales=False, amax_epsilon=0.0,
                                          align_size=16), id="block"),
    pytest.param(MXFP8BlockScaling, dict(fp8_format=Format.E4M3, scale_mode=ScaleMode.ROUND_UP, align_size=32),
                 id="mxfp8"),
    pytest.param(NVFP4BlockScaling, dict(disable_rht=False, disable_stochastic_rounding=False,
                                         disable_2d_quantization=False, align_size=128), id="nvfp4"),
]


@pytest.mark.parametrize("cls, defaults", DEFAULTS)
def test_fields_and_defaults(cls, defaults):
    r = cls()
    assert {f.name: getattr(r, f.name) for f in dataclasses.fields(r)} == defaults
    assert isinstance(r.align_size, int)


@pytest.mark.parametrize("cls, defaults", DEFAULTS)
def test_align_size_can_be_overridden(cls, defaults):
    assert cls(align_size=64).align_size == 64
    smallest = cls().align_multiple()  # NVFP4's Hadamard runs need 16 rows; the FP8 recipes take any
    assert cls(align_size=smallest).align_size == smallest
    assert cls(align_size=64) != cls()


ELEMENT_FORMATS = [  # (recipe, expected element format name per role input/weight/grad_output)
    pytest.param(DelayedScaling(), ("E4M3", "E4M3", "E5M2"), id="delayed-hybrid"),
    pytest.param(DelayedScaling(fp8_format=Format.E4M3), ("E4M3", "E4M3", "E4M3"), id="delayed-e4m3"),
    pytest.param(Float8CurrentScaling(), ("E4M3", "E4M3", "E5M2"), id="current-hybrid"),
    pytest.param(Float8BlockScaling(), ("E4M3", "E4M3", "E4M3"), id="block"),
    pytest.param(MXFP8BlockScaling(), ("E4M3", "E4M3", "E4M3"), id="mxfp8"),
    pytest.param(MXFP8BlockScaling(fp8_format=Format.HYBRID), ("E4M3", "E4M3", "E5M2"), id="mxfp8-hybrid"),
    pytest.param(NVFP4BlockScaling(), ("E2M1", "E2M1", "E2M1"), id="nvfp4"),
]


@pytest.mark.parametrize("recipe, names", ELEMENT_FORMATS)
def test_element_format_per_role(recipe, names):
    assert tuple(recipe.element_format(role).name for role in ROLES) == names
    assert tuple(recipe.quantizer(role).fmt.name for role in ROLES) == names


BLOCKS = [  # rowwise block (rows, cols) per role input/weight/grad_output; None = one scale per tensor
    pytest.param(DelayedScaling(), (None, None, None), id="delayed"),
    pytest.param(Float8CurrentScaling(), (None, None, None), id="current"),
    pytest.param(Float8BlockScaling(), ((1, 128), (128, 128), (1, 128)), id="block"),
    pytest.param(MXFP8BlockScaling(), ((1, 32), (1, 32), (1, 32)), id="mxfp8"),
    pytest.param(NVFP4BlockScaling(), ((1, 16), (16, 16), (1, 16)), id="nvfp4"),
    pytest.param(NVFP4BlockScaling(disable_2d_quantization=True), ((1, 16), (1, 16), (1, 16)), id="nvfp4-1d"),
]


@pytest.mark.parametrize("recipe, blocks", BLOCKS)
def test_block_shape_per_role(recipe, blocks):
    assert tuple(recipe.quantizer(role).block for role in ROLES) == blocks


def test_nvfp4_rht_and_stochastic_rounding_per_role():
    q = {role: NVFP4BlockScaling().quantizer(role) for role in ROLES}
    assert (q["input"].rht, q["weight"].rht, q["grad_output"].rht) == (True, False, True)
    assert (q["input"].stochastic, q["weight"].stochastic, q["grad_output"].stochastic) == (False, False, True)
    off = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)
    assert not any(off.quantizer(role).rht or off.quantizer(role).stochastic for role in ROLES)


def test_unknown_role_raises():
    for role in ("bias", "grad_input", "Weight"):
        with pytest.raises(ValueError, match=repr(role)):
            MXFP8BlockScaling().quantizer(role)


@pytest.mark.parametrize("cls", FP8_RECIPES)
def test_pure_e5m2_is_rejected(cls):
    with pytest.raises(ValueError, match="fp8_format"):
        cls(fp8_format=Format.E5M2)


INVALID = [
    (DelayedScaling, "margin", -1), (DelayedScaling, "margin", 1.5), (DelayedScaling, "margin", True),
    (DelayedScaling, "amax_history_len", 0), (DelayedScaling, "amax_history_len", 2.0),
    (DelayedScaling, "amax_history_len", True), (DelayedScaling, "amax_compute_algo", "mean"),
    (DelayedScaling, "amax_compute_algo", None), (DelayedScaling, "reduce_amax", 1),
    (DelayedScaling, "fp8_format", "HYBRID"), (DelayedScaling, "align_size", 0),
    (Float8CurrentScaling, "power_2_scale", "true"), (Float8CurrentScaling, "amax_epsilon", -1e-3),
    (Float8CurrentScaling, "amax_epsilon", float("nan")), (Float8CurrentScaling, "amax_epsilon", float("inf")),
    (Float8CurrentScaling, "amax_epsilon", "0"), (Float8CurrentScaling, "align_size", -16),
    (Float8BlockScaling, "use_f32_scales", 0), (Float8BlockScaling, "amax_epsilon", -0.5),
    (Float8BlockScaling, "align_size", 16.0), (Float8BlockScaling, "fp8_format", None),
    (MXFP8BlockScaling, "scale_mode", "floor"), (MXFP8BlockScaling, "align_size", True),
    (NVFP4BlockScaling, "disable_rht", "no"), (NVFP4BlockScaling, "disable_stochastic_rounding", 1),
    (NVFP4BlockScaling, "disable_2d_quantization", None), (NVFP4BlockScaling, "align_size", 0),
]


@pytest.mark.parametrize("cls, field, value", INVALID, ids=[f"{c.__name__}-{f}-{v!r}" for c, f, v in INVALID])
def test_invalid_value_raises_naming_the_field(cls, field, value):
    with pytest.raises(ValueError, match=field):
        cls(**{field: value})


@pytest.mark.parametrize("cls", [p.values[0] for p in DEFAULTS])
def test_recipes_are_frozen(cls):
    r = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.align_size = 7
    assert r.align_size == cls().align_size
    assert hash(r) == hash(cls())  # frozen dataclasses hash by value, so recipes can key caches
    assert dataclasses.replace(r, align_size=48).align_size == 48


# ---------------------------------------------------------------- config files

def test_from_dict():
    assert recipe_from_config({"name": "nvfp4", "disable_rht": True}) == NVFP4BlockScaling(disable_rht=True)
    assert recipe_from_config({"name": "delayed"}) == DelayedScaling()
    assert recipe_from_config({"name": "current", "fp8_format": "e4m3", "power_2_scale": True}) == \
        Float8CurrentScaling(fp8_format=Format.E4M3, power_2_scale=True)
    assert recipe_from_config({"name": "mxfp8", "scale_mode": ScaleMode.FLOOR}) == \
        MXFP8BlockScaling(scale_mode=ScaleMode.FLOOR)


def test_from_json_and_yaml_strings():
    assert recipe_from_config('{"name": "mxfp8", "scale_mode": "floor", "align_size": 64}') == \
        MXFP8BlockScaling(scale_mode=ScaleMode.FLOOR, align_size=64)
    text = "name: delayed\nmargin: 2\namax_compute_algo: most_recent\nfp8_format: E4M3\n"
    assert recipe_from_config(text) == DelayedScaling(margin=2, amax_compute_algo="most_recent",
                                                      fp8_format=Format.E4M3)
    assert recipe_from_config("name: block") == Float8BlockScaling()
    assert recipe_from_config("{name: block, use_f32_scales: true}") == Float8BlockScaling(use_f32_scales=True)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
@pytest.mark.parametrize("as_path", [False, True], ids=["str", "Path"])
def test_from_files(tmp_path, suffix, as_path):
    recipe = Float8BlockScaling(fp8_format=Format.HYBRID, amax_epsilon=1e-6, align_size=32)
    cfg = recipe_to_config(recipe)
    path = tmp_path / f"recipe{suffix}"
    path.write_text(json.dumps(cfg) if suffix == ".json" else yaml.safe_dump(cfg))
    assert recipe_from_config(path if as_path else str(path)) == recipe


def test_missing_file_raises(tmp_path):
    with pytest.raises(ValueError, match="missing.yaml"):
        recipe_from_config(str(tmp_path / "missing.yaml"))


BAD_CONFIGS = [
    pytest.param({"name": "fp4"}, "fp4", id="unknown-name"),
    pytest.param({"name": "mxfp8", "scale_mod": "floor"}, "scale_mod", id="unknown-key"),
    pytest.param({"name": "delayed", "margins": 1}, "margins", id="unknown-key-delayed"),
    pytest.param({"name": "mxfp8", "scale_mode": "nearest"}, "nearest", id="bad-scale-mode"),
    pytest.param({"name": "current", "fp8_format": "E3M4"}, "E3M4", id="bad-format"),
    pytest.param({"name": "block", "fp8_format": "E5M2"}, "fp8_format", id="e5m2"),
    pytest.param({"name": "delayed", "amax_compute_algo": "avg"}, "amax_compute_algo", id="bad-algo"),
    pytest.param({"name": "nvfp4", "align_size": -1}, "align_size", id="bad-align"),
    pytest.param({"disable_rht": True}, "name", id="no-name"),
    pytest.param('["nvfp4"]', "mapping", id="json-list"),
    pytest.param("{not json: [", "YAML", id="unparseable"),
]


@pytest.mark.parametrize("config, offender", BAD_CONFIGS)
def test_bad_configs_raise_naming_the_offender(config, offender):
    with pytest.raises(ValueError, match=offender):
        recipe_from_config(config)


def test_to_config_names_and_plain_types():
    names = [recipe_to_config(cls())["name"] for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                                                        MXFP8BlockScaling, NVFP4BlockScaling)]
    assert names == ["delayed", "current", "block", "mxfp8", "nvfp4"]
    with pytest.raises(ValueError):
        recipe_to_config({"name": "mxfp8"})


# ---------------------------------------------------------------- round trip

FP8_FORMATS = st.sampled_from([Format.E4M3, Format.HYBRID])
ALIGN = st.integers(1, 1024)
EPSILON = st.one_of(st.just(0.0), st.floats(0.0, 1e3, allow_nan=False, allow_infinity=False))

RECIPES = st.one_of(
    st.builds(DelayedScaling, margin=st.integers(0, 16), fp8_format=FP8_FORMATS, amax_history_len=st.integers(1, 4096),
              amax_compute_algo=st.sampled_from(["max", "most_recent"]), reduce_amax=st.booleans(), align_size=ALIGN),
    st.builds(Float8CurrentScaling, fp8_format=FP8_FORMATS, power_2_scale=st.booleans(), amax_epsilon=EPSILON,
              align_size=ALIGN),
    st.builds(Float8BlockScaling, fp8_format=FP8_FORMATS, use_f32_scales=st.booleans(), amax_epsilon=EPSILON,
              align_size=ALIGN),
    st.builds(MXFP8BlockScaling, fp8_format=FP8_FORMATS, scale_mode=st.sampled_from(list(ScaleMode)),
              align_size=ALIGN),
    st.builds(NVFP4BlockScaling, disable_rht=st.booleans(), disable_stochastic_rounding=st.booleans(),
              disable_2d_quantization=st.booleans(), align_size=st.integers(1, 256).map(lambda a: 16 * a)),
)


@given(recipe=RECIPES)
def test_config_round_trip(recipe):
    cfg = recipe_to_config(recipe)
    assert all(isinstance(v, (str, int, float, bool)) for v in cfg.values()), cfg
    assert set(cfg) == {"name"} | {f.name for f in dataclasses.fields(recipe)}
    assert recipe_from_config(cfg) == recipe
    assert recipe_from_config(json.dumps(cfg)) == recipe
    assert recipe_from_config(yaml.safe_dump(cfg)) == recipe
    assert type(recipe_from_config(cfg)) is type(recipe)
    assert recipe_to_config(recipe_from_config(cfg)) == cfg


def test_round_trip_through_files(tmp_path: Path):
    for i, recipe in enumerate([DelayedScaling(margin=3, reduce_amax=False), NVFP4BlockScaling(disable_rht=True),
                                MXFP8BlockScaling(scale_mode=ScaleMode.FLOOR, fp8_format=Format.HYBRID)]):
        for suffix, dump in ((".json", json.dumps), (".yaml", yaml.safe_dump)):
            path = tmp_path / f"r{i}{suffix}"
            path.write_text(dump(recipe_to_config(recipe)))
            assert recipe_from_config(path) == recipe
