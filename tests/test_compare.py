"""`qmoe compare` (the main job) and the plain PyTorch MoE peer of `qmoe bench moe`."""
import json
import math

import pytest
import torch

import qmoe
from benchmarks.plain_moe import PlainMoE
from qmoe.cli import main
from qmoe.compare import GRADIENTS, format_table, load_compare_config, run_compare
from qmoe.recipes import DelayedScaling, Float8CurrentScaling

TINY = {"tokens": 32, "hidden": 32, "ffn": 32, "experts": 4, "top_k": 2}


@pytest.fixture(scope="module")
def tiny_rows():
    """Every recipe and both high precisions on a tiny layer, one timed step each."""
    return run_compare(shape=TINY, device="cpu", steps=1, progress=False)


def test_every_recipe_gets_a_row_with_finite_errors(tiny_rows):
    assert [r.recipe for r in tiny_rows] == ["fp32", "bf16", "delayed", "current", "block", "mxfp8", "nvfp4"]
    for r in tiny_rows:
        assert not r.error, r.error
        assert r.step_ms > 0 and r.path.endswith("grouped")
        assert all(math.isfinite(v) for v in r.errors.values())
    fp32 = tiny_rows[0]
    assert all(v == 0 for v in fp32.errors.values())  # the reference against itself: runs are deterministic
    assert fp32.path == "fp32/reference grouped" and tiny_rows[2].path == "reference/reference grouped"


def test_errors_are_ordered_by_precision(tiny_rows):
    by = {r.recipe: r for r in tiny_rows}
    for key in ("output", *GRADIENTS):
        assert by["bf16"].errors[key] < 0.02  # 8 mantissa bits, fp32 accumulation
        for fp8 in ("delayed", "current", "block", "mxfp8"):
            assert by["bf16"].errors[key] < by[fp8].errors[key] < 0.3
    assert by["nvfp4"].output_error > 2 * by["mxfp8"].output_error  # 4-bit elements
    # FP8 E4M3 with power-of-two scales rounds the same mantissas whatever the block size
    assert by["block"].errors == by["mxfp8"].errors


def test_delayed_scaling_is_timed_after_its_warm_up():
    """Without warm-up delayed scaling quantizes with the fresh scale 1, and the small gradients underflow;
    after one step its scales come from the amax history and it matches current scaling."""
    cold, current = run_compare([DelayedScaling(), Float8CurrentScaling()], shape=TINY, device="cpu", steps=1,
                                warmup=0, progress=False)
    warm, = run_compare([DelayedScaling()], shape=TINY, device="cpu", steps=1, warmup=1, progress=False)
    for grad in ("input", "fc1"):
        assert warm.errors[grad] < 1.5 * current.errors[grad] < cold.errors[grad]


