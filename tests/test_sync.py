"""The sync machinery in one process: bucket plans, zero-copy buckets, a world of one, the
boundary transforms and their errors. The 2-rank behaviour is in test_distributed.py."""

from __future__ import annotations

import io
from typing import Any

import optree
import pytest
import torch
from models import (
    F64,
    max_diff,
    mean_loss,
    mlp_params,
    regression_batch,
    token_batch,
    token_count_step,
    token_mean_loss,
)
from test_misuse import raises
from torch.func import grad

import gradaccum

# -- plans (dry runs, no process group) --------------------------------------------------------


def test_plan_groups_by_dtype_in_reverse_path_order_and_respects_the_cap() -> None:
    params = {
        "c": torch.zeros(100, dtype=torch.float32),  # 400 bytes
        "a": torch.zeros(100, dtype=F64),  # 800 bytes
        "b": torch.zeros(10, dtype=torch.bfloat16),  # accumulated in float32: 40 bytes
        "d": torch.zeros(50, dtype=F64),  # 400 bytes
    }
    plan = gradaccum.all_reduce(bucket_mb=300 / 2**20).plan(params)
    got = [(b.dtype, b.paths, b.numel, b.nbytes, b.tail) for b in plan]
    assert got == [  # leaves in reverse path order, grouped by (device, dtype) as they come
        (F64, ("['d']",), 50, 400, False),  # d alone reaches 300 bytes: the bucket closes
        (F64, ("['a']",), 102, 816, True),  # the weight rides in the last float64 bucket
        (torch.float32, ("['c']",), 100, 400, False),
        (torch.float32, ("['b']",), 10, 40, False),  # what is left: below the limit
    ]
    # As in DDP, a bucket takes leaves until it reaches its limit, and the first bucket of each
    # group has a limit of 1 MiB (so that the first all-reduce can start early).
    big = {f"l{i}": torch.zeros(2**17) for i in range(6)}  # 512 KiB each
    assert [len(b.paths) for b in gradaccum.all_reduce(bucket_mb=2).plan(big)] == [2, 4]


def test_plan_order_compares_numbers_in_paths_as_numbers() -> None:
    # Backward produces gradients from the last layer to the first: the first bucket holds the
    # last layers, with layers.10 after layers.9 (not between layers.1 and layers.2).
    params = {f"layers.{i}.weight": torch.zeros(4) for i in range(12)}
    plan = gradaccum.all_reduce(bucket_mb=16 / 2**20).plan(params)
    assert [b.paths[0] for b in plan] == [f"['layers.{i}.weight']" for i in reversed(range(12))]


def test_plan_for_low_precision_accumulators_adds_a_float32_weight_bucket() -> None:
    params = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    plan = gradaccum.all_reduce().plan(params, accum_dtype=torch.bfloat16)
    assert [(b.dtype, b.paths, b.numel, b.tail) for b in plan] == [
        (torch.bfloat16, ("['w']",), 4, False),
        (torch.float32, (), 2, True),
    ]


def test_plan_order_is_the_same_whatever_the_dict_insertion_order() -> None:
    params = mlp_params(kind="dict")
    assert isinstance(params, dict)
    backwards = dict(reversed(list(params.items())))
    sync = gradaccum.all_reduce(bucket_mb=1e-5)
    assert sync.plan(params) == sync.plan(backwards)


def test_sync_needs_an_initialised_process_group() -> None:
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.all_reduce())
    with raises(
        RuntimeError,
        "accumulate(mean_loss, n=2)(...): sync=all_reduce() needs torch.distributed "
        "initialised, but no process group exists; call torch.distributed.init_process_group(...)"
        " first (torchrun sets the environment for it; after destroy_process_group(), again before"
        " using it), or, in a job of one process only, drop sync=.",
    ):
        step(mlp_params(), regression_batch(4))


