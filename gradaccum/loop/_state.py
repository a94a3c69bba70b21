"""A ``gradaccum.loop.Step``'s state as a checkpoint, checked whole before any of it is applied.

[`Step.state_dict()`][gradaccum.loop.Step.state_dict] holds, besides the model's, optimizer's
and scheduler's own state dicts and the window in progress, what a resume must match: the
optimizer's and scheduler's classes, the model's parameter names in each optimizer group (in
order), and the reduction. ``prepare`` compares all of it
with the live step and builds the restored window without changing anything, and returns the
function that applies it: a refused load leaves the model, optimizer, scheduler and window as
they were. ``gradaccum.loop.load`` agrees over the ranks between the two.

``checkpoint`` is ``Step.state_dict()``; ``restore`` is ``Step.load_state_dict()``: the format
(``FORMAT``) checked, then ``prepare`` and what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._errors import GradAccumError, describe, dtype_name

__all__ = ["FORMAT", "checkpoint", "kind", "optimizer_params", "prepare", "restore"]

FORMAT = "gradaccum.loop.Step/2"
REBUILD = "build the Step as the one that was saved"
KEYS = (
    "model",
    "optimizer",
    "optimizer_kind",
    "optimizer_params",
    "scheduler",
    "scheduler_kind",
    "reduction",
    "accumulator",
)


def kind(obj: Any) -> str:
    """The class of ``obj`` as ``module.QualName`` (what a checkpoint records)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _names(saved: str, mine: str) -> tuple[str, str]:
    """Two classes by their names, with their modules when the names alone are the same."""
    a, b = saved.rsplit(".", 1)[-1], mine.rsplit(".", 1)[-1]
    return (saved, mine) if a == b else (a, b)


def optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The model's name of each parameter in each of the optimizer's groups, in order."""
    names = {id(p): k for k, p in model.named_parameters()}
    return [
        [names.get(id(p), f"<tensor {i}, not a parameter of the model>") for i, p in enumerate(g)]
        for g in (group["params"] for group in optimizer.param_groups)
    ]


def _few(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return f"[{shown}{', ...' if len(names) > 5 else ''}] ({len(names)})"


def _tensor(t: torch.Tensor) -> str:
    return f"a {dtype_name(t.dtype)} tensor of shape {tuple(t.shape)}"


def _check_model(where: str, model: torch.nn.Module, saved: dict[str, Any]) -> None:
    mine = model.state_dict()
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"this model has entries the checkpoint lacks: {_few(missing)}")
        if extra:
            parts.append(f"the checkpoint has entries this model lacks: {_few(extra)}")
        raise ValueError(
            f"{where}: the checkpoint's model does not fit this model: {'; '.join(parts)}; "
            f"build the model as the one that was saved."
        )
    for key, value in mine.items():
        got = saved[key]
        if not isinstance(value, torch.Tensor):
            continue
        if (
            not isinstance(got, torch.Tensor)
            or got.shape != value.shape
            or got.dtype != value.dtype
        ):
            was = _tensor(got) if isinstance(got, torch.Tensor) else describe(got)
            raise ValueError(
                f"{where}: the checkpoint's model does not fit this model: {key!r} is {was} "
                f"in the checkpoint, but {_tensor(value)} in this model; build the model as "
                f"the one that was saved (the same shapes and dtype)."
            )


def _check_optimizer(where: str, step: Any, sd: dict[str, Any]) -> None:
    saved_kind, mine = sd["optimizer_kind"], kind(step.optimizer)
    if saved_kind != mine:
        a, b = _names(saved_kind, mine)
        raise ValueError(
            f"{where}: the checkpoint's optimizer is {a}, this one {b}; its state (momentum, "
            f"moments) holds only for the optimizer it came from: build the optimizer as "
            f"{a}(...), as in the run that was saved."
        )
    saved, here = sd["optimizer_params"], optimizer_params(step.model, step.optimizer)
    if len(saved) != len(here):
        raise ValueError(
            f"{where}: the checkpoint's optimizer has {len(saved)} parameter group(s), this one "
            f"{len(here)}; build the optimizer over the same parameter groups as the one that "
            f"was saved."
        )
    for g, (was, now) in enumerate(zip(saved, here)):
        if list(was) != now:
            raise ValueError(
                f"{where}: the optimizer's parameter group {g} holds {_few(now)}, but the "
                f"checkpoint's held {_few(list(was))}; build the optimizer over the same "
                f"parameters, in the same groups and order, as the one that was saved."
            )
    groups = sd["optimizer"].get("param_groups")
    if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
        len(g) for g in here
    ]:
        raise GradAccumError(
            f"{where}: the checkpoint's optimizer state does not list the parameters its "
            f"optimizer_params name; the file was changed after it was saved: resume from a "
            f"checkpoint that gradaccum.loop.save() wrote."
        )


def _check_scheduler(where: str, step: Any, sd: dict[str, Any]) -> None:
    saved, sched = sd["scheduler"], step.scheduler
    if (saved is None) != (sched is None):
        raise ValueError(
            f"{where}: the saved step {'has no' if saved is None else 'has a'} scheduler, this "
            f"one {'has one' if sched is not None else 'has none'}; {REBUILD}."
        )
    if sched is not None and sd["scheduler_kind"] != kind(sched):
        a, b = _names(sd["scheduler_kind"], kind(sched))
        raise ValueError(
            f"{where}: the checkpoint's scheduler is {a}, this one {b}; build the scheduler "
            f"as {a}(...), as in the run that was saved."
        )


def _name(path: str) -> str:
    """``"['0.weight']"`` (an accumulator's key path) as ``0.weight``."""
    return path[2:-2] if path.startswith("['") and path.endswith("']") else path


def _check_window(where: str, step: Any, sd: dict[str, Any]) -> Any:
    if sd["reduction"] != step.reduction:
        raise ValueError(
            f"{where}: the checkpoint's Step has reduction={sd['reduction']!r}, this one "
            f"reduction={step.reduction!r}; the window's running sums hold for the reduction "
            f"they were taken with: build the Step with reduction={sd['reduction']!r}."
        )
    acc = sd["accumulator"]
    if isinstance(acc, dict) and step.reduction == "mean" and acc.get("reduction") == "mean":
        # Saved before issue 35, when a "mean" Step's accumulator was "mean": its sums (each
        # micro-batch's gradient times its rows) and weight (the rows) are what "count" holds.
        acc = {**acc, "reduction": "count"}
    paths = acc.get("paths") if isinstance(acc, dict) else None
    if isinstance(paths, list):
        saved = [_name(str(p)) for p in paths]
        here = [_name(p) for p in step.state.layout.paths]
        if saved != here:
            gone = [k for k in saved if k not in here]
            new = [k for k in here if k not in saved]
            diff = []
            if gone:
                diff.append(f"{_few(gone)} not trained here (requires_grad=False)")
            if new:
                diff.append(f"{_few(new)} trained here only")
            raise ValueError(
                f"{where}: the checkpoint's step trained {len(saved)} parameter(s), this one "
                f"{len(here)}: {'; '.join(diff) or 'in another order'}; set requires_grad as "
                f"in the run that was saved, before building the Step."
            )
    try:
        return step.acc.load_state_dict(step.state, acc)
    except GradAccumError as err:
        raise GradAccumError(
            f"{where}: the checkpoint's window in progress does not load: {err}"
        ) from err


def _check_fields(where: str, sd: Any) -> dict[str, Any]:
    missing = [k for k in KEYS if k not in sd]
    if missing:
        raise GradAccumError(
            f"{where}: the saved step lacks {missing}; pass what Step.state_dict() returned."
        )
    kinds = (
        ("model", dict),
        ("optimizer", dict),
        ("optimizer_kind", str),
        ("optimizer_params", list),
        ("reduction", str),
        ("accumulator", dict),
    )
    for key, want in kinds:
        if not isinstance(sd[key], want):
            raise GradAccumError(
                f"{where}: the saved step's {key} must be a {want.__name__}, got "
                f"{describe(sd[key])}; pass what Step.state_dict() returned."
            )
    if sd["scheduler"] is not None and not isinstance(sd["scheduler_kind"], str):
        raise GradAccumError(
            f"{where}: the saved step has a scheduler but its scheduler_kind is "
            f"{describe(sd['scheduler_kind'])}; pass what Step.state_dict() returned."
        )
    return dict(sd)


def prepare(where: str, step: Any, state_dict: dict[str, Any]) -> Callable[[], None]:
    """Check ``state_dict`` (a ``Step.state_dict()``, format already checked) against ``step``.

    Everything is compared, and the window in progress rebuilt, before anything changes.

    Returns:
        The function that applies it all: the model, the optimizer, the scheduler, the window.

    Raises:
        ValueError: The checkpoint's model, optimizer, scheduler or reduction is not this
            step's (the message names the difference).
        GradAccumError: The state dict is damaged or its window does not load.
    """
    sd = _check_fields(where, state_dict)
    _check_model(where, step.model, sd["model"])
    _check_optimizer(where, step, sd)
    _check_scheduler(where, step, sd)
    restored = _check_window(where, step, sd)

    def commit() -> None:
        step.model.load_state_dict(sd["model"])
        step.optimizer.load_state_dict(sd["optimizer"])
        if step.scheduler is not None:
            step.scheduler.load_state_dict(sd["scheduler"])
        step._micro.drop()  # the window in progress, if any, is replaced by the checkpoint's
        step.state = restored
        step._saves = 0  # the saves since the last boundary: none, on every rank

    return commit


def checkpoint(step: Any) -> dict[str, Any]:
    """``Step.state_dict()``: the state dicts, what a resume must match, the window's sums.

    Under a deferred sync the last window's checks are read first (``sync.verify()``): a
    checkpoint is never taken of a window that failed on another rank.
    """
    if step.sync is not None and step.sync.defer:
        step.sync.verify()
    return {
        "format": FORMAT,
        "model": step.model.state_dict(),
        "optimizer": step.optimizer.state_dict(),
        "optimizer_kind": kind(step.optimizer),
        "optimizer_params": optimizer_params(step.model, step.optimizer),
        "scheduler": None if step.scheduler is None else step.scheduler.state_dict(),
        "scheduler_kind": None if step.scheduler is None else kind(step.scheduler),
        "reduction": step.reduction,
        "accumulator": step.acc.state_dict(step.state),
    }


def restore(step: Any, state_dict: dict[str, Any]) -> None:
    """``Step.load_state_dict(state_dict)``: its format checked, then all of it or nothing."""
    sd = state_dict
    where = "Step.load_state_dict(state_dict)"
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        got = sd.get("format") if isinstance(sd, dict) else None
        if isinstance(got, str) and got.startswith("gradaccum.loop.Step/"):
            raise ValueError(
                f"{where}: the state has format {got!r}, but this gradaccum reads "
                f"{FORMAT!r}; load it with the gradaccum version that saved it."
            )
        raise ValueError(
            f"{where}: expected a dict with format {FORMAT!r}, got {describe(sd)}; pass "
            f"what Step.state_dict() returned."
        )
    prepare(where, step, sd)()
