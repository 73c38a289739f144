"""What `qmoe converge` trains: the model, the training schedule, the runs; presets and config files.

A config file (YAML or JSON) overlays a preset:

    preset: small            # the base (default tiny; `--preset` on the command line wins)
    model: {layers: 4, hidden: 512, experts: 16, top_k: 2, ffn: 512}
    train: {steps: 2000, batch: 16, seq_len: 512, lr: 1.0e-3}
    recipes: [bf16, current, {label: nvfp4-no-rht, name: nvfp4, disable_rht: true}]
    seeds: 2                 # bf16 baseline seeds: their spread is the noise floor

`recipes` entries are `bf16` (the unquantized baseline), a recipe name (`delayed`, `current`,
`block`, `mxfp8`, `nvfp4`), or a recipe config dict (`qmoe.recipes.recipe_from_config`) with an
optional `label` naming the run. Unknown keys are errors that name the key.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields

from qmoe.converge.model import ModelConfig, supports_shared_expert
from qmoe.recipes import Recipe, recipe_from_config, recipe_to_config
from qmoe.recipes.config import load_config

BASELINE = "bf16"
RECIPE_NAMES = ("delayed", "current", "block", "mxfp8", "nvfp4")
PRECISIONS = ("auto", "bf16", "fp32")
TOP_KEYS = ("preset", "model", "train", "recipes", "seeds")


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation and evaluation schedule (config file section `train`)."""

    steps: int = 150
    batch: int = 8
    seq_len: int = 64
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 15  # linear warm-up from lr / warmup_steps
    weight_decay: float = 0.1  # on matrices only (norm weights and the router bias are not decayed)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm (0 disables clipping)
    eval_every: int = 25  # held-out evaluation interval, in steps (and always at the last step)
    eval_batches: int = 4
    log_every: int = 5  # train-loss curve resolution: mean loss over each interval of this many steps
    final_evals: int = 3  # the final loss of a run is the mean of its last this-many evaluations
    seed: int = 0  # initial weights of every recipe run and of the first bf16 seed
    data_seed: int = 0  # the batch order, shared by every run
    precision: str = "auto"  # bf16: fp32 weights under torch.autocast(bf16); fp32: no torch.autocast
    checkpoint_every: int = 500  # steps between resumable checkpoints (0: only when stopped early)

    def __post_init__(self):
        for name in ("steps", "batch", "seq_len", "warmup_steps", "eval_every", "eval_batches", "log_every",
                     "final_evals", "seed", "data_seed", "checkpoint_every"):
            v = getattr(self, name)
            low = 0 if name in ("warmup_steps", "seed", "data_seed", "checkpoint_every") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"train.{name} must be an integer >= {low}, got {v!r}")
        for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"train.{name} must be a number >= 0, got {v!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


@dataclass(frozen=True)
class RunSpec:
    """One training run: a label, a recipe (None: the unquantized baseline) and the init seed."""

    label: str
    recipe: Recipe | None
    seed: int

    @property
    def is_baseline(self) -> bool:
        return self.recipe is None

    def recipe_config(self) -> dict:
        return {"name": BASELINE} if self.recipe is None else recipe_to_config(self.recipe)


@dataclass(frozen=True)
class ConvergeConfig:
    preset: str
    model: ModelConfig
    train: TrainConfig
    recipes: tuple = (BASELINE, "delayed", "current")  # entries as in a config file, labels derived by runs()
    seeds: int = 2

    def __post_init__(self):
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ValueError(f"seeds must be a positive integer, got {self.seeds!r}")
        self.runs()  # validates every recipe entry

    def runs(self) -> list[RunSpec]:
        """bf16 seeds first (labels bf16-s0, bf16-s1, ...), then every quantized run at train.seed."""
        specs, labels = [], set()
        for entry in self.recipes:
            label, recipe = parse_recipe_entry(entry)
            if recipe is None:
                new = [RunSpec(f"{BASELINE}-s{i}", None, self.train.seed + i) for i in range(self.seeds)]
            else:
                new = [RunSpec(label, recipe, self.train.seed)]
            for spec in new:
                if spec.label in labels:
                    raise ValueError(f"recipes: the run label {spec.label!r} appears twice; give one a 'label'")
                labels.add(spec.label)
            specs += new
        if not any(s.is_baseline for s in specs):
            raise ValueError(f"recipes must include the {BASELINE!r} baseline: gaps are measured against it")
        return specs

    def to_dict(self) -> dict:
        return {"preset": self.preset, "model": dataclasses.asdict(self.model),
                "train": dataclasses.asdict(self.train), "recipes": [s.recipe_config() | {"label": s.label}
                                                                    for s in self.runs()],
                "seeds": self.seeds}