# -- a world of one: the full boundary path --------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_world_of_one_equals_no_sync_and_grads_are_bucket_views() -> None:
    params, batch = mlp_params(kind="nested"), regression_batch(12)
    sync = gradaccum.all_reduce(bucket_mb=1e-5)
    plain = gradaccum.accumulate(grad(mean_loss), 3)(params, batch)
    synced = gradaccum.accumulate(grad(mean_loss), 3, sync=sync)(params, batch)
    assert max_diff(plain, synced) < 1e-15
    # Zero-copy: each returned leaf is a view into its bucket, which was reduced in place.
    leaves = optree.tree_leaves(synced)
    bases = {id(x._base) for x in leaves}
    assert None not in {x._base for x in leaves}
    assert len(bases) == len(sync.plan(params))


@pytest.mark.usefixtures("world_of_one")
def test_world_of_one_count_reduction_with_tensor_counts_and_records() -> None:
    params, batch = mlp_params(), token_batch(10)
    step = token_count_step(4, sync=gradaccum.all_reduce())
    with gradaccum.sync.record_collectives() as log:
        g, (loss, tokens) = step(params, batch)
    assert max_diff(g, grad(token_mean_loss)(params, batch)) < 1e-14
    assert float(tokens) == float(batch["mask"].sum())
    grad_bytes = sum(x.numel() * 8 for x in optree.tree_leaves(params))
    assert [(c.kind, c.purpose, c.nbytes) for c in log] == [
        ("all_reduce", "fingerprint", 16),
        ("all_reduce", "gradients", grad_bytes + 16),
    ]


@pytest.mark.usefixtures("world_of_one")
def test_streaming_with_sync_resumes_mid_window_bit_identically() -> None:
    params = mlp_params()
    acc = gradaccum.Accumulator(n=3, sync=gradaccum.all_reduce(bucket_mb=1e-5))
    batches = [regression_batch(4, seed=s) for s in range(3)]
    state = acc.init(params)
    state = acc.add(state, grad(mean_loss)(params, batches[0]), size=4)
    buffer = io.BytesIO()
    torch.save(acc.state_dict(state), buffer)
    for b in batches[1:]:
        state = acc.add(state, grad(mean_loss)(params, b), size=4)
    straight, _ = acc.finalize(state)
    buffer.seek(0)
    resumed = acc.load_state_dict(acc.init(params), torch.load(buffer, weights_only=True))
    assert all(x._base is not None for x in optree.tree_leaves(resumed.sums))  # bucket views
    for b in batches[1:]:
        resumed = acc.add(resumed, grad(mean_loss)(params, b), size=4)
    again, _ = acc.finalize(resumed)
    assert max_diff(straight, again) == 0.0


@pytest.mark.usefixtures("world_of_one")
def test_empty_window_everywhere_is_an_error_under_mean_and_zeros_under_sum() -> None:
    params = mlp_params()
    acc = gradaccum.Accumulator(n=2, sync=gradaccum.all_reduce())
    with raises(
        ValueError,
        "Accumulator(n=2).finalize(state): the window's rows add up to 0 over all 1 ranks, so "
        "there is no mean to divide by; skip windows with no items on any rank (e.g. all "
        "padding), or use reduction='sum'.",
    ):
        acc.finalize(acc.init(params))
    acc = gradaccum.Accumulator(n=2, reduction="sum", sync=gradaccum.all_reduce())
    g, state = acc.finalize(acc.init(params))
    assert all(float(x.abs().max()) == 0.0 for x in optree.tree_leaves(g))
    assert state.window == 1


