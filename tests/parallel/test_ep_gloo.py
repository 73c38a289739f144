"""Expert parallelism on CPU: `MoELayer(ep_group=...)` over 2, 4 and 8 gloo processes.

Every case compares the expert-parallel layer with the single-process MoELayer holding all E
experts and the same weights (rank r loads its slice, `shard_expert_state_dict`): the output
and the input gradient of rank r's tokens, the router gradient (summed over ranks, as data
parallelism would) and rank r's expert gradients against the matching slice.

References: fp32 cases run the single-process layer on each rank's tokens on their own (the
auxiliary losses and capacity are per routing call) and sum the expert gradients; recipe cases
run it once on all ranks' tokens concatenated, which quantizes every expert's group from the
same rows in the same order as the expert-parallel layer does, so where the math is the same
the results are identical. Quantized dispatch with 1-row blocks (FP8 1x128, MXFP8) sends the
very codes the single process computes: identical, except FC1's weight gradient, whose
columnwise copy is quantized from the dequantized rows (NUMERICS.md tolerance; power-of-two
scales make it identical here). Quantized current scaling takes one amax over the group
instead of one per expert: NUMERICS.md tolerance. The router's gradient sums the same terms
in another order: fp32 tolerance. Experts that get nothing must get exact zero gradients.
Two more cases check amax reduction (shared layers reduced over amax_reduction_group, the
experts' slots local) and the construction error for E not divisible by the ranks.

One spawn per world size runs all its cases (spawning dominates the runtime); each case is a
test that reads the workers' verdicts. A deadline kills hung workers, and gloo's own timeout
turns a collective that never completes into an error. Under the `gpu` marker the same cases run
with qmoe's kernels, within each recipe's tolerance: on 2 GPUs with NCCL, and with both ranks
sharing one GPU over gloo where only one is present.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

H, F, E = 64, 32, 8
DEADLINE_S = 150
_DEVICE = torch.device("cpu")  # a worker's device: cuda:rank under NCCL (test_expert_parallel_layer_on_gpus)

# id: (world, spec). spec keys: recipe (config name or None), dtype, top_k, capacity (factor),
# aux (coefficient), bias, skew ("none" | "one-rank": every token goes to rank 0's experts and
# all of them to expert 0), tokens ("uneven": 9 + 4r per rank | "equal": 12), quantized (dispatch),
# expect ("fp32" | "identical" | "tolerance" | "error": a ValueError on every rank), requantized
# (expectation for w1, whose wgrad copy quantized dispatch quantizes from dequantized rows),
# reference ("per-rank" | "concat"; default per-rank for fp32, concat otherwise), layer (more
# MoELayer options).
CASES = {
    "fp32-k2": (2, dict()),
    "fp32-k1-bias-aux": (2, dict(top_k=1, bias=True, aux=0.1)),
    "fp32-skew-zero-rank-one-expert": (2, dict(skew="one-rank", bias=True)),
    "fp32-capacity": (2, dict(capacity=1.0, aux=0.1, tokens="equal")),
    "capacity-uneven-tokens-raise": (2, dict(capacity=1.0, expect="error")),
    "bf16": (2, dict(dtype="bf16", expect="identical")),
    "delayed": (2, dict(recipe="delayed", expect="identical")),
    "current-bf16-dispatch": (2, dict(recipe="current", quantized=False, expect="identical")),
    "current-quantized": (2, dict(recipe="current", expect="tolerance")),
    "block-quantized": (2, dict(recipe="block", expect="identical", requantized="tolerance")),
    "mxfp8-quantized": (2, dict(recipe="mxfp8", bias=True, expect="identical", requantized="tolerance")),
    "mxfp8-bf16-dispatch": (2, dict(recipe="mxfp8", quantized=False, expect="identical")),
    "mxfp8-quantized-skew": (2, dict(recipe="mxfp8", skew="one-rank", expect="identical", requantized="tolerance")),
    "mxfp8-quantized-capacity": (2, dict(recipe="mxfp8", capacity=2.0, tokens="equal", expect="tolerance",
                                         reference="per-rank")),
    "nvfp4": (2, dict(recipe="nvfp4", expect="identical")),
    "shared-amax-reduced-expert-amax-local": (2, dict(kind="amax")),
    "experts-not-divisible-by-ranks-raise": (2, dict(kind="bad-experts")),
    "mxfp8-capacity-cuda-graph": (2, dict(kind="graph", recipe="mxfp8", capacity=2.0, gpu_only=True)),
    "fp32-capacity-cuda-graph": (2, dict(kind="graph", capacity=1.0, gpu_only=True)),
    "fp32-k2-4ranks": (4, dict(top_k=2, bias=True, aux=0.1)),
    "fp32-skew-4ranks": (4, dict(skew="one-rank")),
    # HF DeepSeek-V3 / gpt-oss / Qwen2-MoE routing options and a gated shared expert (replicated)
    "fp32-routing-options-shared-experts": (2, dict(layer=dict(
        score_function="sigmoid", num_groups=4, group_topk=2, group_score_topk=2, normalize_topk_probs=False,
        scaling_factor=2.5, router_bias=True, shared_expert_ffn_hidden_size=16, shared_expert_gate=True))),
    "fp32-capacity-4ranks": (4, dict(capacity=1.5, tokens="equal")),
    "block-quantized-4ranks": (4, dict(recipe="block", expect="identical", requantized="tolerance")),
    "current-quantized-skew-4ranks": (4, dict(recipe="current", skew="one-rank", expect="tolerance")),
    # 8 ranks, one expert each (E = 8): the DeepSeek-V3 layout's degree of expert parallelism
    "fp32-k2-8ranks": (8, dict(top_k=2, aux=0.1)),
    "fp32-skew-8ranks": (8, dict(skew="one-rank", top_k=1, bias=True)),  # rank 0 holds one expert
    "mxfp8-quantized-8ranks": (8, dict(recipe="mxfp8", expect="identical", requantized="tolerance")),
    "fp32-capacity-8ranks": (8, dict(capacity=1.5, tokens="equal")),
}


# ---------------------------------------------------------------- what every rank runs

def _recipe(name):
    from qmoe.recipes import recipe_from_config

    if name is None:
        return None
    config = {"name": name}
    if name == "nvfp4":
        config["disable_stochastic_rounding"] = True  # deterministic, so both layers round alike
    return recipe_from_config(config)


def _build(spec, world, group=None):
    import qmoe

    dtype = torch.bfloat16 if spec.get("dtype") == "bf16" else torch.float32
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(H, F, E, spec.get("top_k", 2), bias=spec.get("bias", False),
                             aux_loss_coeff=spec.get("aux", 0.0), capacity_factor=spec.get("capacity"),
                             expert_bias=spec.get("skew") == "one-rank", params_dtype=dtype, device=_DEVICE,
                             ep_group=group, quantized_dispatch=spec.get("quantized", True),
                             **spec.get("layer", {}))
    if group is None:
        with torch.no_grad():
            layer.router.weight.mul_(4)  # clear-cut selections, varied probabilities
            if layer.router.bias is not None:
                layer.router.bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(3)))
            if spec.get("skew") == "one-rank":  # selection only: rank 0's experts, expert 0 always
                first_rank = torch.full((E,), -50.0)
                first_rank[:E // world] = 0.0
                first_rank[0] = 50.0
                layer.router.expert_bias.copy_(first_rank)
    return layer.eval()  # eval: an expert bias stays put between steps


def _inputs(spec, world):
    """Each rank's tokens and upstream gradients, known to every rank."""
    gen = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if spec.get("dtype") == "bf16" else torch.float32
    sizes = [12 if spec.get("tokens") == "equal" else 9 + 4 * r for r in range(world)]
    xs = [torch.randn(t, H, generator=gen).to(_DEVICE, dtype) for t in sizes]
    gs = [torch.randn(t, H, generator=gen).to(_DEVICE, dtype) for t in sizes]
    return xs, gs