def parse_recipe_entry(entry) -> tuple[str, Recipe | None]:
    """(label, recipe) from `bf16`, a recipe name or a recipe config dict with an optional `label`."""
    if isinstance(entry, str):
        if entry == BASELINE:
            return BASELINE, None
        if entry not in RECIPE_NAMES:
            raise ValueError(f"recipes: unknown recipe {entry!r}; expected {BASELINE} or one of "
                             f"{', '.join(RECIPE_NAMES)}")
        return entry, recipe_from_config({"name": entry})
    if isinstance(entry, dict):
        cfg = dict(entry)
        label = cfg.pop("label", None)
        if cfg.get("name") == BASELINE:
            if len(cfg) > 1:
                raise ValueError(f"recipes: the {BASELINE} baseline takes no fields, got {sorted(set(cfg) - {'name'})}")
            return BASELINE, None
        recipe = recipe_from_config(cfg)
        label = label if label is not None else cfg["name"]
        if not isinstance(label, str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
            raise ValueError(f"recipes: label {label!r} must be letters, digits and _ . + - only (it names files)")
        return label, recipe
    raise ValueError(f"recipes: an entry is a recipe name or a recipe config dict, got {entry!r}")


# The extra runs of `--ablations`: what NVFP4 costs without each of its three safeguards, and
# delayed scaling with a short amax history (it reacts faster to growing activations).
ABLATIONS = (
    {"label": "nvfp4-no-rht", "name": "nvfp4", "disable_rht": True},
    {"label": "nvfp4-no-sr", "name": "nvfp4", "disable_stochastic_rounding": True},
    {"label": "nvfp4-no-2d", "name": "nvfp4", "disable_2d_quantization": True},
    {"label": "delayed-h16", "name": "delayed", "amax_history_len": 16},
)

ALL_RECIPES = (BASELINE, *RECIPE_NAMES)


def _presets() -> dict:
    """name -> (ModelConfig, TrainConfig, default recipes)."""
    dsv3_shared = {"shared_expert_ffn": 128} if supports_shared_expert() else {}
    return {
        # a 2-core CPU, through qmoe's pure-torch reference: a few hundred thousand parameters, a
        # loss that falls visibly within the budget
        "tiny": (ModelConfig(layers=2, hidden=64, heads=4, experts=8, top_k=2, ffn=64, aux_loss_coeff=0.01),
                 TrainConfig(), (BASELINE, "delayed", "current")),
        # one GPU: tens of millions of parameters, 2000 steps; sized so that bf16 and the five
        # recipes fit one short device job (run times in benchmarks/results/convergence.json)
        "small": (ModelConfig(layers=4, hidden=512, heads=8, experts=16, top_k=2, ffn=512, aux_loss_coeff=0.01),
                  TrainConfig(steps=2000, batch=16, seq_len=512, lr=1e-3, warmup_steps=100, eval_every=100,
                              eval_batches=8, log_every=10, checkpoint_every=500),
                  ALL_RECIPES),
        # DeepSeek-V3's MoE in miniature: many fine-grained experts, sigmoid scores, group-limited
        # top-k, aux-loss-free bias balancing, routed-output scaling, and a shared expert
        "dsv3-like": (ModelConfig(layers=4, hidden=512, heads=8, experts=64, top_k=8, ffn=128,
                                  score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=True,
                                  scaling_factor=2.5, **dsv3_shared),
                      TrainConfig(steps=2000, batch=16, seq_len=512, lr=1e-3, warmup_steps=100, eval_every=100,
                                  eval_batches=8, log_every=10, checkpoint_every=500),
                      ALL_RECIPES),
    }


PRESET_NAMES = ("tiny", "small", "dsv3-like")


def preset(name: str) -> ConvergeConfig:
    presets = _presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESET_NAMES)}")
    model, train, recipes = presets[name]
    return ConvergeConfig(name, model, train, recipes)


def _overlay(section: str, base, values) -> object:
    if values is None:
        return base
    if not isinstance(values, dict):
        raise TypeError(f"config key {section!r} must be a mapping, got {type(values).__name__}")
    known = {f.name for f in fields(base)}
    for key in values:
        if key not in known:
            raise ValueError(f"unknown config key '{section}.{key}'; known: {', '.join(sorted(known))}")
    return dataclasses.replace(base, **values)


def load_converge_config(source=None, preset_name: str | None = None) -> ConvergeConfig:
    """A ConvergeConfig from a preset overlaid with a config (dict, JSON/YAML text or file path)."""
    cfg = load_config(source) if source is not None else {}
    if not isinstance(cfg, dict):
        raise TypeError(f"a converge config is a mapping with keys {', '.join(TOP_KEYS)}, got {type(cfg).__name__}")
    for key in cfg:
        if key not in TOP_KEYS:
            raise ValueError(f"unknown config key {key!r}; known: {', '.join(TOP_KEYS)}")
    base = preset(preset_name or cfg.get("preset") or "tiny")
    recipes = cfg.get("recipes", base.recipes)
    if isinstance(recipes, str) or not isinstance(recipes, (list, tuple)):
        raise TypeError(f"config key 'recipes' must be a list, got {recipes!r}")
    return ConvergeConfig(base.preset, _overlay("model", base.model, cfg.get("model")),
                          _overlay("train", base.train, cfg.get("train")), tuple(recipes),
                          cfg.get("seeds", base.seeds))


def with_overrides(cfg: ConvergeConfig, *, recipes=None, seeds=None, steps=None, ablations=False,
                   precision=None) -> ConvergeConfig:
    """The command line's overrides on top of a loaded config."""
    train = cfg.train
    if steps is not None:
        train = dataclasses.replace(train, steps=steps)
    if precision is not None:
        train = dataclasses.replace(train, precision=precision)
    entries = tuple(recipes) if recipes is not None else cfg.recipes
    if ablations:
        entries += tuple(a for a in ABLATIONS if a not in entries)
    return dataclasses.replace(cfg, train=train, recipes=entries, seeds=seeds if seeds is not None else cfg.seeds)

