"""The table of pinned error messages: every bad input gradaccum can meet in one process.

This is the one table of the project's error messages (CONTRIBUTING.md, "Error messages").
Each case builds fresh inputs, makes one bad call and says which exception it expects and which
words (the argument's name, the key path...) the message must contain; ``MESSAGES`` pins the
whole text of a case's message, character for character. One generic test runs them all and
checks, for each:

- the exception type;
- the message starts with the call shape (``name(...)``), names the argument, and gives a fix
  (after the expectation: ``; pass ...``, ``. Use ...``, ``; step_fn must ...``; CONTRIBUTING.md);
- the message is ``MESSAGES[case id]`` when the case has an entry there;
- every tensor reachable from the inputs (params, grads, accumulator states, modules' parameters,
  ``.grad`` and buffers, optimizer state, state dicts, shards) is bit-identical afterwards, and
  the containers hold the same keys.

A new error gets a case here, and its message an entry in ``MESSAGES``. (tests/test_errors.py,
which pinned the messages of accumulate, Accumulator, MicroBatches and the module helpers a
second time, is merged into this table. Messages that need more than one process, or a whole
loop run, are pinned next to their behaviour: tests/test_loop_*.py, test_distributed.py...)
Cases tagged ``item=N`` are the bad inputs of the reliability issue (item N of its list),
``item="loop"`` those of ``gradaccum.loop`` (issue 26: windows, Step, save and load, where
"unchanged" covers the step's window, the data position and the files of a checkpoint
directory), ``item="deferred"`` those of the deferred boundary (issue 36: ``all_reduce(defer=)``,
``guard``, ``found_inf``, ``Step`` over it); the others existed before them. Distributed paths
run in a world of one process (gloo, a HashStore).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradaccum

F64 = torch.float64
NAN, INF = float("nan"), float("inf")

Exc = type[BaseException] | tuple[type[BaseException], ...]
NS = dict[str, Any]


# -- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One bad call.

    ``names``: words the message must contain; a tuple among them means any one of its words.
    ``world``: run inside a gloo process group of one rank. ``item``: the reliability issue's
    item number for the bad inputs it added, ``"loop"`` for the loop's (None: an error that
    existed before them).
    ``absent``: words the message must not contain (a misleading phrase).
    """

    id: str
    setup: Callable[[], NS]
    call: Callable[[NS], Any]
    exc: Exc
    names: tuple[str | tuple[str, ...], ...]
    world: bool = False
    item: int | str | None = None
    absent: tuple[str, ...] = ()


CASES: list[Case] = []


def case(
    id: str,
    setup: Callable[[], NS],
    call: Callable[[NS], Any],
    exc: Exc,
    *names: str | tuple[str, ...],
    world: bool = False,
    item: int | str | None = None,
    absent: tuple[str, ...] = (),
) -> None:
    assert all(c.id != id for c in CASES), id
    CASES.append(Case(id, setup, call, exc, names, world, item, absent))


def raises(exc: type[BaseException], message: str) -> contextlib.AbstractContextManager[Any]:
    """``pytest.raises`` that matches the whole message, character for character."""
    return pytest.raises(exc, match=rf"\A{re.escape(message)}\Z")


# -- inputs -------------------------------------------------------------------------------------


def params() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([0.1, 0.2, 0.3], dtype=F64), "b": torch.tensor(0.5, dtype=F64)}


def grads(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), scale, dtype=F64), "b": torch.tensor(scale, dtype=F64)}


def x(rows: int = 8) -> torch.Tensor:
    return torch.arange(rows * 3, dtype=F64).reshape(rows, 3) / 10


def y(rows: int = 8) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, rows, dtype=F64)


def step_fn(params: Any, batch: Any) -> Any:
    """Gradients of the right tree: ones."""
    return {k: torch.ones_like(v) for k, v in params.items()}


def aux_fn(params: Any, batch: Any) -> Any:
    return step_fn(params, batch), {
        "loss": torch.tensor(1.0, dtype=F64),
        "tokens": torch.tensor(3.0, dtype=F64),
    }


def returning(out: Any) -> Callable[..., Any]:
    """A step function named ``step_fn`` that returns ``out``."""

    def step_fn(params: Any, batch: Any) -> Any:
        return out

    return step_fn


def mean_loss(params: Any, batch: Any) -> torch.Tensor:
    xs, ys = batch
    return ((xs @ params["w"] + params["b"] - ys) ** 2).mean()


def pb(**more: Any) -> NS:
    """Params and a batch (x, y) of 8 rows."""
    return {"params": params(), "batch": (x(), y()), **more}


def mid(n: int = 4, reduction: str = "mean", **kw: Any) -> NS:
    """An Accumulator and a state holding one micro-batch (running sums allocated)."""
    acc = gradaccum.Accumulator(n=n, reduction=reduction, **kw)  # type: ignore[arg-type]
    weight = {"count": 2} if reduction == "count" else {"size": 2}
    p = params()
    state = acc.add(acc.init(p), grads(), **weight)
    return {"acc": acc, "state": state, "params": p, "grads": grads(2.0)}


def fresh(n: int = 4, reduction: str = "mean") -> NS:
    acc = gradaccum.Accumulator(n=n, reduction=reduction)  # type: ignore[arg-type]
    p = params()
    return {"acc": acc, "state": acc.init(p), "params": p, "grads": grads()}


def saved(change: Callable[[dict[str, Any]], None] | None = None, **kw: Any) -> NS:
    """A mid-window state (n=4, one micro-batch) and its state dict, changed by ``change``."""
    ns = mid(**kw)
    sd = ns["acc"].state_dict(ns["state"])
    if change is not None:
        change(sd)
    return {**ns, "sd": sd}


def saved_other(p: dict[str, torch.Tensor], **kw: Any) -> NS:
    """A fresh state for params() and the state dict of a window over ``p``."""
    other = gradaccum.Accumulator(n=4, **kw)
    weight = {"count": 2} if kw.get("reduction") == "count" else {"size": 2}
    state = other.add(other.init(p), {k: torch.ones_like(v) for k, v in p.items()}, **weight)
    return {**mid(), "sd": other.state_dict(state)}


