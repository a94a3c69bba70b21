"""Boundary metrics: ``Accumulator.add(..., metrics=...)`` and ``Accumulator.boundary``.

The metric sums equal the plain sums over every micro-batch (of every rank, on 2 gloo
processes), they ride the boundary collective that carries the weight (the collectives of a
window are the same with and without them), they survive a mid-window checkpoint bit for bit,
and bad metrics are refused before anything changes.
"""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run, values
from hypothesis import given, settings
from hypothesis import strategies as st
from models import F64, max_diff, mean_loss, mlp_params, regression_batch
from test_window_alignment import sign_sync
from torch.func import grad_and_value

import gradaccum
from gradaccum.streaming import WindowStats

ADD = "Accumulator.add(state, grads): "


def raises(exc: type[BaseException], message: str) -> Any:
    return pytest.raises(exc, match=rf"\A{re.escape(message)}\Z")


def _micro(params: Any, seed: int, rows: int) -> tuple[Any, dict[str, Any]]:
    """One micro-batch's gradient of the mean loss and its metrics (a summed loss, rows)."""
    g, loss = grad_and_value(mean_loss)(params, regression_batch(rows, seed=seed))
    return g, {"loss": loss.detach() * rows, "rows": rows, "one": 1.0}


# -- one process ----------------------------------------------------------------------------


def test_boundary_sums_the_metrics_of_the_window_and_returns_finalize_s_gradients() -> None:
    params, acc = mlp_params(), gradaccum.Accumulator(n=3)
    state, straight = acc.init(params), acc.init(params)
    want: dict[str, float] = {"loss": 0.0, "rows": 0.0, "one": 0.0}
    for j, rows in enumerate((4, 1, 6)):
        g, m = _micro(params, j, rows)
        state = acc.add(state, g, size=rows, metrics=m)
        straight = acc.add(straight, g, size=rows)
        for k in want:
            want[k] += float(m[k])
    grads, state, stats = acc.boundary(state)
    ref, _ = acc.finalize(straight)
    assert max_diff(grads, ref) == 0.0
    assert stats == WindowStats(0, 11.0, want)
    assert list(stats.metrics) == ["loss", "one", "rows"]  # sorted by name
    assert state.window == 1
    assert state.sums is None
    # The next window starts from zeros under the same names (what an empty window sends).
    assert {k: float(v) for k, v in state.metrics.items()} == {"loss": 0, "one": 0, "rows": 0}
    g, m = _micro(params, 7, 2)
    _, _, stats = acc.boundary(acc.add(state, g, size=2))  # no metrics: the names go
    assert stats == WindowStats(1, 2.0, {})


def test_metrics_stay_on_the_device_in_float64_and_count_weights_are_reported() -> None:
    acc = gradaccum.Accumulator(n=2, reduction="count")
    state = acc.init({"w": torch.zeros(2)})
    for tokens in (3, 5):
        loss = torch.tensor(0.5 * tokens, dtype=torch.float32)
        state = acc.add(
            state, {"w": torch.ones(2)}, count=torch.tensor(tokens), metrics={"loss": loss}
        )
        assert state.metrics["loss"].dtype == F64
        assert state.metrics["loss"].dim() == 0
    _, _, stats = acc.boundary(state)
    assert stats == WindowStats(0, 8.0, {"loss": 4.0})


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.floats(-1e6, 1e6, allow_nan=False) | st.integers(-(2**40), 2**40),
        min_size=1,
        max_size=12,
    ),
    as_tensor=st.booleans(),
)
def test_any_sequence_of_metrics_sums_exactly_as_float64(
    values: list[Any], as_tensor: bool
) -> None:
    acc = gradaccum.Accumulator(n=len(values), reduction="sum")
    state = acc.init({"w": torch.zeros(1, dtype=F64)})
    for v in values:
        m = torch.tensor(v, dtype=F64) if as_tensor else v
        state = acc.add(state, {"w": torch.ones(1, dtype=F64)}, metrics={"m": m})
    _, _, stats = acc.boundary(state)
    want = 0.0
    for v in values:  # left to right, in float64, as the running sum adds
        want += float(v)
    assert stats.metrics["m"] == want
    assert stats.weight == len(values)