def _grads(layer):
    fc1, fc2 = layer.experts.fc1, layer.experts.fc2
    out = {"router": layer.router.weight.grad, "w1": fc1.weight.grad, "w2": fc2.weight.grad}
    if fc1.use_bias:
        out.update(b1=fc1.bias.grad, b2=fc2.bias.grad)
    if layer.router.bias is not None:
        out["router_bias"] = layer.router.bias.grad
    if layer.shared_experts is not None:
        out.update(shared_w1=layer.shared_experts.fc1.weight.grad, shared_w2=layer.shared_experts.fc2.weight.grad)
    if layer.shared_expert_gate is not None:
        out["shared_gate"] = layer.shared_expert_gate.weight.grad
    return {k: v.detach().clone() for k, v in out.items()}


# replicated parameters: their gradients are summed over the ranks, as data parallelism would
REPLICATED = ("router", "router_bias", "shared_w1", "shared_w2", "shared_gate")


def _step(layer, x, g, recipe, steps):
    """`steps` forward + backward passes (delayed scaling warms its history up); the last one's results."""
    import qmoe

    group = dist.group.WORLD if dist.is_initialized() else None
    for _ in range(steps):
        layer.zero_grad()
        x = x.detach().clone().requires_grad_(True)
        with qmoe.autocast(recipe=recipe, enabled=recipe is not None, amax_reduction_group=group):
            y = layer(x)
        ((y.float() * g.float()).sum() + layer.aux_loss).backward()
    return {"y": y.detach(), "dx": x.grad.detach(), **_grads(layer)}