def linear(with_grad: bool = True) -> NS:
    """A float64 Linear(2, 1) with .grad set and an SGD optimizer with momentum state."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 1).to(F64)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(3, 2, dtype=F64)).sum().backward()
    opt.step()  # momentum buffers
    if not with_grad:
        opt.zero_grad(set_to_none=True)
    return {"module": lin, "opt": opt, "x": torch.ones(3, 2, dtype=F64)}


def batchnorm() -> NS:
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3).to(F64)
    bn(torch.randn(6, 3, dtype=F64))  # running statistics move off their initial values
    return {"module": bn, "buffers": gradaccum.buffers_of(bn)}


W, B = torch.ones(1, 2, dtype=F64), torch.ones(1, dtype=F64)


def world_params() -> dict[str, torch.Tensor]:
    return {
        "w1": torch.arange(12, dtype=F64).reshape(4, 3) / 10,
        "b1": torch.zeros(4, dtype=F64),
        "w2": torch.ones(4, dtype=F64),
    }


def world_loss(params: Any, batch: Any) -> torch.Tensor:
    xs, ys = batch
    h = torch.tanh(xs @ params["w1"].T + params["b1"])
    return ((h @ params["w2"] - ys) ** 2).mean()


def sharded(**kw: Any) -> NS:
    """Params sharded over the world of one, with a sync, a batch and an optimizer on shards."""
    p = world_params()
    sp = gradaccum.shard(
        p, param_groups=lambda path: "w" if "w" in path else "b", bucket_mb=1e-5, **kw
    )
    opt = torch.optim.SGD(list(sp.shards), lr=0.1, momentum=0.9)
    for s in sp.shards:
        s.grad = torch.ones_like(s)
    opt.step()
    return {"params": p, "sharded": sp, "opt": opt, "batch": (x(), y())}


def mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def dtensor() -> NS:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    dt = distribute_tensor(torch.randn(4, 2), mesh(), [Shard(0)])
    return {"params": {"w": dt}, "batch": torch.ones(4, 2)}


def fsdp_model() -> NS:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    fully_shard(model, mesh=mesh())
    return {"module": model, "grads": {"weight": torch.ones(3, 2), "bias": torch.ones(3)}}


# -- n, reduction and the other options ---------------------------------------------------------

BAD_N = [
    ("0", 0, ValueError),
    ("negative", -1, ValueError),
    ("float", 2.5, TypeError),
    ("bool", True, TypeError),
    ("str", "4", TypeError),
    ("None", None, TypeError),
]
for _id, _n, _exc in BAD_N:
    case(
        f"accumulate-n-{_id}",
        dict,
        lambda ns, n=_n: gradaccum.accumulate(step_fn, n),
        _exc,
        "n must be",
    )
    case(
        f"Accumulator-n-{_id}",
        dict,
        lambda ns, n=_n: gradaccum.Accumulator(n=n),
        _exc,
        "n must be",
    )

for _id, _r in [("avg", "avg"), ("upper-case", "MEAN"), ("None", None), ("int", 1)]:
    case(
        f"accumulate-reduction-{_id}",
        dict,
        lambda ns, r=_r: gradaccum.accumulate(step_fn, 2, reduction=r),
        ValueError,
        "reduction",
    )
    case(
        f"Accumulator-reduction-{_id}",
        dict,
        lambda ns, r=_r: gradaccum.Accumulator(2, reduction=r),
        ValueError,
        "reduction",
    )

case(
    "accumulate-step_fn-not-callable",
    dict,
    lambda ns: gradaccum.accumulate(3, 2),  # type: ignore[arg-type]
    TypeError,
    "step_fn",
)
case(
    "accumulate-accum_dtype-int32",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, accum_dtype=torch.int32),
    TypeError,
    "accum_dtype",
)
case(
    "Accumulator-accum_dtype-str",
    dict,
    lambda ns: gradaccum.Accumulator(2, accum_dtype="float32"),  # type: ignore[arg-type]
    TypeError,
    "accum_dtype",
)
case(
    "accumulate-has_aux-int",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, has_aux=1),  # type: ignore[arg-type]
    TypeError,
    "has_aux",
)
case(
    "accumulate-count-reduction-without-count",
    dict,
    lambda ns: gradaccum.accumulate(aux_fn, 2, has_aux=True, reduction="count"),
    ValueError,
    "count=",
)
case(
    "accumulate-count-reduction-without-has_aux",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, reduction="count", count=lambda aux: 1),
    ValueError,
    "has_aux",
)
case(
    "accumulate-count-with-mean",
    dict,
    lambda ns: gradaccum.accumulate(aux_fn, 2, has_aux=True, count=lambda aux: 1),
    ValueError,
    "count=",
    "reduction",
)
case(
    "accumulate-count-with-sum",
    dict,
    lambda ns: gradaccum.accumulate(
        aux_fn, 2, has_aux=True, reduction="sum", count=lambda aux: aux["tokens"]
    ),
    ValueError,
    "count=",
    "reduction",
)
case(
    "accumulate-count-reduction-without-has_aux-or-count",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, reduction="count"),
    ValueError,
    "has_aux",
    "count=",
)
case(
    "accumulate-count-reduction-count-not-a-function",
    dict,
    lambda ns: gradaccum.accumulate(aux_fn, 2, has_aux=True, reduction="count", count=3),
    ValueError,
    "count=",
)
case(
    "accumulate-aux_reduction-without-has_aux",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, aux_reduction="sum"),
    ValueError,
    "aux_reduction",
    "has_aux",
)
case(
    "accumulate-aux_reduction-unknown",
    dict,
    lambda ns: gradaccum.accumulate(aux_fn, 2, has_aux=True, aux_reduction="avg"),
    ValueError,
    "aux_reduction",
)
case(
    "accumulate-aux_reduction-tree-leaf-unknown",
    dict,
    lambda ns: gradaccum.accumulate(
        aux_fn, 2, has_aux=True, aux_reduction={"loss": "mean", "tokens": "avg"}
    ),
    ValueError,
    "aux_reduction leaf ['tokens']",
)
case(
    "accumulate-sync-not-a-sync",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, sync=3),  # type: ignore[arg-type]
    TypeError,
    "sync",
)
case(
    "Accumulator-sync-not-a-sync",
    dict,
    lambda ns: gradaccum.Accumulator(2, sync="all_reduce"),  # type: ignore[arg-type]
    TypeError,
    "sync",
)
case(
    "accumulate-micro_transform-not-callable",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, micro_transform=3),  # type: ignore[arg-type]
    TypeError,
    "micro_transform",
)
case(
    "accumulate-batch_argnum-negative",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, batch_argnum=-1),
    TypeError,
    "batch_argnum",
)
case(
    "accumulate-argnums-str",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, argnums="0"),  # type: ignore[arg-type]
    TypeError,
    "argnums",
)
case(
    "accumulate-argnums-empty-tuple",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, argnums=()),
    TypeError,
    "argnums",
)
case(
    "accumulate-argnums-negative",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, argnums=-1, batch_argnum=1),
    ValueError,
    "argnums",
)
case(
    "accumulate-batch_argnum-in-argnums",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, argnums=(0, 1)),
    ValueError,
    "batch_argnum",
    "argnums",
)
case(
    "accumulate-batch_argnum-in-argnums-int",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, argnums=1),
    ValueError,
    "batch_argnum",
    "argnums",
)
case(
    "accumulate-batch_argnum-in-default-argnums",
    dict,
    lambda ns: gradaccum.accumulate(step_fn, 2, batch_argnum=0),
    ValueError,
    "batch_argnum",
    "argnums",
)
case(
    "accumulate-grad-argnums-differ",
    dict,
    lambda ns: gradaccum.accumulate(
        gradaccum.grad(mean_loss, argnums=1), 2, argnums=0, batch_argnum=2
    ),
    ValueError,
    "argnums",
)
case(
    "accumulate-grad_and_value-with-has_aux-False",
    dict,
    lambda ns: gradaccum.accumulate(gradaccum.grad_and_value(mean_loss), 2, has_aux=False),
    ValueError,
    "has_aux",
)

# -- the batch ----------------------------------------------------------------------------------

for _id, _batch in [
    ("list-of-ints", [1, 2, 3]),
    ("dict-of-int", {"x": 3}),
    ("str", "abc"),
    ("empty-dict", {}),
    ("empty-tuple", ()),
    ("None", None),
    ("list-of-None", [None, None]),
]:
    case(
        f"accumulate-batch-without-tensor-{_id}",
        lambda b=_batch: {"params": params(), "batch": b},
        lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], ns["batch"]),
        ValueError,
        "batch",
    )
case(
    "accumulate-batch-0-dim-leaf",
    lambda: {"params": params(), "batch": {"x": x(), "scale": torch.tensor(2.0, dtype=F64)}},
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], ns["batch"]),
    ValueError,
    "batch leaf ['scale']",
)
case(
    "accumulate-batch-rows-disagree",
    lambda: {"params": params(), "batch": {"x": x(8), "y": y(6)}},
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], ns["batch"]),
    ValueError,
    "['x']",
    "['y']",
)
case(
    "accumulate-batch-rows-disagree-nested",
    lambda: {"params": params(), "batch": {"in": {"x": x(8)}, "out": [y(8), y(5)]}},
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], ns["batch"]),
    ValueError,
    "['out'][1]",
)
case(
    "accumulate-batch-numpy-leaf",
    lambda: {"params": params(), "batch": {"x": x(), "y": np.linspace(-1.0, 1.0, 8)}},
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], ns["batch"]),
    TypeError,
    "batch leaf ['y']",
)
case(
    "accumulate-n-more-than-rows",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 9)(ns["params"], ns["batch"]),
    ValueError,
    "n=9",
)
case(
    "accumulate-batch-0-rows",
    lambda: {"params": params(), "batch": (x(0), y(0))},
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], ns["batch"]),
    ValueError,
    "0 rows",
)
case(
    "accumulate-no-batch-argument",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"]),
    TypeError,
    "params",
    "batch",
)
case(
    "accumulate-no-argument",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 2)(),
    TypeError,
    "params",
    "batch",
)
case(
    "accumulate-batch_argnum-2-without-argument-2",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 2, batch_argnum=2)(ns["params"], ns["batch"]),
    TypeError,
    "position 2",
)
case(
    "accumulate-argnums-0-2-without-argument-2",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 2, argnums=(0, 2))(ns["params"], ns["batch"]),
    TypeError,
    "[0, 2]",
)
case(
    "accumulate-batch-as-keyword",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], batch=ns["batch"]),
    TypeError,
    "positionally",
)

# -- the params ---------------------------------------------------------------------------------

case(
    "accumulate-params-leaf-float",
    lambda: {"params": {"w": 1.0}, "batch": (x(), y())},
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], ns["batch"]),
    TypeError,
    "params leaf ['w']",
)
case(
    "accumulate-params-leaf-int64",
    lambda: {"params": {"w": torch.arange(3)}, "batch": (x(), y())},
    lambda ns: gradaccum.accumulate(step_fn, 2)(ns["params"], ns["batch"]),
    TypeError,
    "params leaf ['w']",
)


case(
    "accumulate-empty-params-torch.func.grad",
    lambda: {"params": {}, "batch": torch.ones(4, 2)},
    lambda ns: gradaccum.accumulate(
        torch.func.grad(lambda p, b: sum(v.sum() for v in p.values()) + 0 * b.sum()), n=2
    )(ns["params"], ns["batch"]),
    (ValueError, TypeError),
    "params",
    ("empty", "no leaf", "no leaves", "no tensor", "at least one"),
    item=9,
)


def _sum_loss(p: Any, b: Any, *more: Any) -> torch.Tensor:
    """A loss over whatever tensors the params hold (none, here)."""
    trees = [p, *more]
    return sum((v.sum() for t in trees for v in t.values()), 0 * b.sum())


_NO_LEAF = ("empty", "no leaf", "no leaves", "no tensor", "at least one")
for _id, _step, _args, _kw in [
    ("gradaccum.grad", lambda: gradaccum.grad(_sum_loss), ({}, torch.ones(4, 2)), {}),
    (
        "gradaccum.grad_and_value",
        lambda: gradaccum.grad_and_value(_sum_loss),
        ({}, torch.ones(4, 2)),
        {"has_aux": True},
    ),
    ("None", lambda: torch.func.grad(_sum_loss), (None, torch.ones(4, 2)), {}),
    (
        "argnums-tuple-torch.func.grad",
        lambda: torch.func.grad(_sum_loss, argnums=(0, 2)),
        ({}, torch.ones(4, 2), {}),
        {"argnums": (0, 2)},
    ),
    (
        "argnums-tuple-gradaccum.grad",
        lambda: gradaccum.grad(_sum_loss, argnums=(0, 2)),
        ({}, torch.ones(4, 2), {}),
        {},
    ),
]:
    case(
        f"accumulate-empty-params-{_id}",
        lambda a=_args: {"args": a},
        lambda ns, st=_step, kw=_kw: gradaccum.accumulate(st(), 2, **kw)(*ns["args"]),
        ValueError,
        "params",
        "argnums",
        _NO_LEAF,
        item=9,
    )

# -- what step_fn returns -----------------------------------------------------------------------

ONE3, ONE = torch.ones(3, dtype=F64), torch.ones((), dtype=F64)
BAD_GRADS: list[tuple[str, Any, Exc, str]] = [
    ("missing-key", {"w": ONE3}, ValueError, "params tree"),
    ("extra-key", {"w": ONE3, "b": ONE, "c": ONE}, ValueError, "params tree"),
    ("renamed-key", {"w": ONE3, "bias": ONE}, ValueError, "params tree"),
    ("list-vs-dict", [ONE3, ONE], ValueError, "params tree"),
    ("float-leaf", {"w": 1.0, "b": ONE}, TypeError, "gradient leaf ['w']"),
    ("wrong-shape", {"w": torch.ones(2, dtype=F64), "b": ONE}, ValueError, "gradient leaf ['w']"),
    ("per-sample", {"w": torch.ones(4, 3, dtype=F64), "b": ONE}, ValueError, "gradient leaf ['w']"),
    ("int64", {"w": torch.ones(3, dtype=torch.int64), "b": ONE}, TypeError, "gradient leaf ['w']"),
    ("complex", {"w": ONE3, "b": torch.ones((), dtype=torch.complex128)}, TypeError, "leaf ['b']"),
    ("None-leaf", {"w": None, "b": ONE}, TypeError, "gradient leaf ['w']"),
    ("bare-tensor", ONE3, ValueError, "params tree"),
    ("str-leaf", {"w": ONE3, "b": "g"}, TypeError, "gradient leaf ['b']"),
    ("broadcastable-shape", {"w": torch.ones(1, 3, dtype=F64), "b": ONE}, ValueError, "leaf ['w']"),
    ("bool", {"w": torch.ones(3, dtype=torch.bool), "b": ONE}, TypeError, "gradient leaf ['w']"),
]
for _id, _out, _exc, _name in BAD_GRADS:
    case(
        f"accumulate-grads-{_id}",
        pb,
        lambda ns, out=_out: gradaccum.accumulate(returning(out), 2)(ns["params"], ns["batch"]),
        _exc,
        _name,
    )
    if _id != "None-leaf":
        case(
            f"Accumulator.add-grads-{_id}",
            mid,
            lambda ns, out=_out: ns["acc"].add(ns["state"], out, size=2),
            _exc,
            _name,
        )


def nested_params() -> dict[str, Any]:
    return {
        "layer": {"w": torch.zeros(3, dtype=F64), "b": torch.zeros(2, dtype=F64)},
        "out": [torch.zeros(1, dtype=F64)],
    }


def nested(layer: Any = None, out: Any = None) -> dict[str, Any]:
    """Gradients for nested_params(), with ``layer`` or ``out`` replaced."""
    if layer is None:
        layer = {"w": torch.ones(3, dtype=F64), "b": torch.ones(2, dtype=F64)}
    return {"layer": layer, "out": [torch.ones(1, dtype=F64)] if out is None else out}


def mid_nested() -> NS:
    """An Accumulator over nested_params() and a state holding one micro-batch."""
    acc, p = gradaccum.Accumulator(n=4), nested_params()
    state = acc.add(acc.init(p), nested(), size=2)
    return {"acc": acc, "state": state, "params": p}


NESTED_GRADS: list[tuple[str, Any, Exc, str]] = [
    ("missing-key", nested(layer={"w": ONE3}), ValueError, "at ['layer']"),
    ("leaf-vs-dict", nested(layer=ONE3), ValueError, "at ['layer']"),
    ("list-length", nested(out=[ONE, ONE]), ValueError, "at ['out']"),
    ("tuple-vs-list", nested(out=(torch.ones(1, dtype=F64),)), ValueError, "at ['out']"),
    (
        "wrong-shape",
        nested(layer={"w": ONE3, "b": torch.ones(3, dtype=F64)}),
        ValueError,
        "gradient leaf ['layer']['b']",
    ),
    (
        "int32",
        nested(layer={"w": ONE3, "b": torch.ones(2, dtype=torch.int32)}),
        TypeError,
        "gradient leaf ['layer']['b']",
    ),
]
for _id, _out, _exc, _name in NESTED_GRADS:
    case(
        f"accumulate-grads-nested-{_id}",
        lambda: {"params": nested_params(), "batch": (x(), y())},
        lambda ns, out=_out: gradaccum.accumulate(returning(out), 2)(ns["params"], ns["batch"]),
        _exc,
        _name,
    )
    case(
        f"Accumulator.add-grads-nested-{_id}",
        mid_nested,
        lambda ns, out=_out: ns["acc"].add(ns["state"], out, size=2),
        _exc,
        _name,
    )


def bad_tree_at_micro_batch(k: int) -> Callable[..., Any]:
    """A step function named ``step_fn`` that returns ones, but a tree without ``b`` at
    micro-batch ``k`` (counting from 1), and records the micro-batches it saw."""
    seen: list[int] = []

    def step_fn(params: Any, batch: Any) -> Any:
        seen.append(len(seen) + 1)
        grads = {name: torch.ones_like(leaf) for name, leaf in params.items()}
        return {"w": grads["w"]} if seen[-1] == k else grads

    step_fn.seen = seen  # type: ignore[attr-defined]
    return step_fn


case(
    "accumulate-grads-missing-key-at-micro-batch-2",
    pb,
    lambda ns: gradaccum.accumulate(bad_tree_at_micro_batch(2), 4)(ns["params"], ns["batch"]),
    ValueError,
    "params tree",
)

for _id, _out in [
    ("bare-tensor", ONE3),
    ("grads-only", {"w": ONE3, "b": ONE}),
    ("3-tuple", ({"w": ONE3, "b": ONE}, 1.0, 2.0)),
    ("1-tuple", ({"w": ONE3, "b": ONE},)),
    ("list-pair", [{"w": ONE3, "b": ONE}, 1.0]),
]:
    case(
        f"accumulate-has_aux-output-{_id}",
        pb,
        lambda ns, out=_out: gradaccum.accumulate(returning(out), 2, has_aux=True)(
            ns["params"], ns["batch"]
        ),
        TypeError,
        "has_aux",
        "(grads, aux)",
    )
case(
    "accumulate-pair-without-has_aux",
    pb,
    lambda ns: gradaccum.accumulate(returning(({"w": ONE3, "b": ONE}, ONE)), 2)(
        ns["params"], ns["batch"]
    ),
    ValueError,
    "has_aux=True",
)
case(
    "accumulate-micro_transform-wrong-shape",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 2, micro_transform=lambda g: {**g, "w": g["w"][:2]})(
        ns["params"], ns["batch"]
    ),
    ValueError,
    "micro_transform",
    "gradient leaf ['w']",
)

# -- counts and aux -----------------------------------------------------------------------------


def _count_step(count: Any) -> Callable[..., Any]:
    return gradaccum.accumulate(aux_fn, 2, has_aux=True, reduction="count", count=lambda a: count)


for _id, _count, _exc, _item in [
    ("negative", -3, ValueError, None),
    ("str", "3", TypeError, None),
    ("two-elements", torch.ones(2, dtype=F64), TypeError, None),
    ("complex", torch.tensor(3 + 0j), TypeError, None),
    ("bool-tensor", torch.tensor(True), TypeError, None),
    ("nan", NAN, ValueError, 7),
]:
    case(
        f"accumulate-count-{_id}",
        pb,
        lambda ns, c=_count: _count_step(c)(ns["params"], ns["batch"]),
        _exc,
        "count",
        item=_item,
    )
case(
    "accumulate-counts-add-up-to-0",
    pb,
    lambda ns: _count_step(0)(ns["params"], ns["batch"]),
    ValueError,
    "counts",
)
case(
    "accumulate-aux_reduction-count-without-count-reduction",
    pb,
    lambda ns: gradaccum.accumulate(aux_fn, 2, has_aux=True, aux_reduction="count")(
        ns["params"], ns["batch"]
    ),
    ValueError,
    "aux_reduction",
    "reduction='count'",
)
case(
    "accumulate-aux_reduction-not-a-prefix",
    pb,
    lambda ns: gradaccum.accumulate(aux_fn, 2, has_aux=True, aux_reduction={"loss": "mean"})(
        ns["params"], ns["batch"]
    ),
    ValueError,
    "aux_reduction",
)
case(
    "accumulate-aux_reduction-list-not-a-prefix",
    pb,
    lambda ns: gradaccum.accumulate(aux_fn, 2, has_aux=True, aux_reduction=["mean", "sum"])(
        ns["params"], ns["batch"]
    ),
    ValueError,
    "aux_reduction",
)


def _changing_aux() -> Callable[..., Any]:
    calls: list[int] = []

    def step_fn(params: Any, batch: Any) -> Any:
        calls.append(1)
        aux = {"loss": ONE} if len(calls) == 1 else {"loss": ONE, "extra": ONE}
        return {"w": ONE3, "b": ONE}, aux

    return step_fn


case(
    "accumulate-aux-tree-changes",
    pb,
    lambda ns: gradaccum.accumulate(_changing_aux(), 2, has_aux=True)(ns["params"], ns["batch"]),
    ValueError,
    "aux tree",
)
case(
    "accumulate-aux-leaf-str-under-mean",
    pb,
    lambda ns: gradaccum.accumulate(
        returning(({"w": ONE3, "b": ONE}, {"tag": "a"})), 2, has_aux=True
    )(ns["params"], ns["batch"]),
    TypeError,
    "aux leaf ['tag']",
)


def _growing_aux() -> Callable[..., Any]:
    """Aux leaf ['h'] has 1 element in the first micro-batch, 2 in the second."""
    calls: list[int] = []

    def step_fn(params: Any, batch: Any) -> Any:
        calls.append(1)
        return {"w": ONE3, "b": ONE}, {"h": torch.ones(len(calls), dtype=F64)}

    return step_fn


case(
    "accumulate-aux_reduction-stack-str-leaf",
    pb,
    lambda ns: gradaccum.accumulate(
        returning(({"w": ONE3, "b": ONE}, {"tag": "a"})), 2, has_aux=True, aux_reduction="stack"
    )(ns["params"], ns["batch"]),
    TypeError,
    "aux leaf ['tag']",
)
case(
    "accumulate-aux_reduction-stack-shapes-differ",
    pb,
    lambda ns: gradaccum.accumulate(_growing_aux(), 2, has_aux=True, aux_reduction="stack")(
        ns["params"], ns["batch"]
    ),
    ValueError,
    "aux leaf ['h']",
)

# -- MicroBatches -------------------------------------------------------------------------------

for _id, _batches in [
    ("tensor", torch.ones(3, 2, dtype=F64)),
    ("dict", {"a": torch.ones(2, dtype=F64)}),
    ("iterator", iter([torch.ones(2, dtype=F64)])),
    ("generator", (t for t in [torch.ones(2, dtype=F64)])),
    ("int", 3),
    ("None", None),
    ("str", "ab"),
]:
    case(
        f"MicroBatches-{_id}",
        lambda b=_batches: {"batches": b},
        lambda ns: gradaccum.MicroBatches(ns["batches"]),
        TypeError,
        "batches",
        "list",
    )
case(
    "MicroBatches-empty",
    lambda: {"params": params(), "batches": []},
    lambda ns: gradaccum.accumulate(step_fn, 2)(
        ns["params"], gradaccum.MicroBatches(ns["batches"])
    ),
    ValueError,
    "micro-batch",
)
case(
    "MicroBatches-empty-tuple",
    lambda: {"params": params(), "batches": ()},
    lambda ns: gradaccum.accumulate(step_fn, 2)(
        ns["params"], gradaccum.MicroBatches(ns["batches"])
    ),
    ValueError,
    "micro-batch",
)
case(
    "accumulate-MicroBatches-0-rows",
    lambda: {"params": params(), "batches": [(x(3), y(3)), (x(0), y(0))]},
    lambda ns: gradaccum.accumulate(step_fn, 2)(
        ns["params"], gradaccum.MicroBatches(ns["batches"])
    ),
    ValueError,
    "micro-batch 1",
)
case(
    "accumulate-MicroBatches-without-tensor",
    lambda: {"params": params(), "batches": [(x(3), y(3)), [1, 2]]},
    lambda ns: gradaccum.accumulate(step_fn, 2)(
        ns["params"], gradaccum.MicroBatches(ns["batches"])
    ),
    ValueError,
    "micro-batch 1",
)
case(
    "accumulate-MicroBatches-without-tensor-tuple",
    lambda: {"params": params(), "batches": [(x(3), y(3)), (1, 2)]},
    lambda ns: gradaccum.accumulate(step_fn, 2)(
        ns["params"], gradaccum.MicroBatches(ns["batches"])
    ),
    ValueError,
    "micro-batch 1",
)
case(
    "accumulate-MicroBatches-rows-disagree",
    lambda: {"params": params(), "batches": [(x(3), y(3)), (x(3), y(2))]},
    lambda ns: gradaccum.accumulate(step_fn, 2)(
        ns["params"], gradaccum.MicroBatches(ns["batches"])
    ),
    ValueError,
    "micro-batch 1",
    "[1] has 2",
)
_MB_INDEX = ("micro-batch 1", "micro_batch 1", "batches[1]", "index 1")
case(
    "MicroBatches-mismatched-keys",
    lambda: {"batches": [{"x": x(3)}, {"y": x(3)}]},
    lambda ns: gradaccum.MicroBatches(ns["batches"]),
    ValueError,
    _MB_INDEX,
    "'y'",
    item=10,
)
case(
    "MicroBatches-mismatched-nested",
    lambda: {"batches": [{"a": {"x": x(3)}, "b": y(3)}, {"a": {"y": x(3)}, "b": y(3)}]},
    lambda ns: gradaccum.MicroBatches(ns["batches"]),
    ValueError,
    _MB_INDEX,
    "['a']",
    item=10,
)

# -- gradaccum.grad / grad_and_value ------------------------------------------------------------

case(
    "grad-fn-not-callable",
    dict,
    lambda ns: gradaccum.grad("loss"),  # type: ignore[arg-type]
    TypeError,
    "fn",
)
case(
    "grad-argnums-negative",
    dict,
    lambda ns: gradaccum.grad(mean_loss, argnums=-1),
    ValueError,
    "argnums",
)
case(
    "grad-argnums-duplicate",
    dict,
    lambda ns: gradaccum.grad(mean_loss, argnums=(0, 0)),
    ValueError,
    "argnums",
)
case(
    "grad_and_value-has_aux-int",
    dict,
    lambda ns: gradaccum.grad_and_value(mean_loss, has_aux=1),  # type: ignore[arg-type]
    TypeError,
    "has_aux",
)
case(
    "grad-loss-not-scalar",
    pb,
    lambda ns: gradaccum.grad(lambda p, b: p["w"] * 2)(ns["params"], ns["batch"]),
    TypeError,
    "scalar",
)
case(
    "grad-has_aux-not-a-pair",
    pb,
    lambda ns: gradaccum.grad(mean_loss, has_aux=True)(ns["params"], ns["batch"]),
    TypeError,
    "has_aux",
)
case(
    "grad-loss-int",
    pb,
    lambda ns: gradaccum.grad(lambda p, b: torch.tensor(1))(ns["params"], ns["batch"]),
    TypeError,
    "loss",
)
case(
    "grad-too-few-args",
    dict,
    lambda ns: gradaccum.grad(mean_loss, argnums=1)(params()),
    TypeError,
    "params",
)
case(
    "grad-params-int-leaf",
    lambda: {"params": {"w": torch.arange(3), "b": torch.zeros(())}, "batch": (x(), y())},
    lambda ns: gradaccum.grad(mean_loss)(ns["params"], ns["batch"]),
    TypeError,
    "params leaf ['w']",
)
case(
    "accumulate-grad-loss-not-scalar",
    pb,
    lambda ns: gradaccum.accumulate(gradaccum.grad(lambda p, b: p["w"] * 2), 2)(
        ns["params"], ns["batch"]
    ),
    TypeError,
    "scalar",
)

# -- Accumulator --------------------------------------------------------------------------------


def _schedule_window_1(n: Any) -> NS:
    acc = gradaccum.Accumulator(n=lambda window: [1, n][window])
    state = acc.add(acc.init(params()), grads(), size=2)
    out, state = acc.finalize(state)
    return {"acc": acc, "state": state, "out": out}


for _id, _n, _exc in [
    ("0", 0, ValueError),
    ("negative", -1, ValueError),
    ("float", 2.5, TypeError),
    ("bool", True, TypeError),
    ("str", "4", TypeError),
    ("None", None, TypeError),
]:
    case(
        f"Accumulator-schedule-returns-{_id}-is_complete",
        lambda n=_n: _schedule_window_1(n),
        lambda ns: ns["acc"].is_complete(ns["state"]),
        _exc,
        "schedule",
        "n must be",
    )
    case(
        f"Accumulator-schedule-returns-{_id}-window_size",
        lambda n=_n: _schedule_window_1(n),
        lambda ns: ns["acc"].window_size(ns["state"]),
        _exc,
        "schedule",
        "n must be",
    )
case(
    "Accumulator-schedule-reduction-x",
    dict,
    lambda ns: gradaccum.Accumulator(lambda window: 2, "x"),  # type: ignore[arg-type]
    ValueError,
    "<schedule>",
    "reduction",
)
case(
    "Accumulator-schedule-finalize-empty-window",
    lambda: {"acc": gradaccum.Accumulator(lambda window: 2), "params": params()},
    lambda ns: ns["acc"].finalize(ns["acc"].init(ns["params"])),
    ValueError,
    "<schedule>",
    "add()",
)
case(
    "Accumulator.init-params-leaf-str",
    lambda: {"acc": gradaccum.Accumulator(2), "params": {"w": "weights"}},
    lambda ns: ns["acc"].init(ns["params"]),
    TypeError,
    "params leaf ['w']",
)
case(
    "Accumulator.init-params-int-tensor",
    lambda: {"acc": gradaccum.Accumulator(2), "params": {"w": torch.arange(3)}},
    lambda ns: ns["acc"].init(ns["params"]),
    TypeError,
    "params leaf ['w']",
)
for _method, _call in [
    ("add", lambda ns: ns["acc"].add(ns["params"], ns["grads"], size=2)),
    ("is_complete", lambda ns: ns["acc"].is_complete(ns["params"])),
    ("finalize", lambda ns: ns["acc"].finalize(ns["params"])),
    ("abort", lambda ns: ns["acc"].abort(ns["params"])),
    ("state_dict", lambda ns: ns["acc"].state_dict(ns["params"])),
    ("load_state_dict", lambda ns: ns["acc"].load_state_dict(ns["params"], {})),
]:
    case(
        f"Accumulator.{_method}-state-not-a-state",
        mid,
        _call,
        TypeError,
        "state must be an AccumState",
    )
case(
    "Accumulator.add-without-size",
    mid,
    lambda ns: ns["acc"].add(ns["state"], ns["grads"]),
    ValueError,
    "size=",
)
for _id, _size, _exc in [
    ("0", 0, ValueError),
    ("negative", -2, ValueError),
    ("str", "3", TypeError),
    ("float", 2.5, TypeError),
    ("bool", True, TypeError),
]:
    case(
        f"Accumulator.add-size-{_id}",
        mid,
        lambda ns, s=_size: ns["acc"].add(ns["state"], ns["grads"], size=s),
        _exc,
        "size",
    )
case(
    "Accumulator.add-count-under-mean",
    mid,
    lambda ns: ns["acc"].add(ns["state"], ns["grads"], size=2, count=7),
    ValueError,
    "count=",
)
case(
    "Accumulator.add-count-under-sum",
    lambda: fresh(reduction="sum"),
    lambda ns: ns["acc"].add(ns["state"], ns["grads"], size=2, count=7),
    ValueError,
    "count=",
)
case(
    "Accumulator.add-no-count-under-count",
    lambda: mid(reduction="count"),
    lambda ns: ns["acc"].add(ns["state"], ns["grads"], size=3),
    ValueError,
    "count=",
)
for _id, _count, _exc, _item in [
    ("negative", -1, ValueError, None),
    ("str", "3", TypeError, None),
    ("two-elements", torch.ones(2), TypeError, None),
    ("nan", NAN, ValueError, 7),
]:
    case(
        f"Accumulator.add-count-{_id}",
        lambda: mid(n=2, reduction="count"),
        lambda ns, c=_count: ns["acc"].add(ns["state"], ns["grads"], count=c),
        _exc,
        "count",
        item=_item,
    )
case(
    "Accumulator.add-count-nan-fresh-state",
    lambda: fresh(n=2, reduction="count"),
    lambda ns: ns["acc"].add(ns["state"], ns["grads"], count=NAN),
    ValueError,
    "count",
    item=7,
)
for _red in ["mean", "sum", "count"]:
    case(
        f"Accumulator.finalize-empty-window-{_red}",
        lambda r=_red: fresh(reduction=r),
        lambda ns: ns["acc"].finalize(ns["state"]),
        ValueError,
        "add()",
    )


def _after_a_window(reduction: str) -> NS:
    """An Accumulator(n=2) and the fresh state that finalize returned after a window."""
    ns = fresh(n=2, reduction=reduction)
    weight = {"count": 2} if reduction == "count" else {}
    _, state = ns["acc"].finalize(ns["acc"].add(ns["state"], ns["grads"], size=2, **weight))
    return {**ns, "state": state}


for _red in ["mean", "sum", "count"]:
    case(
        f"Accumulator.finalize-empty-window-after-a-window-{_red}",
        lambda r=_red: _after_a_window(r),
        lambda ns: ns["acc"].finalize(ns["state"]),
        ValueError,
        "add()",
    )
case(
    "Accumulator.finalize-counts-add-up-to-0",
    lambda: {**fresh(n=2, reduction="count")},
    lambda ns: ns["acc"].finalize(ns["acc"].add(ns["state"], ns["grads"], count=0)),
    ValueError,
    "counts",
)

# -- a consumed Accumulator state (item 2) --------------------------------------------------------


def _added_twice() -> NS:
    """state1 held sums and was passed to add: state2 is the current state."""
    ns = fresh()
    acc = ns["acc"]
    state1 = acc.add(ns["state"], grads(1.0), size=1)
    state2 = acc.add(state1, grads(2.0), size=1)
    return {**ns, "state1": state1, "state2": state2}


def _finalized() -> NS:
    """state1 held sums and was finalized: its gradients and the next state are returned."""
    ns = fresh()
    acc = ns["acc"]
    state1 = acc.add(ns["state"], grads(1.0), size=1)
    state1 = acc.add(state1, grads(3.0), size=3)
    out, nxt = acc.finalize(state1)
    return {**ns, "state1": state1, "out": out, "next": nxt}


_CONSUMED = ("consumed",)
_USE_RETURNED = ("returned", "return")
case(
    "Accumulator.add-state-consumed-by-add",
    _added_twice,
    lambda ns: ns["acc"].add(ns["state1"], grads(5.0), size=1),
    ValueError,
    _CONSUMED,
    _USE_RETURNED,
    item=2,
)
case(
    "Accumulator.finalize-state-consumed-by-add",
    _added_twice,
    lambda ns: ns["acc"].finalize(ns["state1"]),
    ValueError,
    _CONSUMED,
    _USE_RETURNED,
    item=2,
)
case(
    "Accumulator.add-state-consumed-by-finalize",
    _finalized,
    lambda ns: ns["acc"].add(ns["state1"], grads(5.0), size=1),
    ValueError,
    _CONSUMED,
    _USE_RETURNED,
    item=2,
)
case(
    "Accumulator.finalize-state-consumed-by-finalize",
    _finalized,
    lambda ns: ns["acc"].finalize(ns["state1"]),
    ValueError,
    _CONSUMED,
    _USE_RETURNED,
    item=2,
)
case(
    "Accumulator.state_dict-state-consumed-by-finalize",
    _finalized,
    lambda ns: ns["acc"].state_dict(ns["state1"]),
    ValueError,
    _CONSUMED,
    _USE_RETURNED,
    item=2,
)

# -- Accumulator.load_state_dict ----------------------------------------------------------------

LOAD_BAD: list[tuple[str, Callable[[], NS], str | tuple[str, ...], int | None]] = [
    ("list", lambda: {**mid(), "sd": [1, 2]}, "state_dict", None),
    ("None", lambda: {**mid(), "sd": None}, "state_dict", None),
    ("tensor", lambda: {**mid(), "sd": torch.ones(2, dtype=F64)}, "state_dict", None),
    (
        "module-state-dict",
        lambda: {**mid(), "sd": torch.nn.Linear(2, 1).state_dict()},
        "format",
        None,
    ),
    ("empty-dict", lambda: {**mid(), "sd": {}}, "format", None),
    (
        "other-format",
        lambda: saved(lambda sd: sd.update(format="gradaccum.streaming.AccumState/0")),
        "format",
        None,
    ),
    ("no-sums-key", lambda: saved(lambda sd: sd.pop("sums")), "'sums'", None),
    ("short-shapes", lambda: saved(lambda sd: sd["shapes"].pop()), "shapes", None),
    ("paths-int", lambda: saved(lambda sd: sd.update(paths=3)), "paths", None),
    ("short-sums", lambda: saved(lambda sd: sd["sums"].pop()), "running sums", None),
    ("micro_step-str", lambda: saved(lambda sd: sd.update(micro_step="x")), "micro_step", None),
    ("micro_step-negative", lambda: saved(lambda sd: sd.update(micro_step=-1)), "micro_step", 5),
    ("micro_step-more-than-n", lambda: saved(lambda sd: sd.update(micro_step=5)), "micro_step", 5),
    ("window-negative", lambda: saved(lambda sd: sd.update(window=-1)), "window", None),
    ("window-str", lambda: saved(lambda sd: sd.update(window="x")), "window", None),
    ("weight-str", lambda: saved(lambda sd: sd.update(weight="x")), "weight", None),
    ("weight-1-dim", lambda: saved(lambda sd: sd.update(weight=torch.ones(2))), "weight", None),
    ("weight-0-mid-window", lambda: saved(lambda sd: sd.update(weight=0)), "weight", 5),
    ("weight-negative", lambda: saved(lambda sd: sd.update(weight=-1)), "weight", 5),
    ("weight-nan", lambda: saved(lambda sd: sd.update(weight=NAN)), "weight", 5),
    ("sums-None-mid-window", lambda: saved(lambda sd: sd.update(sums=None)), "sums", 5),
    (
        "different-keys",
        lambda: saved_other({"w": torch.zeros(3, dtype=F64), "c": torch.zeros((), dtype=F64)}),
        "['b']",
        None,
    ),
    ("missing-key", lambda: saved_other({"w": torch.zeros(3, dtype=F64)}), "['b']", None),
    (
        "different-shape",
        lambda: saved_other({"w": torch.zeros(4, dtype=F64), "b": torch.zeros((), dtype=F64)}),
        "['w']",
        None,
    ),
    (
        "different-dtype",
        lambda: saved_other({"w": torch.zeros(3), "b": torch.zeros(())}),
        "float32",
        None,
    ),
    ("different-reduction", lambda: saved_other(params(), reduction="sum"), "reduction", None),
    (
        "different-accum_dtype",
        lambda: saved_other(params(), accum_dtype=torch.float32),
        "accum_dtype",
        None,
    ),
]
for _id, _setup, _name, _item in LOAD_BAD:
    case(
        f"Accumulator.load_state_dict-{_id}",
        _setup,
        lambda ns: ns["acc"].load_state_dict(ns["state"], ns["sd"]),
        gradaccum.GradAccumError,
        _name,
        item=_item,
    )


case(
    "Accumulator.load_state_dict-format-only",
    lambda: {**mid(), "sd": {"format": "gradaccum.AccumState/1"}},
    lambda ns: ns["acc"].load_state_dict(ns["state"], ns["sd"]),
    gradaccum.GradAccumError,
    "lacks the keys",
)


def _extra_key(fresh_state: bool) -> NS:
    """The state dict of a window over params() and one more leaf ``c``."""
    ns = saved_other({**params(), "c": torch.zeros(1, dtype=F64)})
    if fresh_state:
        ns["state"] = ns["acc"].init(ns["params"])
    return ns


for _id, _fresh in [("extra-key", False), ("extra-key-into-fresh-state", True)]:
    case(
        f"Accumulator.load_state_dict-{_id}",
        lambda f=_fresh: _extra_key(f),
        lambda ns: ns["acc"].load_state_dict(ns["state"], ns["sd"]),
        gradaccum.GradAccumError,
        "['c']",
    )


class _OwnLayout:
    """A layout gradaccum did not make (e.g. an AccumState built by hand)."""


def _foreign_layout() -> NS:
    ns = saved()
    return {**ns, "state": ns["state"]._replace(layout=_OwnLayout())}


for _method, _call in [
    ("add", lambda ns: ns["acc"].add(ns["state"], ns["grads"], size=2)),
    ("load_state_dict", lambda ns: ns["acc"].load_state_dict(ns["state"], ns["sd"])),
]:
    case(
        f"Accumulator.{_method}-state-layout-foreign",
        _foreign_layout,
        _call,
        TypeError,
        "state",
        "layout",
        absent=("got AccumState;", "got AccumState."),
    )
case(
    "Accumulator.load_state_dict-weight-0-into-fresh-state",
    lambda: {**fresh(), "sd": saved(lambda sd: sd.update(weight=0))["sd"]},
    lambda ns: ns["acc"].load_state_dict(ns["state"], ns["sd"]),
    gradaccum.GradAccumError,
    "weight",
    item=5,
)

# -- nn.Module interop --------------------------------------------------------------------------

for _id, _new, _exc, _name in [
    ("missing", {"weight": W}, ValueError, "['bias']"),
    ("extra", {"weight": W, "bias": B, "scale": B}, ValueError, "['scale']"),
    ("renamed", {"weight": W, "b": B}, ValueError, "['b']"),
    ("wrong-shape", {"weight": W, "bias": torch.ones(2, dtype=F64)}, ValueError, "grads['bias']"),
    (
        "wrong-shape-first",
        {"weight": torch.ones(2, 1, dtype=F64), "bias": B},
        ValueError,
        "['weight']",
    ),
    ("list", [W, B], TypeError, "grads"),
    ("int64", {"weight": W, "bias": torch.ones(1, dtype=torch.int64)}, TypeError, "grads['bias']"),
    (
        "complex128",
        {"weight": W, "bias": torch.ones(1, dtype=torch.complex128)},
        TypeError,
        "['bias']",
    ),
    ("str-value", {"weight": W, "bias": "g"}, ValueError, "grads['bias']"),
]:
    for _grad in (True, False):
        case(
            f"write_grads-{_id}-{'grad-set' if _grad else 'grad-None'}",
            lambda g=_grad: linear(with_grad=g),
            lambda ns, new=_new: gradaccum.write_grads(ns["module"], new),
            _exc,
            _name,
        )

case(
    "update_buffers-unknown-name-dict",
    batchnorm,
    lambda ns: gradaccum.update_buffers(
        ns["buffers"], {"running_mean": torch.zeros(3, dtype=F64), "running_avg": torch.ones(3)}
    ),
    KeyError,
    "running_avg",
)
case(
    "update_buffers-unknown-name-module",
    batchnorm,
    lambda ns: gradaccum.update_buffers(ns["module"], {"running_avg": torch.ones(3)}),
    KeyError,
    "running_avg",
)
for _id, _value in [
    ("4", torch.ones(4, dtype=F64)),
    ("0-dim", torch.tensor(5.0, dtype=F64)),
    ("float", 1.0),
]:
    case(
        f"update_buffers-wrong-shape-{_id}",
        batchnorm,
        lambda ns, v=_value: gradaccum.update_buffers(
            ns["buffers"], {"running_mean": torch.zeros(3, dtype=F64), "running_var": v}
        ),
        ValueError,
        "new_buffers['running_var']",
    )
case(
    "update_buffers-new_buffers-list",
    batchnorm,
    lambda ns: gradaccum.update_buffers(ns["module"], [torch.ones(3, dtype=F64)]),
    TypeError,
    "new_buffers",
)
case(
    "update_buffers-buffers-list",
    batchnorm,
    lambda ns: gradaccum.update_buffers(list(ns["buffers"].values()), {}),  # type: ignore[arg-type]
    TypeError,
    "buffers must be",
)
case(
    "update_buffers-float-into-int-buffer-module",
    batchnorm,
    lambda ns: gradaccum.update_buffers(ns["module"], {"num_batches_tracked": torch.tensor(1.5)}),
    TypeError,
    "num_batches_tracked",
    item=11,
)
case(
    "update_buffers-float-into-int-buffer-dict",
    batchnorm,
    lambda ns: gradaccum.update_buffers(
        ns["buffers"],
        {"running_mean": torch.zeros(3, dtype=F64), "num_batches_tracked": torch.tensor(1.5)},
    ),
    TypeError,
    "num_batches_tracked",
    item=11,
)

# Something else than a module where a module is expected (item 8).
case(
    "params_of-dict",
    lambda: {"module": {}},
    lambda ns: gradaccum.params_of(ns["module"]),
    TypeError,
    "module",
    item=8,
)
case(
    "params_of-state_dict",
    lambda: {"module": linear()["module"].state_dict()},
    lambda ns: gradaccum.params_of(ns["module"]),
    TypeError,
    "module",
    item=8,
)
case(
    "buffers_of-dict",
    lambda: {"module": {"running_mean": torch.zeros(3)}},
    lambda ns: gradaccum.buffers_of(ns["module"]),
    TypeError,
    "module",
    item=8,
)
case(
    "write_grads-module-dict",
    lambda: {"module": {"weight": W.clone(), "bias": B.clone()}},
    lambda ns: gradaccum.write_grads(ns["module"], {"weight": W, "bias": B}),
    TypeError,
    "module",
    item=8,
)
case(
    "call_module-module-dict",
    lambda: {"module": {"weight": W.clone(), "bias": B.clone()}, "x": torch.ones(3, 2, dtype=F64)},
    lambda ns: gradaccum.call_module(ns["module"], {"weight": W, "bias": B}, {}, ns["x"]),
    TypeError,
    "module",
    item=8,
)

# call_module with a misspelled parameter key (item 3).
case(
    "call_module-misspelled-key",
    linear,
    lambda ns: gradaccum.call_module(
        ns["module"], {"weigth": W.clone(), "bias": B.clone()}, {}, ns["x"]
    ),
    ValueError,
    "'weight'",
    "'weigth'",
    item=3,
)


# Params taken before the module was moved (item 4).
def _moved() -> NS:
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 1)
    p = gradaccum.params_of(lin)
    lin.double()
    return {
        "module": lin,
        "params": p,
        "x": torch.ones(4, 2, dtype=F64),
        "y": torch.zeros(4, dtype=F64),
    }


_STALE = ("params_of",), ("stale", "no longer", "storage")


def _moved_step(ns: NS) -> Any:
    lin = ns["module"]

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        out, _ = gradaccum.call_module(lin, p, {}, batch[0])
        return ((out.squeeze(-1) - batch[1]) ** 2).mean()

    return gradaccum.accumulate(gradaccum.grad(loss_fn), 2)(ns["params"], (ns["x"], ns["y"]))


case(
    "call_module-params-stale-after-to",
    _moved,
    lambda ns: gradaccum.call_module(ns["module"], ns["params"], {}, ns["x"]),
    (gradaccum.GradAccumError, ValueError),
    *_STALE,
    item=4,
)
case(
    "accumulate-call_module-params-stale-after-to",
    _moved,
    _moved_step,
    (gradaccum.GradAccumError, ValueError),
    *_STALE,
    item=4,
)
case(
    "call_module-params-not-a-dict",
    linear,
    lambda ns: gradaccum.call_module(ns["module"], [W, B], {}, ns["x"]),
    TypeError,
    "params",
)
case(
    "call_module-buffers-not-a-dict",
    linear,
    lambda ns: gradaccum.call_module(
        ns["module"], gradaccum.params_of(ns["module"]), None, ns["x"]
    ),
    TypeError,
    "buffers",
)

# -- boundary transforms ------------------------------------------------------------------------

for _id, _norm in [("0", 0), ("negative", -1.0), ("str", "1"), ("bool", True), ("nan", NAN)]:
    case(
        f"clip_by_global_norm-max_norm-{_id}",
        lambda: {"grads": grads()},
        lambda ns, m=_norm: gradaccum.boundary.clip_by_global_norm(ns["grads"], m),
        ValueError,
        "max_norm",
    )
case(
    "clip_by_global_norm-group-str",
    lambda: {"grads": grads()},
    lambda ns: gradaccum.boundary.clip_by_global_norm(ns["grads"], 1.0, group="x"),
    TypeError,
    "group",
)
case(
    "clip_by_global_norm-int-leaf",
    lambda: {"grads": {"w": torch.ones(2, dtype=torch.int64)}},
    lambda ns: gradaccum.boundary.clip_by_global_norm(ns["grads"], 1.0),
    TypeError,
    "gradient leaf ['w']",
)
for _id, _kw, _name, _item in [
    ("init_scale-0", {"init_scale": 0}, "init_scale", None),
    ("init_scale-negative", {"init_scale": -1.0}, "init_scale", None),
    ("init_scale-str", {"init_scale": "1"}, "init_scale", None),
    ("init_scale-nan", {"init_scale": NAN}, "init_scale", None),
    ("init_scale-inf", {"init_scale": INF}, "init_scale", 6),
    ("growth_factor-below-1", {"growth_factor": 0.5}, "growth_factor", None),
    ("backoff_factor-above-1", {"backoff_factor": 2.0}, "backoff_factor", None),
    ("backoff_factor-0", {"backoff_factor": 0}, "backoff_factor", None),
    ("growth_interval-0", {"growth_interval": 0}, "growth_interval", None),
    ("growth_interval-float", {"growth_interval": 1.5}, "growth_interval", None),
    ("growth_factor-inf", {"growth_factor": INF}, "growth_factor", None),
    ("min_scale-0", {"min_scale": 0}, "min_scale", None),
    ("min_scale-inf", {"min_scale": INF}, "min_scale", None),
    ("init_scale-below-min_scale", {"init_scale": 0.5, "min_scale": 1.0}, "min_scale", None),
]:
    case(
        f"LossScale-{_id}",
        dict,
        lambda ns, kw=_kw: gradaccum.boundary.LossScale(**kw),
        ValueError,
        _name,
        item=_item,
    )
case(
    "LossScale.unscale-state-float",
    lambda: {"grads": grads()},
    lambda ns: gradaccum.boundary.LossScale().unscale(ns["grads"], 65536.0),  # type: ignore[arg-type]
    TypeError,
    "state",
)
case(
    "LossScale.unscale-state-scale-inf",
    lambda: {"grads": grads()},
    lambda ns: gradaccum.boundary.LossScale().unscale(
        ns["grads"], gradaccum.boundary.LossScaleState(INF, 0)
    ),
    ValueError,
    "state.scale",
)
case(
    "LossScale.unscale-group-str",
    lambda: {"grads": grads(), "state": gradaccum.boundary.LossScale().init()},
    lambda ns: gradaccum.boundary.LossScale().unscale(ns["grads"], ns["state"], group="x"),
    TypeError,
    "group",
)
case(
    "LossScale.unscale-int-leaf",
    lambda: {
        "grads": {"w": torch.ones(2, dtype=torch.int64)},
        "state": gradaccum.boundary.LossScale().init(),
    },
    lambda ns: gradaccum.boundary.LossScale().unscale(ns["grads"], ns["state"]),
    TypeError,
    "gradient leaf ['w']",
)

# -- syncs and reductions: construction (no process group needed) ------------------------------

for _id, _kw, _exc, _name in [
    ("bucket_mb-0", {"bucket_mb": 0}, ValueError, "bucket_mb"),
    ("bucket_mb-str", {"bucket_mb": "25"}, ValueError, "bucket_mb"),
    ("check-unknown", {"check": "sometimes"}, ValueError, "check"),
    ("timeout-0", {"timeout": 0}, ValueError, "timeout"),
    ("bucket_mb-nan", {"bucket_mb": NAN}, ValueError, "bucket_mb"),
    ("bucket_mb-inf", {"bucket_mb": INF}, ValueError, "bucket_mb"),
    ("timeout-nan", {"timeout": NAN}, ValueError, "timeout"),
    ("overlap-int", {"overlap": 1}, TypeError, "overlap"),
    ("group-str", {"group": "world"}, TypeError, "group"),
]:
    case(
        f"all_reduce-{_id}",
        dict,
        lambda ns, kw=_kw: gradaccum.all_reduce(**kw),
        _exc,
        _name,
    )
case(
    "AllReduce.plan-int-leaf",
    dict,
    lambda ns: gradaccum.all_reduce().plan({"w": torch.arange(3)}),
    TypeError,
    "params leaf ['w']",
)
case(
    "accumulate-all_reduce-without-process-group",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 2, sync=gradaccum.all_reduce())(
        ns["params"], ns["batch"]
    ),
    RuntimeError,
    "init_process_group",
)
case(
    "Accumulator.finalize-all_reduce-without-process-group",
    lambda: mid(sync=gradaccum.all_reduce()),
    lambda ns: ns["acc"].finalize(ns["state"]),
    RuntimeError,
    "init_process_group",
)
case(
    "shard-without-process-group",
    lambda: {"params": world_params()},
    lambda ns: gradaccum.shard(ns["params"]),
    RuntimeError,
    "init_process_group",
)
for _id, _kw, _exc, _name in [
    ("fn-not-callable", {"fn": 3}, TypeError, "fn"),
    ("init-not-callable", {"init": 0}, TypeError, "init"),
    ("timeout-0", {"timeout": 0}, ValueError, "timeout"),
    ("timeout-str", {"timeout": "60"}, ValueError, "timeout"),
    ("timeout-nan", {"timeout": NAN}, ValueError, "timeout"),
    ("timeout-inf", {"timeout": INF}, ValueError, "timeout"),
]:
    case(
        f"custom_reduce-{_id}",
        dict,
        lambda ns, kw=_kw: gradaccum.custom_reduce(**{"fn": lambda g, s, pg: (g, s), **kw}),
        _exc,
        _name,
    )
case(
    "custom_reduce-group-without-process-group",
    pb,
    lambda ns: gradaccum.accumulate(
        step_fn, 2, sync=gradaccum.custom_reduce(lambda g, s, pg: (g, s), group=object())
    )(ns["params"], ns["batch"]),
    RuntimeError,
    "init_process_group",
)
case(
    "custom_reduce-fn-returns-not-a-pair",
    pb,
    lambda ns: gradaccum.accumulate(step_fn, 2, sync=gradaccum.custom_reduce(lambda g, s, pg: g))(
        ns["params"], ns["batch"]
    ),
    TypeError,
    "(grads, state)",
)
case(
    "custom_reduce-fn-returns-wrong-shape",
    pb,
    lambda ns: gradaccum.accumulate(
        step_fn, 2, sync=gradaccum.custom_reduce(lambda g, s, pg: ({**g, "w": g["w"][:2]}, s))
    )(ns["params"], ns["batch"]),
    ValueError,
    "shaped like",
)
case(
    "custom_reduce-rows-add-up-to-0",
    lambda: {"params": params(), "batch": (x(0), y(0))},
    lambda ns: gradaccum.accumulate(
        step_fn, 2, sync=gradaccum.custom_reduce(lambda g, s, pg: (g, s))
    )(ns["params"], ns["batch"]),
    ValueError,
    "rows",
)
for _id, _kw, _name in [
    ("dtype-float32", {"dtype": torch.float32}, "dtype"),
    ("bucket_mb-0", {"bucket_mb": 0}, "bucket_mb"),
    ("bucket_mb-nan", {"bucket_mb": NAN}, "bucket_mb"),
    ("bucket_mb-inf", {"bucket_mb": INF}, "bucket_mb"),
    ("timeout-nan", {"timeout": NAN}, "timeout"),
]:
    case(
        f"compressed_all_reduce-{_id}",
        dict,
        lambda ns, kw=_kw: gradaccum.compression.compressed_all_reduce(
            **{"dtype": torch.bfloat16, **kw}
        ),
        ValueError,
        _name,
    )
for _id, _ratio in [("0", 0), ("above-1", 1.5), ("negative", -0.1), ("bool", True)]:
    case(
        f"topk_all_reduce-ratio-{_id}",
        dict,
        lambda ns, r=_ratio: gradaccum.compression.topk_all_reduce(ratio=r),
        ValueError,
        "ratio",
    )
for _id, _rank in [("0", 0), ("float", 2.0)]:
    case(
        f"powersgd-rank-{_id}",
        dict,
        lambda ns, r=_rank: gradaccum.compression.powersgd(rank=r),
        ValueError,
        "rank",
    )
case(
    "powersgd-seed-float",
    dict,
    lambda ns: gradaccum.compression.powersgd(rank=2, seed=1.5),  # type: ignore[arg-type]
    ValueError,
    "seed",
)
for _id, _args, _kw, _name in [
    ("noise_multiplier-negative", (-1.0, 1.0, 4), {}, "noise_multiplier"),
    ("max_norm-0", (1.0, 0, 4), {}, "max_norm"),
    ("expected_batch_size-0", (1.0, 1.0, 0), {}, "expected_batch_size"),
    ("seed-float", (1.0, 1.0, 4), {"seed": 1.5}, "seed"),
    ("noise_multiplier-nan", (NAN, 1.0, 4), {}, "noise_multiplier"),
    ("noise_multiplier-inf", (INF, 1.0, 4), {}, "noise_multiplier"),
    ("max_norm-nan", (1.0, NAN, 4), {}, "max_norm"),
    ("max_norm-inf", (1.0, INF, 4), {}, "max_norm"),
    ("expected_batch_size-nan", (1.0, 1.0, NAN), {}, "expected_batch_size"),
    ("expected_batch_size-inf", (1.0, 1.0, INF), {}, "expected_batch_size"),
]:
    case(
        f"dp_noise-{_id}",
        dict,
        lambda ns, a=_args, kw=_kw: gradaccum.privacy.dp_noise(*a, **kw),
        ValueError,
        _name,
    )
for _id, _norm in [("0", 0), ("nan", NAN), ("inf", INF)]:
    case(
        f"clip_per_sample-max_norm-{_id}",
        dict,
        lambda ns, m=_norm: gradaccum.privacy.clip_per_sample(m),
        ValueError,
        "max_norm",
    )
case(
    "clip_per_sample-leading-dims-differ",
    lambda: {"grads": {"w": torch.ones(3, 2, dtype=F64), "b": torch.ones(2, dtype=F64)}},
    lambda ns: gradaccum.privacy.clip_per_sample(1.0)(ns["grads"]),
    ValueError,
    "leaf ['w']",
)

# -- testing.compare ----------------------------------------------------------------------------

case(
    "testing.compare-n-0",
    pb,
    lambda ns: gradaccum.testing.compare(step_fn, ns["params"], ns["batch"], 0),
    ValueError,
    "n must be",
)
case(
    "testing.compare-count-without-count",
    pb,
    lambda ns: gradaccum.testing.compare(
        aux_fn, ns["params"], ns["batch"], 2, has_aux=True, reduction="count"
    ),
    ValueError,
    "count=",
)
case(
    "testing.compare-batch-rows-disagree",
    lambda: {"params": params(), "batch": (x(8), y(6))},
    lambda ns: gradaccum.testing.compare(step_fn, ns["params"], ns["batch"], 2),
    ValueError,
    "[1] has 6",
)

# -- a world of one: sharding, reduce-scatter -----------------------------------------------------

for _id, _kw, _exc, _name in [
    ("policy-unknown", {"policy": "always"}, ValueError, "policy"),
    ("policy-dict-missing-group", {"policy": {"w": "every"}}, ValueError, "policy"),
    (
        "policy-dict-unknown-group",
        {"policy": {"w": "every", "b": "every", "x": "every"}},
        ValueError,
        "policy",
    ),
    ("policy-dict-unknown-policy", {"policy": {"w": "often", "b": "every"}}, ValueError, "policy"),
    ("policy-int", {"policy": 3}, TypeError, "policy"),
    ("gather-unknown", {"gather": "step"}, ValueError, "gather"),
    ("check-unknown", {"check": "sometimes"}, ValueError, "check"),
    ("timeout-negative", {"timeout": -1}, ValueError, "timeout"),
    ("reduce_dtype-int", {"reduce_dtype": torch.int32}, ValueError, "reduce_dtype"),
]:
    case(
        f"reduce_scatter-{_id}",
        sharded,
        lambda ns, kw=_kw: gradaccum.reduce_scatter(ns["sharded"], **kw),
        _exc,
        _name,
        world=True,
    )
case(
    "reduce_scatter-sharded-not-a-Sharded",
    lambda: {"params": world_params()},
    lambda ns: gradaccum.reduce_scatter(ns["params"]),  # type: ignore[arg-type]
    TypeError,
    "sharded",
    world=True,
)
for _id, _kw, _exc, _name in [
    ("bucket_mb-0", {"bucket_mb": 0}, ValueError, "bucket_mb"),
    ("bucket_mb-nan", {"bucket_mb": NAN}, ValueError, "bucket_mb"),
    ("param_groups-int", {"param_groups": 3}, TypeError, "param_groups"),
    ("param_groups-returns-int", {"param_groups": lambda path: 1}, TypeError, "param_groups"),
    ("src-1", {"src": 1}, ValueError, "src"),
]:
    case(
        f"shard-{_id}",
        lambda: {"params": world_params()},
        lambda ns, kw=_kw: gradaccum.shard(ns["params"], **kw),
        _exc,
        _name,
        world=True,
    )
case(
    "shard-int-leaf",
    lambda: {"params": {"i": torch.arange(3)}},
    lambda ns: gradaccum.shard(ns["params"]),
    TypeError,
    "params leaf ['i']",
    world=True,
)
case(
    "Sharded.write_grads-one-too-few",
    sharded,
    lambda ns: ns["sharded"].write_grads([torch.zeros_like(ns["sharded"].shards[0])]),
    ValueError,
    "one per shard",
    world=True,
)
case(
    "Sharded.write_grads-wrong-shape",
    sharded,
    lambda ns: ns["sharded"].write_grads(
        [torch.zeros_like(ns["sharded"].shards[0]), torch.zeros(99, dtype=F64)]
    ),
    ValueError,
    "gradient shard 1",
    world=True,
)
case(
    "Sharded.write_grads-wrong-dtype",
    sharded,
    lambda ns: ns["sharded"].write_grads([s.float() for s in ns["sharded"].shards]),
    ValueError,
    "gradient shard 0",
    world=True,
)
case(
    "Sharded.group_shards-unknown",
    sharded,
    lambda ns: ns["sharded"].group_shards("decay"),
    KeyError,
    "'decay'",
    world=True,
)


def _sharded_sd(change: Callable[[dict[str, Any]], None]) -> NS:
    ns = sharded()
    sd = ns["sharded"].state_dict()
    change(sd)
    return {**ns, "sd": sd}


for _id, _change, _name in [
    ("format", lambda sd: sd.update(format="x"), "format"),
    ("rank", lambda sd: sd.update(rank=1), "rank"),
    ("world", lambda sd: sd.update(world=2), "world size"),
    ("bucket_mb", lambda sd: sd.update(bucket_mb=1.0), "bucket_mb"),
    (
        "shard-shape",
        lambda sd: sd["shards"].__setitem__(0, torch.zeros(1, dtype=F64)),
        "saved shard 0",
    ),
]:
    case(
        f"Sharded.load_state_dict-{_id}",
        lambda c=_change: _sharded_sd(c),
        lambda ns: ns["sharded"].load_state_dict(ns["sd"]),
        gradaccum.GradAccumError,
        _name,
        world=True,
    )


def _rs_step(ns: NS) -> Callable[..., Any]:
    sync = gradaccum.reduce_scatter(ns["sharded"])
    return gradaccum.accumulate(gradaccum.grad(world_loss), 2, sync=sync)


def _two_params(p: Any, b: Any, q: Any) -> torch.Tensor:
    return world_loss(p, b) + q.sum()


case(
    "accumulate-reduce_scatter-argnums-tuple",
    sharded,
    lambda ns: gradaccum.accumulate(
        gradaccum.grad(_two_params, argnums=(0, 2)),
        2,
        argnums=(0, 2),
        sync=gradaccum.reduce_scatter(ns["sharded"]),
    )(ns["sharded"], ns["batch"], torch.ones(2, dtype=F64)),
    ValueError,
    "argnums",
    world=True,
)
case(
    "accumulate-reduce_scatter-other-Sharded",
    lambda: {**sharded(), "other": sharded()["sharded"]},
    lambda ns: _rs_step(ns)(ns["other"], ns["batch"]),
    ValueError,
    "Sharded",
    world=True,
)
case(
    "accumulate-reduce_scatter-params-differ",
    sharded,
    lambda ns: _rs_step(ns)({k: v for k, v in ns["params"].items() if k != "b1"}, ns["batch"]),
    ValueError,
    "['b1']",
    world=True,
)
case(
    "accumulate-reduce_scatter-more-micro-batches-than-n",
    sharded,
    lambda ns: _rs_step(ns)(
        ns["sharded"],
        gradaccum.MicroBatches([tuple(t[i : i + 2] for t in ns["batch"]) for i in (0, 2, 4)]),
    ),
    ValueError,
    "n=2",
    world=True,
)


def _rs_accumulator(full: bool) -> NS:
    ns = sharded()
    acc = gradaccum.Accumulator(2, sync=gradaccum.reduce_scatter(ns["sharded"]))
    state = acc.init(ns["sharded"])
    for _ in range(2 if full else 1):
        state = acc.add(state, {k: torch.ones_like(v) for k, v in ns["params"].items()}, size=4)
    return {**ns, "acc": acc, "state": state}


case(
    "Accumulator.add-reduce_scatter-past-n",
    lambda: _rs_accumulator(full=True),
    lambda ns: ns["acc"].add(
        ns["state"], {k: torch.ones_like(v) for k, v in ns["params"].items()}, size=4
    ),
    ValueError,
    "n=2",
    world=True,
)


def _rs_saved(change: Callable[[dict[str, Any]], None]) -> NS:
    ns = _rs_accumulator(full=False)
    sd = ns["acc"].state_dict(ns["state"])
    change(sd)
    return {**ns, "sd": sd}


for _id, _change, _name in [
    ("format", lambda sd: sd.update(format="gradaccum.AccumState/1"), "format"),
    ("reduction", lambda sd: sd.update(reduction="sum"), "reduction"),
    ("rank", lambda sd: sd.update(rank=1), "rank"),
    ("micro_step-negative", lambda sd: sd.update(micro_step=-1), "micro_step"),
    ("full-shape", lambda sd: sd["out"].__setitem__(0, torch.zeros(1, dtype=F64)), "saved buffer"),
]:
    case(
        f"Accumulator.load_state_dict-reduce_scatter-{_id}",
        lambda c=_change: _rs_saved(c),
        lambda ns: ns["acc"].load_state_dict(ns["state"], ns["sd"]),
        gradaccum.GradAccumError,
        _name,
        world=True,
    )

# -- DTensor params: FSDP2's fully_shard (item 1) ------------------------------------------------

_DTENSOR = ("DTensor", "fully_shard")
case(
    "params_of-fully_shard-module",
    fsdp_model,
    lambda ns: gradaccum.params_of(ns["module"]),
    gradaccum.GradAccumError,
    *_DTENSOR,
    world=True,
    item=1,
)
case(
    "write_grads-fully_shard-module",
    fsdp_model,
    lambda ns: gradaccum.write_grads(ns["module"], ns["grads"]),
    gradaccum.GradAccumError,
    *_DTENSOR,
    world=True,
    item=1,
)
case(
    "accumulate-DTensor-params",
    dtensor,
    lambda ns: gradaccum.accumulate(lambda p, b: {"w": torch.ones(4, 2)}, 2)(
        ns["params"], ns["batch"]
    ),
    gradaccum.GradAccumError,
    *_DTENSOR,
    world=True,
    item=1,
)
case(
    "accumulate-grad-DTensor-params",
    dtensor,
    lambda ns: gradaccum.accumulate(gradaccum.grad(lambda p, b: (b * p["w"]).sum()), 2)(
        ns["params"], ns["batch"]
    ),
    gradaccum.GradAccumError,
    *_DTENSOR,
    world=True,
    item=1,
)
case(
    "Accumulator.init-DTensor-params",
    dtensor,
    lambda ns: gradaccum.Accumulator(2).init(ns["params"]),
    gradaccum.GradAccumError,
    *_DTENSOR,
    world=True,
    item=1,
)


# -- the loop: windows, Step, save and load (issue 26, item="loop") -----------------------------


def loop_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).to(
        F64
    )


def loop_batches(count: int = 5, rows: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 3, generator=g, dtype=F64), torch.randn(rows, 1, generator=g, dtype=F64))
        for _ in range(count)
    ]


def loop_loader(count: int = 7, rows: int = 2) -> Any:
    """A DataLoader of ``count`` micro-batches of ``rows`` rows (in order)."""
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(count * rows, 3, generator=g, dtype=F64)
    ys = torch.randn(count * rows, 1, generator=g, dtype=F64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=rows)


def loop_mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    xs, ys = batch
    return torch.nn.functional.mse_loss(model(xs), ys)


def loop_step(*, added: int = 1, **kw: Any) -> NS:
    """A model, AdamW with state, a warm-up scheduler, windows of 3 and a Step fed by them, with
    one window applied and ``added`` micro-batches of the next one added (no sync)."""
    model = loop_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    data = gradaccum.loop.windows(loop_loader(), 3, epochs=2)
    step = gradaccum.loop.Step(model, loop_mse, opt, data=data, scheduler=sched, **kw)
    it = iter(data)
    for batch in next(it):
        step.add(batch)
    step.apply()
    window = next(it)
    taken = iter(window)
    for _ in range(added):
        step.add(next(taken))
    return {"model": model, "opt": opt, "sched": sched, "data": data, "step": step, "it": taken}


def loop_saved(**kw: Any) -> NS:
    """``loop_step()`` saved mid-window into a fresh directory, then a fresh step to load into
    (built by ``kw``'s options), and the directory."""
    ns = loop_step()
    path = Path(tempfile.mkdtemp(prefix="misuse-loop-"))
    gradaccum.loop.save(path, ns["step"])
    fresh = loop_fresh(**kw)
    return {**fresh, "path": path, "files": path}


def loop_fresh(
    *,
    hidden: int = 4,
    optimizer: str = "adamw",
    scheduler: bool = True,
    n: int = 3,
    rows: int = 2,
    reduction: str = "mean",
    count: int = 7,
) -> NS:
    """A step and windows as a resumed run builds them, before ``load``."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    ).to(F64)
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0) if scheduler else None
    data = gradaccum.loop.windows(loop_loader(count, rows), n, epochs=2)
    step = gradaccum.loop.Step(
        model,
        loop_mse,
        opt,
        data=data,
        scheduler=sched,
        reduction=reduction,  # type: ignore[arg-type]
    )
    out: NS = {"model": model, "opt": opt, "data": data, "step": step}
    if sched is not None:
        out["sched"] = sched
    return out


def a_file() -> Path:
    path = Path(tempfile.mkdtemp(prefix="misuse-loop-")) / "checkpoint"
    path.write_bytes(b"not a directory")
    return path


class NotDDP(torch.nn.Module):
    """A module with DistributedDataParallel's ``no_sync``: what ``Step`` refuses to wrap."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(3, 1).to(F64)

    def no_sync(self) -> Any:
        return contextlib.nullcontext()


class Augmented(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random augmentation in ``__getitem__``: a mid-epoch position cannot be replayed."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3,), float(i), dtype=F64) + torch.rand(3, dtype=F64), torch.zeros(
            1, dtype=F64
        )


def loop_augmented() -> NS:
    model = loop_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Augmented(), batch_size=2)
    data = gradaccum.loop.windows(loader, 2)
    step = gradaccum.loop.Step(model, loop_mse, opt, data=data)
    window = next(iter(data))
    step.add(next(iter(window)))
    path = Path(tempfile.mkdtemp(prefix="misuse-loop-"))
    return {"model": model, "opt": opt, "data": data, "step": step, "window": window, "path": path}


