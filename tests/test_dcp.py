"""Sharded params and AdamW state through ``torch.distributed.checkpoint`` (127.0.0.1, gloo).

Training on 4 ranks is saved with DCP between windows, then resumed on 4 ranks (bit-identical
to the uninterrupted run), on 2 ranks (resharded: the loaded params and optimizer state equal
the saved ones exactly, and the run goes on to the same params within float64 rounding), and
the other way round (saved on 2, loaded on 4). Resuming without the optimizer state gives other
params (so the check can fail). A checkpoint of another layout is refused before anything
changes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist import run, values
from models import mean_loss, mlp_params, regression_batch
from test_distributed import _shard

import gradaccum

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SPLITS = {2: (5, 4), 4: (3, 0, 4, 2)}  # 9 rows per window, split unevenly
WINDOWS = 4
SAVE_AFTER = 2
N = 2


def _groups(path: str) -> str:
    return "no_decay" if "'b" in path else "decay"


def _setup(seed: int) -> tuple[Any, Any, Any]:
    sp = gradaccum.shard(mlp_params(kind="dict", seed=seed), bucket_mb=1e-5, param_groups=_groups)
    opt = torch.optim.AdamW(
        [
            {"params": sp.group_shards("decay"), "weight_decay": 0.1},
            {"params": sp.group_shards("no_decay"), "weight_decay": 0.0},
        ],
        lr=0.05,
    )
    step = gradaccum.accumulate(gradaccum.grad(mean_loss), N, sync=gradaccum.reduce_scatter(sp))
    return sp, opt, step


def _train(sp: Any, opt: Any, step: Any, rank: int, world: int, windows: range) -> None:
    for w in windows:
        batch = regression_batch(sum(SPLITS[world]), seed=100 + w)
        sp.write_grads(step(sp, _shard(batch, rank, SPLITS[world])))
        opt.step()
        opt.zero_grad(set_to_none=True)


def _full_state(sp: Any, opt: Any) -> dict[str, torch.Tensor]:
    """The gathered params and AdamW moments (the moments gathered like params)."""
    out = {f"param {k}": v.clone() for k, v in sp.gather().items()}
    for name in ("exp_avg", "exp_avg_sq"):
        saved = [s.clone() for s in sp.shards]
        with torch.no_grad():
            for s in sp.shards:
                s.copy_(opt.state[s][name])
            out.update({f"{name} {k}": v.clone() for k, v in sp.gather().items()})
            for s, t in zip(sp.shards, saved, strict=True):
                s.copy_(t)
    return out


def _save(rank: int, world: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    sp, opt, step = _setup(0)
    _train(sp, opt, step, rank, world, range(SAVE_AFTER))
    dcp.save({"train": gradaccum.checkpoint.dcp_checkpoint(sp, opt)}, checkpoint_id=folder)
    saved = _full_state(sp, opt)
    _train(sp, opt, step, rank, world, range(SAVE_AFTER, WINDOWS))
    return {"saved": saved, "final": _full_state(sp, opt)}


def _resume(rank: int, world: int, folder: str, with_opt: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    sp, opt, step = _setup(7)  # other initial params: the checkpoint must replace them
    ckpt = gradaccum.checkpoint.dcp_checkpoint(sp, opt if with_opt else None)
    dcp.load({"train": ckpt}, checkpoint_id=folder)
    loaded = _full_state(sp, opt) if with_opt else {}
    _train(sp, opt, step, rank, world, range(SAVE_AFTER, WINDOWS))
    out: dict[str, Any] = {"loaded": loaded, "final": _full_state(sp, opt)}
    # Another layout (one bucket): refused, nothing changed.
    other = gradaccum.shard(mlp_params(kind="dict", seed=7), param_groups=_groups)
    before = [s.clone() for s in other.shards]
    try:
        dcp.load({"train": gradaccum.checkpoint.dcp_checkpoint(other)}, checkpoint_id=folder)
        out["other layout"] = "no error"
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        out["other layout"] = f"{type(err).__name__}: {err}"
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(other.shards, before, strict=True))
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(4, 4), (4, 2), (2, 4)])
def test_dcp_resumes_and_reshards(tmp_path: Any, saved_on: int, loaded_on: int) -> None:
    folder = os.path.join(tmp_path, "ckpt")
    first = values(run(_save, folder, world=saved_on, timeout=180), world=saved_on)[0]
    for out in values(run(_resume, folder, True, world=loaded_on, timeout=180), world=loaded_on):
        assert _diff(out["loaded"], first["saved"]) == 0.0  # exactly what was saved
        if saved_on == loaded_on:
            assert _diff(out["final"], first["final"]) == 0.0  # bit-identical
        else:
            assert _diff(out["final"], first["final"]) < 1e-12
        # DCP refuses the bucket shapes first; gradaccum checks the leaves when they agree.
        assert (
            "saved for another sharded layout" in out["other layout"]
            or "Size mismatch between saved" in out["other layout"]
        ), out["other layout"]
        assert out["unchanged"] is True
    if (saved_on, loaded_on) == (4, 2):  # without the optimizer state: other params
        out = values(run(_resume, folder, False, world=loaded_on, timeout=180), world=loaded_on)[0]
        assert _diff(out["final"], first["final"]) > 1e-3


# -- a window in progress: Accumulator + reduce_scatter, through dcp_save / dcp_load -----------

MID_SPLITS = {2: (5, 6), 4: (3, 2, 4, 2)}  # 11 rows per window: 2 non-empty micro-batches each


def _micro(world: int, rank: int, w: int) -> list[Any]:
    batch = regression_batch(sum(MID_SPLITS[world]), seed=200 + w)
    mine = _shard(batch, rank, MID_SPLITS[world])
    return list(zip(*(torch.tensor_split(t, N) for t in mine), strict=True))


def _accumulate(
    sp: Any, opt: Any, acc: Any, state: Any, rank: int, world: int, steps: range
) -> Any:
    """Micro-steps ``steps`` (window ``k // N``, micro-batch ``k % N``) of the streaming loop."""
    from torch.func import grad

    for k in steps:
        w, i = divmod(k, N)
        x, y = _micro(world, rank, w)[i]
        state = acc.add(state, grad(mean_loss)(sp.gather(), (x, y)), size=len(x))
        if i == N - 1:
            grads, state = acc.finalize(state)
            sp.write_grads(grads)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return state


def _mid(rank: int, world: int, folder: str, policy: str, stage: str) -> dict[str, Any]:
    sp, opt, _ = _setup(0 if stage == "save" else 7)
    acc = gradaccum.Accumulator(N, sync=gradaccum.reduce_scatter(sp, policy=policy))
    mid, between = os.path.join(folder, "mid"), os.path.join(folder, "between")
    out: dict[str, Any] = {}
    if stage == "save":
        state = _accumulate(sp, opt, acc, acc.init(sp), rank, world, range(2 * N))
        gradaccum.checkpoint.dcp_save(between, sp, opt, accumulator=acc, state=state)
        state = _accumulate(sp, opt, acc, state, rank, world, range(2 * N, 2 * N + 1))
        gradaccum.checkpoint.dcp_save(mid, sp, opt, accumulator=acc, state=state)
        _accumulate(sp, opt, acc, state, rank, world, range(2 * N + 1, 4 * N))
        return {"final": _full_state(sp, opt)}
    fresh = {k: v.clone() for k, v in sp.gather().items()}
    try:
        state = gradaccum.checkpoint.dcp_load(mid, sp, opt, accumulator=acc)
        out["mid micro_step"] = state.micro_step
        _accumulate(sp, opt, acc, state, rank, world, range(2 * N + 1, 4 * N))
        out["mid final"] = _full_state(sp, opt)
    except gradaccum.GradAccumError as err:
        out["mid error"] = str(err)
        now = sp.gather()  # neither the params nor the (fresh) optimizer were touched
        out["mid unchanged"] = not opt.state and all(torch.equal(now[k], fresh[k]) for k in now)
    sp, opt, _ = _setup(7)
    acc = gradaccum.Accumulator(N, sync=gradaccum.reduce_scatter(sp, policy=policy))
    state = gradaccum.checkpoint.dcp_load(between, sp, opt, accumulator=acc)
    out["between window"] = (state.window, state.micro_step)
    _accumulate(sp, opt, acc, state, rank, world, range(2 * N, 4 * N))
    out["between final"] = _full_state(sp, opt)
    return out


@pytest.mark.parametrize("policy", ["boundary", "every"])
def test_a_window_in_progress_resumes_bit_identically(tmp_path: Any, policy: str) -> None:
    folder = str(tmp_path)
    first = values(run(_mid, folder, policy, "save", world=4, timeout=180), world=4)[0]
    for out in values(run(_mid, folder, policy, "load", world=4, timeout=180), world=4):
        assert out["mid micro_step"] == 1
        assert _diff(out["mid final"], first["final"]) == 0.0  # bit-identical
        assert out["between window"] == (2, 0)
        assert _diff(out["between final"], first["final"]) == 0.0
    for out in values(run(_mid, folder, policy, "load", world=2, timeout=180), world=2):
        assert out["mid error"].startswith(
            "dcp_load(checkpoint_id, sharded, optimizer, accumulator=...): the checkpoint holds "
            "a window in progress, saved on a mesh of [4] ranks, but this one is [2]"
        ), out
        assert out["mid unchanged"] is True
        assert out["between window"] == (2, 0)  # between windows: any number of ranks
        assert _diff(out["between final"], first["final"]) < 1e-12