def test_cli_compare_with_config_json_and_plot(tmp_path, capsys):
    cfg = tmp_path / "compare.yaml"
    cfg.write_text("recipes: [bf16, {name: mxfp8}, {name: nvfp4, disable_rht: true}]\n"
                   "shape: {tokens: 32, hidden: 32, ffn: 32, experts: 4, top_k: 2}\nseed: 3\nsteps: 1\n")
    png, js = tmp_path / "c.png", tmp_path / "c.json"
    assert main(["compare", "--config", str(cfg), "--plot", str(png), "--json", str(js), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mxfp8" in out and "nvfp4" in out and "current" not in out and "ms/step" in out
    rows = json.loads(js.read_text())
    assert [r["recipe"] for r in rows] == ["bf16", "mxfp8", "nvfp4"]
    assert rows[2]["config"] == {"name": "nvfp4", "disable_rht": True, "disable_stochastic_rounding": False,
                                 "disable_2d_quantization": False, "align_size": 128}
    assert set(rows[0]) >= {"output_error", "input_grad_error", "router_grad_error", "fc1_grad_error",
                            "fc2_grad_error", "step_ms", "path"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text, msg", [
    ("recipes: [{name: fp3}]", "unknown recipe name 'fp3'"),
    ("recipes: [{name: mxfp8, colour: red}]", "unknown config key(s) 'colour'"),
    ("recipes: []", "non-empty list"),
    ("shape: {tokens: 0}", "positive integer"),
    ("shape: {hidden: 100}", "multiple of 16"),
    ("shape: {layers: 2}", "unknown shape key"),
    ("shape: {experts: 2, top_k: 4}", "exceeds"),
    ("steps: 0", "'steps' must be an integer >= 1"),
    ("colour: red", "unknown config key"),
    ("[1, 2]", "is a mapping"),
], ids=["recipe-name", "recipe-field", "no-recipes", "zero-tokens", "hidden-16", "shape-key", "top-k",
        "steps", "top-key", "not-a-mapping"])
def test_bad_config_is_a_clear_error(tmp_path, capsys, text, msg):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    assert main(["compare", "--config", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_bad_device_and_missing_file_are_clear_errors(tmp_path, capsys):
    assert main(["compare", "--device", "tpu", "--no-progress"]) == 2
    assert "not a torch device" in capsys.readouterr().err
    assert main(["compare", "--config", str(tmp_path / "none.yaml"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_accepts_names_and_mappings():
    kw = load_compare_config({"recipes": ["fp32", {"name": "bf16"}, "block", {"name": "delayed", "margin": 1}],
                              "seed": 2})
    assert kw["recipes"][:2] == ["fp32", "bf16"] and kw["recipes"][3] == DelayedScaling(margin=1)
    assert kw["seed"] == 2


def test_a_failing_recipe_is_a_row_not_a_crash(monkeypatch):
    import qmoe.compare as compare

    real = compare.run_step

    def flaky(layer, x, dy, spec):
        if spec == "bf16":
            raise qmoe.UnsupportedError("the bf16 test op", why="this test says so")
        return real(layer, x, dy, spec)

    monkeypatch.setattr(compare, "run_step", flaky)
    rows = run_compare(["bf16", Float8CurrentScaling()], shape=TINY, device="cpu", steps=1, progress=False)
    assert "UnsupportedError" in rows[0].error and math.isnan(rows[0].output_error) and not rows[1].error
    assert "failed: UnsupportedError" in format_table(rows)


# ---------------------------------------------------------------- the plain PyTorch MoE peer

@pytest.mark.parametrize("pre_softmax", [False, True], ids=["topk-then-softmax", "softmax-then-topk"])
@pytest.mark.parametrize("use_grouped_mm", [False, pytest.param(True, marks=pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm"))], ids=["loop", "grouped_mm"])
def test_plain_moe_equals_moe_layer_in_fp32(pre_softmax, use_grouped_mm):
    """The benchmark's peer computes what qmoe's MoELayer computes: forward and every gradient."""
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(64, 96, 6, 2, pre_softmax=pre_softmax)
    peer = PlainMoE.from_moe_layer(layer, dtype=torch.float32, use_grouped_mm=use_grouped_mm)
    x, dy = torch.randn(3, 17, 64), torch.randn(3, 17, 64)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = layer(xa), peer(xb)
    ya.backward(dy)
    yb.backward(dy)
    pairs = [(ya, yb), (xa.grad, xb.grad), (layer.router.weight.grad, peer.router_weight.grad),
             (layer.experts.fc1.weight.grad, peer.fc1_weight.grad),
             (layer.experts.fc2.weight.grad, peer.fc2_weight.grad)]
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_plain_moe_gives_an_empty_expert_zero_gradients():
    torch.manual_seed(0)
    peer = PlainMoE(32, 32, 4, 1, dtype=torch.float32)
    with torch.no_grad():
        peer.router_weight[3] = -100.0  # expert 3 never wins
    peer(torch.randn(16, 32).abs()).square().mean().backward()
    assert torch.equal(peer.fc1_weight.grad[3], torch.zeros_like(peer.fc1_weight.grad[3]))
    assert torch.isfinite(peer.fc1_weight.grad).all()


def test_bench_moe_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from benchmarks.bench_moe import main as bench_main

    assert bench_main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_moe_rows_carry_the_eager_and_the_graphed_ratio(capsys):
    """A recipe's speed against qmoe bf16 in both modes (they differ: the eager one counts the host),
    printed side by side; a mode that did not run leaves its ratio empty."""
    from benchmarks.bench_moe import HEADER, _print_row, _ratios

    base = dict(shape="s", path="native", error=None, graph_error=None, tokens_per_s=1.0, peak_gib=1.0,
                peer_ms=None, speedup_vs_peer=None, ratio_vs_qmoe_bf16=None, graphed_ratio_vs_qmoe_bf16=None)
    bf16 = dict(base, recipe="bf16", eager_ms=30.0, graphed_ms=29.0)
    _ratios(bf16, bf16)
    block = dict(base, recipe="block", eager_ms=25.0, graphed_ms=23.2)
    _ratios(block, bf16)
    assert block["ratio_vs_qmoe_bf16"] == pytest.approx(1.2)
    assert block["graphed_ratio_vs_qmoe_bf16"] == pytest.approx(1.25)
    no_graph = dict(base, recipe="mxfp8", eager_ms=40.0, graphed_ms=None, graph_error="capture failed")
    _ratios(no_graph, bf16)
    assert no_graph["ratio_vs_qmoe_bf16"] == pytest.approx(0.75) and no_graph["graphed_ratio_vs_qmoe_bf16"] is None
    for row in (bf16, block, no_graph):
        _print_row(row)
    lines = capsys.readouterr().out.splitlines()
    assert HEADER.split()[-3:] == ["bf16", "graphed", "note"]
    assert "1.00x    1.00x" in lines[0] and "1.20x    1.25x" in lines[1] and "0.75x       -x" in lines[2]