# windows(data, n, ...): its arguments, before anything is read.
for _id, _n, _exc in BAD_N:
    case(
        f"loop.windows-n-{_id}",
        dict,
        lambda ns, n=_n: gradaccum.loop.windows(range(4), n),
        _exc,
        "n must be",
        item="loop",
    )
for _id, _epochs in [("0", 0), ("negative", -2), ("float", 1.5), ("str", "2"), ("bool", True)]:
    case(
        f"loop.windows-epochs-{_id}",
        dict,
        lambda ns, e=_epochs: gradaccum.loop.windows(range(4), 2, epochs=e),
        ValueError,
        "epochs must be",
        item="loop",
    )
for _id, _timeout in [("0", 0), ("negative", -1.0), ("nan", NAN), ("inf", INF), ("str", "5")]:
    case(
        f"loop.windows-timeout-{_id}",
        dict,
        lambda ns, t=_timeout: gradaccum.loop.windows(range(4), 2, timeout=t),
        ValueError,
        "timeout must be",
        item="loop",
    )
for _id, _data in [("int", 5), ("None", None), ("float", 2.5)]:
    case(
        f"loop.windows-data-{_id}",
        dict,
        lambda ns, d=_data: gradaccum.loop.windows(d, 2),
        TypeError,
        "data must be",
        item="loop",
    )
