"""Window alignment on 2 gloo processes: ranks at different windows raise on every rank, naming
both windows, before any gradient is sent; aligned runs (and checkpoints restored on every rank)
are unaffected.

The window index (``WindowSpec.index``: ``AccumState.window``, or the windows an accumulated
function opened) is in every built-in sync's fingerprint. Each spawn runs every sync kind, each
on a process group of its own (a mismatch marks its group broken).
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run, values
from models import F64, mean_loss, mlp_params, regression_batch
from torch.func import grad

import gradaccum
from gradaccum._errors import misaligned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

KINDS = ("all_reduce", "reduce_scatter", "custom_reduce")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sign_sync.py"


def sign_sync(**kwargs: Any) -> Any:
    """examples/sign_sync.py's SignSync: a sync written outside the package."""
    spec = importlib.util.spec_from_file_location("sign_sync", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SignSync(**kwargs)


FIX = (
    "Their data or their calls got out of step (e.g. loaders of different lengths, or an epoch "
    "that ended early on one rank), so this boundary would combine gradients of different "
    "windows; nothing was reduced. Every rank must run the same number of windows: call each "
    "accumulated function (or finalize) as often on every rank, let "
    "gradaccum.loop.windows(...) pad a short loader with empty windows (with an Accumulator, "
    "call acc.end_epoch(state) at each epoch's end so that this is caught), and restore "
    "Accumulator states from the same checkpoint on every rank."
)


def message(where: str, rank: int, at: tuple[int, int]) -> str:
    return (
        f"{where}: the ranks are at different windows: rank {rank} is at window {at[rank]} but "
        f"rank {1 - rank} at window {at[1 - rank]}. {FIX}"
    )


def _sync(kind: str, params: Any, calls: list[int], check: str = "fingerprint") -> Any:
    """A sync of ``kind`` on a new group of both ranks; the params its step functions take."""
    group = dist.new_group([0, 1])
    if kind == "sign_sync":  # the base class's boundary: the same check, nothing to add
        return sign_sync(group=group, compress=False), params
    if kind == "all_reduce":
        return gradaccum.all_reduce(group, check=check), params
    if kind == "reduce_scatter":
        sharded = gradaccum.shard(params, group)
        return gradaccum.reduce_scatter(sharded, check=check), sharded

    def summed(grads: Any, state: Any, pg: Any) -> Any:
        calls.append(1)
        for g in grads.values():
            dist.all_reduce(g, group=pg)
        return grads, state

    return gradaccum.custom_reduce(summed, group=group), params


def _grads(rank: int, w: int, i: int) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, rank + 2 * w + i) for k, v in mlp_params().items()}


def _purposes(log: list[Any]) -> list[str]:
    return [f"{c.kind} {c.purpose}" for c in log]


