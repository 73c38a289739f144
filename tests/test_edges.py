"""Nothing surprising at the edges: one regression test per item of issue 22 (numbered as there).

Non-finite values never poison other data (NUMERICS.md "Non-finite values"), every bad argument
is named at the call that receives it, empty batches work everywhere, and the command line
refuses bad options in one line before any work. The delayed-scaling item (2) lives in
tests/test_delayed_scaling.py and its kernel in tests/kernels/test_delayed_scaling_interpret.py;
the non-finite kernel twins in tests/kernels/test_quantize_interpret.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import qmoe
from qmoe.cli import main
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling, recipe_from_config)
from qmoe.recipes.recipe import ROLES

REPO = Path(__file__).resolve().parents[1]
RECIPES = [DelayedScaling(), Float8CurrentScaling(), Float8CurrentScaling(power_2_scale=True), Float8BlockScaling(),
           MXFP8BlockScaling(), NVFP4BlockScaling()]
IDS = ["delayed", "current", "current-pow2", "block", "mxfp8", "nvfp4"]


# ---------------------------------------------------------------- 1. one inf flushes nothing else

@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), NVFP4BlockScaling()], ids=["current", "nvfp4"])
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_item1_one_non_finite_value_leaves_the_others_alone(recipe, bad, device="cpu"):
    x = (torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 1e-3).to(device)
    clean = x.clone()
    x[5, 37] = bad
    clean[5, 37] = 0.0
    got = recipe.quantizer("input").quantize(x, columnwise=False).dequantize()
    want = recipe.quantizer("input").quantize(clean, columnwise=False).dequantize()
    outside = torch.ones_like(x, dtype=torch.bool)
    if isinstance(recipe, NVFP4BlockScaling):
        outside[5, 32:48] = False  # the value's own 1x16 block
    else:
        outside[5, 37] = False
    assert torch.equal(got[outside], want[outside])  # bit for bit: the per-tensor amax ignored it
    assert (got[outside] != 0).float().mean() > 0.9


# ---------------------------------------------------------------- 3. finite in, finite out

@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("value", [3.3e38, -3.4e38, torch.finfo(torch.float32).max], ids=["3.3e38", "-3.4e38",
                                                                                           "FLT_MAX"])
def test_item3_finite_inputs_near_flt_max_dequantize_finite(recipe, value, device="cpu"):
    for role in ROLES:
        qt = recipe.quantizer(role).quantize(torch.full((32, 32), value, device=device))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for columnwise in (False, True):
                out = qt.dequantize(dtype, columnwise=columnwise)
                assert torch.isfinite(out).all(), (role, dtype, columnwise)
        assert torch.sign(qt.dequantize()).eq(float(np.sign(value))).all()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_items_1_3_5_on_the_gpu_kernels(recipe):
    """The non-finite rules and empty tensors through the Triton kernels (sm90+ picks them)."""
    for bad in (float("inf"), float("nan")):
        if isinstance(recipe, (Float8CurrentScaling, NVFP4BlockScaling)):
            test_item1_one_non_finite_value_leaves_the_others_alone(recipe, bad, "cuda")
    for value in (3.3e38, -3.4e38, torch.finfo(torch.float32).max):
        test_item3_finite_inputs_near_flt_max_dequantize_finite(recipe, value, "cuda")
    for shape in ((4, 0), (0, 0), (0, 32)):
        test_item5_empty_tensors_quantize_to_empty_results(recipe, shape, "cuda")


@pytest.mark.gpu
def test_item2_delayed_scaling_skips_a_non_finite_step_on_the_gpu():
    q = DelayedScaling(amax_history_len=16).quantizer("input")
    for a in (10.0, float("inf"), 10.0, 12.0):
        q.quantize(torch.full((4, 32), a, device="cuda"))
        q.update_scale()
    assert q.scale.item() == np.float32(448) / np.float32(12.0)
    assert q.nonfinite_steps.item() == 1 and torch.isfinite(q.amax_history).all()


# ---------------------------------------------------------------- 4. empty batch, every loss

@pytest.mark.parametrize("shape", [(0, 16), (0, 3, 16), (2, 0, 16)])
def test_item4_empty_batch_with_every_loss(shape):
    layer = qmoe.nn.MoELayer(16, 32, 4, 2, aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                             expert_bias=True)
    x = torch.zeros(shape, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and layer.aux_loss.item() == 0.0
    (y.sum() + layer.aux_loss).backward()
    assert x.grad.shape == x.shape


# ---------------------------------------------------------------- 5. empty quantizations

@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("shape", [(4, 0), (0, 0), (0, 32), (2, 3, 0)])
def test_item5_empty_tensors_quantize_to_empty_results(recipe, shape, device="cpu"):
    for role in ROLES:
        qt = recipe.quantizer(role).quantize(torch.zeros(shape, device=device))
        assert qt.dequantize().shape == shape
        m = int(np.prod(shape[:-1]))
        assert qt.dequantize(columnwise=True).shape == (shape[-1], m)


# ---------------------------------------------------------------- 6. accepted silently before

def _router(**kw):
    return qmoe.nn.TopKRouter(16, 4, 2, **kw)


def _layer(**kw):
    return qmoe.nn.MoELayer(16, 32, 4, 2, **kw)


SILENT = [
    (lambda: _layer(scaling_factor=float("nan")), "scaling_factor"),
    (lambda: _layer(scaling_factor=-1.0), "scaling_factor"),
    (lambda: _router(expert_bias_update_rate=-1e-3), "expert_bias_update_rate"),
    (lambda: _layer(aux_loss_coeff=float("nan")), "aux_loss_coeff"),
    (lambda: _layer(capacity_factor=0.0), "capacity_factor"),
    (lambda: _layer(capacity_factor=-1.0), "capacity_factor"),
    (lambda: NVFP4BlockScaling(align_size=1), "align_size"),
    (lambda: MXFP8BlockScaling(align_size=2 ** 40), "align_size"),
    (lambda: Float8CurrentScaling().quantizer("input").quantize(torch.ones(4, 32), rowwise="no"), "rowwise"),
    (lambda: _layer(bias="no"), "bias"),
    (lambda: _layer(expert_bias="yes"), "expert_bias"),
    (lambda: _layer(delay_wgrad_compute="yes"), "delay_wgrad_compute"),
    (lambda: qmoe.nn.GroupedLinear(4, 16, 32, single_grouped_weight="no"), "single_grouped_weight"),
    (lambda: Float8CurrentScaling().quantizer("input").quantize(torch.ones(4, 32)).dequantize(dtype=torch.int32),
     "dtype"),
    (lambda: qmoe.autocast(recipe=Float8CurrentScaling(), amax_reduction_group=42), "amax_reduction_group"),
    (lambda: _layer(params_dtype=torch.int64), "params_dtype"),
]


@pytest.mark.parametrize("call, name", SILENT, ids=[f"{n}-{i}" for i, (_, n) in enumerate(SILENT)])
def test_item6_bad_arguments_raise_at_the_call_naming_them(call, name):
    with pytest.raises((ValueError, TypeError)) as e:
        call()
    assert name in str(e.value)


# ---------------------------------------------------------------- 7. top_k against the routing map

def test_item7_permute_refuses_a_top_k_below_the_routing_map():
    routing_map = torch.zeros(4, 4, dtype=torch.bool)
    routing_map[:, :2] = True
    with pytest.raises(ValueError, match="top_k=1"):
        qmoe.ops.moe_permute(torch.randn(4, 8), routing_map, top_k=1)
    out, _, _, split_sizes = qmoe.ops.moe_permute(torch.randn(4, 8), routing_map, top_k=2)
    assert int(split_sizes.sum()) == out.shape[0] == 8


# ---------------------------------------------------------------- 8. errors that name the right thing

def test_item8_errors_name_the_argument_given():
    with pytest.raises(ValueError, match="ffn_hidden_size must be a positive integer, got -8"):
        qmoe.nn.MoELayer(64, -8, 4, 2)
    layer = _layer()
    with pytest.raises(TypeError, match="MoELayer input x .* got torch.float64"):
        layer(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="got torch.int32"):
        layer(torch.ones(3, 16, dtype=torch.int32))
    lin = qmoe.nn.GroupedLinear(3, 8, 4)
    sd = {f"weight{g}": torch.zeros(4, 8) for g in range(3)} | {f"bias{g}": torch.zeros(4) for g in range(3)}
    with pytest.raises(ValueError, match=r"state_dict\['weight1'\] must have shape \[4, 8\]"):
        lin.load_state_dict(sd | {"weight1": torch.zeros(4, 9)})
    with pytest.raises(ValueError, match="'weight00' is not a per-expert key"):
        lin.load_state_dict(sd | {"weight00": torch.zeros(4, 8)})


# ---------------------------------------------------------------- 9. config files

@pytest.mark.parametrize("config, match", [
    ({"name": ["mxfp8"]}, "unknown recipe name"),
    ("recipe.txt", "use a .json, .yaml or .yml file"),
    ('{"name": "current", "name": "mxfp8"}', "'name' is given twice"),
    ("name: current\nname: mxfp8\n", "'name' is given twice"),
    ('{"name": "current",}', "not valid JSON"),
], ids=["list-name", "txt", "json-duplicate", "yaml-duplicate", "trailing-comma"])
def test_item9_bad_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        recipe_from_config(config)


def test_item9_yaml_exponent_reads_as_a_number():
    assert recipe_from_config("name: current\namax_epsilon: 1e-3\n").amax_epsilon == 1e-3


# ---------------------------------------------------------------- 10. the command line, up front

def _config(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("argv, key", [
    (["info", "--device", "bogus"], "--device"),
    (["info", "--device", "cuda:7"], "--device"),
    (["report", "--json", "/no/such/folder/r.json"], "--json"),
    (["compare", "--plot", "/no/such/folder/c.png"], "--plot"),
    (["report", "--config", "shapes: 5"], "'shape'"),
    (["report", "--config", "seed: abc"], "'seed'"),
    (["report", "--config", "seed: 1.5"], "'seed'"),
    (["report", "--config", "recipes: null"], "'recipes'"),
], ids=["info-bogus", "info-cuda7", "json-folder", "plot-folder", "shapes-5", "seed-abc", "seed-1.5",
        "recipes-null"])
def test_item10_bad_options_exit_2_with_one_line(tmp_path, capsys, monkeypatch, argv, key):
    import qmoe.report

    monkeypatch.setattr(qmoe.report, "run_report", lambda *a, **k: pytest.fail("the run started"))
    if "--config" in argv:
        argv = [*argv[:-1], _config(tmp_path, argv[-1])]
    assert main([*argv, *(["--no-progress"] if argv[0] != "info" else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
@pytest.mark.parametrize("command", ["info", "report", "compare"])
def test_item10_cuda_on_a_cpu_machine(capsys, command):
    assert main([command, "--device", "cuda", *(["--no-progress"] if command != "info" else [])]) == 2
    assert "--device" in capsys.readouterr().err


# ---------------------------------------------------------------- 11. one config schema

def _readme_config() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert blocks, "README has no YAML config example"
    return blocks[0]


def test_item11_the_readme_config_runs_in_compare_and_report(tmp_path, capsys):
    cfg = _config(tmp_path, _readme_config())
    for command in ("compare", "report"):
        out = tmp_path / f"{command}.json"
        assert main([command, "--config", cfg, "--json", str(out), "--no-progress"]) == 0, command
        rows = json.loads(out.read_text())
        assert {"mxfp8", "nvfp4"} <= {r["recipe"] for r in rows}, command
    capsys.readouterr()


def test_item11_compare_takes_shapes_its_recipes_support():
    from qmoe.compare import load_compare_config

    cfg = load_compare_config({"recipes": ["bf16", "mxfp8"], "shape": {"hidden": 100}})
    assert cfg["shape"] == {"hidden": 100}
    with pytest.raises(ValueError, match="hidden=100 must be a multiple of 16 for nvfp4"):
        load_compare_config({"recipes": ["nvfp4"], "shape": {"hidden": 100}})
    from qmoe.report import load_report_config

    recipes, shape, seed = load_report_config({"recipes": ["bf16", "mxfp8"], "shapes": {"tokens": 32}, "seed": 2})
    assert [type(r) for r in recipes] == [MXFP8BlockScaling] and shape == {"tokens": 32} and seed == 2


# ---------------------------------------------------------------- 12. the plot and the notebooks

def test_item12_compare_figure_is_readable():
    from qmoe.compare import CompareRow, compare_figure

    shape = {"tokens": 128, "hidden": 64, "ffn": 128, "experts": 4, "top_k": 2}
    names = ["fp32", "bf16", "delayed", "current", "block", "mxfp8", "nvfp4"]
    times = [3.0, 3.5, 9.0, 9.5, 15.0, 18.0, 400.0]
    rows = [CompareRow(n, 0.06, 0.07, 0.08, 0.06, 0.06, t, "p", {"name": n}, shape=shape, device="cpu")
            for n, t in zip(names, times)]
    fig = compare_figure(rows)
    assert "128 tokens" in fig._suptitle.get_text() and "on cpu" in fig._suptitle.get_text()
    assert fig.axes[1].get_xscale() == "log"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    drawn = fig.get_tightbbox(canvas.get_renderer())  # everything drawn, in inches: inside the figure
    w, h = fig.get_size_inches()
    assert drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= w + 0.01 and drawn.y1 <= h + 0.01, drawn


@pytest.mark.parametrize("name", ["01_recipes_tour.ipynb", "02_moe_layer.ipynb"])
def test_item12_notebooks_are_committed_with_their_outputs(name):
    nb = json.loads((REPO / "notebooks" / name).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code)
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)


# ---------------------------------------------------------------- 13. README: CPU torch first

def test_item13_readme_installs_cpu_torch_before_the_two_commands():
    text = (REPO / "README.md").read_text()
    block = re.search(r"## The two commands\s+```bash\n(.*?)```", text, re.S).group(1).splitlines()
    first = [i for i, line in enumerate(block) if "qmoe compare" in line][0]
    assert any("download.pytorch.org/whl/cpu" in line for line in block[:first])