case(
    "loop.windows-generator-two-epochs",
    dict,
    lambda ns: gradaccum.loop.windows((i for i in range(4)), 2, epochs=2),
    TypeError,
    "epochs=2",
    item="loop",
)
case(
    "loop.windows-prefetch-str",
    dict,
    lambda ns: gradaccum.loop.windows(range(4), 2, prefetch="yes"),  # type: ignore[arg-type]
    TypeError,
    "prefetch must be",
    item="loop",
)
case(
    "loop.windows-group-str",
    dict,
    lambda ns: gradaccum.loop.windows(range(4), 2, group="world"),
    TypeError,
    "group",
    item="loop",
)
# A factory epoch -> iterable that returns something else: refused when the epoch starts, with
# the windows' position unchanged.
for _id, _made in [("None", None), ("int", 3)]:
    case(
        f"loop.windows-factory-returns-{_id}",
        lambda made=_made: {"data": gradaccum.loop.windows(lambda epoch: made, 2)},
        lambda ns: list(ns["data"]),
        TypeError,
        "factory returned",
        item="loop",
    )
case(
    "loop.windows-schedule-returns-0",
    lambda: {"data": gradaccum.loop.windows(range(4), lambda i: 0)},
    lambda ns: list(ns["data"]),
    ValueError,
    "n must be",
    item="loop",
)
case(
    "loop.Windows.load_state_dict-not-a-position",
    lambda: {"data": gradaccum.loop.windows(range(4), 2)},
    lambda ns: ns["data"].load_state_dict({"epoch": 0}),
    gradaccum.GradAccumError,
    "format",
    item="loop",
)
case(
    "loop.Windows.load_state_dict-older-format",
    lambda: {"data": gradaccum.loop.windows(range(4), 2)},
    lambda ns: ns["data"].load_state_dict({"format": "gradaccum.loop.Windows/1", "epoch": 0}),
    gradaccum.GradAccumError,
    "gradaccum.loop.Windows/1",
    item="loop",
)

# Step(model, loss, optimizer, ...): its arguments.


def _step_args(**change: Any) -> NS:
    model = loop_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    args = {"model": model, "loss": loop_mse, "optimizer": opt, **change}
    return {"model": model, "opt": opt, "args": args}


def _make_step(ns: NS) -> Any:
    args = dict(ns["args"])
    return gradaccum.loop.Step(args.pop("model"), args.pop("loss"), args.pop("optimizer"), **args)


for _id, _change, _exc, _name in [
    ("model-dict", {"model": {}}, TypeError, "model must be"),
    ("model-None", {"model": None}, TypeError, "model must be"),
    ("model-ddp", {"model": NotDDP()}, TypeError, "DistributedDataParallel"),
    ("loss-not-callable", {"loss": "mse"}, TypeError, "loss must be"),
    ("optimizer-params", {"optimizer": [torch.zeros(1)]}, TypeError, "optimizer must be"),
    ("optimizer-None", {"optimizer": None}, TypeError, "optimizer must be"),
    ("scheduler-no-step", {"scheduler": 0.1}, TypeError, "scheduler must be"),
    ("clip-0", {"clip": 0.0}, ValueError, "clip must be"),
    ("clip-negative", {"clip": -1.0}, ValueError, "clip must be"),
    ("clip-nan", {"clip": NAN}, ValueError, "clip must be"),
    ("clip-inf", {"clip": INF}, ValueError, "clip must be"),
    ("clip-str", {"clip": "1"}, ValueError, "clip must be"),
    ("reduction-avg", {"reduction": "avg"}, ValueError, "reduction"),
    ("accum_dtype-int32", {"accum_dtype": torch.int32}, TypeError, "accum_dtype"),
    ("data-a-list", {"data": [1, 2]}, TypeError, "data must be"),
    ("data-a-loader", {"data": range(4)}, TypeError, "data must be"),
    ("sync-str", {"sync": "all_reduce"}, TypeError, "sync"),
]:
    case(
        f"loop.Step-{_id}",
        lambda change=_change: _step_args(**change),
        _make_step,
        _exc,
        _name,
        item="loop",
    )


def _other_scheduler() -> NS:
    ns = _step_args()
    other = torch.optim.SGD(ns["model"].parameters(), lr=0.1)
    ns["args"]["scheduler"] = torch.optim.lr_scheduler.StepLR(other, 1)
    return ns


case(
    "loop.Step-scheduler-of-another-optimizer",
    _other_scheduler,
    _make_step,
    ValueError,
    "scheduler is not the optimizer's",
    item="loop",
)


def _all_frozen() -> NS:
    ns = _step_args()
    ns["model"].requires_grad_(False)
    return ns


case(
    "loop.Step-no-trainable-parameters",
    _all_frozen,
    _make_step,
    ValueError,
    "requires_grad",
    item="loop",
)
case(
    "loop.Step-sync-and-data-sync-differ",
    lambda: _step_args(
        sync=gradaccum.all_reduce(),
        data=gradaccum.loop.windows(range(4), 2, sync=gradaccum.all_reduce()),
    ),
    _make_step,
    ValueError,
    "different syncs",
    world=True,
    item="loop",
)
case(
    "loop.Step-sync-reduce_scatter",
    lambda: _step_args(sync=gradaccum.reduce_scatter(gradaccum.shard(world_params()))),
    _make_step,
    ValueError,
    "reduce_scatter",
    world=True,
    item="loop",
)

# Step.add(batch): what the loss returns, and the rows; nothing added when refused (no sync).


def _adding(loss: Any, reduction: str = "mean") -> NS:
    ns = loop_step(reduction=reduction) if reduction == "mean" else {}
    if not ns:
        model = loop_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ns = {"model": model, "opt": opt}
        ns["step"] = gradaccum.loop.Step(model, loop_mse, opt, reduction=reduction)  # type: ignore[arg-type]
    ns["step"].loss = loss
    ns["batch"] = loop_batches(1)[0]
    return ns


def _summed(m: torch.nn.Module, b: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(b[0]), b[1], reduction="sum")


TYPED = ("gradaccum.Mean(loss, n)", "gradaccum.Sum(loss_sum, n)")
for _id, _loss, _reduction, _exc, _names in [
    ("count-without-a-count", loop_mse, "count", TypeError, ("gradaccum.Sum(summed_loss, count)",)),
    (
        "loss-a-vector",
        lambda m, b: (m(b[0]) - b[1]).pow(2).squeeze(1),
        "mean",
        TypeError,
        ("0-dim",),
    ),
    ("loss-a-float", lambda m, b: 0.5, "mean", TypeError, ("0-dim",)),
    ("loss-three-values", lambda m, b: (loop_mse(m, b), 2, 3), "mean", TypeError, ("3-tuple",)),
    (
        "loss-without-grad",
        lambda m, b: loop_mse(m, b).detach(),
        "mean",
        ValueError,
        ("does not require grad",),
    ),
    # Issue 35: a plain (loss, k) says neither a mean over k items nor a sum over them.
    ("tuple-int-count", lambda m, b: (_summed(m, b), 2), "mean", TypeError, TYPED),
    (
        "tuple-tensor-count",
        lambda m, b: (_summed(m, b), b[0][:, 0].sum()),
        "mean",
        TypeError,
        TYPED,
    ),
    ("tuple-list", lambda m, b: [loop_mse(m, b), 2], "mean", TypeError, TYPED),
    ("tuple-under-count", lambda m, b: (_summed(m, b), 2), "count", TypeError, TYPED),
    ("tuple-under-sum", lambda m, b: (_summed(m, b), 2), "sum", TypeError, TYPED),
    (
        "mean-under-count",
        lambda m, b: gradaccum.Mean(loop_mse(m, b), 2),
        "count",
        TypeError,
        ("gradaccum.Mean(loss, n)", "gradaccum.Sum(loss * n, n)", "reduction='count'"),
    ),
    (
        "mean-under-sum",
        lambda m, b: gradaccum.Mean(loop_mse(m, b), 2),
        "sum",
        TypeError,
        ("gradaccum.Mean(loss, n)", "gradaccum.Sum(loss * n, n)", "reduction='sum'"),
    ),
    (
        "mean-n-negative",
        lambda m, b: gradaccum.Mean(loop_mse(m, b), -2),
        "mean",
        ValueError,
        ("gradaccum.Mean(loss, n)", "-2"),
    ),
]:
    case(
        f"loop.Step.add-{_id}",
        lambda loss=_loss, reduction=_reduction: _adding(loss, reduction),
        lambda ns: ns["step"].add(ns["batch"]),
        _exc,
        *_names,
        item="loop",
        absent=("Accumulator",),
    )

# gradaccum.Mean(loss, n) / gradaccum.Sum(loss, n): checked where they are built.
for _kind in ("Mean", "Sum"):
    for _id, _value, _n, _exc, _names in [
        ("n-negative", torch.tensor(1.0), -1, ValueError, ("n must be >= 0", "-1")),
        ("n-nan", torch.tensor(1.0), NAN, ValueError, ("finite", "nan")),
        ("n-inf", torch.tensor(1.0), INF, ValueError, ("finite", "inf")),
        ("n-a-string", torch.tensor(1.0), "3", TypeError, ("str '3'",)),
        ("n-a-bool", torch.tensor(1.0), True, TypeError, ("bool True",)),
        ("n-two-elements", torch.tensor(1.0), torch.ones(2), TypeError, ("shape=(2,)",)),
        ("n-complex", torch.tensor(1.0), torch.tensor(1j), TypeError, ("complex",)),
        ("loss-a-vector", torch.ones(3), 3, TypeError, ("0-dim", "shape=(3,)")),
        ("loss-a-float", 0.5, 3, TypeError, ("0-dim", "float 0.5")),
    ]:
        case(
            f"gradaccum.{_kind}-{_id}",
            lambda value=_value, n=_n: {"value": value, "n": n},
            lambda ns, kind=_kind: getattr(gradaccum, kind)(ns["value"], ns["n"]),
            _exc,
            f"gradaccum.{_kind}(loss, n)",
            *_names,
            item="loop",
        )


def _dict_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


case(
    "loop.Step.add-rows-ambiguous",
    lambda: {
        **_adding(_dict_loss),
        "batch": {
            "cw": torch.ones(3, dtype=F64),
            "x": torch.ones(2, 3, dtype=F64),
            "y": torch.ones(2, 1, dtype=F64),
        },
    },
    lambda ns: ns["step"].add(ns["batch"]),
    ValueError,
    "batch['cw'] has 3",
    item="loop",
)
case(
    "loop.Step.add-no-rows",
    lambda: {
        **_adding(lambda m, b: m(torch.full((1, 3), b["x"], dtype=F64)).sum()),
        "batch": {"x": 1.0, "y": 2.0},
    },
    lambda ns: ns["step"].add(ns["batch"]),
    ValueError,
    "no tensor with a dim",
    item="loop",
)


def _frozen_mid_window() -> NS:
    ns = loop_step()
    ns["model"][0].bias.requires_grad_(False)
    ns["batch"] = loop_batches(1)[0]
    return ns


case(
    "loop.Step.add-frozen-mid-window",
    _frozen_mid_window,
    lambda ns: ns["step"].add(ns["batch"]),
    ValueError,
    "'0.bias' was frozen",
    item="loop",
)
case(
    "loop.Step.load_state_dict-not-a-state",
    loop_step,
    lambda ns: ns["step"].load_state_dict({"model": {}}),
    ValueError,
    "format",
    item="loop",
)
case(
    "loop.Step.load_state_dict-older-format",
    loop_step,
    lambda ns: ns["step"].load_state_dict({"format": "gradaccum.loop.Step/1"}),
    ValueError,
    "gradaccum.loop.Step/1",
    item="loop",
)

# loop.save(path, step, data=...): refused before anything is written.
for _id, _path, _exc, _name in [
    ("empty", "", ValueError, "path is ''"),
    ("None", None, TypeError, "path must be"),
    ("bytes", b"checkpoint", TypeError, "path must be"),
    ("int", 3, TypeError, "path must be"),
]:
    case(
        f"loop.save-path-{_id}",
        loop_step,
        lambda ns, path=_path: gradaccum.loop.save(path, ns["step"]),
        _exc,
        _name,
        item="loop",
    )
    case(
        f"loop.load-path-{_id}",
        loop_fresh,
        lambda ns, path=_path: gradaccum.loop.load(path, ns["step"]),
        _exc,
        _name,
        item="loop",
    )
case(
    "loop.save-path-a-file",
    lambda: {**loop_step(), "path": a_file()},
    lambda ns: gradaccum.loop.save(ns["path"], ns["step"]),
    ValueError,
    "is a file",
    item="loop",
)
case(
    "loop.load-path-a-file",
    lambda: {**loop_fresh(), "path": a_file()},
    lambda ns: gradaccum.loop.load(ns["path"], ns["step"]),
    ValueError,
    "is a file",
    item="loop",
)
case(
    "loop.load-path-missing",
    lambda: {**loop_fresh(), "path": Path(tempfile.mkdtemp(prefix="misuse-loop-")) / "none"},
    lambda ns: gradaccum.loop.load(ns["path"], ns["step"]),
    FileNotFoundError,
    "does not exist",
    item="loop",
)
for _verb in ("save", "load"):
    case(
        f"loop.{_verb}-step-a-module",
        lambda: {**loop_step(), "path": Path(tempfile.mkdtemp(prefix="misuse-loop-"))},
        lambda ns, verb=_verb: getattr(gradaccum.loop, verb)(ns["path"], ns["model"]),
        TypeError,
        "step must be",
        item="loop",
    )
    case(
        f"loop.{_verb}-data-a-list",
        lambda: {"path": Path(tempfile.mkdtemp(prefix="misuse-loop-"))},
        lambda ns, verb=_verb: getattr(gradaccum.loop, verb)(ns["path"], data=[1, 2]),
        TypeError,
        "data must be",
        item="loop",
    )
    case(
        f"loop.{_verb}-neither-step-nor-data",
        lambda: {"path": Path(tempfile.mkdtemp(prefix="misuse-loop-"))},
        lambda ns, verb=_verb: getattr(gradaccum.loop, verb)(ns["path"]),
        ValueError,
        "both None",
        item="loop",
    )
    case(
        f"loop.{_verb}-data-not-the-steps",
        lambda: {
            **loop_step(),
            "other": gradaccum.loop.windows(loop_batches(7), 3),
            "path": Path(tempfile.mkdtemp(prefix="misuse-loop-")),
        },
        lambda ns, verb=_verb: getattr(gradaccum.loop, verb)(
            ns["path"], ns["step"], data=ns["other"]
        ),
        ValueError,
        "not the step's data",
        item="loop",
    )


def _taken_not_added() -> NS:
    ns = loop_step(added=1)
    next(ns["it"])  # taken from the window, not added to the step
    ns["path"] = Path(tempfile.mkdtemp(prefix="misuse-loop-"))
    return ns


