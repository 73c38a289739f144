"""Data parallelism: DDP and FSDP2 over 2 gloo processes equal one process on the whole batch.

A small model (an MoELayer and a qmoe Linear head, tests/nn/loop_cases.TinyModel) trains 3 SGD
steps on 2 ranks, rank r taking sequence r of each step's batch, with delayed-scaling amaxes
reduced over the group (`qmoe.autocast(amax_reduction_group=...)`). One process training the
same model on both sequences must reach the same parameters: each parameter's change over the
3 steps is compared within the recipe's NUMERICS.md tolerance (gradients are 3 GEMMs deep), and
delayed scaling's scales must be equal on both ranks, bit for bit (the reduced amaxes).

One spawn runs every (wrapper, recipe) case, for speed; the parent reads the results. FSDP2
(`torch.distributed.fsdp.fully_shard`) runs on the CPU with gloo where torch supports it; the
gpu-marked test runs both wrappers with qmoe's kernels, both ranks on one GPU (gloo) or on two
GPUs (NCCL).
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qmoe
from qmoe.recipes import recipe_from_config
from tests.nn.loop_cases import TinyModel, batch
from tests.tolerances import assert_within_tolerance, recipe_tolerance

RECIPES = [None, "delayed", "current", "block", "mxfp8", "nvfp4"]
WRAPPERS = ["ddp", "fsdp2"]


def wrappers_for(backend: str) -> list[str]:
    """FSDP2 on CUDA tensors needs NCCL: over gloo its sharded collectives end the process on an H200
    (both ranks on one GPU), so that case runs DDP only and FSDP2 runs on two GPUs with NCCL."""
    return ["ddp"] if backend == "gloo-one-gpu" else WRAPPERS
STEPS, LR = 3, 0.05
DEADLINE_S = 240


def _recipe(name):
    return None if name is None else recipe_from_config({"name": name})


def _train(model, recipe, device, rank_slice=None, group=None):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, target = batch(step, device, rank_slice=rank_slice)
        opt.zero_grad()
        with qmoe.autocast(recipe=_recipe(recipe), enabled=recipe is not None, amax_reduction_group=group):
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
        loss.backward()
        opt.step()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _delayed_scales(model):
    return {f"{name}.{role}": q.scale.clone() for name, m in model.named_modules() if hasattr(m, "recipe_state")
            for role, q in m.recipe_state.quantizers.items() if getattr(q, "scale", None) is not None}


def _run_case(wrapper, recipe, rank, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = TinyModel(device, expert_bias=False, aux_loss_coeff=0.0)
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in (model.moe, model.head):
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    _train(wrapped, recipe, device, rank_slice=slice(rank, rank + 1), group=dist.group.WORLD)
    params = {n: _full(p.detach()).cpu() for n, p in model.named_parameters()}
    return {"params": params, "scales": {k: v.cpu() for k, v in _delayed_scales(model).items()}}


def _worker(rank, world, port, out_dir, backend):
    requested = backend
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    elif backend == "gloo-one-gpu":
        torch.cuda.set_device(0)
        device, backend = torch.device("cuda", 0), "gloo"
    timeout = datetime.timedelta(seconds=60 if device.type == "cpu" else 300)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    results = {}
    try:
        for wrapper in wrappers_for(requested):
            for recipe in RECIPES:
                try:
                    results[(wrapper, recipe)] = _run_case(wrapper, recipe, rank, device)
                except Exception:  # noqa: BLE001 - reported per case by the parent
                    results[(wrapper, recipe)] = traceback.format_exc(limit=8)
                torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
                dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(backend="gloo", deadline_s=DEADLINE_S):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(2, _free_port(), out_dir, backend), nprocs=2, join=False,
                                 start_method="spawn")
        try:
            ctx.join(timeout=deadline_s)
        except mp.ProcessExitedException:
            pass  # the cases without a result fail below
        finally:
            for p in ctx.processes:  # only the workers this test started
                if p.is_alive():
                    p.kill()
        runs = []
        for r in range(2):
            path = os.path.join(out_dir, f"rank{r}.pt")
            runs.append(torch.load(path, weights_only=False) if os.path.exists(path) else {})
    return runs


def _check(runs, wrapper, recipe, device):
    for r, run in enumerate(runs):
        got = run.get((wrapper, recipe), "no result: the run stopped (deadline or crash) before this case")
        assert not isinstance(got, str), f"rank {r}:\n{got}"
    r0, r1 = runs[0][(wrapper, recipe)], runs[1][(wrapper, recipe)]
    assert r0["scales"].keys() == r1["scales"].keys()
    assert bool(r0["scales"]) == (recipe == "delayed")
    for name in r0["scales"]:  # amaxes reduced over the group: every rank holds the same scales
        assert torch.equal(r0["scales"][name], r1["scales"][name]), name
    start = TinyModel(device, expert_bias=False, aux_loss_coeff=0.0)
    initial = {n: p.detach().cpu().clone() for n, p in start.named_parameters()}
    _train(start, recipe, device)
    rtol, atol = recipe_tolerance(_recipe(recipe), 3)
    for name, p in start.named_parameters():
        want = p.detach().cpu() - initial[name]
        for r, run in enumerate((r0, r1)):
            got = run["params"][name] - initial[name]
            assert_within_tolerance(got, want, rtol, atol, f"{wrapper} {recipe} rank {r} {name} update")


@pytest.fixture(scope="module")
def dp_runs():
    return _spawn()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_data_parallel_equals_single_process(wrapper, recipe, dp_runs):
    _check(dp_runs, wrapper, recipe, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gloo-one-gpu", "nccl"])
def test_data_parallel_equals_single_process_on_gpu(backend):
    if backend == "nccl" and (torch.cuda.device_count() < 2 or not dist.is_nccl_available()):
        pytest.skip("needs 2 CUDA GPUs and NCCL")
    runs = _spawn(backend, deadline_s=int(os.environ.get("DP_DEADLINE_S", 480)))
    for wrapper in wrappers_for(backend):
        for recipe in RECIPES:
            _check(runs, wrapper, recipe, torch.device("cuda", 0))