def _reference(full, xs, gs, recipe, per_rank, steps):
    """The single-process layer's results, split per rank; expert and router gradients summed."""
    if per_rank:
        runs = [_step(full, x, g, recipe, steps) for x, g in zip(xs, gs)]
        out = {k: sum(r[k] for r in runs) for k in runs[0] if k not in ("y", "dx")}
        out["y"], out["dx"] = [r["y"] for r in runs], [r["dx"] for r in runs]
        return out
    run = _step(full, torch.cat(xs), torch.cat(gs), recipe, steps)
    sizes = [x.shape[0] for x in xs]
    run["y"], run["dx"] = list(run["y"].split(sizes)), list(run["dx"].split(sizes))
    return run


def _check(name, got, want, expect, recipe):
    from tests.tolerances import MOE_GEMM_DEPTH, assert_within_tolerance, recipe_tolerance

    got, want = got.float(), want.float()
    if os.environ.get("EP_DEBUG"):
        rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        print(f"{name}: {expect}, relative error {rel:.3g}, identical {torch.equal(got, want)}")
    if not want.any():  # nothing reached these experts (or rows): exact zeros, never noise
        assert not got.any(), f"{name}: expected exact zeros, max |got| {got.abs().max().item():.3g}"
        return
    if name == "router" and expect == "identical":
        expect = "fp32"  # a sum over all tokens, added up per rank here: the same terms in another order
    if expect == "identical":
        assert torch.equal(got, want), f"{name}: not identical, max diff {(got - want).abs().max().item():.3g}"
    elif expect == "tolerance":
        assert_within_tolerance(got, want, *recipe_tolerance(recipe, MOE_GEMM_DEPTH[name]), name)
    else:
        scale = float(want.abs().max())
        # the router gradient sums cancelling per-token terms: measure it on its own magnitude
        rtol = 1e-4 if name == "router" else 1e-5
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale, msg=name)