case(
    "loop.save-step-and-data-disagree",
    _taken_not_added,
    lambda ns: gradaccum.loop.save(ns["path"], ns["step"]),
    ValueError,
    "the step is at window 1 with 1 micro-batch(es) added, but the data at window 1 with 2",
    item="loop",
)
case(
    "loop.save-mid-epoch-augmented-data",
    loop_augmented,
    lambda ns: gradaccum.loop.save(ns["path"], ns["step"]),
    ValueError,
    "draws random numbers",
    item="loop",
)

# loop.load(path, step, data=...): all or nothing; a refused load changes nothing.
for _id, _kw, _exc, _name in [
    ("another-model", {"hidden": 5}, ValueError, "'0.weight'"),
    ("another-optimizer", {"optimizer": "sgd"}, ValueError, "AdamW"),
    ("no-scheduler", {"scheduler": False}, ValueError, "scheduler"),
    ("another-reduction", {"reduction": "sum"}, ValueError, "reduction='mean'"),
    ("another-n", {"n": 2}, gradaccum.GradAccumError, "n=3"),
    (
        "another-batch-size",
        {"rows": 3},
        gradaccum.GradAccumError,
        "the data is not the checkpoint's",
    ),
    ("another-dataset", {"count": 9}, gradaccum.GradAccumError, "length"),
]:
    case(
        f"loop.load-{_id}",
        lambda kw=_kw: loop_saved(**kw),
        lambda ns: gradaccum.loop.load(ns["path"], ns["step"]),
        _exc,
        _name,
        item="loop",
    )


def _saved_data_only() -> NS:
    ns = loop_step()
    path = Path(tempfile.mkdtemp(prefix="misuse-loop-"))
    gradaccum.loop.save(path, data=ns["data"])
    return {**loop_fresh(), "path": path}


case(
    "loop.load-a-step-that-was-not-saved",
    _saved_data_only,
    lambda ns: gradaccum.loop.load(ns["path"], ns["step"]),
    ValueError,
    "holds none",
    item="loop",
)


def _step_without_data() -> NS:
    ns = loop_saved()
    model, opt = ns["model"], ns["opt"]
    ns["step"] = gradaccum.loop.Step(model, loop_mse, opt, scheduler=ns["sched"])
    return ns


case(
    "loop.load-the-data-position-left-out",
    _step_without_data,
    lambda ns: gradaccum.loop.load(ns["path"], ns["step"]),
    ValueError,
    "none is given",
    item="loop",
)


def _damaged() -> NS:
    ns = loop_saved()
    file = ns["path"] / "rank0.pt"
    file.write_bytes(file.read_bytes()[:200])
    return ns


case(
    "loop.load-a-file-cut-short",
    _damaged,
    lambda ns: gradaccum.loop.load(ns["path"], ns["step"]),
    gradaccum.GradAccumError,
    "cannot be read by torch.load",
    item="loop",
)


def _older() -> NS:
    ns = loop_saved()
    file = ns["path"] / "rank0.pt"
    saved = torch.load(file, weights_only=True)
    saved["format"] = "gradaccum.loop.checkpoint/1"
    torch.save(saved, file)
    return ns


case(
    "loop.load-an-older-format",
    _older,
    lambda ns: gradaccum.loop.load(ns["path"], ns["step"]),
    gradaccum.GradAccumError,
    "gradaccum.loop.checkpoint/1",
    item="loop",
)


def _while_iterating() -> NS:
    ns = loop_saved()
    ns["loop"] = iter(ns["data"])
    next(ns["loop"])  # the windows are being iterated
    return ns


case(
    "loop.load-while-the-windows-are-iterated",
    _while_iterating,
    lambda ns: gradaccum.loop.load(ns["path"], ns["step"]),
    RuntimeError,
    "being iterated",
    item="loop",
)


# -- issue 35: compositions, messages (item="35") --------------------------------------------------