@pytest.mark.slow  # compiles (7 s)
def test_a_compiled_micro_step_sums_the_metrics_without_recompiling() -> None:
    # torch.compile drops in-place adds into 0-dim inputs: the running sums are new tensors.
    params, acc = mlp_params(), gradaccum.Accumulator(n=4, reduction="sum")
    x, y = regression_batch(30)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def micro_step(params: Any, state: Any, xb: torch.Tensor, yb: torch.Tensor) -> Any:
        g, loss = gradaccum.grad_and_value(mean_loss)(params, (xb, yb))
        return acc.add(state, g, metrics={"loss": loss.detach() * len(yb), "rows": len(yb)})

    def window() -> WindowStats:
        state = acc.init(params)
        for rows in (slice(0, 8), slice(8, 16), slice(16, 24), slice(24, 30)):
            state = micro_step(params, state, x[rows], y[rows])
        return acc.boundary(state)[2]

    torch._dynamo.reset()
    first = window()
    assert first.metrics["rows"] == 30.0
    assert abs(first.metrics["loss"] - 30 * float(mean_loss(params, (x, y)))) < 1e-12
    with torch.compiler.set_stance("fail_on_recompile"):
        assert window() == first


def test_state_dict_mid_window_keeps_the_metric_sums_bit_identical() -> None:
    params, acc = mlp_params(), gradaccum.Accumulator(n=3)
    mbs = [_micro(params, j, rows) for j, rows in enumerate((3, 2, 5))]
    state = acc.init(params)
    state = acc.add(state, mbs[0][0], size=3, metrics=mbs[0][1])
    buf = io.BytesIO()
    torch.save(acc.state_dict(state), buf)
    for (g, m), rows in zip(mbs[1:], (2, 5), strict=True):
        state = acc.add(state, g, size=rows, metrics=m)
    grads, _, stats = acc.boundary(state)
    buf.seek(0)
    resumed = acc.load_state_dict(acc.init(params), torch.load(buf, weights_only=True))
    for (g, m), rows in zip(mbs[1:], (2, 5), strict=True):
        resumed = acc.add(resumed, g, size=rows, metrics=m)
    again, _, stats_again = acc.boundary(resumed)
    assert max_diff(grads, again) == 0.0
    assert stats_again == stats


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "every", "custom_reduce"])
def test_every_sync_resumes_a_window_with_metrics_bit_identically(kind: str) -> None:
    params = mlp_params()
    mbs = [_micro(params, j, rows) for j, rows in enumerate((3, 2, 5))]

    def build() -> tuple[gradaccum.Accumulator, Any]:
        if kind == "all_reduce":
            return gradaccum.Accumulator(3, sync=gradaccum.all_reduce(bucket_mb=1e-5)), params
        if kind == "custom_reduce":
            return gradaccum.Accumulator(
                3, sync=gradaccum.custom_reduce(lambda g, s, pg: (g, s))
            ), params
        sharded = gradaccum.shard(params, bucket_mb=1e-5)
        policy = "every" if kind == "every" else "boundary"
        sync = gradaccum.reduce_scatter(sharded, policy=policy)
        return gradaccum.Accumulator(3, sync=sync), sharded

    def finish(acc: gradaccum.Accumulator, state: Any) -> tuple[Any, WindowStats]:
        for (g, m), rows in zip(mbs[1:], (2, 5), strict=True):
            state = acc.add(state, g, size=rows, metrics=m)
        grads, _, stats = acc.boundary(state)
        return grads, stats

    acc, target = build()
    state = acc.add(acc.init(target), mbs[0][0], size=3, metrics=mbs[0][1])
    buf = io.BytesIO()
    torch.save(acc.state_dict(state), buf)
    grads, stats = finish(acc, state)
    acc, target = build()
    buf.seek(0)
    resumed = acc.load_state_dict(acc.init(target), torch.load(buf, weights_only=True))
    again, stats_again = finish(acc, resumed)
    assert max_diff(grads, again) == 0.0
    assert stats_again == stats
    assert stats.weight == 10.0


