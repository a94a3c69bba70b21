"""FSDP2 models (``fully_shard``) through gradaccum, on 2 and 4 gloo processes (127.0.0.1).

A model wrapped with ``fully_shard`` on a 1-D mesh (2 ranks) or a 2x2 (replicate, shard) mesh
(HSDP, 4 ranks) trains through ``gradaccum.shard(model)`` and a ``reduce_scatter`` sync: the
gradients land as DTensors on the model's DTensor parameters and equal, in float64, the
gradient of one process on the global batch (rows split unevenly, one rank empty; parameters
whose rows do not divide evenly, some ranks holding none); two AdamW steps on
``model.parameters()`` match the same steps in one process; and FSDP2 itself communicates
nothing: its hooks are kept quiet, every collective is gradaccum's, counted: one all-gather and
one reduce-scatter per ``fully_shard`` unit, as FSDP2's own.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run, values
from models import regression_batch
from test_distributed import _shard

import gradaccum

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

N = 3
TOL = 1e-12
SPLITS = {2: (7, 0), 4: (3, 0, 5, 4)}  # rows per rank: uneven, one empty


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3), torch.nn.Linear(3, 1)
    ).double()


def _loss(model: torch.nn.Module, params: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    out, _ = gradaccum.call_module(model, params, {}, x)
    return ((out.squeeze(-1) - y) ** 2).mean()


def _counting(calls: Counter[str], name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def _fsdp2(rank: int, world: int, shape: tuple[int, ...]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    split = SPLITS[world]
    rows = sum(split)
    batch = regression_batch(rows)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    # The reference: one process, the global batch, plain autograd and AdamW.
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    ref_grads = []
    for _ in range(2):
        ref_opt.zero_grad()
        x, y = batch
        ((ref(x).squeeze(-1) - y) ** 2).mean().backward()
        ref_grads.append({k: p.grad.clone() for k, p in ref.named_parameters()})
        ref_opt.step()
    out: dict[str, Any] = {"diffs": {}, "fsdp traffic": {}, "counts": {}, "kinds": {}}
    for policy in ("boundary", "every"):
        model = _model()
        for layer in (model[0], model[2], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = gradaccum.shard(model)
        sync = gradaccum.reduce_scatter(sharded, policy=policy)
        step = gradaccum.accumulate(
            gradaccum.grad(lambda p, b, m=model: _loss(m, p, b)), N, sync=sync
        )
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        fsdp_calls: Counter[str] = Counter()
        originals = {k: getattr(dist, k) for k in ("all_gather_single", "reduce_scatter_single")}

        for k, fn in originals.items():
            setattr(dist, k, _counting(fsdp_calls, k, fn))
        try:
            for s in range(2):
                with gradaccum.sync.record_collectives() as log:
                    grads = step(sharded, _shard(batch, rank, split))
                sharded.write_grads(grads)
                kinds = {
                    k: (type(p.grad).__name__, p.grad.placements == p.placements)
                    for k, p in model.named_parameters()
                }
                out["kinds"][f"{policy} {s}"] = kinds
                for k, p in model.named_parameters():
                    want = ref_grads[s][k.replace("_fsdp_wrapped_module.", "")]
                    got = p.grad.full_tensor()
                    out["diffs"][f"{policy} step {s} grad {k}"] = float(
                        (got - want).abs().max() / want.abs().max().clamp_min(1e-300)
                    )
                out["counts"][f"{policy} {s}"] = Counter((c.kind, c.purpose, c.dim) for c in log)
                opt.step()
                opt.zero_grad()
        finally:
            for k, fn in originals.items():
                setattr(dist, k, fn)
        out["fsdp traffic"][policy] = dict(fsdp_calls)
        for k, p in model.named_parameters():
            want = dict(ref.named_parameters())[k].detach()
            out["diffs"][f"{policy} params {k}"] = float(
                (p.full_tensor() - want).abs().max() / want.abs().max()
            )
    return out


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["1-D mesh on 2", "2x2 HSDP on 4"])
def test_an_fsdp2_model_trains_exactly_with_gradaccum_collectives_only(
    shape: tuple[int, ...],
) -> None:
    world = 1
    for size in shape:
        world *= size
    for out in values(run(_fsdp2, shape, world=world, timeout=240), world=world):
        bad = {k: v for k, v in out["diffs"].items() if not v < TOL}
        assert len(out["diffs"]) == 2 * (2 * 6 + 6)
        assert not bad, bad
        for key, kinds in out["kinds"].items():
            assert set(kinds.values()) == {("DTensor", True)}, (key, kinds)
        assert out["fsdp traffic"] == {"boundary": {}, "every": {}}
        for key, counts in out["counts"].items():
            policy = key.split()[0]
            units = 3  # one bucket per fully_shard unit (its weight and bias), as FSDP2
            scatter = ("reduce_scatter", "gradients (every)" if policy == "every" else "gradients")
            assert counts[(*scatter, "shard")] == (N if policy == "every" else 1) * units, key
            assert counts[("all_gather", "params", "shard")] == units, key
            if len(shape) == 2:
                assert counts[("all_reduce", "gradients", "replicate")] == units, key


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


def _refusals(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    partly = _model()
    fully_shard(partly[0], mesh=mesh)  # the other layers stay plain
    other = torch.nn.Linear(4, 4).double()
    fully_shard(other, mesh=mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    model = _model()
    fully_shard(model, mesh=mesh)
    sharded = gradaccum.shard(model)
    return {
        "partly": _error(lambda: gradaccum.shard(partly)),
        "placement": _error(lambda: gradaccum.shard(other)),
        "params_of": _error(lambda: gradaccum.params_of(model)),
        "state_dict": _error(sharded.state_dict),
        "other group": _error(lambda: gradaccum.shard(model, dist.new_group([0, 1]))),
    }


def test_unsupported_fsdp2_setups_are_refused() -> None:
    for out in values(run(_refusals, world=2, timeout=120), world=2):
        where = "shard(params, group, bucket_mb=..., param_groups=..., src=...): "
        assert out["partly"].startswith(
            f"ValueError: {where}params is a module that is not wholly wrapped with FSDP2's "
            f"fully_shard (parameters that are not DTensors: ['2.bias', '2.weight', "
        ), out
        assert out["placement"].startswith(
            f"GradAccumError: {where}parameter 'weight' is sharded as [Shard(dim=1)]"
        ), out
        assert "(no shard_placement_fn)" in out["placement"], out
        assert out["params_of"].startswith(
            "GradAccumError: params_of(module): parameter '0.weight' is a DTensor"
        ), out
        assert "sharded = gradaccum.shard(model)" in out["params_of"], out
        assert out["state_dict"].startswith(
            "GradAccumError: Sharded.state_dict(): these shards are an FSDP2 model's parameters"
        ), out
        assert out["other group"].startswith(f"ValueError: {where}group is "), out


# -- a window in progress of an FSDP2 model: DCP for the model, dcp_save for the window --------


def _fsdp2_mid(rank: int, world: int, folder: str, stage: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.func import grad

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    torch.manual_seed(0 if stage == "save" else 5)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    model = model.double()
    if stage != "save":
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # other values: the checkpoint must replace them
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sharded = gradaccum.shard(model)
    acc = gradaccum.Accumulator(2, sync=gradaccum.reduce_scatter(sharded))
    split = (4, 3)  # two non-empty micro-batches per rank

    def micro(k: int) -> Any:
        x, y = _shard(regression_batch(sum(split), seed=300 + k // 2), rank, split)
        return (x[k % 2 :: 2], y[k % 2 :: 2])  # 2 micro-batches of the window's rows

    def run_steps(state: Any, steps: range) -> Any:
        for k in steps:
            mb = micro(k)
            g = grad(lambda p, b: _loss(model, p, b))(sharded.gather(), mb)
            state = acc.add(state, g, size=len(mb[0]))
            if k % 2 == 1:
                grads, state = acc.finalize(state)
                sharded.write_grads(grads)
                opt.step()
                opt.zero_grad()
        return state

    if stage == "save":
        state = run_steps(acc.init(sharded), range(3))  # window 0, and half of window 1
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=f"{folder}/model")
        gradaccum.checkpoint.dcp_save(f"{folder}/window", sharded, accumulator=acc, state=state)
        run_steps(state, range(3, 6))
    else:
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": opt_sd}, checkpoint_id=f"{folder}/model")
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
        state = gradaccum.checkpoint.dcp_load(f"{folder}/window", sharded, accumulator=acc)
        assert state.micro_step == 1, state.micro_step
        run_steps(state, range(3, 6))
    return {k: p.full_tensor().clone() for k, p in model.named_parameters()}


def test_an_fsdp2_window_in_progress_resumes_bit_identically(tmp_path: Any) -> None:
    folder = str(tmp_path)
    first = values(run(_fsdp2_mid, folder, "save", world=2, timeout=180), world=2)[0]
    for out in values(run(_fsdp2_mid, folder, "load", world=2, timeout=180), world=2):
        assert out.keys() == first.keys()
        assert all(torch.equal(out[k], first[k]) for k in out), {
            k: float((out[k] - first[k]).abs().max()) for k in out
        }
