"""Checkpoints of an accumulator state: a dict of tensors, numbers and strings, validated on load.

``torch.save`` / ``torch.load(..., weights_only=True)`` safe, mid-window included.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .. import _tree
from .._errors import GradAccumError, describe, dtype_name

if TYPE_CHECKING:
    from .state import AccumState

__all__ = ["check_counters", "check_like", "check_meta", "check_progress", "load", "save"]

T = TypeVar("T")

FORMAT = "gradaccum.AccumState/1"


def save(reduction: str, state: AccumState[T]) -> dict[str, Any]:
    """The state as a dict; the running sums are copies."""
    lay = state.layout
    return {
        "format": FORMAT,
        "reduction": reduction,
        "paths": list(lay.paths),
        "shapes": [list(s) for s in lay.shapes],
        "dtypes": [dtype_name(d) for d in lay.dtypes],
        "accum_dtypes": [dtype_name(d) for d in lay.accum_dtypes],
        "sums": None if state.sums is None else [s.clone() for s in _tree.flatten(state.sums)[0]],
        "weight": state.weight,
        "micro_step": state.micro_step,
        "window": state.window,
        "epoch": state.epoch,
        "reduce_state": _tree.map_(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state.reduce_state
        ),
        "metrics": None
        if state.metrics is None
        else {k: v.clone() for k, v in state.metrics.items()},
    }


_FIELDS = "accum_dtypes dtypes micro_step paths reduction shapes sums weight window".split()
FIX = "; pass the dict that state_dict() returned (torch.load(path, weights_only=True))."


def _check_fields(where: str, sd: dict[str, Any]) -> None:
    """Check that a state dict has every field, of the right kind and length."""
    missing = [k for k in _FIELDS if k not in sd]
    if missing:
        raise GradAccumError(f"{where}: the state dict lacks the keys {missing}{FIX}")
    lists = (
        ("paths", "a list of key-path strings (e.g. \"['w']\")", "paths"),
        ("shapes", "a list of shapes, one per path", "shapes"),
        ("dtypes", "a list of dtype names, one per path", "dtypes"),
        ("accum_dtypes", "a list of dtype names, one per path", "accum_dtypes"),
        ("sums", "None or a list of tensors, one per path", "running sums"),
    )
    for key, what, _ in lists:
        value = sd[key]
        if key == "sums" and value is None:
            continue
        if not isinstance(value, (list, tuple)):
            raise GradAccumError(f"{where}: {key} must be {what}, got {describe(value)}{FIX}")
        bad = [p for p in value if not isinstance(p, str)] if key == "paths" else []
        if bad:
            got = f"a {type(value).__name__} holding {describe(bad[0])}"
            raise GradAccumError(f"{where}: {key} must be {what}, got {got}{FIX}")
    n = len(sd["paths"])
    for key, _, label in lists:
        if sd[key] is not None and len(sd[key]) != n:
            raise GradAccumError(
                f"{where}: the state dict has {n} paths but {len(sd[key])} {label}{FIX}"
            )
    check_counters(where, sd, ("micro_step", "window", *(("epoch",) if "epoch" in sd else ())), FIX)


def check_counters(where: str, sd: dict[str, Any], keys: tuple[str, ...], fix: str) -> None:
    """Check that the ``keys`` of a state dict are non-negative ints and its weight a number."""
    for key in keys:
        value = sd.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise GradAccumError(
                f"{where}: {key} must be a non-negative int, got {describe(value)}{fix}"
            )
    weight = sd.get("weight")
    if isinstance(weight, bool) or not (
        isinstance(weight, (int, float)) or (isinstance(weight, torch.Tensor) and weight.dim() == 0)
    ):
        raise GradAccumError(
            f"{where}: weight must be a number or a 0-dim tensor, got {describe(weight)}{fix}"
        )


def check_progress(where: str, reduction: str, sd: dict[str, Any], n: int, has_sums: bool) -> None:
    """Check a state dict's micro_step, weight and sums against each other and ``n``."""
    step = sd["micro_step"]
    if step > n:
        raise GradAccumError(
            f"{where}: micro_step is {step}, more than the window's n={n} micro-batches{FIX}"
        )
    if has_sums != (step > 0):
        raise GradAccumError(
            f"{where}: sums is {'present' if has_sums else 'None'} but micro_step is {step}: a "
            f"window holds running sums exactly when it holds a micro-batch{FIX}"
        )
    weight = sd["weight"]
    value = float(weight.item()) if isinstance(weight, torch.Tensor) else float(weight)
    # Each micro-batch adds at least one row under mean and sum; a count may be 0 (all padding).
    least = 0.0 if reduction == "count" else float(step)
    if not math.isfinite(value) or value < least or (step == 0 and value != 0):
        want = (
            "0 before the first micro-batch"
            if step == 0
            else f"a finite number >= {least:g} after {step} micro-batch(es) under "
            f"reduction={reduction!r}"
        )
        raise GradAccumError(f"{where}: weight is {value!r}, expected {want}{FIX}")