def test_a_saved_state_without_metrics_loads_and_bad_metrics_are_refused() -> None:
    acc = gradaccum.Accumulator(n=2)
    state = acc.add(acc.init({"w": torch.zeros(2)}), {"w": torch.ones(2)}, size=1)
    sd = acc.state_dict(state)
    assert sd["metrics"] is None
    del sd["metrics"]  # a checkpoint from before metrics existed
    assert acc.load_state_dict(acc.init({"w": torch.zeros(2)}), sd).metrics is None
    where = "Accumulator.load_state_dict(state, state_dict): "
    fix = "; pass the dict that state_dict() returned (torch.load(path, weights_only=True))."
    for bad in ({"loss": 1.0}, {"loss": torch.ones(2, 2, dtype=F64)}, ["loss"]):
        with raises(
            gradaccum.GradAccumError,
            f"{where}metrics must be None or a dict (sorted by name) from names to floating "
            f"tensors of 0 or 1 dims, got {type(bad).__name__}{fix}",
        ):
            acc.load_state_dict(acc.init({"w": torch.zeros(2)}), {**sd, "metrics": bad})


def test_metric_errors_name_the_key_and_change_nothing() -> None:
    params = {"w": torch.zeros(2, dtype=F64)}
    acc = gradaccum.Accumulator(n=3, reduction="sum")
    g = {"w": torch.ones(2, dtype=F64)}
    state = acc.add(acc.init(params), g, metrics={"loss": 1.0, "tokens": 3})
    cases: list[tuple[Any, type[BaseException], str]] = [
        (
            {"loss": 1.0},
            ValueError,
            "metrics has the names ['loss'] but the window's earlier micro-batches gave ['loss', "
            "'tokens'] (missing 'tokens'); pass the same names at every add() of a window (0 for "
            "a metric with nothing to add in this micro-batch).",
        ),
        (
            {"loss": 1.0, "tokens": 3, "extra": 0},
            ValueError,
            "metrics has the names ['extra', 'loss', 'tokens'] but the window's earlier "
            "micro-batches gave ['loss', 'tokens'] (unexpected 'extra'); pass the same names at "
            "every add() of a window (0 for a metric with nothing to add in this micro-batch).",
        ),
        (
            None,
            ValueError,
            "metrics has the names [] but the window's earlier micro-batches gave ['loss', "
            "'tokens'] (missing 'loss'); pass the same names at every add() of a window (0 for "
            "a metric with nothing to add in this micro-batch).",
        ),
        (
            {"loss": torch.ones(3), "tokens": 3},
            ValueError,
            "metrics['loss'] has the shape (3,) but () at the window's earlier micro-batches; "
            "give a metric one shape in every add() of a window (a scalar, or a 1-D tensor of "
            "one length).",
        ),
        (
            {"loss": torch.ones(3, 1), "tokens": 3},
            ValueError,
            "metrics['loss'] must be a scalar (a 0-dim tensor) or a 1-D tensor, got "
            "Tensor(shape=(3, 1), dtype=float32); sum it to one number (metrics={'loss': "
            "value.sum()}) or flatten it (metrics={'loss': value.reshape(-1)}).",
        ),
        (
            {"loss": "1.0", "tokens": 3},
            TypeError,
            "metrics['loss'] must be a real number or a 0-dim real tensor (or a 1-D one), got "
            "str '1.0'; pass e.g. metrics={'loss': loss.detach()}.",
        ),
        (
            {"loss": 1.0, "tokens": True},
            TypeError,
            "metrics['tokens'] must be a real number or a 0-dim real tensor (or a 1-D one), got "
            "bool True; pass e.g. metrics={'tokens': loss.detach()}.",
        ),
        (
            [("loss", 1.0)],
            TypeError,
            "metrics must be None or a dict from names to numbers or 0-dim tensors (or 1-D "
            "tensors of a fixed length), got list; pass e.g. metrics={'loss': loss.detach()}.",
        ),
    ]
    for metrics, exc, message in cases:
        with raises(exc, ADD + message):
            acc.add(state, g, metrics=metrics)
    # Nothing was added: the window goes on as if the bad calls had not been made.
    state = acc.add(state, g, metrics={"loss": 2.0, "tokens": torch.tensor(4)})
    grads, _, stats = acc.boundary(state)
    assert stats == WindowStats(0, 2.0, {"loss": 3.0, "tokens": 7.0})
    assert torch.equal(grads["w"], torch.full((2,), 2.0, dtype=F64))
    for bad in ("loss", {"loss": (2, 3)}, {"loss": 2}):
        with raises(
            TypeError,
            f"Accumulator.init(params): metrics must be names (a tuple of str), or a dict from "
            f"names to shapes (() or (length,)), got {bad!r}; pass e.g. metrics=('loss',) or "
            f"metrics={{'loss': (), 'per_expert': (8,)}}.",
        ):
            acc.init(params, metrics=bad)