def _embed(p: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"])


def _info(p: Any, z: torch.Tensor, rows: gradaccum.Rows) -> torch.Tensor:
    return (z[rows.local] @ z.T).logsumexp(-1).sum() / rows.total


def coupled_inputs() -> NS:
    g = torch.Generator().manual_seed(0)
    return {
        "params": {"w": torch.randn(3, 4, generator=g, dtype=F64)},
        "x": torch.randn(8, 3, generator=g, dtype=F64),
    }


def _positives(p: Any, batch: Any) -> torch.Tensor:
    return (batch[0] > 0).sum()


def _scaled(p: Any, batch: Any, count: torch.Tensor) -> torch.Tensor:
    return mean_loss(p, batch) / count


def _token_sum(p: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    return ((x @ p["w"] - y) ** 2).sum(), torch.tensor(float(len(y)), dtype=F64)


def _inner_count_step(n: int) -> Any:
    return gradaccum.accumulate(
        torch.func.grad_and_value(_token_sum, has_aux=True),
        n,
        has_aux=True,
        reduction="count",
        count=lambda aux: aux[1],
    )


case(
    "coupled-inside-accumulate",
    coupled_inputs,
    lambda ns: gradaccum.accumulate(gradaccum.coupled(_embed, _info, 2), 2, has_aux=True)(
        ns["params"], ns["x"]
    ),
    ValueError,
    "micro-batch loop",
    "on the whole batch",
    item="35",
)
case(
    "window_stats-inside-accumulate",
    pb,
    lambda ns: gradaccum.accumulate(
        gradaccum.window_stats(_positives, _scaled, 2), 2, has_aux=True
    )(ns["params"], ns["batch"]),
    ValueError,
    "window_stats(_positives, _scaled, n=2)(params, batch): called inside",
    item="35",
)
# Issue 35, section 3: randomness in the two-pass transforms, and complex leaves.


def _masked_by(gen: torch.Generator) -> Callable[..., Any]:
    def embed(p: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["w"]) * (torch.rand(len(x), 1, generator=gen, dtype=F64) > 0.3)

    return embed


def _complex_beside_float(p: Any, x: torch.Tensor) -> Any:
    z = x @ p["w"]
    return {"f": z, "c": torch.complex(z, z)}


def _complex_info(p: Any, reps: Any, rows: gradaccum.Rows) -> torch.Tensor:
    return reps["f"].sum() + reps["c"].abs().sum()


def _complex_stats(p: Any, batch: Any) -> Any:
    return {"n": (batch[0] > 0).sum(), "c": torch.complex(batch[0].sum(), batch[0].sum())}


def _router_stats(p: Any, batch: Any) -> torch.Tensor:
    return (torch.nn.functional.dropout(batch[0], 0.5, training=True) > 0).sum()


def _loss_draws_more(p: Any, batch: Any, count: torch.Tensor) -> torch.Tensor:
    torch.nn.functional.dropout(batch[0], 0.5, training=True)  # the router's, replayed
    out = torch.nn.functional.dropout(batch[0] @ p["w"], 0.5, training=True)  # one more
    return out.pow(2).mean() / count


case(
    "coupled-generators-not-a-list",
    coupled_inputs,
    lambda ns: gradaccum.coupled(_embed, _info, 2, generators=torch.Generator()),
    TypeError,
    "generators",
    "wrap a single one in a list",
    item="35",
)
case(
    "coupled-generators-a-module",
    coupled_inputs,
    lambda ns: gradaccum.coupled(_embed, _info, 2, generators=[np.random]),
    TypeError,
    "generators[0]",
    "module numpy.random",
    item="35",
)
case(
    "coupled-generators-system-random",
    coupled_inputs,
    lambda ns: gradaccum.coupled(
        _embed, _info, 2, generators=[__import__("random").SystemRandom()]
    ),
    TypeError,
    "generators[0]",
    "SystemRandom",
    item="35",
)
case(
    "coupled-generators-not-a-generator",
    coupled_inputs,
    lambda ns: gradaccum.coupled(_embed, _info, 2, generators=[1]),
    TypeError,
    "generators[0]",
    "got int",
    item="35",
)
case(
    "coupled-check_replay-not-a-bool",
    coupled_inputs,
    lambda ns: gradaccum.coupled(_embed, _info, 2, check_replay="yes"),
    TypeError,
    "check_replay",
    item="35",
)
case(
    "loop-Coupled-generators-not-a-list",
    coupled_inputs,
    lambda ns: gradaccum.loop.Coupled(_embed, _info, generators=torch.Generator()),
    TypeError,
    "Coupled(embed, loss)",
    "generators",
    item="35",
)
case(
    "window_stats-generators-a-string",
    pb,
    lambda ns: gradaccum.window_stats(_positives, _scaled, 2, generators="g"),
    TypeError,
    "generators",
    "pass a list or tuple",
    item="35",
)
case(
    "coupled-replay-undeclared-generator",
    lambda: {**coupled_inputs(), "gen": torch.Generator().manual_seed(0)},
    lambda ns: gradaccum.coupled(_masked_by(ns["gen"]), _info, 2)(ns["params"], ns["x"]),
    gradaccum.GradAccumError,
    "did not reproduce pass 1's representations",
    "generators=",
    item="35",
)
case(
    "coupled-complex-representation-beside-a-float-one",
    coupled_inputs,
    lambda ns: gradaccum.coupled(_complex_beside_float, _complex_info, 2)(ns["params"], ns["x"]),
    TypeError,
    "complex leaf ['c']",
    "view_as_real",
    item="35",
)
case(
    "window_stats-complex-statistic",
    pb,
    lambda ns: gradaccum.window_stats(_complex_stats, _scaled, 2)(ns["params"], ns["batch"]),
    TypeError,
    "stats returned a complex leaf ['c']",
    "view_as_real",
    item="35",
)
case(
    "window_stats-loss-draws-more-than-stats",
    pb,
    lambda ns: gradaccum.window_stats(_router_stats, _loss_draws_more, 2)(
        ns["params"], ns["batch"]
    ),
    gradaccum.GradAccumError,
    "drew other random numbers than stats did",
    "torch's CPU generator",
    item="35",
)
case(
    "accumulate-count-inside-accumulate-count",
    pb,
    lambda ns: gradaccum.accumulate(
        _inner_count_step(2), 2, has_aux=True, reduction="count", count=lambda aux: aux[1]
    )(ns["params"], ns["batch"]),
    ValueError,
    "reduction='count'",
    "n the product",
    item="35",
)
case(
    "accumulate-count-inside-accumulate-mean",
    pb,
    lambda ns: gradaccum.accumulate(_inner_count_step(2), 2, has_aux=True)(
        ns["params"], ns["batch"]
    ),
    ValueError,
    "whose reduction is 'mean'",
    item="35",
)


def per_sample_dicts() -> NS:
    g = torch.Generator().manual_seed(0)
    samples = [
        {
            "x": torch.randn(6, 2, generator=g, dtype=F64),
            "y": torch.randn(6, generator=g, dtype=F64),
        }
        for _ in range(4)
    ]
    return {"params": {"w": torch.zeros(2, dtype=F64)}, "batch": samples}


def _samples_loss(p: Any, samples: Any) -> torch.Tensor:
    return torch.stack([(s["x"] @ p["w"] - s["y"]).logsumexp(0) for s in samples]).mean()


case(
    "accumulate-a-list-of-per-sample-dicts",
    per_sample_dicts,
    lambda ns: gradaccum.accumulate(torch.func.grad(_samples_loss), 2)(ns["params"], ns["batch"]),
    ValueError,
    "collate_fn=lambda x: x",
    "MicroBatches",
    item="35",
)


def per_sample_dicts_keys_differ() -> NS:
    """The same samples, one with an optional field (the hostile pass: 0.68 off, silently)."""
    ns = per_sample_dicts()
    ns["batch"][1]["weight"] = torch.ones(6, dtype=F64)
    return ns


case(
    "accumulate-a-list-of-per-sample-dicts-whose-keys-differ",
    per_sample_dicts_keys_differ,
    lambda ns: gradaccum.accumulate(torch.func.grad(_samples_loss), 2)(ns["params"], ns["batch"]),
    ValueError,
    "4 dicts (their keys differ)",
    "collate_fn=lambda x: x",
    item="35",
)


# The messages that named a call the user never wrote (issue 35, section 5): pass 2's inner
# accumulate of coupled() and window_stats(), Step.add run by add_window, an empty window's
# apply() ("call add() at least once before finalize()"), and torch's words for a loss that
# edits reps in place.


def _empty_coupled_step() -> NS:
    model = torch.nn.Linear(3, 2).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = gradaccum.loop.Step(model, gradaccum.loop.Coupled(_model_embed, _model_info), opt)
    return {"model": model, "opt": opt, "step": step}


def _model_embed(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(model(x))


def _model_info(model: torch.nn.Module, z: torch.Tensor, rows: gradaccum.Rows) -> torch.Tensor:
    return (z[rows.local] @ z.T).logsumexp(-1).sum() / rows.total


def _scales_reps(model: torch.nn.Module, z: torch.Tensor, rows: gradaccum.Rows) -> torch.Tensor:
    z.mul_(2.0)  # in place, on the representations the gradient is taken for
    return _model_info(model, z, rows)


def _zeroes_a_row(p: Any, z: torch.Tensor, rows: gradaccum.Rows) -> torch.Tensor:
    z[0] = 0.0
    return _info(p, z, rows)


def _window_step(loss: Any, **kw: Any) -> NS:
    model = torch.nn.Linear(3, 2).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = gradaccum.loop.Step(model, loss, opt, **kw)
    window = [x(4), x(4) + 1]
    return {"model": model, "opt": opt, "step": step, "window": window}


def _rows_positive(model: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return (b[:, 0] > 0).sum()


def _loss_and_rows(model: torch.nn.Module, b: torch.Tensor, count: torch.Tensor) -> Any:
    return model(b).pow(2).mean() / count, len(b)


def _detached(model: torch.nn.Module, b: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return b.sum() / count


def _int_param(ns: NS) -> NS:
    return {**ns["params"], "steps": torch.tensor(3)}


case(
    "step-apply-empty-window",
    lambda: loop_step(added=0),
    lambda ns: ns["step"].apply(),
    ValueError,
    "Step.apply(): no micro-batch was added in window 1",
    "step.add(batch)",
    item="35",
    absent=("finalize()", "add() at least once"),
)
case(
    "step-apply-empty-window-coupled",
    _empty_coupled_step,
    lambda ns: ns["step"].apply(),
    ValueError,
    "Step.apply(): no micro-batch was added in window 0",
    "step.add_window(window)",
    item="35",
)
case(
    "coupled-pass-2-params-leaf-int",
    coupled_inputs,
    lambda ns: gradaccum.coupled(_embed, _info, 2)(_int_param(ns), ns["x"]),
    TypeError,
    "coupled(_embed, _info, n=2)(params, batch): params leaf ['steps']",
    item="35",
    absent=("accumulate(", "surrogate"),
)
case(
    "window_stats-pass-2-loss-not-a-scalar",
    pb,
    lambda ns: gradaccum.window_stats(_positives, lambda p, b, c: b[0] @ p["w"], 2)(
        ns["params"], ns["batch"]
    ),
    TypeError,
    "window_stats(_positives, <lambda>, n=2)(params, batch): the function must return a scalar",
    item="35",
    absent=("accumulate(",),
)
case(
    "window_stats-pass-2-loss-int",
    pb,
    lambda ns: gradaccum.window_stats(_positives, lambda p, b, c: c, 2)(ns["params"], ns["batch"]),
    TypeError,
    "window_stats(_positives, <lambda>, n=2)(params, batch): the loss has dtype int64",
    item="35",
    absent=("accumulate(",),
)
case(
    "add_window-pass-2-loss-returns-a-tuple",
    lambda: _window_step(gradaccum.loop.WindowStats(_rows_positive, _loss_and_rows)),
    lambda ns: ns["step"].add_window(ns["window"]),
    TypeError,
    "Step.add_window(batches): the loss function returned a 2-tuple",
    item="35",
    absent=("Step.add(batch)",),
)
case(
    "add_window-pass-2-loss-without-grad",
    lambda: _window_step(gradaccum.loop.WindowStats(_rows_positive, _detached)),
    lambda ns: ns["step"].add_window(ns["window"]),
    ValueError,
    "Step.add_window(batches): the loss does not depend",
    item="35",
    absent=("Step.add(batch)",),
)
case(
    "coupled-loss-edits-reps-in-place",
    coupled_inputs,
    lambda ns: gradaccum.coupled(_embed, _zeroes_a_row, 2)(ns["params"], ns["x"]),
    RuntimeError,
    "coupled(_embed, _zeroes_a_row, n=2)(params, batch): the loss edited reps in place",
    "reps = reps.clone()",
    item="35",
)
case(
    "Coupled-loss-edits-reps-in-place",
    lambda: _window_step(gradaccum.loop.Coupled(_model_embed, _scales_reps)),
    lambda ns: ns["step"].add_window(ns["window"]),
    RuntimeError,
    "Step.add_window(batches): the loss edited reps in place",
    "reps = reps.clone()",
    item="35",
)


def _loop_positives(model: Any, batch: Any) -> torch.Tensor:
    return (batch[0] > 0).sum()


def _loop_scaled(model: Any, batch: Any, count: torch.Tensor) -> torch.Tensor:
    return loop_mse(model, batch) / count


def _loop_embed(model: Any, batch: Any) -> torch.Tensor:
    return model(batch[0])


def _loop_info(model: Any, z: torch.Tensor, rows: gradaccum.Rows) -> torch.Tensor:
    return (z[rows.local] @ z.T).logsumexp(-1).sum() / rows.total


def loop_window_step(kind: str) -> Callable[[], NS]:
    def setup() -> NS:
        model = loop_model()
        loss: Any = (
            gradaccum.loop.WindowStats(_loop_positives, _loop_scaled)
            if kind == "stats"
            else gradaccum.loop.Coupled(_loop_embed, _loop_info)
        )
        step = gradaccum.loop.Step(model, loss, torch.optim.SGD(model.parameters(), lr=0.1))
        return {"model": model, "step": step}

    return setup


# A window with no micro-batch, in one process (under a sync a rank without any is exact).
case(
    "loop.Step-WindowStats-empty-window",
    loop_window_step("stats"),
    lambda ns: ns["step"].add_window([]),
    gradaccum.GradAccumError,
    "no micro-batch",
    item="35",
)
case(
    "loop.Step-Coupled-empty-window",
    loop_window_step("coupled"),
    lambda ns: ns["step"].add_window([]),
    gradaccum.GradAccumError,
    "no rows",
    item="35",
)

# -- the pinned messages -------------------------------------------------------------------------
# The whole message of a case, character for character: a message changed on purpose is changed
# here. (Cases without an entry check the words in their ``names`` only.)

# -- the deferred boundary (issue 36, item="deferred") ------------------------------------------


def deferred_opt(kind: str = "adamw", **kw: Any) -> NS:
    model = torch.nn.Linear(3, 1).double()
    made: dict[str, Any] = {
        "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=0.1, **kw),
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1, **kw),
    }
    return {"model": model, "opt": made[kind](), "sync": gradaccum.all_reduce(defer=True)}


case(
    "all_reduce-defer-not-bool",
    dict,
    lambda ns: gradaccum.all_reduce(defer=1),  # type: ignore[arg-type]
    TypeError,
    "defer",
    item="deferred",
)
case(
    "all_reduce-defer-check-full",
    dict,
    lambda ns: gradaccum.all_reduce(defer=True, check="full"),
    ValueError,
    "check='full'",
    "defer=True",
    item="deferred",
)
case(
    "guard-not-deferred",
    lambda: {**deferred_opt(fused=True), "sync": gradaccum.all_reduce()},
    lambda ns: ns["sync"].guard(ns["opt"]),
    ValueError,
    "guard(optimizer)",
    "defer=True",
    item="deferred",
)
case(
    "guard-not-fused",
    deferred_opt,
    lambda ns: ns["sync"].guard(ns["opt"]),
    ValueError,
    "found_inf",
    "fused=True",
    item="deferred",
)
case(
    "guard-not-an-optimizer",
    deferred_opt,
    lambda ns: ns["sync"].guard(ns["model"]),
    TypeError,
    "optimizer must be a torch.optim.Optimizer",
    item="deferred",
)
case(
    "guard-sgd-dampening",
    lambda: deferred_opt("sgd", momentum=0.9, dampening=0.5, fused=True),
    lambda ns: ns["sync"].guard(ns["opt"]),
    ValueError,
    "dampening",
    item="deferred",
)
case(
    "guard-a-found_inf-of-its-own",
    lambda: {**deferred_opt(fused=True), "mine": torch.zeros(())},
    lambda ns: (setattr(ns["opt"], "found_inf", ns["mine"]), ns["sync"].guard(ns["opt"])),
    ValueError,
    "found_inf of its own",
    "GradScaler",
    item="deferred",
)
case(
    "found_inf-not-a-device",
    deferred_opt,
    lambda ns: ns["sync"].found_inf("nope"),
    ValueError,
    "device='nope'",
    item="deferred",
)
case(
    "found_inf-a-dtype",
    deferred_opt,
    lambda ns: ns["sync"].found_inf(torch.float32),
    TypeError,
    "device must be None",
    item="deferred",
)
case(
    "found_inf-meta",
    deferred_opt,
    lambda ns: ns["sync"].found_inf("meta"),
    ValueError,
    "meta device",
    item="deferred",
)
case(
    "found_inf-not-deferred",
    lambda: {"sync": gradaccum.all_reduce()},
    lambda ns: ns["sync"].found_inf(),
    ValueError,
    "found_inf(device)",
    "defer=True",
    item="deferred",
)
case(
    "step-defer-not-fused",
    deferred_opt,
    lambda ns: gradaccum.loop.Step(
        ns["model"], lambda m, b: m(b).mean(), ns["opt"], sync=ns["sync"]
    ),
    ValueError,
    "defer=True",
    "fused=True",
    item="deferred",
)
case(
    "step-defer-coupled",
    lambda: deferred_opt(fused=True),
    lambda ns: gradaccum.loop.Step(
        ns["model"],
        gradaccum.loop.Coupled(lambda m, b: m(b), lambda m, b, rows: rows.all.sum()),
        ns["opt"],
        sync=ns["sync"],
    ),
    ValueError,
    "Coupled",
    "defer=True",
    item="deferred",
)


MESSAGES: dict[str, str] = {
    "all_reduce-defer-not-bool": (
        "all_reduce(group, bucket_mb=..., check=..., timeout=...): defer must be a bool, got "
        "int 1 (builtins.int); pass defer=True or False."
    ),
    "all_reduce-defer-check-full": (
        "all_reduce(group, bucket_mb=..., check=..., timeout=...): check='full' compares every "
        "window's descriptions on the host, which defer=True exists to avoid; pass "
        "check='fingerprint' with defer=True (a mismatch still fails the window on every rank), "
        "or defer=False to have it named."
    ),
    "guard-not-deferred": (
        "AllReduce.guard(optimizer): this sync reads each boundary on the host and raises there "
        "(defer=False), so it has no flag to hand over; build it with gradaccum.all_reduce(..., "
        "defer=True) to skip bad windows on the device."
    ),
    "guard-not-fused": (
        "AllReduce.guard(optimizer): AdamW cannot skip a step on the device (its step() does "
        "not honour found_inf, as GradScaler checks with _step_supports_amp_scaling), so a bad "
        "window would be applied before any rank could know; build it with fused=True (Adam, "
        "AdamW, SGD and Adagrad have it), or use all_reduce(defer=False), which reads each "
        "boundary on the host."
    ),
    "guard-not-an-optimizer": (
        "AllReduce.guard(optimizer): optimizer must be a torch.optim.Optimizer, got Linear; "
        "pass the optimizer that steps on this sync's gradients."
    ),
    "guard-sgd-dampening": (
        "AllReduce.guard(optimizer): fused SGD with momentum and dampening != 0 cannot skip its "
        "first step on the device: torch's fused SGD then leaves its momentum buffers "
        "uninitialised (torch.empty_like), and the next step reads them; use dampening=0, or "
        "all_reduce(defer=False)."
    ),
    "guard-a-found_inf-of-its-own": (
        "AllReduce.guard(optimizer): the optimizer already has a found_inf of its own (another "
        "sync's, or a loss scaler's), so it would skip on that one alone; give each optimizer "
        "one deferred sync, and do not use torch.amp.GradScaler with it (it sets and deletes "
        "found_inf at every step)."
    ),
    "found_inf-a-dtype": (
        "AllReduce.found_inf(device): device must be None, a str, an int or a torch.device, got "
        "torch.float32; pass e.g. found_inf('cuda:0'), or leave it out for the gradients' "
        "device."
    ),
    "found_inf-meta": (
        "AllReduce.found_inf(device): a deferred sync's flag cannot live on the meta device (it "
        "holds no data); pass the device the gradients are on (materialise the parameters "
        "first)."
    ),
    "found_inf-not-deferred": (
        "AllReduce.found_inf(device): this sync reads each boundary on the host and raises "
        "there (defer=False), so it keeps no flag; build the sync with defer=True for one."
    ),
    "step-defer-not-fused": (
        "Step(model, loss, optimizer, ...): sync was made with defer=True: "
        "AllReduce.guard(optimizer): AdamW cannot skip a step on the device (its step() does "
        "not honour found_inf, as GradScaler checks with _step_supports_amp_scaling), so a bad "
        "window would be applied before any rank could know; build it with fused=True (Adam, "
        "AdamW, SGD and Adagrad have it), or use all_reduce(defer=False), which reads each "
        "boundary on the host."
    ),
    "step-defer-coupled": (
        "Step(model, loss, optimizer, ...): sync was made with defer=True, and a Coupled loss "
        "exchanges and reads its window's statistics on the host; pass "
        "gradaccum.all_reduce(...) without defer=True for it."
    ),
    "loop.Step-WindowStats-empty-window": (
        "Step.add_window(batches): the window has no micro-batch; window statistics need at "
        "least one; pass a window with at least one micro-batch."
    ),
    "loop.Step-Coupled-empty-window": (
        "Step.add_window(batches): the window has no rows; a coupled loss needs at least one "
        "row; pass a window with at least one micro-batch."
    ),
    "accumulate-a-list-of-per-sample-dicts": (
        "accumulate(_samples_loss, n=2)(...): the batch is a Python list of 4 dicts of one "
        "structure, per-sample containers as a DataLoader with collate_fn=lambda x: x gives; "
        "gradaccum would split each of them along dim 0 of its own tensors (a sample's tokens), "
        "not the list's samples. Collate the samples into one batch (tensors with a leading batch "
        "dim: torch.utils.data.default_collate, or pad them), or pass "
        "gradaccum.MicroBatches([...]) with the micro-batches you chose; if the elements are not "
        "samples (two towers), pass them as a tuple."
    ),
    "coupled-inside-accumulate": (
        "coupled(_embed, _info, n=2)(params, batch): called inside accumulate(_embed, n=2)(...)'s "
        "micro-batch loop, which runs it on each of its micro-batches alone: its loss would see "
        "only that part's examples and statistics, not the window's, and the result is not the "
        "gradient of the objective. Call it on the whole batch instead: it splits the window into "
        "micro-batches itself (pass a larger n for more of them)."
    ),
    "accumulate-count-inside-accumulate-count": (
        "accumulate(_token_sum, n=2)(...): an accumulate with reduction='count' called inside "
        "accumulate(_token_sum, n=2)(...)'s micro-batch loop, whose reduction is 'count': under "
        "'count' a gradient is weighed by the items its summed loss covers, but an inner "
        "accumulate returns its gradient already divided by its own weight, so the result is "
        "not the gradient of the item mean. Use one accumulate over all the micro-batches (n the "
        "product of the two, reduction='count'); nesting is exact under 'mean' and 'sum'."
    ),
    # Issue 35: what a Step loss returns says what it is.
    "loop.Step-reduction-avg": (
        "Step(model, loss, optimizer, ...): reduction must be one of 'mean', 'sum', 'count', got "
        "str 'avg'; leave it out for the mean over the window's items (a bare loss is a mean "
        "over its rows; gradaccum.Mean or gradaccum.Sum say over which items), pass 'sum' to add "
        "the gradients as they come, or 'count' when every micro-batch returns "
        "gradaccum.Sum(summed_loss, count)."
    ),
    "loop.Step.add-count-without-a-count": (
        "Step.add(batch): under reduction='count' the loss function returns "
        "gradaccum.Sum(summed_loss, count), got Tensor(shape=(), dtype=float64); return e.g. "
        "gradaccum.Sum(loss_sum, (labels != -100).sum()), or drop reduction='count' for a mean "
        "over the micro-batch's rows."
    ),
    "loop.Step.add-tuple-int-count": (
        "Step.add(batch): the loss function returned a 2-tuple (tensor, int), which does not "
        "say what the loss is: (loss, rows) and (summed_loss, count) look the same; return "
        "gradaccum.Mean(loss, n) for a mean over n items (rows or tokens), or "
        "gradaccum.Sum(loss_sum, n) for a sum over n items."
    ),
    "loop.Step.add-tuple-tensor-count": (
        "Step.add(batch): the loss function returned a 2-tuple (tensor, tensor), which does not "
        "say what the loss is: (loss, rows) and (summed_loss, count) look the same; return "
        "gradaccum.Mean(loss, n) for a mean over n items (rows or tokens), or "
        "gradaccum.Sum(loss_sum, n) for a sum over n items."
    ),
    "loop.Step.add-tuple-under-count": (
        "Step.add(batch): the loss function returned a 2-tuple (tensor, int), which does not "
        "say what the loss is: (loss, rows) and (summed_loss, count) look the same; return "
        "gradaccum.Mean(loss, n) for a mean over n items (rows or tokens), or "
        "gradaccum.Sum(loss_sum, n) for a sum over n items."
    ),
    "loop.Step.add-loss-three-values": (
        "Step.add(batch): the loss function returned a 3-tuple (tensor, int, int), which does not "
        "say what the loss is: (loss, rows) and (summed_loss, count) look the same; return "
        "gradaccum.Mean(loss, n) for a mean over n items (rows or tokens), or "
        "gradaccum.Sum(loss_sum, n) for a sum over n items."
    ),
    "loop.Step.add-mean-under-count": (
        "Step.add(batch): the loss function returned gradaccum.Mean(loss, n), but under "
        "reduction='count' every micro-batch returns a sum over its items; return "
        "gradaccum.Sum(loss * n, n) (the sum over the n items), or drop reduction='count' (a "
        "Mean is then weighted by its n)."
    ),
    "loop.Step.add-mean-under-sum": (
        "Step.add(batch): the loss function returned gradaccum.Mean(loss, n), but under "
        "reduction='sum' every micro-batch returns a sum over its items; return the summed "
        "loss, gradaccum.Sum(loss * n, n), or drop reduction='sum' to take the mean over the "
        "window's items."
    ),
    "gradaccum.Mean-n-negative": (
        "gradaccum.Mean(loss, n): n must be >= 0, got -1; pass the number of items the mean covers."
    ),
    "gradaccum.Mean-n-nan": (
        "gradaccum.Mean(loss, n): n must be a finite number >= 0, got nan; pass the number of "
        "items the mean covers, e.g. (labels != pad_id).sum(), as a finite number (a NaN count "
        "often comes from a mean or a division by 0 upstream)."
    ),
    "gradaccum.Sum-n-a-string": (
        "gradaccum.Sum(loss, n): n must be a number or a one-element real tensor, got str '3'; "
        "pass the number of items the sum covers, e.g. (labels != pad_id).sum()."
    ),
    "gradaccum.Sum-n-two-elements": (
        "gradaccum.Sum(loss, n): n must be a number or a one-element real tensor, got "
        "Tensor(shape=(2,), dtype=float32); pass the number of items the sum covers, e.g. "
        "(labels != pad_id).sum()."
    ),
    "gradaccum.Mean-loss-a-vector": (
        "gradaccum.Mean(loss, n): loss must be a 0-dim tensor, the mean over the n items, got "
        "Tensor(shape=(3,), dtype=float32); reduce it over the items first (loss.mean())."
    ),
    "gradaccum.Sum-loss-a-vector": (
        "gradaccum.Sum(loss, n): loss must be a 0-dim tensor, the sum over the n items, got "
        "Tensor(shape=(3,), dtype=float32); reduce it over the items first (loss.sum())."
    ),
    "reduce_scatter-reduce_dtype-int": (
        "reduce_scatter(sharded, policy=..., gather=...): reduce_dtype must be a floating "
        "torch.dtype, got torch.int32; pass e.g. reduce_dtype=torch.bfloat16 (half the bytes of "
        "float32 on the wire), or None (the default: each bucket in its accumulation dtype, "
        "exact; for an FSDP2 model, the reduce_dtype of its MixedPrecisionPolicy)."
    ),
    "accumulate-n-0": (
        "accumulate(step_fn, n=0): n must be a positive int (the number of micro-batches), "
        "got 0; pass n >= 1 (n=1 computes the whole batch in one micro-batch)."
    ),
    "Accumulator-n-0": (
        "Accumulator(n=0): n must be a positive int (the number of micro-batches), got 0; "
        "pass n >= 1 (n=1 computes the whole batch in one micro-batch)."
    ),
    "accumulate-n-negative": (
        "accumulate(step_fn, n=-1): n must be a positive int (the number of micro-batches), "
        "got -1; pass n >= 1 (n=1 computes the whole batch in one micro-batch)."
    ),
    "Accumulator-n-negative": (
        "Accumulator(n=-1): n must be a positive int (the number of micro-batches), got -1; "
        "pass n >= 1 (n=1 computes the whole batch in one micro-batch)."
    ),
    "accumulate-n-float": (
        "accumulate(step_fn, n=2.5): n must be a positive int (the number of "
        "micro-batches), got float 2.5; pass e.g. n=4."
    ),
    "Accumulator-n-float": (
        "Accumulator(n=2.5): n must be a positive int (the number of micro-batches), got "
        "float 2.5; pass e.g. n=4."
    ),
    "accumulate-n-bool": (
        "accumulate(step_fn, n=True): n must be a positive int (the number of "
        "micro-batches), got bool True; pass e.g. n=4."
    ),
    "Accumulator-n-bool": (
        "Accumulator(n=True): n must be a positive int (the number of micro-batches), got "
        "bool True; pass e.g. n=4."
    ),
    "accumulate-n-str": (
        "accumulate(step_fn, n='4'): n must be a positive int (the number of "
        "micro-batches), got str '4'; pass e.g. n=4."
    ),
    "Accumulator-n-str": (
        "Accumulator(n='4'): n must be a positive int (the number of micro-batches), got "
        "str '4'; pass e.g. n=4."
    ),
    "accumulate-n-None": (
        "accumulate(step_fn, n=None): n must be a positive int (the number of "
        "micro-batches), got NoneType None; pass e.g. n=4."
    ),
    "Accumulator-n-None": (
        "Accumulator(n=None): n must be a positive int (the number of micro-batches), got "
        "NoneType None; pass e.g. n=4."
    ),
    "accumulate-reduction-avg": (
        "accumulate(step_fn, n=2): reduction must be one of 'mean', 'sum', 'count', got str "
        "'avg'; use 'mean' when step_fn returns the gradient of a mean loss, 'sum' to add "
        "gradients as they come, 'count' for a summed loss normalised by a count that "
        "step_fn returns in its aux."
    ),
    "Accumulator-reduction-avg": (
        "Accumulator(n=2): reduction must be one of 'mean', 'sum', 'count', got str 'avg'; "
        "use 'mean' when step_fn returns the gradient of a mean loss, 'sum' to add "
        "gradients as they come, 'count' for a summed loss normalised by a count that "
        "step_fn returns in its aux."
    ),
    "accumulate-reduction-upper-case": (
        "accumulate(step_fn, n=2): reduction must be one of 'mean', 'sum', 'count', got str "
        "'MEAN'; use 'mean' when step_fn returns the gradient of a mean loss, 'sum' to add "
        "gradients as they come, 'count' for a summed loss normalised by a count that "
        "step_fn returns in its aux."
    ),
    "Accumulator-reduction-upper-case": (
        "Accumulator(n=2): reduction must be one of 'mean', 'sum', 'count', got str 'MEAN'; "
        "use 'mean' when step_fn returns the gradient of a mean loss, 'sum' to add "
        "gradients as they come, 'count' for a summed loss normalised by a count that "
        "step_fn returns in its aux."
    ),
    "accumulate-reduction-None": (
        "accumulate(step_fn, n=2): reduction must be one of 'mean', 'sum', 'count', got "
        "NoneType None; use 'mean' when step_fn returns the gradient of a mean loss, 'sum' "
        "to add gradients as they come, 'count' for a summed loss normalised by a count "
        "that step_fn returns in its aux."
    ),
    "Accumulator-reduction-None": (
        "Accumulator(n=2): reduction must be one of 'mean', 'sum', 'count', got NoneType "
        "None; use 'mean' when step_fn returns the gradient of a mean loss, 'sum' to add "
        "gradients as they come, 'count' for a summed loss normalised by a count that "
        "step_fn returns in its aux."
    ),
    "accumulate-reduction-int": (
        "accumulate(step_fn, n=2): reduction must be one of 'mean', 'sum', 'count', got int "
        "1; use 'mean' when step_fn returns the gradient of a mean loss, 'sum' to add "
        "gradients as they come, 'count' for a summed loss normalised by a count that "
        "step_fn returns in its aux."
    ),
    "Accumulator-reduction-int": (
        "Accumulator(n=2): reduction must be one of 'mean', 'sum', 'count', got int 1; use "
        "'mean' when step_fn returns the gradient of a mean loss, 'sum' to add gradients as "
        "they come, 'count' for a summed loss normalised by a count that step_fn returns in "
        "its aux."
    ),
    "accumulate-accum_dtype-int32": (
        "accumulate(step_fn, n=2): accum_dtype must be None or a floating torch.dtype, got "
        "torch.int32; pass e.g. accum_dtype=torch.float32."
    ),
    "accumulate-count-reduction-without-count": (
        "accumulate(aux_fn, n=2): reduction='count' needs has_aux=True and count=, a "
        "function from a micro-batch's aux to the number of items its summed loss covers; "
        "got has_aux=True, count=None. Pass e.g. has_aux=True, count=lambda aux: "
        "aux['tokens']."
    ),
    "accumulate-count-reduction-without-has_aux": (
        "accumulate(step_fn, n=2): reduction='count' needs has_aux=True and count=, a "
        "function from a micro-batch's aux to the number of items its summed loss covers; "
        "got has_aux=False, count=function. Pass e.g. has_aux=True, count=lambda aux: "
        "aux['tokens']."
    ),
    "accumulate-count-with-mean": (
        "accumulate(aux_fn, n=2): count= is used only with reduction='count', got "
        "reduction='mean'; pass reduction='count' or drop count=."
    ),
    "accumulate-count-with-sum": (
        "accumulate(aux_fn, n=2): count= is used only with reduction='count', got "
        "reduction='sum'; pass reduction='count' or drop count=."
    ),
    "accumulate-count-reduction-without-has_aux-or-count": (
        "accumulate(step_fn, n=2): reduction='count' needs has_aux=True and count=, a "
        "function from a micro-batch's aux to the number of items its summed loss covers; "
        "got has_aux=False, count=None. Pass e.g. has_aux=True, count=lambda aux: "
        "aux['tokens']."
    ),
    "accumulate-count-reduction-count-not-a-function": (
        "accumulate(aux_fn, n=2): reduction='count' needs has_aux=True and count=, a "
        "function from a micro-batch's aux to the number of items its summed loss covers; "
        "got has_aux=True, count=int 3. Pass e.g. has_aux=True, count=lambda aux: "
        "aux['tokens']."
    ),
    "accumulate-aux_reduction-without-has_aux": (
        "accumulate(step_fn, n=2): aux_reduction= needs has_aux=True (step_fn returning "
        "(grads, aux)); pass has_aux=True or drop aux_reduction=."
    ),
    "accumulate-aux_reduction-unknown": (
        "accumulate(aux_fn, n=2): aux_reduction must be one of 'mean', 'sum', 'count', "
        "'concat', 'stack', 'last', got str 'avg'; pass one of those names, or a tree of "
        "them shaped like the aux."
    ),
    "accumulate-aux_reduction-tree-leaf-unknown": (
        "accumulate(aux_fn, n=2): aux_reduction leaf ['tokens'] must be one of 'mean', "
        "'sum', 'count', 'concat', 'stack', 'last', got str 'avg'; pass one of those names, "
        "or a tree of them shaped like the aux."
    ),
    "accumulate-batch_argnum-in-argnums": (
        "accumulate(step_fn, n=2): batch_argnum=1 is also in argnums=(0, 1); the batch is "
        "split, not differentiated. Pass the position of the batch as batch_argnum."
    ),
    "accumulate-batch_argnum-in-argnums-int": (
        "accumulate(step_fn, n=2): batch_argnum=1 is also in argnums=1; the batch is split, "
        "not differentiated. Pass the position of the batch as batch_argnum."
    ),
    "accumulate-batch_argnum-in-default-argnums": (
        "accumulate(step_fn, n=2): batch_argnum=0 is also in argnums=0; the batch is split, "
        "not differentiated. Pass the position of the batch as batch_argnum."
    ),
    "accumulate-batch-without-tensor-list-of-ints": (
        "accumulate(step_fn, n=2)(...): expected a batch pytree with at least one tensor "
        "leaf, got leaves int 1, int 2, int 3; pass the batch tensors (e.g. (x, y) or {'x': "
        "x, 'y': y}) as this argument."
    ),
    "accumulate-batch-without-tensor-dict-of-int": (
        "accumulate(step_fn, n=2)(...): expected a batch pytree with at least one tensor "
        "leaf, got leaves int 3; pass the batch tensors (e.g. (x, y) or {'x': x, 'y': y}) "
        "as this argument."
    ),
    "accumulate-batch-without-tensor-str": (
        "accumulate(step_fn, n=2)(...): expected a batch pytree with at least one tensor "
        "leaf, got leaves str 'abc'; pass the batch tensors (e.g. (x, y) or {'x': x, 'y': "
        "y}) as this argument."
    ),
    "accumulate-batch-without-tensor-empty-dict": (
        "accumulate(step_fn, n=2)(...): expected a batch pytree with at least one tensor "
        "leaf, got dict; pass the batch tensors (e.g. (x, y) or {'x': x, 'y': y}) as this "
        "argument."
    ),
    "accumulate-batch-without-tensor-empty-tuple": (
        "accumulate(step_fn, n=2)(...): expected a batch pytree with at least one tensor "
        "leaf, got tuple; pass the batch tensors (e.g. (x, y) or {'x': x, 'y': y}) as this "
        "argument."
    ),
    "accumulate-batch-without-tensor-None": (
        "accumulate(step_fn, n=2)(...): expected a batch pytree with at least one tensor "
        "leaf, got NoneType None; pass the batch tensors (e.g. (x, y) or {'x': x, 'y': y}) "
        "as this argument."
    ),
    "accumulate-batch-without-tensor-list-of-None": (
        "accumulate(step_fn, n=2)(...): expected a batch pytree with at least one tensor "
        "leaf, got list; pass the batch tensors (e.g. (x, y) or {'x': x, 'y': y}) as this "
        "argument."
    ),
    "accumulate-batch-0-dim-leaf": (
        "accumulate(step_fn, n=2)(...): batch leaf ['scale'] is a 0-dim tensor, which has "
        "no dim 0 to split along; give it a leading batch dimension (x.unsqueeze(0)) or "
        "pass it through another argument of step_fn."
    ),
    "accumulate-batch-rows-disagree": (
        "accumulate(step_fn, n=2)(...): batch leaves disagree on their size along dim 0: "
        "['x'] has 8 rows but ['y'] has 6; every tensor in a batch must have the same "
        "number of rows. Give every tensor leaf of the batch the same number of rows, or "
        "pass tensors that are not split by row through another argument of step_fn."
    ),
    "accumulate-batch-rows-disagree-nested": (
        "accumulate(step_fn, n=2)(...): batch leaves disagree on their size along dim 0: "
        "['in']['x'] has 8 rows but ['out'][1] has 5; every tensor in a batch must have the "
        "same number of rows. Give every tensor leaf of the batch the same number of rows, "
        "or pass tensors that are not split by row through another argument of step_fn."
    ),
    "accumulate-batch-numpy-leaf": (
        "accumulate(step_fn, n=2)(...): batch leaf ['y'] is ndarray, which gradaccum does "
        "not split (only torch tensors are split; other leaves go whole to every "
        "micro-batch); convert it with torch.as_tensor, or pass it through another argument "
        "of step_fn."
    ),
    "accumulate-n-more-than-rows": (
        "accumulate(step_fn, n=9)(...): n=9 micro-batches is more than the 8 rows of the "
        "batch, so some micro-batches would be empty; pass n <= 8, or a larger batch."
    ),
    "accumulate-batch-0-rows": (
        "accumulate(step_fn, n=2)(...): the batch has 0 rows along dim 0, so there is "
        "nothing to accumulate; pass a batch with at least n=2 rows."
    ),
    "accumulate-no-batch-argument": (
        "accumulate(step_fn, n=2)(...): expected the params at position(s) [0] and the "
        "batch at position 1, got 1 positional argument(s); pass them positionally, e.g. "
        "step(params, batch)."
    ),
    "accumulate-no-argument": (
        "accumulate(step_fn, n=2)(...): expected the params at position(s) [0] and the "
        "batch at position 1, got 0 positional argument(s); pass them positionally, e.g. "
        "step(params, batch)."
    ),
    "accumulate-batch_argnum-2-without-argument-2": (
        "accumulate(step_fn, n=2)(...): expected the params at position(s) [0] and the "
        "batch at position 2, got 2 positional argument(s); pass them positionally, e.g. "
        "step(params, batch)."
    ),
    "accumulate-argnums-0-2-without-argument-2": (
        "accumulate(step_fn, n=2)(...): expected the params at position(s) [0, 2] and the "
        "batch at position 1, got 2 positional argument(s); pass them positionally, e.g. "
        "step(params, batch)."
    ),
    "accumulate-batch-as-keyword": (
        "accumulate(step_fn, n=2)(...): expected the params at position(s) [0] and the "
        "batch at position 1, got 1 positional argument(s); pass them positionally, e.g. "
        "step(params, batch)."
    ),
    "accumulate-grads-missing-key": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a dict with keys ['w']; step_fn "
        "must return one gradient per params leaf, in a tree of the same structure (as "
        "torch.func.grad does)."
    ),
    "Accumulator.add-grads-missing-key": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a dict with keys ['w']; step_fn "
        "must return one gradient per params leaf, in a tree of the same structure (as "
        "torch.func.grad does)."
    ),
    "accumulate-grads-extra-key": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a dict with keys ['b', 'c', "
        "'w']; step_fn must return one gradient per params leaf, in a tree of the same "
        "structure (as torch.func.grad does)."
    ),
    "Accumulator.add-grads-extra-key": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a dict with keys ['b', 'c', "
        "'w']; step_fn must return one gradient per params leaf, in a tree of the same "
        "structure (as torch.func.grad does)."
    ),
    "accumulate-grads-renamed-key": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a dict with keys ['bias', 'w']; "
        "step_fn must return one gradient per params leaf, in a tree of the same structure "
        "(as torch.func.grad does)."
    ),
    "Accumulator.add-grads-renamed-key": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a dict with keys ['bias', 'w']; "
        "step_fn must return one gradient per params leaf, in a tree of the same structure "
        "(as torch.func.grad does)."
    ),
    "accumulate-grads-list-vs-dict": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a list of length 2; step_fn must "
        "return one gradient per params leaf, in a tree of the same structure (as "
        "torch.func.grad does)."
    ),
    "Accumulator.add-grads-list-vs-dict": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a list of length 2; step_fn must "
        "return one gradient per params leaf, in a tree of the same structure (as "
        "torch.func.grad does)."
    ),
    "accumulate-grads-float-leaf": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['w'] is float 1.0, expected a tensor "
        "of shape (3,); step_fn must return tensors (as torch.func.grad does)."
    ),
    "Accumulator.add-grads-float-leaf": (
        "Accumulator.add(state, grads): gradient leaf ['w'] is float 1.0, expected a tensor "
        "of shape (3,); step_fn must return tensors (as torch.func.grad does)."
    ),
    "accumulate-grads-wrong-shape": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['w'] has shape (2,) but the params "
        "leaf has shape (3,); step_fn must return gradients shaped like params (per-sample "
        "gradients must be reduced inside step_fn)."
    ),
    "Accumulator.add-grads-wrong-shape": (
        "Accumulator.add(state, grads): gradient leaf ['w'] has shape (2,) but the params "
        "leaf has shape (3,); step_fn must return gradients shaped like params (per-sample "
        "gradients must be reduced inside step_fn)."
    ),
    "accumulate-grads-per-sample": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['w'] has shape (4, 3) but the params "
        "leaf has shape (3,); step_fn must return gradients shaped like params (per-sample "
        "gradients must be reduced inside step_fn)."
    ),
    "Accumulator.add-grads-per-sample": (
        "Accumulator.add(state, grads): gradient leaf ['w'] has shape (4, 3) but the params "
        "leaf has shape (3,); step_fn must return gradients shaped like params (per-sample "
        "gradients must be reduced inside step_fn)."
    ),
    "accumulate-grads-int64": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['w'] has dtype int64; gradients must "
        "be real floating tensors (integer and complex gradients are not supported). Check "
        "that step_fn returns gradients, not inputs or indices."
    ),
    "Accumulator.add-grads-int64": (
        "Accumulator.add(state, grads): gradient leaf ['w'] has dtype int64; gradients must "
        "be real floating tensors (integer and complex gradients are not supported). Check "
        "that step_fn returns gradients, not inputs or indices."
    ),
    "accumulate-grads-complex": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['b'] has dtype complex128; gradients "
        "must be real floating tensors (integer and complex gradients are not supported). "
        "Check that step_fn returns gradients, not inputs or indices."
    ),
    "Accumulator.add-grads-complex": (
        "Accumulator.add(state, grads): gradient leaf ['b'] has dtype complex128; gradients "
        "must be real floating tensors (integer and complex gradients are not supported). "
        "Check that step_fn returns gradients, not inputs or indices."
    ),
    "accumulate-grads-None-leaf": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['w'] is None, expected a tensor of "
        "shape (3,); step_fn must return a tensor for every params leaf "
        "(torch.autograd.grad returns None for an unused parameter: pass "
        "materialize_grads=True, or use torch.func.grad)."
    ),
    "accumulate-grads-bare-tensor": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a leaf; step_fn must return one "
        "gradient per params leaf, in a tree of the same structure (as torch.func.grad "
        "does)."
    ),
    "Accumulator.add-grads-bare-tensor": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a leaf; step_fn must return one "
        "gradient per params leaf, in a tree of the same structure (as torch.func.grad "
        "does)."
    ),
    "accumulate-grads-str-leaf": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['b'] is str 'g', expected a tensor "
        "of shape (); step_fn must return tensors (as torch.func.grad does)."
    ),
    "Accumulator.add-grads-str-leaf": (
        "Accumulator.add(state, grads): gradient leaf ['b'] is str 'g', expected a tensor "
        "of shape (); step_fn must return tensors (as torch.func.grad does)."
    ),
    "accumulate-grads-broadcastable-shape": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['w'] has shape (1, 3) but the params "
        "leaf has shape (3,); step_fn must return gradients shaped like params (per-sample "
        "gradients must be reduced inside step_fn)."
    ),
    "Accumulator.add-grads-broadcastable-shape": (
        "Accumulator.add(state, grads): gradient leaf ['w'] has shape (1, 3) but the params "
        "leaf has shape (3,); step_fn must return gradients shaped like params (per-sample "
        "gradients must be reduced inside step_fn)."
    ),
    "accumulate-grads-bool": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['w'] has dtype bool; gradients must "
        "be real floating tensors (integer and complex gradients are not supported). Check "
        "that step_fn returns gradients, not inputs or indices."
    ),
    "Accumulator.add-grads-bool": (
        "Accumulator.add(state, grads): gradient leaf ['w'] has dtype bool; gradients must "
        "be real floating tensors (integer and complex gradients are not supported). Check "
        "that step_fn returns gradients, not inputs or indices."
    ),
    "accumulate-grads-nested-missing-key": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "['layer']: expected a dict with keys ['b', 'w'], got a dict with keys ['w']; "
        "step_fn must return one gradient per params leaf, in a tree of the same structure "
        "(as torch.func.grad does)."
    ),
    "Accumulator.add-grads-nested-missing-key": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "['layer']: expected a dict with keys ['b', 'w'], got a dict with keys ['w']; "
        "step_fn must return one gradient per params leaf, in a tree of the same structure "
        "(as torch.func.grad does)."
    ),
    "accumulate-grads-nested-leaf-vs-dict": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "['layer']: expected a dict with keys ['b', 'w'], got a leaf; step_fn must return "
        "one gradient per params leaf, in a tree of the same structure (as torch.func.grad "
        "does)."
    ),
    "Accumulator.add-grads-nested-leaf-vs-dict": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "['layer']: expected a dict with keys ['b', 'w'], got a leaf; step_fn must return "
        "one gradient per params leaf, in a tree of the same structure (as torch.func.grad "
        "does)."
    ),
    "accumulate-grads-nested-list-length": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "['out']: expected a list of length 1, got a list of length 2; step_fn must return "
        "one gradient per params leaf, in a tree of the same structure (as torch.func.grad "
        "does)."
    ),
    "Accumulator.add-grads-nested-list-length": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "['out']: expected a list of length 1, got a list of length 2; step_fn must return "
        "one gradient per params leaf, in a tree of the same structure (as torch.func.grad "
        "does)."
    ),
    "accumulate-grads-nested-tuple-vs-list": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "['out']: expected a list of length 1, got a tuple of length 1; step_fn must return "
        "one gradient per params leaf, in a tree of the same structure (as torch.func.grad "
        "does)."
    ),
    "Accumulator.add-grads-nested-tuple-vs-list": (
        "Accumulator.add(state, grads): the gradients do not match the params tree at "
        "['out']: expected a list of length 1, got a tuple of length 1; step_fn must return "
        "one gradient per params leaf, in a tree of the same structure (as torch.func.grad "
        "does)."
    ),
    "accumulate-grads-nested-wrong-shape": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['layer']['b'] has shape (3,) but the "
        "params leaf has shape (2,); step_fn must return gradients shaped like params "
        "(per-sample gradients must be reduced inside step_fn)."
    ),
    "Accumulator.add-grads-nested-wrong-shape": (
        "Accumulator.add(state, grads): gradient leaf ['layer']['b'] has shape (3,) but the "
        "params leaf has shape (2,); step_fn must return gradients shaped like params "
        "(per-sample gradients must be reduced inside step_fn)."
    ),
    "accumulate-grads-nested-int32": (
        "accumulate(step_fn, n=2)(...): gradient leaf ['layer']['b'] has dtype int32; "
        "gradients must be real floating tensors (integer and complex gradients are not "
        "supported). Check that step_fn returns gradients, not inputs or indices."
    ),
    "Accumulator.add-grads-nested-int32": (
        "Accumulator.add(state, grads): gradient leaf ['layer']['b'] has dtype int32; "
        "gradients must be real floating tensors (integer and complex gradients are not "
        "supported). Check that step_fn returns gradients, not inputs or indices."
    ),
    "accumulate-grads-missing-key-at-micro-batch-2": (
        "accumulate(step_fn, n=4)(...): the gradients do not match the params tree at <root>: "
        "expected a dict with keys ['b', 'w'], got a dict with keys ['w']; step_fn must return one "
        "gradient per params leaf, in a tree of the same structure (as torch.func.grad does)."
    ),
    "accumulate-has_aux-output-bare-tensor": (
        "accumulate(step_fn, n=2)(...): with has_aux=True, step_fn must return a pair "
        "(grads, aux), got Tensor(shape=(3,), dtype=float64); return (grads, aux), as "
        "torch.func.grad_and_value does, or pass has_aux=False."
    ),
    "accumulate-has_aux-output-grads-only": (
        "accumulate(step_fn, n=2)(...): with has_aux=True, step_fn must return a pair "
        "(grads, aux), got dict; return (grads, aux), as torch.func.grad_and_value does, or "
        "pass has_aux=False."
    ),
    "accumulate-has_aux-output-3-tuple": (
        "accumulate(step_fn, n=2)(...): with has_aux=True, step_fn must return a pair "
        "(grads, aux), got tuple of length 3; return (grads, aux), as "
        "torch.func.grad_and_value does, or pass has_aux=False."
    ),
    "accumulate-has_aux-output-1-tuple": (
        "accumulate(step_fn, n=2)(...): with has_aux=True, step_fn must return a pair "
        "(grads, aux), got tuple of length 1; return (grads, aux), as "
        "torch.func.grad_and_value does, or pass has_aux=False."
    ),
    "accumulate-has_aux-output-list-pair": (
        "accumulate(step_fn, n=2)(...): with has_aux=True, step_fn must return a pair "
        "(grads, aux), got list of length 2; return (grads, aux), as "
        "torch.func.grad_and_value does, or pass has_aux=False."
    ),
    "accumulate-pair-without-has_aux": (
        "accumulate(step_fn, n=2)(...): the gradients do not match the params tree at "
        "<root>: expected a dict with keys ['b', 'w'], got a tuple of length 2; step_fn "
        "must return one gradient per params leaf, in a tree of the same structure (as "
        "torch.func.grad does); if step_fn returns (grads, aux), pass has_aux=True."
    ),
    "accumulate-count-negative": (
        "accumulate(aux_fn, n=2)(...): the count must be >= 0, got -3; return the number of "
        "items the summed loss covers."
    ),
    "accumulate-count-str": (
        "accumulate(aux_fn, n=2)(...): the count must be a number or a one-element real "
        "tensor, got str '3'; return the number of items the summed loss covers, e.g. "
        "(labels != pad_id).sum()."
    ),
    "accumulate-count-two-elements": (
        "accumulate(aux_fn, n=2)(...): the count must be a number or a one-element real "
        "tensor, got Tensor(shape=(2,), dtype=float64); return the number of items the "
        "summed loss covers, e.g. (labels != pad_id).sum()."
    ),
    "accumulate-count-complex": (
        "accumulate(aux_fn, n=2)(...): the count must be a number or a one-element real "
        "tensor, got Tensor(shape=(), dtype=complex64); return the number of items the "
        "summed loss covers, e.g. (labels != pad_id).sum()."
    ),
    "accumulate-aux_reduction-count-without-count-reduction": (
        "accumulate(aux_fn, n=2)(...): aux_reduction 'count' for aux leaf ['loss'] needs "
        "reduction='count' (there is no count to divide by); use 'mean' or 'sum'."
    ),
    "accumulate-aux_reduction-not-a-prefix": (
        "accumulate(aux_fn, n=2)(...): aux_reduction {'loss': 'mean'} is not a prefix of "
        "the aux tree PyTreeSpec({'loss': *, 'tokens': *}): at <root>: expected a dict with "
        "keys ['loss'], got a dict with keys ['loss', 'tokens']; pass one name for all "
        "leaves, or a tree shaped like the aux (or a prefix of it) whose leaves are names."
    ),
    "accumulate-aux_reduction-list-not-a-prefix": (
        "accumulate(aux_fn, n=2)(...): aux_reduction ['mean', 'sum'] is not a prefix of the "
        "aux tree PyTreeSpec({'loss': *, 'tokens': *}): at <root>: expected a list of "
        "length 2, got a dict with keys ['loss', 'tokens']; pass one name for all leaves, "
        "or a tree shaped like the aux (or a prefix of it) whose leaves are names."
    ),
    "MicroBatches-tensor": (
        "MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got "
        "Tensor(shape=(3, 2), dtype=float64); wrap your micro-batches in a list: "
        "MicroBatches([mb0, mb1, ...])."
    ),
    "MicroBatches-dict": (
        "MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got dict; "
        "wrap your micro-batches in a list: MicroBatches([mb0, mb1, ...])."
    ),
    "MicroBatches-iterator": (
        "MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got "
        "list_iterator; wrap your micro-batches in a list: MicroBatches([mb0, mb1, ...])."
    ),
    "MicroBatches-generator": (
        "MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got "
        "generator; wrap your micro-batches in a list: MicroBatches([mb0, mb1, ...])."
    ),
    "MicroBatches-int": (
        "MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got int 3; "
        "wrap your micro-batches in a list: MicroBatches([mb0, mb1, ...])."
    ),
    "MicroBatches-None": (
        "MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got "
        "NoneType None; wrap your micro-batches in a list: MicroBatches([mb0, mb1, ...])."
    ),
    "MicroBatches-str": (
        "MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got str "
        "'ab'; wrap your micro-batches in a list: MicroBatches([mb0, mb1, ...])."
    ),
    "MicroBatches-empty": (
        "accumulate(step_fn, n=2)(...): the MicroBatches is empty; without a sync there is "
        "nothing to accumulate: pass MicroBatches([mb0, ...]) with one or more "
        "micro-batches (with sync=, an empty MicroBatches joins the boundary with zero "
        "weight)."
    ),
    "MicroBatches-empty-tuple": (
        "accumulate(step_fn, n=2)(...): the MicroBatches is empty; without a sync there is "
        "nothing to accumulate: pass MicroBatches([mb0, ...]) with one or more "
        "micro-batches (with sync=, an empty MicroBatches joins the boundary with zero "
        "weight)."
    ),
    "accumulate-MicroBatches-0-rows": (
        "accumulate(step_fn, n=2)(...): micro-batch 1 of the MicroBatches has 0 rows; a "
        "micro-batch needs at least one row. Drop empty micro-batches before passing them."
    ),
    "accumulate-MicroBatches-without-tensor-tuple": (
        "accumulate(step_fn, n=2)(...) micro-batch 1: expected a batch pytree with at least "
        "one tensor leaf, got leaves int 1, int 2; pass the batch tensors (e.g. (x, y) or "
        "{'x': x, 'y': y}) as this argument."
    ),
    "Accumulator-schedule-returns-0-is_complete": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got 0; pass n >= 1 (n=1 computes the whole "
        "batch in one micro-batch)."
    ),
    "Accumulator-schedule-returns-0-window_size": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got 0; pass n >= 1 (n=1 computes the whole "
        "batch in one micro-batch)."
    ),
    "Accumulator-schedule-returns-negative-is_complete": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got -1; pass n >= 1 (n=1 computes the whole "
        "batch in one micro-batch)."
    ),
    "Accumulator-schedule-returns-negative-window_size": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got -1; pass n >= 1 (n=1 computes the whole "
        "batch in one micro-batch)."
    ),
    "Accumulator-schedule-returns-float-is_complete": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got float 2.5; pass e.g. n=4."
    ),
    "Accumulator-schedule-returns-float-window_size": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got float 2.5; pass e.g. n=4."
    ),
    "Accumulator-schedule-returns-bool-is_complete": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got bool True; pass e.g. n=4."
    ),
    "Accumulator-schedule-returns-bool-window_size": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got bool True; pass e.g. n=4."
    ),
    "Accumulator-schedule-returns-str-is_complete": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got str '4'; pass e.g. n=4."
    ),
    "Accumulator-schedule-returns-str-window_size": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got str '4'; pass e.g. n=4."
    ),
    "Accumulator-schedule-returns-None-is_complete": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got NoneType None; pass e.g. n=4."
    ),
    "Accumulator-schedule-returns-None-window_size": (
        "Accumulator(n=<schedule>): the schedule's value for window 1: n must be a positive "
        "int (the number of micro-batches), got NoneType None; pass e.g. n=4."
    ),
    "Accumulator-schedule-reduction-x": (
        "Accumulator(n=<schedule>): reduction must be one of 'mean', 'sum', 'count', got "
        "str 'x'; use 'mean' when step_fn returns the gradient of a mean loss, 'sum' to add "
        "gradients as they come, 'count' for a summed loss normalised by a count that "
        "step_fn returns in its aux."
    ),
    "Accumulator-schedule-finalize-empty-window": (
        "Accumulator(n=<schedule>).finalize(state): the window holds no micro-batch, so "
        "there is no gradient to return; call add() at least once before finalize()."
    ),
    "Accumulator.add-state-not-a-state": (
        "Accumulator.add(state, grads): state must be an AccumState (from Accumulator.init, "
        "add or finalize), got dict; start with state = acc.init(params), then state = "
        "acc.add(state, grads, ...)."
    ),
    "Accumulator.add-without-size": (
        "Accumulator.add(state, grads): reduction='mean' needs size=, the micro-batch's "
        "number of rows, to weight it exactly; pass size=len(micro_batch)."
    ),
    "Accumulator.add-size-0": (
        "Accumulator.add(state, grads): size must be the micro-batch's number of rows, a "
        "positive int, got int 0; pass size=len(micro_batch)."
    ),
    "Accumulator.add-size-str": (
        "Accumulator.add(state, grads): size must be the micro-batch's number of rows, a "
        "positive int, got str '3'; pass size=len(micro_batch)."
    ),
    "Accumulator.add-size-float": (
        "Accumulator.add(state, grads): size must be the micro-batch's number of rows, a "
        "positive int, got float 2.5; pass size=len(micro_batch)."
    ),
    "Accumulator.add-size-bool": (
        "Accumulator.add(state, grads): size must be the micro-batch's number of rows, a "
        "positive int, got bool True; pass size=len(micro_batch)."
    ),
    "Accumulator.add-count-under-mean": (
        "Accumulator.add(state, grads): count= is used only with reduction='count', got "
        "reduction='mean'; pass size= (the micro-batch's rows), or use Accumulator(n, "
        "reduction='count')."
    ),
    "Accumulator.add-count-under-sum": (
        "Accumulator.add(state, grads): count= is used only with reduction='count', got "
        "reduction='sum'; pass size= (the micro-batch's rows), or use Accumulator(n, "
        "reduction='count')."
    ),
    "Accumulator.add-no-count-under-count": (
        "Accumulator.add(state, grads): reduction='count' needs count=, the number of items "
        "the micro-batch's summed loss covers; pass e.g. count=(labels != pad_id).sum()."
    ),
    "Accumulator.finalize-empty-window-after-a-window-mean": (
        "Accumulator(n=2).finalize(state): the window holds no micro-batch, so there is no "
        "gradient to return; call add() at least once before finalize()."
    ),
    "Accumulator.finalize-empty-window-after-a-window-sum": (
        "Accumulator(n=2).finalize(state): the window holds no micro-batch, so there is no "
        "gradient to return; call add() at least once before finalize()."
    ),
    "Accumulator.finalize-empty-window-after-a-window-count": (
        "Accumulator(n=2).finalize(state): the window holds no micro-batch, so there is no "
        "gradient to return; call add() at least once before finalize()."
    ),
    "Accumulator.finalize-counts-add-up-to-0": (
        "Accumulator(n=2).finalize(state): the window's counts add up to 0, so there is no "
        "item mean to divide by; skip windows with no items (e.g. all padding), or use "
        "reduction='sum'."
    ),
    "Accumulator.load_state_dict-list": (
        "Accumulator.load_state_dict(state, state_dict): expected a dict saved by "
        "Accumulator.state_dict (format 'gradaccum.AccumState/1'), got list; pass the dict "
        "that state_dict() returned (torch.load(path, weights_only=True))."
    ),
    "Accumulator.load_state_dict-None": (
        "Accumulator.load_state_dict(state, state_dict): expected a dict saved by "
        "Accumulator.state_dict (format 'gradaccum.AccumState/1'), got NoneType None; pass "
        "the dict that state_dict() returned (torch.load(path, weights_only=True))."
    ),
    "Accumulator.load_state_dict-tensor": (
        "Accumulator.load_state_dict(state, state_dict): expected a dict saved by "
        "Accumulator.state_dict (format 'gradaccum.AccumState/1'), got Tensor(shape=(2,), "
        "dtype=float64); pass the dict that state_dict() returned (torch.load(path, "
        "weights_only=True))."
    ),
    "Accumulator.load_state_dict-module-state-dict": (
        "Accumulator.load_state_dict(state, state_dict): expected a dict saved by "
        "Accumulator.state_dict (format 'gradaccum.AccumState/1'), got format None; pass "
        "the dict that state_dict() returned (torch.load(path, weights_only=True))."
    ),
    "Accumulator.load_state_dict-empty-dict": (
        "Accumulator.load_state_dict(state, state_dict): expected a dict saved by "
        "Accumulator.state_dict (format 'gradaccum.AccumState/1'), got format None; pass "
        "the dict that state_dict() returned (torch.load(path, weights_only=True))."
    ),
    "Accumulator.load_state_dict-other-format": (
        "Accumulator.load_state_dict(state, state_dict): expected a dict saved by "
        "Accumulator.state_dict (format 'gradaccum.AccumState/1'), got format "
        "'gradaccum.streaming.AccumState/0'; pass the dict that state_dict() returned "
        "(torch.load(path, weights_only=True))."
    ),
    "Accumulator.load_state_dict-no-sums-key": (
        "Accumulator.load_state_dict(state, state_dict): the state dict lacks the keys "
        "['sums']; pass the dict that state_dict() returned (torch.load(path, "
        "weights_only=True))."
    ),
    "Accumulator.load_state_dict-short-shapes": (
        "Accumulator.load_state_dict(state, state_dict): the state dict has 2 paths but 1 "
        "shapes; pass the dict that state_dict() returned (torch.load(path, "
        "weights_only=True))."
    ),
    "Accumulator.load_state_dict-short-sums": (
        "Accumulator.load_state_dict(state, state_dict): the state dict has 2 paths but 1 "
        "running sums; pass the dict that state_dict() returned (torch.load(path, "
        "weights_only=True))."
    ),
    "Accumulator.load_state_dict-micro_step-str": (
        "Accumulator.load_state_dict(state, state_dict): micro_step must be a non-negative "
        "int, got str 'x'; pass the dict that state_dict() returned (torch.load(path, "
        "weights_only=True))."
    ),
    "Accumulator.load_state_dict-weight-str": (
        "Accumulator.load_state_dict(state, state_dict): weight must be a number or a 0-dim "
        "tensor, got str 'x'; pass the dict that state_dict() returned (torch.load(path, "
        "weights_only=True))."
    ),
    "Accumulator.load_state_dict-different-keys": (
        "Accumulator.load_state_dict(state, state_dict): the saved state is for a different "
        "params tree: params leaves [\"['b']\"] are not in the saved state; saved leaves "
        "[\"['c']\"] are not in the params; load it for the same params it was saved with."
    ),
    "Accumulator.load_state_dict-missing-key": (
        "Accumulator.load_state_dict(state, state_dict): the saved state is for a different "
        "params tree: params leaves [\"['b']\"] are not in the saved state; load it for the "
        "same params it was saved with."
    ),
    "Accumulator.load_state_dict-different-shape": (
        "Accumulator.load_state_dict(state, state_dict): params leaf ['w'] is shape [3] "
        "float64 but the state was saved for shape [4] float64; load it for the same params "
        "it was saved with."
    ),
    "Accumulator.load_state_dict-different-dtype": (
        "Accumulator.load_state_dict(state, state_dict): params leaf ['b'] is shape [] "
        "float64 but the state was saved for shape [] float32; load it for the same params "
        "it was saved with."
    ),
    "Accumulator.load_state_dict-different-reduction": (
        "Accumulator.load_state_dict(state, state_dict): the state was saved with "
        "reduction='sum' but this Accumulator has reduction='mean'; load it into an "
        "Accumulator with the same reduction."
    ),
    "Accumulator.load_state_dict-different-accum_dtype": (
        "Accumulator.load_state_dict(state, state_dict): saved running sum for ['b'] is "
        "Tensor(shape=(), dtype=float32), expected shape [] float64 (the accumulation "
        "dtype); save and load with the same accum_dtype."
    ),
    "Accumulator.load_state_dict-format-only": (
        "Accumulator.load_state_dict(state, state_dict): the state dict lacks the keys "
        "['accum_dtypes', 'dtypes', 'micro_step', 'paths', 'reduction', 'shapes', 'sums', "
        "'weight', 'window']; pass the dict that state_dict() returned (torch.load(path, "
        "weights_only=True))."
    ),
    "Accumulator.load_state_dict-extra-key": (
        "Accumulator.load_state_dict(state, state_dict): the saved state is for a different "
        "params tree: saved leaves [\"['c']\"] are not in the params; load it for the same "
        "params it was saved with."
    ),
    "Accumulator.load_state_dict-extra-key-into-fresh-state": (
        "Accumulator.load_state_dict(state, state_dict): the saved state is for a different "
        "params tree: saved leaves [\"['c']\"] are not in the params; load it for the same "
        "params it was saved with."
    ),
    "write_grads-missing-grad-set": (
        "write_grads(module, grads): grads and the module's trainable parameters differ: "
        "missing ['bias'], unknown []; compute grads with respect to "
        "gradaccum.params_of(module)."
    ),
    "write_grads-missing-grad-None": (
        "write_grads(module, grads): grads and the module's trainable parameters differ: "
        "missing ['bias'], unknown []; compute grads with respect to "
        "gradaccum.params_of(module)."
    ),
    "write_grads-extra-grad-set": (
        "write_grads(module, grads): grads and the module's trainable parameters differ: "
        "missing [], unknown ['scale']; compute grads with respect to "
        "gradaccum.params_of(module)."
    ),
    "write_grads-extra-grad-None": (
        "write_grads(module, grads): grads and the module's trainable parameters differ: "
        "missing [], unknown ['scale']; compute grads with respect to "
        "gradaccum.params_of(module)."
    ),
    "write_grads-renamed-grad-set": (
        "write_grads(module, grads): grads and the module's trainable parameters differ: "
        "missing ['bias'], unknown ['b']; compute grads with respect to "
        "gradaccum.params_of(module)."
    ),
    "write_grads-renamed-grad-None": (
        "write_grads(module, grads): grads and the module's trainable parameters differ: "
        "missing ['bias'], unknown ['b']; compute grads with respect to "
        "gradaccum.params_of(module)."
    ),
    "write_grads-wrong-shape-grad-set": (
        "write_grads(module, grads): grads['bias'] is Tensor(shape=(2,), dtype=float64), "
        "expected shape (1,); compute grads with respect to gradaccum.params_of(module)."
    ),
    "write_grads-wrong-shape-grad-None": (
        "write_grads(module, grads): grads['bias'] is Tensor(shape=(2,), dtype=float64), "
        "expected shape (1,); compute grads with respect to gradaccum.params_of(module)."
    ),
    "write_grads-wrong-shape-first-grad-set": (
        "write_grads(module, grads): grads['weight'] is Tensor(shape=(2, 1), "
        "dtype=float64), expected shape (1, 2); compute grads with respect to "
        "gradaccum.params_of(module)."
    ),
    "write_grads-wrong-shape-first-grad-None": (
        "write_grads(module, grads): grads['weight'] is Tensor(shape=(2, 1), "
        "dtype=float64), expected shape (1, 2); compute grads with respect to "
        "gradaccum.params_of(module)."
    ),
    "write_grads-list-grad-set": (
        "write_grads(module, grads): grads must be a dict of tensors by parameter name, got "
        "list; use the params dict from gradaccum.params_of(module)."
    ),
    "write_grads-list-grad-None": (
        "write_grads(module, grads): grads must be a dict of tensors by parameter name, got "
        "list; use the params dict from gradaccum.params_of(module)."
    ),
    "write_grads-int64-grad-set": (
        "write_grads(module, grads): grads['bias'] has dtype int64; gradients must be real "
        "floating tensors. Compute grads with respect to gradaccum.params_of(module)."
    ),
    "write_grads-int64-grad-None": (
        "write_grads(module, grads): grads['bias'] has dtype int64; gradients must be real "
        "floating tensors. Compute grads with respect to gradaccum.params_of(module)."
    ),
    "write_grads-complex128-grad-set": (
        "write_grads(module, grads): grads['bias'] has dtype complex128; gradients must be "
        "real floating tensors. Compute grads with respect to gradaccum.params_of(module)."
    ),
    "write_grads-complex128-grad-None": (
        "write_grads(module, grads): grads['bias'] has dtype complex128; gradients must be "
        "real floating tensors. Compute grads with respect to gradaccum.params_of(module)."
    ),
    "update_buffers-unknown-name-dict": (
        "update_buffers(buffers, new_buffers): new_buffers has ['running_avg'], which buffers "
        "does not have (it has ['num_batches_tracked', 'running_mean', 'running_var']); pass the "
        "buffers of the same module."
    ),
    "update_buffers-unknown-name-module": (
        "update_buffers(buffers, new_buffers): new_buffers has ['running_avg'], which buffers "
        "does not have (it has ['num_batches_tracked', 'running_mean', 'running_var']); pass the "
        "buffers of the same module."
    ),
    "update_buffers-wrong-shape-4": (
        "update_buffers(buffers, new_buffers): new_buffers['running_var'] is "
        "Tensor(shape=(4,), dtype=float64), expected shape (3,); pass the new_buffers that "
        "call_module returned for the same module."
    ),
    "update_buffers-wrong-shape-0-dim": (
        "update_buffers(buffers, new_buffers): new_buffers['running_var'] is "
        "Tensor(shape=(), dtype=float64), expected shape (3,); pass the new_buffers that "
        "call_module returned for the same module."
    ),
    "update_buffers-wrong-shape-float": (
        "update_buffers(buffers, new_buffers): new_buffers['running_var'] is float 1.0, "
        "expected shape (3,); pass the new_buffers that call_module returned for the same "
        "module."
    ),
    "update_buffers-new_buffers-list": (
        "update_buffers(buffers, new_buffers): new_buffers must be a dict of tensors by "
        "buffer name, got list; pass the new_buffers that call_module returned."
    ),
    "testing.compare-count-without-count": (
        "accumulate(aux_fn, n=2): reduction='count' needs has_aux=True and count=, a "
        "function from a micro-batch's aux to the number of items its summed loss covers; "
        "got has_aux=True, count=None. Pass e.g. has_aux=True, count=lambda aux: "
        "aux['tokens']."
    ),
    "testing.compare-batch-rows-disagree": (
        "accumulate(step_fn, n=2)(...): batch leaves disagree on their size along dim 0: "
        "[0] has 8 rows but [1] has 6; every tensor in a batch must have the same number of "
        "rows. Give every tensor leaf of the batch the same number of rows, or pass tensors "
        "that are not split by row through another argument of step_fn."
    ),
    "step-apply-empty-window": (
        "Step.apply(): no micro-batch was added in window 1, so there is no gradient to apply; "
        "add the window's micro-batches first (step.add(batch)), then call step.apply()."
    ),
    "step-apply-empty-window-coupled": (
        "Step.apply(): no micro-batch was added in window 0, so there is no gradient to apply; "
        "add the window's micro-batches first (step.add_window(window)), then call "
        "step.apply()."
    ),
    "coupled-pass-2-params-leaf-int": (
        "coupled(_embed, _info, n=2)(params, batch): params leaf ['steps'] has dtype int64; "
        "gradients exist only for floating tensors. Move it out of the params pytree (into "
        "buffers, or another argument of step_fn)."
    ),
    "window_stats-pass-2-loss-not-a-scalar": (
        "window_stats(_positives, <lambda>, n=2)(params, batch): the function must return a "
        "scalar (0-dim) loss tensor, got a tensor of shape (4,); reduce it with .mean() or "
        ".sum()."
    ),
    "window_stats-pass-2-loss-int": (
        "window_stats(_positives, <lambda>, n=2)(params, batch): the loss has dtype int64; it "
        "must be a floating tensor to be differentiated."
    ),
    "add_window-pass-2-loss-returns-a-tuple": (
        "Step.add_window(batches): the loss function returned a 2-tuple (tensor, int), which "
        "does not say what the loss is: (loss, rows) and (summed_loss, count) look the same; "
        "return gradaccum.Mean(loss, n) for a mean over n items (rows or tokens), or "
        "gradaccum.Sum(loss_sum, n) for a sum over n items."
    ),
    "add_window-pass-2-loss-without-grad": (
        "Step.add_window(batches): the loss does not depend on the model's trainable parameters "
        "(it does not require grad); compute it from model(...), outside torch.no_grad()."
    ),
    "coupled-loss-edits-reps-in-place": (
        "coupled(_embed, _zeroes_a_row, n=2)(params, batch): the loss edited reps in place "
        "(torch: a view of a leaf Variable that requires grad is being used in an in-place "
        "operation); compute on a copy: reps = reps.clone(), or with out-of-place ops (z = z / "
        "t, not z.div_(t))."
    ),
    "Coupled-loss-edits-reps-in-place": (
        "Step.add_window(batches): the loss edited reps in place (torch: a leaf Variable that "
        "requires grad is being used in an in-place operation); compute on a copy: reps = "
        "reps.clone(), or with out-of-place ops (z = z / t, not z.div_(t))."
    ),
}