def load(
    reduction: str, state: AccumState[T], sd: dict[str, Any], n: int | None = None
) -> tuple[list[torch.Tensor] | None, Any]:
    """Validate ``sd`` completely against ``state``'s layout; return its sums and weight."""
    where, lay = "Accumulator.load_state_dict(state, state_dict)", state.layout
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise GradAccumError(
            f"{where}: expected a dict saved by Accumulator.state_dict (format {FORMAT!r}), got "
            f"{describe(sd) if not isinstance(sd, dict) else 'format ' + repr(sd.get('format'))}"
            f"{FIX}"
        )
    _check_fields(where, sd)
    if n is not None:
        check_progress(where, reduction, sd, n, sd["sums"] is not None)
    if sd["reduction"] != reduction:
        raise GradAccumError(
            f"{where}: the state was saved with reduction={sd['reduction']!r} but this "
            f"Accumulator has reduction={reduction!r}; load it into an Accumulator with the same "
            f"reduction."
        )
    saved_paths, paths = list(sd["paths"]), list(lay.paths)
    if saved_paths != paths:
        missing = [p for p in paths if p not in saved_paths]
        extra = [p for p in saved_paths if p not in paths]
        detail = (
            (f"params leaves {missing} are not in the saved state" if missing else "")
            + ("; " if missing and extra else "")
            + (f"saved leaves {extra} are not in the params" if extra else "")
        )
        raise GradAccumError(
            f"{where}: the saved state is for a different params tree: "
            f"{detail or 'the leaves are in a different order'}; load it for the same params "
            f"it was saved with."
        )
    sums = sd["sums"]
    for i, path in enumerate(paths):
        want_shape, want_dtype = list(lay.shapes[i]), dtype_name(lay.dtypes[i])
        if list(sd["shapes"][i]) != want_shape or sd["dtypes"][i] != want_dtype:
            raise GradAccumError(
                f"{where}: params leaf {path} is shape {want_shape} {want_dtype} but the state "
                f"was saved for shape {list(sd['shapes'][i])} {sd['dtypes'][i]}; load it for the "
                f"same params it was saved with."
            )
        if sums is not None and (
            not isinstance(sums[i], torch.Tensor)
            or list(sums[i].shape) != want_shape
            or sums[i].dtype != lay.accum_dtypes[i]
        ):
            raise GradAccumError(
                f"{where}: saved running sum for {path} is {describe(sums[i])}, expected shape "
                f"{want_shape} {dtype_name(lay.accum_dtypes[i])} (the accumulation dtype); save "
                f"and load with the same accum_dtype."
            )
    weight = sd["weight"]
    if isinstance(weight, torch.Tensor):
        weight = weight.to(lay.devices[0] if lay.devices else "cpu", copy=True)
    return sums, weight


def check_like(
    where: str,
    given: Any,
    shards: tuple[torch.Tensor, ...],
    what: str,
    error: type[Exception],
    fix: str,
) -> None:
    """Check that ``given`` is a list of tensors shaped and typed like ``shards``."""
    if not isinstance(given, (tuple, list)) or len(given) != len(shards):
        raise error(
            f"{where}: expected {len(shards)} tensors, one per shard, got {describe(given)}; {fix}."
        )
    for k, (t, s) in enumerate(zip(given, shards)):
        if not isinstance(t, torch.Tensor) or t.shape != s.shape or t.dtype != s.dtype:
            raise error(
                f"{where}: {what} {k} is {describe(t)}, expected shape {tuple(s.shape)} "
                f"{dtype_name(s.dtype)}; {fix}."
            )


def check_meta(where: str, sd: Any, fmt: str, meta: dict[str, Any]) -> None:
    """Check a sharded state dict's format, world size, rank and layout against ``meta``."""
    fix = "pass the dict that state_dict() returned on this rank"
    if not isinstance(sd, dict) or sd.get("format") != fmt:
        got = describe(sd) if not isinstance(sd, dict) else f"format {sd.get('format')!r}"
        raise GradAccumError(f"{where}: expected a dict of format {fmt!r}, got {got}; {fix}.")
    if sd.get("world") != meta["world"]:
        raise GradAccumError(
            f"{where}: the state was saved with world size {sd.get('world')!r} but this group "
            f"has {meta['world']} ranks, and these per-rank files cannot be resharded. Resume "
            f"with world size {sd.get('world')!r}, or save with torch.distributed.checkpoint "
            f"through gradaccum.checkpoint.dcp_checkpoint(sharded, optimizer), which reshards."
        )
    if sd.get("rank") != meta["rank"]:
        raise GradAccumError(
            f"{where}: the state was saved by rank {sd.get('rank')!r} but this is rank "
            f"{meta['rank']}; each rank must load its own file (e.g. f'ckpt/rank{{rank}}.pt')."
        )
    saved = list(sd.get("description") or [])
    if saved != meta["description"] or sd.get("bucket_mb") != meta["bucket_mb"]:
        mine = meta["description"]
        diff = next(
            (f"{a!r} here but {b!r} saved" for a, b in zip(mine, saved) if a != b),
            f"bucket_mb={meta['bucket_mb']} here but {sd.get('bucket_mb')!r} saved"
            if sd.get("bucket_mb") != meta["bucket_mb"]
            else f"{len(mine)} layout lines here but {len(saved)} saved",
        )
        raise GradAccumError(
            f"{where}: the state was saved for another sharded layout: {diff}; shard the same "
            f"params with the same param_groups and bucket_mb as when it was saved."
        )