def test_without_metrics_add_does_no_metric_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradaccum import _metrics

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("metric work on the hot path")

    monkeypatch.setattr(_metrics, "check", fail)
    monkeypatch.setattr(_metrics, "add", fail)
    acc = gradaccum.Accumulator(n=2)
    state = acc.init({"w": torch.zeros(2)})
    for _ in range(2):
        state = acc.add(state, {"w": torch.ones(2)}, size=1)
    assert state.metrics is None
    grads, state = acc.finalize(state)
    assert state.metrics is None


class _Quiet(gradaccum.sync.Sync):
    """A sync of one's own whose window reports no totals."""

    def open(self, spec: Any) -> Any:
        window = _QuietWindow(spec)
        return window


class _QuietWindow(gradaccum.sync.Window):
    def finish(self, weight: Any, failed: bool = False) -> Any:
        return self.normalised(weight)


@pytest.mark.usefixtures("world_of_one")
def test_every_sync_reduces_the_metrics_in_its_boundary_collective() -> None:
    params = {"w": torch.zeros(3, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    syncs = {
        "local": lambda: None,
        "all_reduce": lambda: gradaccum.all_reduce(),
        "reduce_scatter": lambda: gradaccum.reduce_scatter(gradaccum.shard(params)),
        "every": lambda: gradaccum.reduce_scatter(gradaccum.shard(params), policy="every"),
        "custom_reduce": lambda: gradaccum.custom_reduce(lambda g, s, pg: (g, s)),
    }
    for name, make in syncs.items():
        logs = []
        for metrics in (None, {"loss": 1.5, "tokens": 2}):
            sync = make()
            acc = gradaccum.Accumulator(n=2, sync=sync)
            state = acc.init(
                params if name in ("local", "all_reduce", "custom_reduce") else sync.sharded
            )
            with gradaccum.sync.record_collectives() as log:
                for _ in range(2):
                    g = {"w": torch.ones(3, dtype=F64), "b": torch.ones(2, dtype=F64)}
                    state = acc.add(state, g, size=2, metrics=metrics)
                _, _, stats = acc.boundary(state)
            logs.append([(c.kind, c.purpose, c.numel) for c in log])
            assert stats.weight == 4.0, name
            assert stats.metrics == ({} if metrics is None else {"loss": 3.0, "tokens": 4.0}), name
        plain, with_metrics = logs
        assert [c[:2] for c in plain] == [c[:2] for c in with_metrics], name
        grown = [b[2] - a[2] for a, b in zip(plain, with_metrics, strict=True)]
        assert sorted(grown) == ([] if name == "local" else [0] * (len(plain) - 1) + [2]), name
    acc = gradaccum.Accumulator(n=1, sync=_Quiet())
    state = acc.add(
        acc.init(params), {"w": torch.ones(3, dtype=F64), "b": torch.ones(2, dtype=F64)}, size=1
    )
    with raises(
        TypeError,
        "Accumulator(n=1).boundary(state): the window of _Quiet did not report the window's "
        "totals (Window.totals) at the boundary, so there are no stats to return; in the sync's "
        "Window, exchange the weight through a Comm from self.connect(...) (or set self.totals "
        "in finish), or call finalize(state) instead.",
    ):
        acc.boundary(state)


# -- 2 gloo processes -----------------------------------------------------------------------

SPLITS = {0: (4, 1, 3), 1: (2,)}  # rows of each rank's micro-batches: uneven


def _sync_of(kind: str, params: Any) -> tuple[Any, Any]:
    if kind == "all_reduce":
        return gradaccum.all_reduce(bucket_mb=1e-5), params  # several buckets
    if kind in ("reduce_scatter", "every"):
        sharded = gradaccum.shard(params, bucket_mb=1e-5)
        policy = "every" if kind == "every" else "boundary"
        return gradaccum.reduce_scatter(sharded, policy=policy), sharded
    if kind.startswith("hybrid"):
        from torch.distributed.device_mesh import init_device_mesh

        shape = (2, 1) if kind == "hybrid 2x1" else (1, 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        sharded = gradaccum.shard(params, mesh)
        return gradaccum.reduce_scatter(sharded), sharded

    def summed(grads: Any, state: Any, pg: Any) -> Any:
        for g in grads.values():
            dist.all_reduce(g, group=pg)
        return grads, state

    return gradaccum.custom_reduce(summed), params


KINDS_2 = ("all_reduce", "reduce_scatter", "every", "hybrid 2x1", "hybrid 1x2", "custom_reduce")


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    params = mlp_params()
    out: dict[str, Any] = {}
    for kind in KINDS_2:
        got: dict[str, Any] = {}
        for with_metrics in (False, True):
            sync, target = _sync_of(kind, params)
            acc = gradaccum.Accumulator(n=3, sync=sync)
            state = acc.init(target)
            windows, logs = [], []
            for w in range(3):  # window 2: rank 1 is empty (it sends the names of window 1)
                with gradaccum.sync.record_collectives() as log:
                    sizes = SPLITS[rank] if not (w == 2 and rank == 1) else ()
                    for j, rows in enumerate(sizes):
                        g, m = _micro(params, 100 * w + 10 * rank + j, rows)
                        state = acc.add(state, g, size=rows, metrics=m if with_metrics else None)
                    _, state, stats = acc.boundary(state)
                windows.append(stats)
                logs.append([(c.kind, c.purpose, c.numel) for c in log])
            got["metrics" if with_metrics else "plain"] = (windows, logs)
        out[kind] = got
    # Ranks giving different metric names: caught by the fingerprint, before any gradient.
    acc = gradaccum.Accumulator(n=1, sync=gradaccum.all_reduce())
    g, m = _micro(params, rank, 2)
    if rank == 1:
        m = {**m, "extra": 0.0}
    with gradaccum.sync.record_collectives() as log:
        try:
            acc.boundary(acc.add(acc.init(params), g, size=2, metrics=m))
            out["names"] = "no error"
        except gradaccum.GradAccumError as err:
            out["names"] = str(err)
    out["names log"] = [c.purpose for c in log]
    # A first window empty on rank 1: init(metrics=...) gives it the names.
    acc = gradaccum.Accumulator(n=1, sync=gradaccum.all_reduce(dist.new_group([0, 1])))
    state = acc.init(params, metrics=("loss", "one", "rows"))
    if rank == 0:
        state = acc.add(state, g, size=2, metrics=m)
    _, _, out["first empty"] = acc.boundary(state)
    return out


def _want(w: int) -> tuple[float, dict[str, float]]:
    params, total, sums = mlp_params(), 0.0, {"loss": 0.0, "one": 0.0, "rows": 0.0}
    for rank, sizes in SPLITS.items():
        for j, rows in enumerate(sizes if not (w == 2 and rank == 1) else ()):
            _, m = _micro(params, 100 * w + 10 * rank + j, rows)
            total += rows
            for k in sums:
                sums[k] += float(m[k])
    return total, sums


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_sum_the_metrics_of_every_micro_batch_in_the_same_collectives() -> None:
    results = values(run(_two_ranks, timeout=240))
    for rank, r in enumerate(results):
        for kind in KINDS_2:
            (plain, plain_logs), (stats, logs) = r[kind]["plain"], r[kind]["metrics"]
            for w in range(3):
                weight, sums = _want(w)
                assert plain[w] == WindowStats(w, weight, {}), (kind, w)
                assert stats[w][:2] == (w, weight), (kind, w)
                assert stats[w].metrics.keys() == sums.keys(), (kind, w)
                for k, v in sums.items():
                    assert abs(stats[w].metrics[k] - v) <= 1e-12 * max(1.0, abs(v)), (kind, w, k)
                # The same collectives, one of them 3 elements longer (the tail).
                a, b = plain_logs[w], logs[w]
                assert [c[:2] for c in a] == [c[:2] for c in b], (kind, w)
                grown = sorted(y[2] - x[2] for x, y in zip(a, b, strict=True))
                tails = 2 if kind == "hybrid 2x1" else 1  # shard, then replicate group
                assert grown == [0] * (len(a) - tails) + [3] * tails, (kind, w, a, b)
        other = 1 - rank
        names = ("['loss', 'one', 'rows']", "['extra', 'loss', 'one', 'rows']")
        mine, theirs = (names[rank], names[other])
        assert r["names"] == (
            f"Accumulator(n=1).boundary(state): the ranks disagree on the gradients to "
            f"synchronise: rank {rank} has metrics "
            f"{mine} but rank {other} has metrics {theirs}. Every rank must pass params with the "
            f"same key paths, shapes and dtypes, and the same reduction, sync options and (where "
            f"it sets the collectives) n; nothing was reduced."
        )
        assert r["names log"] == ["fingerprint", "fingerprint"]
        _, m = _micro(mlp_params(), 0, 2)
        assert r["first empty"] == WindowStats(0, 2.0, {k: float(v) for k, v in m.items()})


@pytest.mark.usefixtures("world_of_one")
def test_dcp_save_and_load_keep_the_metric_sums_of_a_window_in_progress(tmp_path: Any) -> None:
    def build() -> tuple[Any, gradaccum.Accumulator]:
        sharded = gradaccum.shard({"w": torch.zeros(3, dtype=F64)})
        return sharded, gradaccum.Accumulator(2, sync=gradaccum.reduce_scatter(sharded))

    g = {"w": torch.ones(3, dtype=F64)}
    loss = torch.tensor(0.1, dtype=F64)
    sharded, acc = build()
    state = acc.add(acc.init(sharded), g, size=1, metrics={"loss": loss / 3})
    gradaccum.checkpoint.dcp_save(str(tmp_path), sharded, accumulator=acc, state=state)
    _, _, straight = acc.boundary(acc.add(state, g, size=1, metrics={"loss": loss}))
    sharded, acc = build()
    state = gradaccum.checkpoint.dcp_load(str(tmp_path), sharded, accumulator=acc)
    _, _, resumed = acc.boundary(acc.add(state, g, size=1, metrics={"loss": loss}))
    assert resumed == straight


@pytest.mark.usefixtures("world_of_one")
def test_a_sync_written_outside_the_package_carries_the_metrics_in_the_base_tail() -> None:
    acc = gradaccum.Accumulator(n=2, sync=sign_sync(compress=False))
    state = acc.init({"w": torch.zeros(3, dtype=F64)})
    with gradaccum.sync.record_collectives() as log:
        for loss in (1.0, 2.5):
            state = acc.add(state, {"w": torch.ones(3, dtype=F64)}, size=2, metrics={"loss": loss})
        _, _, stats = acc.boundary(state)
    assert stats == WindowStats(0, 4.0, {"loss": 3.5})
    assert [(c.purpose, c.numel) for c in log] == [
        ("weight", 5),  # [weight, failed, loss, h, h**2]: the base class's tail
        ("gradients", 3),
    ]


# -- 1-D metrics (a count per parameter, per expert) ----------------------------------------


def _counts(seed: int, k: int = 4) -> torch.Tensor:
    """A micro-batch's 1-D metric: small integer counts (exact in every dtype)."""
    return torch.randint(0, 5, (k,), generator=torch.Generator().manual_seed(seed)).to(F64)


def test_a_1d_metric_is_summed_element_by_element_and_reported_as_a_list() -> None:
    params, acc = mlp_params(), gradaccum.Accumulator(n=3)
    state = acc.init(params, metrics={"loss": (), "per": (4,)})
    assert {k: tuple(v.shape) for k, v in state.metrics.items()} == {"loss": (), "per": (4,)}
    want = torch.zeros(4, dtype=F64)
    loss = 0.0
    for j, rows in enumerate((4, 1, 6)):
        g, m = _micro(params, j, rows)
        state = acc.add(state, g, size=rows, metrics={"loss": m["loss"], "per": _counts(j)})
        want += _counts(j)
        loss += float(m["loss"])
    assert state.metrics["per"].dtype == F64
    grads, state, stats = acc.boundary(state)
    assert stats.metrics == {"loss": stats.metrics["loss"], "per": want.tolist()}
    assert abs(stats.metrics["loss"] - loss) < 1e-12
    assert all(isinstance(v, float) for v in stats.metrics["per"])
    # An empty next window carries zeros of the same shape (what it would send).
    assert torch.equal(state.metrics["per"], torch.zeros(4, dtype=F64))
    # A 1-D metric of length 1 stays a list; one of length 0 is allowed.
    state = acc.add(state, g, size=1, metrics={"one": torch.ones(1), "none": torch.zeros(0)})
    assert acc.boundary(state)[2].metrics == {"none": [], "one": [1.0]}


def test_a_1d_metric_survives_a_mid_window_checkpoint_bit_identically() -> None:
    params, acc = mlp_params(), gradaccum.Accumulator(n=3)
    mbs = [
        (_micro(params, j, rows)[0], rows, _counts(j, 6) / 3) for j, rows in enumerate((3, 2, 5))
    ]
    state = acc.init(params)
    g, rows, c = mbs[0]
    state = acc.add(state, g, size=rows, metrics={"per": c})
    buf = io.BytesIO()
    torch.save(acc.state_dict(state), buf)
    for g, rows, c in mbs[1:]:
        state = acc.add(state, g, size=rows, metrics={"per": c})
    _, _, stats = acc.boundary(state)
    buf.seek(0)
    resumed = acc.load_state_dict(acc.init(params), torch.load(buf, weights_only=True))
    assert resumed.metrics["per"].shape == (6,)
    for g, rows, c in mbs[1:]:
        resumed = acc.add(resumed, g, size=rows, metrics={"per": c})
    assert acc.boundary(resumed)[2] == stats


@pytest.mark.usefixtures("world_of_one")
def test_every_sync_carries_a_1d_metric_in_its_boundary_tail() -> None:
    params = {"w": torch.zeros(3, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    syncs = {
        "local": lambda: None,
        "all_reduce": lambda: gradaccum.all_reduce(),
        "reduce_scatter": lambda: gradaccum.reduce_scatter(gradaccum.shard(params)),
        "every": lambda: gradaccum.reduce_scatter(gradaccum.shard(params), policy="every"),
        "custom_reduce": lambda: gradaccum.custom_reduce(lambda g, s, pg: (g, s)),
    }
    for name, make in syncs.items():
        logs = []
        for metrics in (None, {"loss": 1.5, "per": torch.tensor([1.0, 0.0, 2.0, 5.0, 0.5])}):
            sync = make()
            acc = gradaccum.Accumulator(n=2, sync=sync)
            state = acc.init(
                params if name in ("local", "all_reduce", "custom_reduce") else sync.sharded
            )
            with gradaccum.sync.record_collectives() as log:
                for _ in range(2):
                    g = {"w": torch.ones(3, dtype=F64), "b": torch.ones(2, dtype=F64)}
                    state = acc.add(state, g, size=2, metrics=metrics)
                _, _, stats = acc.boundary(state)
            logs.append([(c.kind, c.purpose, c.numel) for c in log])
            want = {} if metrics is None else {"loss": 3.0, "per": [2.0, 0.0, 4.0, 10.0, 1.0]}
            assert stats.metrics == want, name
        plain, with_metrics = logs
        grown = [b[2] - a[2] for a, b in zip(plain, with_metrics, strict=True)]
        assert sorted(grown) == ([] if name == "local" else [0] * (len(plain) - 1) + [6]), name


def _two_ranks_1d(rank: int, world: int) -> dict[str, Any]:
    params, out = mlp_params(), {}
    for kind in ("all_reduce", "custom_reduce", "reduce_scatter"):
        sync, target = _sync_of(kind, params)
        acc = gradaccum.Accumulator(n=2, sync=sync)
        state = acc.init(target, metrics={"per": (4,)})
        stats = []
        for w in range(2):  # window 1: rank 1 is empty (it sends zeros of the same shape)
            for j in range(2 if (w == 0 or rank == 0) else 0):
                g, _ = _micro(params, 10 * rank + j, 2)
                state = acc.add(state, g, size=2, metrics={"per": _counts(100 * w + 10 * rank + j)})
            _, state, s = acc.boundary(state)
            stats.append(s.metrics["per"])
        out[kind] = stats
    # Ranks whose 1-D metric has another length: the fingerprint names both, nothing is sent.
    acc = gradaccum.Accumulator(n=1, sync=gradaccum.all_reduce())
    g, _ = _micro(params, rank, 2)
    with gradaccum.sync.record_collectives() as log:
        try:
            acc.boundary(
                acc.add(acc.init(params), g, size=2, metrics={"per": _counts(0, 4 + rank)})
            )
            out["lengths"] = "no error"
        except gradaccum.GradAccumError as err:
            out["lengths"] = str(err)
    out["lengths log"] = [c.purpose for c in log]
    return out


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_two_ranks_sum_a_1d_metric_and_refuse_lengths_that_differ() -> None:
    results = values(run(_two_ranks_1d, timeout=180))
    want = [
        (sum(_counts(10 * r + j) for r in range(2) for j in range(2))).tolist(),
        (_counts(100) + _counts(101)).tolist(),
    ]
    for rank, r in enumerate(results):
        for kind in ("all_reduce", "custom_reduce", "reduce_scatter"):
            assert r[kind] == want, (kind, rank)
        other = 1 - rank
        lengths = ("['per[4]']", "['per[5]']")
        assert r["lengths"] == (
            f"Accumulator(n=1).boundary(state): the ranks disagree on the gradients to "
            f"synchronise: rank {rank} has metrics {lengths[rank]} but rank {other} has metrics "
            f"{lengths[other]}. Every rank must pass params with the same key paths, shapes and "
            f"dtypes, and the same reduction, sync options and (where it sets the collectives) "
            f"n; nothing was reduced."
        )
        assert r["lengths log"] == ["fingerprint", "fingerprint"]


@pytest.mark.usefixtures("world_of_one")
def test_dcp_save_and_load_keep_a_1d_metric_of_a_window_in_progress(tmp_path: Any) -> None:
    def build() -> tuple[Any, gradaccum.Accumulator]:
        sharded = gradaccum.shard({"w": torch.zeros(3, dtype=F64)})
        return sharded, gradaccum.Accumulator(2, sync=gradaccum.reduce_scatter(sharded))

    g = {"w": torch.ones(3, dtype=F64)}
    m = {"loss": torch.tensor(0.1, dtype=F64), "per": torch.tensor([0.5, 1.0], dtype=F64)}
    sharded, acc = build()
    state = acc.add(acc.init(sharded), g, size=1, metrics=m)
    gradaccum.checkpoint.dcp_save(str(tmp_path), sharded, accumulator=acc, state=state)
    _, _, straight = acc.boundary(acc.add(state, g, size=1, metrics=m))
    sharded, acc = build()
    state = gradaccum.checkpoint.dcp_load(str(tmp_path), sharded, accumulator=acc)
    assert state.metrics["per"].shape == (2,)
    _, _, resumed = acc.boundary(acc.add(state, g, size=1, metrics=m))
    assert resumed == straight
    assert resumed.metrics["per"] == [1.0, 2.0]