# -- the generic test ---------------------------------------------------------------------------

# After the call shape and the expectation, a fix: "; pass ...", ". Use ...", "; step_fn must ...".
FIX = re.compile(
    r"(?:;|\.)\s+(?:.*?\b)?(?:pass|use|call|give|return|load|drop|wrap|start|convert|compute|"
    r"shard|skip|move|build|resume|save|look|check|gather|reduce|take|must|e\.g\.|change|"
    r"unfreeze)\b",
    re.IGNORECASE | re.DOTALL,
)
CALL_SHAPE = re.compile(r"\A[A-Za-z_][\w.]*\(")


def message(err: BaseException) -> str:
    """The message as written (KeyError's str() adds quotes)."""
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        return err.args[0]
    return str(err)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: compare this rank's shard
    return to_local() if callable(to_local) else t


def _tensor_record(t: torch.Tensor) -> tuple[Any, ...]:
    local = _local(t).detach()
    return ("tensor", local.dtype, tuple(local.shape), local.device, t.requires_grad, local.clone())


def snapshot(obj: Any, path: str = "ns", out: list[tuple[str, Any]] | None = None) -> list[Any]:
    """``(path, record)`` for every tensor and plain value reachable from ``obj``, cloned."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append((path, _tensor_record(obj)))
        if obj.is_leaf and obj.grad is not None:
            out.append((f"{path}.grad", _tensor_record(obj.grad)))
    elif isinstance(obj, torch.nn.Module):
        out.append((f"{path}.training", obj.training))
        for k, p in obj.named_parameters():
            snapshot(p, f"{path}.param[{k}]", out)
            out.append((f"{path}.param[{k}].requires_grad", p.requires_grad))
        for k, b in obj.named_buffers():
            snapshot(b, f"{path}.buffer[{k}]", out)
    elif isinstance(obj, torch.optim.Optimizer):
        snapshot(obj.state_dict(), f"{path}.state_dict()", out)
    elif isinstance(
        obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    ):
        snapshot(obj.state_dict(), f"{path}.state_dict()", out)
    elif isinstance(obj, gradaccum.loop.Step):
        snapshot(obj.model, f"{path}.model", out)
        snapshot(obj.optimizer, f"{path}.optimizer", out)
        snapshot(obj.scheduler, f"{path}.scheduler", out)
        snapshot(obj.state, f"{path}.state", out)  # the window in progress: sums, weight, metrics
        out.append((f"{path}._saves", ("value", "int", obj._saves)))
    elif isinstance(obj, gradaccum.loop.Windows):
        position = (obj.epoch, obj.window, obj.micro_batch, obj._in_window, obj._closed)
        out.append((f"{path}.position", ("value", "tuple", position)))
        # Refused mid-epoch for data a replay cannot give; a factory that fails refuses it too.
        with contextlib.suppress(ValueError, TypeError):
            snapshot(obj.state_dict(), f"{path}.state_dict()", out)
    elif isinstance(obj, Path):  # a checkpoint directory or a file: what it holds, byte for byte
        if obj.is_dir():
            files = sorted(f for f in obj.rglob("*") if f.is_file())
            held = [
                (str(f.relative_to(obj)), hashlib.sha256(f.read_bytes()).hexdigest()) for f in files
            ]
            out.append((path, ("dir", held)))
        else:
            data = obj.read_bytes() if obj.exists() else None
            out.append((path, ("file", None if data is None else hashlib.sha256(data).hexdigest())))
    elif isinstance(obj, gradaccum.sharding.Sharded):
        snapshot(list(obj.shards), f"{path}.shards", out)
    elif isinstance(obj, gradaccum.sync.CustomReduce):
        snapshot(obj.state, f"{path}.state", out)
    elif isinstance(obj, gradaccum.MicroBatches):
        snapshot(list(obj), f"{path}.batches", out)
    elif isinstance(obj, np.ndarray):
        out.append((path, ("ndarray", obj.dtype, obj.shape, obj.copy())))
    elif isinstance(obj, Mapping):
        out.append((f"{path}.keys", ("keys", type(obj).__name__, sorted(map(repr, obj)))))
        for k in sorted(obj, key=repr):
            snapshot(obj[k], f"{path}[{k!r}]", out)
    elif isinstance(obj, (list, tuple)):
        out.append((f"{path}.len", ("seq", type(obj).__name__, len(obj))))
        for i, v in enumerate(obj):
            snapshot(v, f"{path}[{i}]", out)
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype)):
        out.append((path, ("value", type(obj).__name__, obj)))
    else:  # functions, layouts, iterators, syncs: the same object (do not consume iterators)
        out.append((path, ("object", id(obj))))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        _, dtype, shape, device, req, t = a
        _, dtype2, shape2, device2, req2, t2 = b
        if (dtype, shape, device, req) != (dtype2, shape2, device2, req2):
            return False
        if t.numel() == 0:
            return True
        bits = t.contiguous().reshape(-1).view(torch.uint8)  # bit-identical, NaN included
        return torch.equal(bits, t2.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, tuple) and a and a[0] == "ndarray":
        return a[1:3] == b[1:3] and a[3].tobytes() == b[3].tobytes()
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, tuple) and a and a[0] == "value":
        return a[:2] == b[:2] and (a[2] == b[2] or (a[2] != a[2] and b[2] != b[2]))
    return bool(a == b)


def assert_unchanged(before: list[Any], after: list[Any]) -> None:
    paths_before, paths_after = [p for p, _ in before], [p for p, _ in after]
    assert paths_before == paths_after, (
        f"the inputs changed structure: {sorted(set(paths_before) ^ set(paths_after))}"
    )
    changed = [p for (p, a), (_, b) in zip(before, after) if not _same(a, b)]
    assert not changed, f"the call changed {changed}"


def check_message(c: Case, err: BaseException) -> None:
    msg = message(err)
    assert CALL_SHAPE.match(msg), f"the message does not start with the call shape: {msg!r}"
    missing = [
        n for n in c.names if not (any(w in msg for w in n) if isinstance(n, tuple) else n in msg)
    ]
    assert not missing, f"the message does not name {missing}: {msg!r}"
    present = [w for w in c.absent if w in msg]
    assert not present, f"the message says {present}, which misleads: {msg!r}"
    assert FIX.search(msg.split(": ", 1)[-1]), f"the message gives no fix: {msg!r}"


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_misuse(c: Case, request: pytest.FixtureRequest) -> None:
    if c.world:
        request.getfixturevalue("world")
    else:
        assert not dist.is_initialized()
    ns = c.setup()
    before = snapshot(ns)
    with pytest.raises(c.exc) as info:
        c.call(ns)
    check_message(c, info.value)
    if c.id in MESSAGES:
        assert message(info.value) == MESSAGES[c.id]
    assert_unchanged(before, snapshot(ns))


def test_every_pinned_message_belongs_to_a_case() -> None:
    ids = {c.id for c in CASES}
    assert not [k for k in MESSAGES if k not in ids]


def test_the_catalogue_is_broad() -> None:
    assert len(CASES) >= 80
    assert {c.item for c in CASES if isinstance(c.item, int)} == set(range(1, 12))
    loop = [c for c in CASES if c.item == "loop"]
    assert len(loop) >= 90
    for call in ("windows", "Step", "Step.add", "save", "load"):
        assert any(c.id.startswith(f"loop.{call}-") for c in loop), call
    assert len([c for c in CASES if c.item == "deferred"]) >= 13


def test_the_snapshot_sees_every_kind_of_change() -> None:
    """The unchanged check is not vacuous: each mutation below is caught, NaN equals NaN."""
    mutations: list[Callable[[NS], None]] = [
        lambda ns: ns["params"]["w"].add_(1.0),
        lambda ns: ns["params"].update(c=torch.zeros(1)),
        lambda ns: ns["params"]["w"].requires_grad_(True),
        lambda ns: ns["module"].weight.grad.mul_(2.0),
        lambda ns: setattr(ns["module"].weight, "grad", None),
        lambda ns: ns["opt"].state[ns["module"].bias]["momentum_buffer"].zero_(),
        lambda ns: ns["bn"].running_var.fill_(3.0),
        lambda ns: ns["bn"].num_batches_tracked.add_(1),
        lambda ns: ns["bn"].eval(),
        lambda ns: ns["state"].sums["b"].add_(1.0),
        lambda ns: ns["sd"].update(micro_step=2),
        lambda ns: ns["nan"][1].zero_(),
        lambda ns: ns["batch"][0].__setitem__((0, 0), 9.0),
        # The loop's: the step's window, its scheduler, the data position, a checkpoint's files.
        lambda ns: next(iter(ns["loop"]["step"].state.sums.values())).add_(1.0),
        lambda ns: setattr(ns["loop"]["step"], "_saves", 1),
        lambda ns: ns["loop"]["sched"].step(),
        lambda ns: setattr(ns["loop"]["data"], "_pos", 5),
        lambda ns: (ns["ckpt"] / "rank0.pt").write_bytes(b"another save"),
        lambda ns: (ns["ckpt"] / "shared.pt").write_bytes(b"a new file"),
    ]
    for mutate in mutations:
        ns = {**linear(), **mid(), **pb(), "bn": batchnorm()["module"], "loop": loop_step()}
        ns["ckpt"] = Path(tempfile.mkdtemp(prefix="misuse-loop-"))
        (ns["ckpt"] / "rank0.pt").write_bytes(b"a save")
        ns["sd"] = ns["acc"].state_dict(ns["state"])
        ns["nan"] = torch.tensor([NAN, 1.0])
        before = snapshot(ns)
        assert_unchanged(before, snapshot(ns))
        mutate(ns)
        with pytest.raises(AssertionError, match="the (call changed|inputs changed structure)"):
            assert_unchanged(before, snapshot(ns))


# -- what must keep working next to the errors above ---------------------------------------------


def test_an_error_at_a_later_micro_batch_leaves_no_partial_work() -> None:
    """Micro-batch 2 returns a bad tree (case accumulate-grads-missing-key-at-micro-batch-2):
    it stops there, and the next call starts afresh."""
    fn = bad_tree_at_micro_batch(2)
    step = gradaccum.accumulate(fn, 4)
    p, batch = params(), (x(), y())
    with pytest.raises(ValueError, match="do not match the params tree"):
        step(p, batch)
    assert fn.seen == [1, 2]  # type: ignore[attr-defined]
    got = step(p, batch)  # micro-batches 3 to 6 of the step function: all good
    assert all(torch.equal(got[k], torch.ones_like(p[k])) for k in p)


def test_a_fresh_state_may_be_reused() -> None:
    """A state from init holds no sums: adding to it twice gives two independent windows."""
    acc = gradaccum.Accumulator(n=2)
    state0 = acc.init(params())
    a = acc.add(state0, grads(1.0), size=1)
    b = acc.add(state0, grads(3.0), size=1)
    ga, _ = acc.finalize(a)
    gb, nxt = acc.finalize(b)
    assert torch.equal(ga["w"], torch.full((3,), 1.0, dtype=F64))
    assert torch.equal(gb["w"], torch.full((3,), 3.0, dtype=F64))
    # The state finalize returns is fresh too, and usable.
    g, _ = acc.finalize(acc.add(nxt, grads(2.0), size=2))
    assert torch.equal(g["b"], torch.tensor(2.0, dtype=F64))
    assert torch.equal(ga["w"], torch.full((3,), 1.0, dtype=F64))  # earlier results unchanged


def test_the_returned_state_goes_on_after_a_refused_consumed_one() -> None:
    acc = gradaccum.Accumulator(n=2)
    state1 = acc.add(acc.init(params()), grads(1.0), size=1)
    state2 = acc.add(state1, grads(3.0), size=1)
    with pytest.raises(ValueError, match="consumed"):
        acc.add(state1, grads(5.0), size=1)
    g, _ = acc.finalize(state2)
    assert torch.equal(g["w"], torch.full((3,), 2.0, dtype=F64))


def test_a_count_window_holding_no_items_yet_saves_and_loads() -> None:
    """Under reduction='count' a weight of 0 mid-window is legitimate (all padding so far)."""
    acc = gradaccum.Accumulator(n=4, reduction="count")
    state = acc.add(acc.init(params()), grads(), count=0)
    restored = acc.load_state_dict(acc.init(params()), acc.state_dict(state))
    assert (restored.micro_step, restored.weight) == (1, 0)
    tensor_count = acc.add(acc.init(params()), grads(), count=torch.tensor(0))
    restored = acc.load_state_dict(acc.init(params()), acc.state_dict(tensor_count))
    assert restored.micro_step == 1
    assert int(restored.weight) == 0


def test_call_module_with_a_frozen_parameter_left_out() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).to(F64)
    model[0].bias.requires_grad_(False)
    params = gradaccum.params_of(model)
    assert "0.bias" not in params
    xs = torch.ones(4, 2, dtype=F64)
    out, new_buffers = gradaccum.call_module(model, params, gradaccum.buffers_of(model), xs)
    assert torch.equal(out, model(xs))
    assert sorted(new_buffers) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]


def test_call_module_strict_false_accepts_a_misspelled_key() -> None:
    lin = linear()["module"]
    xs = torch.ones(3, 2, dtype=F64)
    bad = {"weigth": torch.zeros(1, 2, dtype=F64), "bias": torch.zeros(1, dtype=F64)}
    out, _ = gradaccum.call_module(lin, bad, {}, xs, strict=False)
    assert torch.equal(out, xs @ lin.weight.detach().T)  # the module's own weight, bias 0


def test_params_of_again_after_moving_the_module() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 1)
    gradaccum.params_of(lin)
    lin.double()
    params = gradaccum.params_of(lin)
    xs = torch.ones(4, 2, dtype=F64)
    out, _ = gradaccum.call_module(lin, params, {}, xs)
    assert out.dtype == F64
    assert torch.equal(out, lin(xs))


def test_loss_scale_state_loads_with_weights_only() -> None:
    state = gradaccum.boundary.LossScale(init_scale=256.0).init()
    buffer = io.BytesIO()
    torch.save({"loss_scale": state, "step": 3}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["loss_scale"] == state
    assert isinstance(loaded["loss_scale"], gradaccum.boundary.LossScaleState)


def test_the_error_class_is_named_where_it_is_imported_from() -> None:
    import pickle
    import traceback

    err = gradaccum.GradAccumError("f(x): went wrong; pass y.")
    assert type(err).__module__ == "gradaccum"
    assert "gradaccum.GradAccumError: f(x): went wrong" in "".join(
        traceback.format_exception_only(type(err), err)
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is gradaccum.GradAccumError
    assert str(back) == str(err)