def _accumulators(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in (*KINDS, "sign_sync"):
        calls: list[int] = []
        sync, target = _sync(kind, mlp_params(), calls)
        acc = gradaccum.Accumulator(n=2, sync=sync)
        state = acc.init(target)
        normal = []
        for w in range(2):  # a normal multi-window run: one fingerprint per window, no error
            with gradaccum.sync.record_collectives() as log:
                for i in range(2):
                    state = acc.add(state, _grads(rank, w, i), size=3)
                grads, state = acc.finalize(state)
            normal.append(_purposes(log))
        out[f"{kind} normal"] = normal
        out[f"{kind} normal calls"] = len(calls)
        if rank == 0:  # as after a finalize that rank 1 did not make
            state = state._replace(window=state.window + 1)
        with gradaccum.sync.record_collectives() as log:
            try:
                for i in range(2):
                    state = acc.add(state, _grads(rank, 2, i), size=3)
                acc.finalize(state)
                out[kind] = "no error"
            except gradaccum.GradAccumError as err:
                out[kind] = str(err)
        out[f"{kind} log"] = _purposes(log)
        out[f"{kind} calls"] = len(calls)
    # check="never": nothing is checked, the misaligned windows are combined silently.
    sync, _ = _sync("all_reduce", None, [], check="never")
    acc = gradaccum.Accumulator(n=1, sync=sync)
    state = acc.init(mlp_params())._replace(window=5 if rank == 0 else 0)
    acc.finalize(acc.add(state, _grads(rank, 0, 0), size=1))
    out["never"] = "no error"
    return out


def test_accumulators_at_different_windows_raise_on_every_rank_before_any_gradient() -> None:
    results = values(run(_accumulators))
    for rank, r in enumerate(results):
        for kind in (*KINDS, "sign_sync"):
            first = {
                "sign_sync": ["all_reduce weight", "all_reduce gradients"],
                "all_reduce": ["all_reduce fingerprint", "all_reduce gradients"],
                "reduce_scatter": [
                    "all_reduce fingerprint",
                    "reduce_scatter gradients",
                    "all_reduce weight",
                ],
                "custom_reduce": ["all_reduce weight"],
            }[kind]
            assert r[f"{kind} normal"] == [first, first], kind
            where = (
                "Accumulator.add(state, grads)"  # its window opens (and checks) at the first add
                if kind == "reduce_scatter"
                else "Accumulator(n=2).finalize(state)"
            )
            assert r[kind] == message(where, rank, (3, 2)), kind
            # Only the fingerprint (and the descriptions it then compares) went on the wire: the
            # tail of the base class carries it for a sync of the simple tier.
            gathered = "all_gather_object fingerprint"
            simple = kind in ("custom_reduce", "sign_sync")
            check = "all_reduce weight" if simple else "all_reduce fingerprint"
            assert r[f"{kind} log"] == [check, gathered], kind
            assert r[f"{kind} calls"] == r[f"{kind} normal calls"], kind  # fn did not run
        assert r["never"] == "no error"


def _step_functions(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x, y = regression_batch(8)
    for kind in KINDS:
        calls: list[int] = []
        sync, target = _sync(kind, mlp_params(), calls)
        train = gradaccum.accumulate(gradaccum.grad(mean_loss), 2, sync=sync)
        other = gradaccum.accumulate(gradaccum.grad(mean_loss), 2, sync=sync)
        train(target, (x, y))
        train(target, (x, y))  # both ranks at window 2 of train: fine
        before = len(calls)
        with gradaccum.sync.record_collectives() as log:
            try:  # rank 0 calls the other step function (its window 0); rank 1 train again
                (other if rank == 0 else train)(target, (x, y))
                out[kind] = "no error"
            except gradaccum.GradAccumError as err:
                out[kind] = str(err)
        out[f"{kind} gradients sent"] = [p for p in _purposes(log) if "gradients" in p]
        out[f"{kind} fn calls"] = len(calls) - before
    return out


def test_step_functions_called_a_different_number_of_times_raise_on_every_rank() -> None:
    results = values(run(_step_functions))
    for rank, r in enumerate(results):
        for kind in KINDS:
            where = "accumulate(mean_loss, n=2)(...)"
            assert r[kind] == message(where, rank, (0, 2)), kind
            assert r[f"{kind} gradients sent"] == [], kind
            assert r[f"{kind} fn calls"] == 0, kind


def _checkpoints(rank: int, world: int) -> dict[str, Any]:
    params = mlp_params()
    acc = gradaccum.Accumulator(n=2, sync=gradaccum.all_reduce(dist.new_group([0, 1])))
    state, saved = acc.init(params), {}
    for w in range(3):
        for i in range(2):
            state = acc.add(state, grad(mean_loss)(params, regression_batch(4, seed=w + i)), size=4)
            if i == 0:  # mid-window, at windows 0, 1 and 2
                buf = io.BytesIO()
                torch.save(acc.state_dict(state), buf)
                saved[w] = buf.getvalue()
        grads, state = acc.finalize(state)
    straight = grads

    def resume(at: int, acc: gradaccum.Accumulator) -> Any:
        sd = torch.load(io.BytesIO(saved[at]), weights_only=True)
        state = acc.load_state_dict(acc.init(params), sd)
        for w in range(at, 3):
            for i in range(1 if w == at else 0, 2):
                g = grad(mean_loss)(params, regression_batch(4, seed=w + i))
                state = acc.add(state, g, size=4)
            grads, state = acc.finalize(state)
        return grads, state.window

    grads, window = resume(1, acc)  # both ranks from the same checkpoint: aligned
    out: dict[str, Any] = {
        "same": max(float((grads[k] - straight[k]).abs().max()) for k in grads),
        "window": window,
    }
    acc = gradaccum.Accumulator(n=2, sync=gradaccum.all_reduce(dist.new_group([0, 1])))
    try:  # rank 0 from window 2's checkpoint, rank 1 from window 1's
        resume(2 if rank == 0 else 1, acc)
        out["mixed"] = "no error"
    except gradaccum.GradAccumError as err:
        out["mixed"] = str(err)
    return out


def test_checkpoints_restored_on_every_rank_keep_the_ranks_aligned() -> None:
    for rank, r in enumerate(values(run(_checkpoints))):
        assert r["same"] == 0.0
        assert r["window"] == 3
        assert r["mixed"] == message("Accumulator(n=2).finalize(state)", rank, (2, 1))


def test_the_message_groups_the_ranks_by_window() -> None:
    assert misaligned("f(...)", 1, [4, 3, 4, 2]) == (
        f"f(...): the ranks are at different windows: rank 1 is at window 3 but rank 3 at window "
        f"2; ranks 0, 2 at window 4. {FIX}"
    )


@pytest.mark.usefixtures("world_of_one")
def test_the_window_index_is_in_the_fingerprint_description() -> None:
    acc = gradaccum.Accumulator(n=1, sync=gradaccum.all_reduce(check="full"))
    state = acc.init({"w": torch.zeros(2, dtype=F64)})
    state = acc.add(state._replace(window=7), {"w": torch.ones(2, dtype=F64)}, size=1)
    window = acc._window("here", state, 1)
    window._probe()  # what last() starts (and reads) when nothing started it before
    probe = window.probe
    assert probe is not None
    window.comm.agree(probe)
    assert probe.desc[0] == "window index 7"


def _epochs(rank: int, world: int, end_epoch: bool) -> dict[str, Any]:
    """The issue's loop: n=4, 21 micro-batches on rank 0 and 20 on rank 1, a bare Accumulator
    that finalizes a short last window at each epoch's end; each rank stops after 6 windows."""
    acc = gradaccum.Accumulator(n=4, sync=gradaccum.all_reduce(dist.new_group([0, 1])))
    state = acc.init(mlp_params())
    windows: list[tuple[int, int]] = []
    try:
        for epoch in range(2):
            for i in range(21 - rank):
                state = acc.add(state, _grads(rank, epoch, i), size=1)
                if acc.is_complete(state):
                    _, state = acc.finalize(state)
                    windows.append((epoch, state.window))
                    if len(windows) == 6:
                        return {"error": None, "windows": windows}
            if state.micro_step:  # the short last window (rank 0 only)
                _, state = acc.finalize(state)
                windows.append((epoch, state.window))
                if len(windows) == 6:
                    return {"error": None, "windows": windows}
            if end_epoch:
                state = acc.end_epoch(state)
        return {"error": None, "windows": windows}
    except gradaccum.GradAccumError as err:
        return {"error": str(err), "windows": windows}


def test_end_epoch_catches_epochs_of_different_lengths_on_every_rank() -> None:
    for rank, r in enumerate(values(run(_epochs, True))):
        at = ("5", "5 of epoch 1")  # rank 0's short last window of epoch 0; rank 1's next
        assert r["error"] == (
            f"Accumulator(n=4).finalize(state): the ranks are at different windows: rank {rank} "
            f"is at window {at[rank]} but rank {1 - rank} at window {at[1 - rank]}. {FIX}"
        )
        assert len(r["windows"]) == 5  # the 5 full windows of epoch 0 were reduced together


def test_without_end_epoch_a_short_last_window_mixes_epochs_silently() -> None:
    """What end_epoch is for (and gradaccum.loop.windows does): the index alone stays in step."""
    r0, r1 = values(run(_epochs, False))
    assert r0["error"] is None
    assert r1["error"] is None
    # The 6th window closed: rank 0's short one of epoch 0, with rank 1's first of epoch 1.
    assert (r0["windows"][5], r1["windows"][5]) == ((0, 6), (1, 6))


def test_end_epoch_refuses_a_window_in_progress() -> None:
    acc = gradaccum.Accumulator(n=4)
    state = acc.add(acc.init({"w": torch.zeros(2)}), {"w": torch.ones(2)}, size=1)
    with pytest.raises(ValueError, match=r"holds 1 micro-batch\(es\) of epoch 0; call grads"):
        acc.end_epoch(state)
    _, state = acc.finalize(state)
    assert acc.end_epoch(state).epoch == 1