def _check_amax_groups(rank, world):
    """Shared layers' amaxes are reduced over amax_reduction_group; expert-parallel experts' stay local."""
    import qmoe
    from qmoe.autocast import RecipeState
    from qmoe.recipes import DelayedScaling, Float8CurrentScaling

    world_group = dist.group.WORLD
    amax = [2.0, 8.0][rank]
    w = torch.full((4, 128), amax)
    w[0, 0] = -amax
    shared = RecipeState().get(Float8CurrentScaling(), world_group)
    local = RecipeState(local_amax=True).get(Float8CurrentScaling(), world_group)
    def scale_inv(a):  # NUMERICS.md in fp32: 1 / (448 / amax)
        return (1.0 / (torch.tensor(448.0) / a)).item()

    # current scaling: a shared weight takes the group's amax (8), activations and local slots their own
    assert shared["weight"].quantize(w).rowwise_scale_inv.item() == scale_inv(8.0)
    assert GroupedTensorOf(shared["weight"], w).rowwise_scale_inv.tolist() == [scale_inv(8.0)] * 2
    assert shared["input"].quantize(w).rowwise_scale_inv.item() == scale_inv(amax)
    assert local["weight"].quantize(w).rowwise_scale_inv.item() == scale_inv(amax)

    # delayed scaling: a shared Linear's slots are reduced at the region's exit, the experts' are not
    torch.manual_seed(0)
    linear = qmoe.nn.Linear(H, H)
    layer = qmoe.nn.MoELayer(H, F, E, 2, ep_group=world_group)
    x = torch.randn(10, H) * (1 + 3 * rank)
    with qmoe.autocast(recipe=DelayedScaling(), amax_reduction_group=world_group):
        layer(linear(x)).sum().backward()
    amax_x = x.abs().amax()
    dist.all_reduce(amax_x, op=dist.ReduceOp.MAX)
    want = torch.tensor(448.0) / amax_x  # the group's amax, on every rank (HYBRID: E4M3 input)
    assert torch.equal(linear.recipe_state.quantizers["input"].scale, want.reshape(1))
    assert not layer.experts.fc1.recipe_state.quantizers["input"].state.reduce_amax


def GroupedTensorOf(q, w):  # noqa: N802 - two groups of the same rows
    from qmoe import GroupedTensor

    return GroupedTensor.quantize(torch.cat((w, w)), [4, 4], q)