@pytest.mark.usefixtures("world_of_one")
def test_a_step_fn_error_still_joins_the_boundary_and_reraises() -> None:
    calls = {"n": 0}

    def step_fn(p: Any, b: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise FloatingPointError("boom")
        return grad(mean_loss)(p, b)

    step = gradaccum.accumulate(step_fn, 3, sync=gradaccum.all_reduce())
    with (
        gradaccum.sync.record_collectives() as log,
        pytest.raises(FloatingPointError, match="boom"),
    ):
        step(mlp_params(), regression_batch(6))
    assert [c.purpose for c in log] == ["fingerprint", "gradients"]  # joined, flagged


# -- boundary transforms in one process --------------------------------------------------------


def test_clip_by_global_norm_matches_torch_and_is_pure() -> None:
    g = {"a": torch.randn(5, 3, dtype=F64), "b": torch.randn(7, dtype=F64)}
    before = {k: v.clone() for k, v in g.items()}
    for max_norm in (0.5, 1e6):
        clipped, norm = gradaccum.boundary.clip_by_global_norm(g, max_norm)
        ref = [v.clone() for v in g.values()]
        for t in ref:
            t.grad = t.clone()
        torch_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        assert float((norm - torch_norm).abs()) < 1e-15
        for k, t in zip(g, ref, strict=True):
            assert torch.allclose(clipped[k], t.grad, rtol=0, atol=1e-15)
    assert max_diff(g, before) == 0.0


def test_loss_scale_grows_after_the_interval_and_backs_off_on_overflow() -> None:
    scaler = gradaccum.boundary.LossScale(init_scale=8.0, growth_interval=2)
    state = scaler.init()
    finite_grads = {"w": torch.tensor([8.0, -16.0], dtype=torch.float16)}
    g, finite, state = scaler.unscale(finite_grads, state)
    assert finite
    assert g["w"].tolist() == [1.0, -2.0]
    assert g["w"].dtype == torch.float16
    assert state == gradaccum.boundary.LossScaleState(8.0, 1)
    _, _, state = scaler.unscale(finite_grads, state)
    assert state == gradaccum.boundary.LossScaleState(16.0, 0)
    for bad in (float("nan"), float("-inf")):
        _, finite, new = scaler.unscale({"w": torch.tensor([1.0, bad])}, state)
        assert not finite
        assert new == gradaccum.boundary.LossScaleState(8.0, 0)
    # A large finite fp16 value is not an overflow (no norm that could overflow is taken).
    _, finite, _ = scaler.unscale({"w": torch.full((1000,), 60000.0, dtype=torch.float16)}, state)
    assert finite


CLIP = "clip_by_global_norm(grads, max_norm): "
SCALE = "LossScale(init_scale, growth_factor, backoff_factor, growth_interval, min_scale): "
ALL_REDUCE = "all_reduce(group, bucket_mb=..., check=..., timeout=...): "


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (
            lambda: gradaccum.all_reduce(bucket_mb=0),
            ValueError,
            ALL_REDUCE + "bucket_mb must be a positive, finite number of MiB, got int 0; pass e.g. "
            "bucket_mb=25 (DDP's default).",
        ),
        (
            lambda: gradaccum.all_reduce(bucket_mb="25"),
            ValueError,
            ALL_REDUCE
            + "bucket_mb must be a positive, finite number of MiB, got str '25'; pass e.g. "
            "bucket_mb=25 (DDP's default).",
        ),
        (
            lambda: gradaccum.all_reduce(check="once"),
            ValueError,
            ALL_REDUCE + "check must be one of 'fingerprint', 'full', 'never', got str 'once'; "
            "pass check='fingerprint' (the default: the ranks check that their trees agree in "
            "every window), 'full' (a debug mode) or 'never'.",
        ),
        (
            lambda: gradaccum.all_reduce(timeout=-1),
            ValueError,
            ALL_REDUCE
            + "timeout must be None or a positive, finite number of seconds, got int -1; pass "
            "e.g. timeout=60.",
        ),
        (
            lambda: gradaccum.all_reduce("world"),
            TypeError,
            ALL_REDUCE + "group must be None (the default group), a torch.distributed "
            "ProcessGroup or a DeviceMesh, got str 'world'; pass e.g. dist.new_group([0, 1]).",
        ),
        (
            lambda: gradaccum.accumulate(grad(mean_loss), 2, sync="all_reduce"),
            TypeError,
            "accumulate(mean_loss, n=2): sync must be None, gradaccum.all_reduce(...), "
            "gradaccum.reduce_scatter(sharded), a custom reduction or another gradaccum.sync.Sync, "
            "got str 'all_reduce'; pass "
            "sync=gradaccum.all_reduce() to synchronise over the default process group.",
        ),
        (
            lambda: gradaccum.Accumulator(n=2, sync=True),
            TypeError,
            "Accumulator(n=2): sync must be None, gradaccum.all_reduce(...), "
            "gradaccum.reduce_scatter(sharded), a custom reduction or another gradaccum.sync.Sync, "
            "got bool True; pass "
            "sync=gradaccum.all_reduce() to synchronise over the default process group.",
        ),
        (
            lambda: gradaccum.accumulate(grad(mean_loss), 2)({"w": "x"}, regression_batch(4)),
            TypeError,
            "accumulate(mean_loss, n=2)(...): params leaf ['w'] is str 'x'; every params leaf "
            "must be a floating tensor. Move non-tensor values out of the params pytree.",
        ),
        (
            lambda: gradaccum.boundary.clip_by_global_norm({"w": torch.ones(2)}, 0),
            ValueError,
            CLIP + "max_norm must be a positive number, got int 0; pass e.g. max_norm=1.0.",
        ),
        (
            lambda: gradaccum.boundary.clip_by_global_norm(
                {"w": torch.ones(2, dtype=torch.int64)}, 1.0
            ),
            TypeError,
            CLIP + "gradient leaf ['w'] is Tensor(shape=(2,), dtype=int64); every leaf must be a "
            "floating tensor. Pass the gradients that accumulate() or Accumulator.finalize() "
            "returned.",
        ),
        (
            lambda: gradaccum.boundary.LossScale(init_scale=0),
            ValueError,
            SCALE + "init_scale must be a positive number, got int 0; pass e.g. init_scale=2.0**16 "
            "(torch.amp.GradScaler's default).",
        ),
        (
            lambda: gradaccum.boundary.LossScale(backoff_factor=2.0),
            ValueError,
            SCALE + "backoff_factor must be a number in (0, 1], got float 2.0; pass e.g. "
            "backoff_factor=0.5 (the default), or 1.0 to never back off.",
        ),
        (
            lambda: gradaccum.boundary.LossScale(growth_interval=0),
            ValueError,
            SCALE + "growth_interval must be a positive int (a number of windows), got int 0; pass "
            "e.g. growth_interval=2000 (the default).",
        ),
        (
            lambda: gradaccum.boundary.LossScale().unscale({"w": torch.ones(1)}, 65536.0),
            TypeError,
            "LossScale.unscale(grads, state): state must be a LossScaleState, got float 65536.0; "
            "start with state = scaler.init() and pass on the state unscale() returns.",
        ),
    ],
)
def test_errors(call: Any, exc: type[BaseException], message: str) -> None:
    with raises(exc, message):
        call()


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    # full: the 16-byte exchange, then the descriptions themselves, in every window
    ("check", "fingerprints"),
    [("fingerprint", 3), ("full", 6), ("never", 0)],
)
def test_check_modes_decide_how_often_the_fingerprint_is_exchanged(
    check: str, fingerprints: int
) -> None:
    sync = gradaccum.all_reduce(check=check)  # type: ignore[arg-type]
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=sync)
    with gradaccum.sync.record_collectives() as log:
        for w in range(3):
            step(mlp_params(), regression_batch(4, seed=w))
    assert [c.purpose for c in log].count("fingerprint") == fingerprints
    assert [c.purpose for c in log].count("gradients") == 3


