"""Converge configs: presets, config files overlaying them, errors that name the key, the LR schedule."""
import dataclasses
import json

import pytest

from qmoe.cli import main
from qmoe.converge.config import (ABLATIONS, PRESET_NAMES, TrainConfig, load_converge_config, preset,
                                  with_overrides)
from qmoe.converge.model import supports_shared_expert
from qmoe.converge.train import learning_rate
from qmoe.recipes import DelayedScaling, NVFP4BlockScaling


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_build(name):
    cfg = preset(name)
    labels = [s.label for s in cfg.runs()]
    assert labels[:2] == ["bf16-s0", "bf16-s1"]
    assert len(labels) == len(set(labels))
    if name != "tiny":
        assert cfg.train.steps >= 2000
        assert labels[2:] == ["delayed", "current", "block", "mxfp8", "nvfp4"]


def test_dsv3_like_preset_is_deepseek_shaped():
    m = preset("dsv3-like").model
    assert (m.score_function, m.expert_bias, m.top_k) == ("sigmoid", True, 8)
    assert m.num_groups and m.group_topk and m.experts // m.num_groups >= 2
    assert (m.shared_expert_ffn is not None) == supports_shared_expert()


def test_config_file_overlays_the_preset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: small\nmodel: {layers: 1}\ntrain: {steps: 7}\nseeds: 3\n"
                    "recipes: [bf16, {label: nvfp4-no-rht, name: nvfp4, disable_rht: true}, delayed]\n")
    cfg = load_converge_config(str(path))
    assert cfg.preset == "small" and cfg.model.layers == 1 and cfg.model.hidden == preset("small").model.hidden
    assert cfg.train.steps == 7 and cfg.train.lr == preset("small").train.lr
    runs = cfg.runs()
    assert [s.label for s in runs] == ["bf16-s0", "bf16-s1", "bf16-s2", "nvfp4-no-rht", "delayed"]
    assert [s.seed for s in runs] == [0, 1, 2, 0, 0]  # recipe runs start from the first bf16 seed's weights
    assert runs[3].recipe == NVFP4BlockScaling(disable_rht=True) and runs[4].recipe == DelayedScaling()
    # the command line's preset wins over the file's
    assert load_converge_config(str(path), preset_name="tiny").model.hidden == preset("tiny").model.hidden


def test_overrides_and_ablations():
    cfg = with_overrides(preset("tiny"), recipes=["bf16", "nvfp4"], seeds=1, steps=9, ablations=True,
                         precision="fp32")
    assert cfg.train.steps == 9 and cfg.train.precision == "fp32" and cfg.seeds == 1
    assert [s.label for s in cfg.runs()] == ["bf16-s0", "nvfp4"] + [a["label"] for a in ABLATIONS]
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize("cfg, msg", [
    ({"colour": 1}, "unknown config key 'colour'"),
    ({"model": {"hiden": 64}}, "unknown config key 'model.hiden'"),
    ({"train": {"stepz": 3}}, "unknown config key 'train.stepz'"),
    ({"train": {"steps": 0}}, "train.steps"),
    ({"train": {"precision": "fp16"}}, "train.precision"),
    ({"recipes": ["current"]}, "must include the 'bf16' baseline"),
    ({"recipes": ["bf16", "fp3"]}, "unknown recipe 'fp3'"),
    ({"recipes": ["bf16", {"name": "nvfp4", "disable_rht": 1, "x": 2}]}, "unknown config key"),
    ({"recipes": ["bf16", "current", {"name": "current"}]}, "appears twice"),
    ({"recipes": ["bf16", {"name": "current", "label": "a/b"}]}, "label"),
    ({"seeds": 0}, "seeds"),
    ({"preset": "huge"}, "unknown preset 'huge'"),
])
def test_bad_configs_name_what_is_wrong(cfg, msg):
    with pytest.raises(ValueError, match=msg):
        load_converge_config(cfg)


def test_cli_unknown_key_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"hidden": 64, "expertz": 4}}))
    assert main(["converge", "--config", str(path), "--no-progress", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.expertz" in err
    assert not (tmp_path / "r.json").exists()


def test_learning_rate_warms_up_then_decays_to_the_floor():
    tc = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [learning_rate(s, tc) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert learning_rate(0, dataclasses.replace(tc, warmup_steps=0)) == pytest.approx(1.0)