def _check_graph_replay(spec, rank, world):
    """Fixed-capacity EP: the layer's forward and backward captured in CUDA graphs (NCCL all-to-alls
    inside) replay new tokens, so new routing, exactly as the eager layer computes them."""
    import qmoe

    recipe = _recipe(spec.get("recipe"))
    layer = _build(spec, world, group=dist.group.WORLD).train()
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(16, H, generator=gen).to(_DEVICE), torch.randn(16, H, generator=gen).to(_DEVICE))
               for _ in range(3)]
    sample = batches[0][0].clone().requires_grad_(True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        graphed = qmoe.graph.capture(layer, (sample,))

    def run(fn, x, g):
        layer.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            y = fn(x)
        ((y.float() * g.float()).sum() + layer.aux_loss).backward()
        return {"y": y.detach().clone(), "dx": x.grad.clone(), **_grads(layer)}

    for x, g in batches[1:]:
        want = run(layer, x, g)
        got = run(graphed, x, g)
        for k in want:
            assert torch.equal(got[k], want[k]), \
                f"{k}: replay differs from eager, max diff {(got[k] - want[k]).abs().max().item():.3g}"


def _run_case(spec, rank, world):
    from qmoe.parallel import shard_expert_state_dict

    if spec.get("kind") == "graph":
        return _check_graph_replay(spec, rank, world)
    if spec.get("kind") == "amax":
        return _check_amax_groups(rank, world)
    if spec.get("kind") == "bad-experts":
        import qmoe

        with pytest.raises(ValueError, match=f"num_experts=3 must be divisible by the expert-parallel group size "
                                             f"{world}"):
            qmoe.nn.MoELayer(H, F, 3, 2, ep_group=dist.group.WORLD)
        return

    expect = spec.get("expect", "fp32")
    # fp32 layers route each rank's tokens on their own (capacity and aux losses are per routing
    # call), whatever tolerance the device's kernels need below
    per_rank = spec.get("reference", "per-rank" if expect == "fp32" else "concat") == "per-rank"
    if _DEVICE.type == "cuda" and expect in ("identical", "fp32"):
        # the kernels' tiles may add in another order for other group sizes: the recipe's tolerance
        expect = "tolerance"
        spec = {**spec, "requantized": "tolerance"}
    recipe = _recipe(spec.get("recipe"))
    steps = 2 if spec.get("recipe") == "delayed" else 1  # the second step uses recorded amaxes
    full = _build(spec, world)
    ep = _build(spec, world, group=dist.group.WORLD)
    ep.load_state_dict(shard_expert_state_dict(full.state_dict(), E, rank, world))
    xs, gs = _inputs(spec, world)
    if expect == "error":
        with pytest.raises(ValueError, match="same token count on every rank"):
            _step(ep, xs[rank], gs[rank], recipe, steps)
        return
    want = _reference(full, xs, gs, recipe, per_rank, steps)
    got = _step(ep, xs[rank], gs[rank], recipe, steps)
    stats = ep.dispatcher.last_stats
    quantized = spec.get("quantized", True) and spec.get("recipe") in ("current", "block", "mxfp8")
    assert stats["quantized"] == quantized, stats
    if quantized:  # a row on the wire: 1 byte per element, its scales, its fp32 prob
        scale_bytes = {"current": 0, "block": 4 * -(-H // 128), "mxfp8": -(-H // 32)}[spec["recipe"]]
        assert stats["dispatch_bytes"] == stats["rows_sent"] * (H + scale_bytes + 4), stats
    lo, hi = rank * E // world, (rank + 1) * E // world
    _check("y", got["y"], want["y"][rank], expect, recipe)
    _check("dx", got["dx"], want["dx"][rank], expect, recipe)
    for k in got:
        if k in REPLICATED:
            dist.all_reduce(got[k])
            _check("router" if k.startswith("router") else k, got[k], want[k], expect, recipe)
        elif k not in ("y", "dx"):
            _check(k, got[k], want[k][lo:hi], spec.get("requantized", expect) if k == "w1" else expect, recipe)
    if spec.get("skew") == "one-rank":
        assert ep.router.tokens_per_expert[0] == xs[rank].shape[0], "expert 0 should receive every token"
        received = ep.dispatcher.last_stats["rows_received"]
        assert (received == 0) == (rank > 0), f"rank {rank} received {received} rows"
    if recipe is not None and recipe.config_name == "delayed":
        # expert slots stay local: this rank's fc1 input scales are the full layer's for its experts
        local = ep.experts.fc1.recipe_state.quantizers["input"].scale
        assert torch.equal(local, full.experts.fc1.recipe_state.quantizers["input"].scale[lo:hi])


def _worker(rank, world, port, out_dir, case_ids, backend="gloo"):
    global _DEVICE
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":  # NCCL_NVLS_ENABLE and the like are inherited from the environment as they are
        torch.cuda.set_device(rank)
        _DEVICE = torch.device("cuda", rank)
    elif backend == "gloo-one-gpu":  # every rank on GPU 0; gloo stages the CUDA tensors through the host
        torch.cuda.set_device(0)
        _DEVICE = torch.device("cuda", 0)
        backend = "gloo"
    # kernels compile and autotune on first use on a GPU: a rank may wait that long for the other
    timeout = datetime.timedelta(seconds=60 if _DEVICE.type == "cpu" else 300)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    verdicts = {}
    try:
        for case in case_ids:
            verdicts[case] = "the worker died in this case (a collective mismatch aborts gloo)"
            if os.environ.get("EP_DEBUG"):
                print(f"[rank {rank}] {case} starts at {time.monotonic():.1f}", flush=True)
            _save(verdicts, out_dir, rank)
            try:
                _run_case(CASES[case][1], rank, world)
                verdicts[case] = None
            except Exception:  # noqa: BLE001 - reported per case by the parent
                verdicts[case] = traceback.format_exc(limit=6)
            _save(verdicts, out_dir, rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _save(verdicts, out_dir, rank):
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(verdicts, f)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------- the parent: one spawn per world size

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, backend="gloo", case_ids=None, deadline_s=DEADLINE_S):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    case_ids = case_ids or [c for c, (w, spec) in CASES.items() if w == world and not spec.get("gpu_only")]
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), out_dir, case_ids, backend), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    break  # cases without a verdict fail below
        except mp.ProcessExitedException:
            pass  # a crashed worker's case keeps its "died" verdict, later cases get none
        finally:
            for p in ctx.processes:  # only the workers this test started
                if p.is_alive():
                    p.kill()
        verdicts = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.json")
            got = {}
            if os.path.exists(path):
                with open(path) as f:
                    got = json.load(f)
            verdicts.append({c: got.get(c, f"not run: the {world}-process run stopped (deadline {deadline_s} s "
                                            f"or a crash) before this case") for c in case_ids})
    return verdicts


@pytest.fixture(scope="module")
def ep_runs():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = _spawn(world)
        return cache[world]
    return get


@pytest.mark.parametrize("case", [c for c, (_, spec) in CASES.items() if not spec.get("gpu_only")])
def test_expert_parallel_layer_equals_single_process(case, ep_runs):
    world = CASES[case][0]
    failures = [f"rank {r}:\n{v[case]}" for r, v in enumerate(ep_runs(world)) if v.get(case)]
    assert not failures, "\n".join(failures)


GPU_CASES = ["fp32-k2", "fp32-skew-zero-rank-one-expert", "fp32-capacity", "bf16", "delayed", "current-quantized",
             "block-quantized", "mxfp8-quantized", "mxfp8-quantized-skew", "mxfp8-quantized-capacity", "nvfp4",
             "fp32-capacity-cuda-graph", "mxfp8-capacity-cuda-graph"]


@pytest.mark.gpu
def test_expert_parallel_layer_sharing_one_gpu():
    """The 2-rank cases with qmoe's GPU kernels on a machine with one GPU: both ranks on it, gloo
    carrying the tokens (CUDA graphs need NCCL: those cases run in the test below)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cases = [c for c in GPU_CASES if CASES[c][1].get("kind") != "graph"]
    verdicts = _spawn(2, "gloo-one-gpu", cases, deadline_s=int(os.environ.get("EP_DEADLINE_S", 480)))
    failures = [f"{case} on rank {r}:\n{v[case]}" for r, v in enumerate(verdicts) for case in cases if v[case]]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_expert_parallel_layer_on_gpus():
    """The 2-rank cases on 2 GPUs with NCCL and qmoe's kernels, within each recipe's tolerance, and
    the fixed-capacity layer captured in CUDA graphs."""
    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA GPUs and NCCL")
    # the first runs compile and autotune the kernels
    verdicts = _spawn(2, "nccl", GPU_CASES, deadline_s=int(os.environ.get("EP_DEADLINE_S", 480)))
    failures = [f"{case} on rank {r}:\n{v[case]}" for r, v in enumerate(verdicts) for case in GPU_CASES if v[case]]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- in-process checks

def test_shard_expert_state_dict_slices_and_renumbers():
    from qmoe.parallel import shard_expert_state_dict

    full = {"router.weight": torch.zeros(8, 4), "experts.fc1.weight": torch.arange(8.0).view(8, 1, 1),
            "experts.fc2.weight3": torch.ones(1), "experts.fc2.weight5": torch.full((1,), 5.0)}
    local = shard_expert_state_dict(full, 8, ep_rank=1, ep_size=2)
    assert local["router.weight"] is full["router.weight"]
    assert local["experts.fc1.weight"].flatten().tolist() == [4.0, 5.0, 6.0, 7.0]
    assert set(local) == {"router.weight", "experts.fc1.weight", "experts.fc2.weight1"}
    assert local["experts.fc2.weight1"].item() == 5.0


def test_ep_group_without_torch_distributed_raises():
    import qmoe

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a real group object, with no default group initialised
    with pytest.raises(ValueError, match="init_process_group"):
        qmoe.nn.MoELayer(H, F, E, 2, ep_group=group)
    with pytest.raises(TypeError, match="ep_group"):  # anything else is named as the wrong type
        qmoe.nn.MoELayer(H, F, E, 2, ep_group=object())