@pytest.mark.usefixtures("world_of_one")
def test_training_loop_steps_optimizer_and_scheduler_once_per_boundary() -> None:
    """The recipe of the docs: one accumulated call per window, then clip, unscale, step."""
    model = torch.nn.Linear(5, 1).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = gradaccum.boundary.LossScale(init_scale=4.0)
    scale = scaler.init()
    calls = {"micro": 0}

    def loss_fn(params: Any, batch: Any, factor: float) -> torch.Tensor:
        calls["micro"] += 1
        x, y = batch
        out = torch.func.functional_call(model, params, (x,)).squeeze(-1)
        loss = ((out - y) ** 2).mean() * factor
        return loss * (float("inf") if calls["micro"] == 5 else 1.0)  # window 2 overflows

    step = gradaccum.accumulate(grad(loss_fn), 4, sync=gradaccum.all_reduce())
    applied = 0
    for w in range(3):
        grads = step(gradaccum.params_of(model), regression_batch(8, seed=w), scale.scale)
        grads, finite, scale = scaler.unscale(grads, scale)
        if finite:
            grads, _ = gradaccum.boundary.clip_by_global_norm(grads, 1.0)
            gradaccum.write_grads(model, grads)
            opt.step()
            sched.step()
            applied += 1
    assert calls["micro"] == 12
    assert applied == 2
    assert sched.last_epoch == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert scale == gradaccum.boundary.LossScaleState(2.0, 1)


@pytest.mark.usefixtures("world_of_one")
def test_abort_and_early_errors_join_the_boundary_flagged() -> None:
    params = mlp_params()
    acc = gradaccum.Accumulator(n=3, sync=gradaccum.all_reduce())
    state = acc.add(acc.init(params), grad(mean_loss)(params, regression_batch(2)), size=2)
    with gradaccum.sync.record_collectives() as log:
        fresh = acc.abort(state)
    assert [c.purpose for c in log] == ["fingerprint", "gradients"]
    assert (fresh.sums, fresh.weight, fresh.micro_step, fresh.window) == (None, 0, 0, 1)
    # accumulate: a bad params tree on a later call fails before the layout is known; the rank
    # still joins, with the layout of its previous window.
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.all_reduce())
    step(params, regression_batch(4))
    bad = {**params, "w1": params["w1"].to(torch.int64)}
    with gradaccum.sync.record_collectives() as log, pytest.raises(TypeError, match="dtype int64"):
        step(bad, regression_batch(4))
    assert [c.purpose for c in log] == ["fingerprint", "gradients"]
    # Without sync, abort only discards the window.
    plain = gradaccum.Accumulator(n=3)
    state = plain.add(plain.init(params), grad(mean_loss)(params, regression_batch(2)), size=2)
    assert plain.abort(state).sums is None


@pytest.mark.usefixtures("world_of_one")
def test_sums_outside_buckets_and_a_weight_only_bucket_are_reduced_correctly() -> None:
    params = mlp_params()
    g = grad(mean_loss)(params, regression_batch(6))
    # A state whose sums were allocated without a sync (separate tensors): packed, then unpacked.
    state = gradaccum.Accumulator(n=1).add(gradaccum.Accumulator(n=1).init(params), g, size=6)
    synced, _ = gradaccum.Accumulator(n=1, sync=gradaccum.all_reduce()).finalize(state)
    assert max_diff(synced, g) < 1e-15  # 6 * g / 6
    # bfloat16 accumulators: the weight travels in a float32 bucket of its own.
    low = {k: v.to(torch.bfloat16) for k, v in params.items()}
    sync = gradaccum.all_reduce()
    step = gradaccum.accumulate(grad(mean_loss), 2, accum_dtype=torch.bfloat16, sync=sync)
    batch = tuple(t.to(torch.bfloat16) for t in regression_batch(6))
    with gradaccum.sync.record_collectives() as log:
        out = step(low, batch)
    plain = gradaccum.accumulate(grad(mean_loss), 2, accum_dtype=torch.bfloat16)(low, batch)
    assert max_diff(out, plain) == 0.0
    assert [(c.purpose, c.dtype, c.numel) for c in log if c.purpose == "gradients"] == [
        ("gradients", torch.bfloat16, sum(v.numel() for v in params.values())),
        ("gradients", torch.float32, 2),
    ]
