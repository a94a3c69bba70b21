"""Save and load shards, optimizer state and an accumulator's window with DCP, one call each way.

The params and optimizer state go through [`dcp_checkpoint()`][gradaccum.checkpoint.dcp_checkpoint]
(resharded on load). A window in progress is per rank: each of its tensors is saved as one row
of a DTensor with a row per rank of the mesh, so it loads on the same ranks only.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from .. import _metrics
from .._errors import GradAccumError
from ..sharding._sharded import Sharded
from ._dcp import dcp_checkpoint

__all__ = ["dcp_load", "dcp_save"]


def _per_rank(mesh: Any, local: torch.Tensor) -> Any:
    """This rank's row of a tensor with one row per rank of ``mesh`` (every dim sharded)."""
    from torch.distributed.tensor import DTensor, Shard

    view = local.reshape((1,) * mesh.ndim + (-1,))
    shape = torch.Size([*mesh.shape, local.numel()])
    place = [Shard(d) for d in range(mesh.ndim)]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(view, mesh, place, run_check=False, shape=shape, stride=stride)


def dcp_save(
    checkpoint_id: Any,
    sharded: Sharded,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    accumulator: Any = None,
    state: Any = None,
) -> None:
    """Save the shards, an optimizer's state and an accumulator's window with DCP.

    The params and optimizer state are saved as by
    [`dcp_checkpoint()`][gradaccum.checkpoint.dcp_checkpoint] (they reshard on load). A window in
    progress (``state`` of an [`Accumulator`][gradaccum.Accumulator] with a
    [`reduce_scatter()`][gradaccum.reduce_scatter] sync) is saved per rank: it resumes
    bit-identically on the same ranks; between windows, on any number.

    Args:
        checkpoint_id: Where to save (a directory), as for ``torch.distributed.checkpoint.save``.
        sharded: What [`shard()`][gradaccum.shard] returned. For an FSDP2 model's shards,
            only the accumulator is saved here: save the model and its optimizer with DCP's
            ``get_state_dict`` (and pass ``optimizer=None``).
        optimizer: An optimizer over ``sharded.shards``, or ``None``.
        accumulator: The [`Accumulator`][gradaccum.Accumulator] whose ``state`` to save, or
            ``None``.
        state: Its current state (with ``accumulator``).

    Examples:
        >>> import tempfile, torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sharded = gradaccum.shard({"w": torch.ones(3)})
        >>> opt = torch.optim.AdamW(sharded.shards, lr=0.1)
        >>> acc = gradaccum.Accumulator(2, sync=gradaccum.reduce_scatter(sharded))
        >>> state = acc.add(acc.init(sharded), {"w": torch.ones(3)}, size=1)  # mid-window
        >>> path = tempfile.mkdtemp()
        >>> gradaccum.checkpoint.dcp_save(path, sharded, opt, accumulator=acc, state=state)
        >>> dist.destroy_process_group()

        [`dcp_load()`][gradaccum.checkpoint.dcp_load] reads it back.
    """
    from torch.distributed.checkpoint import state_dict_saver

    ckpt, mesh = _parts("dcp_save(checkpoint_id, sharded, optimizer, ...)", sharded, optimizer)
    out: dict[str, Any] = {} if ckpt is None else {"train": ckpt}
    if accumulator is not None:
        sd = accumulator.state_dict(state)
        w = sd["weight"]
        metrics = sd.get("metrics") or {}  # the window's metric sums ride with the counters
        counters = [float(w), float(isinstance(w, torch.Tensor)), sd["micro_step"], sd["steps"]]
        counters += [float(x) for v in metrics.values() for x in v.reshape(-1).tolist()]
        mid = sd["full"] is not None
        bufs = [*(sd["full"] or []), *(sd["out"] or [])]
        out["accumulator"] = {
            "meta": json.dumps(  # one value, not a dict: the loader cannot know its keys
                {
                    **{k: sd[k] for k in ("format", "reduction", "policies", "accum_dtypes")},
                    "window": sd["window"],
                    "epoch": sd.get("epoch", 0),
                    "metrics": list(metrics),
                    "metric_shapes": [list(v.shape) for v in metrics.values()],
                    "world": list(mesh.shape),
                    "mid_window": mid,
                    "buffers": [None if b is None else [str(b.dtype), b.numel()] for b in bufs],
                    "full": len(sd["full"] or []),
                }
            ),
            "counters": _per_rank(mesh, torch.tensor(counters, dtype=torch.float64)),
            "buffers": {f"b{i}": _per_rank(mesh, b) for i, b in enumerate(bufs) if b is not None},
        }
    state_dict_saver.save(out, checkpoint_id=checkpoint_id)


def dcp_load(
    checkpoint_id: Any,
    sharded: Sharded,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    accumulator: Any = None,
) -> Any:
    """Load what [`dcp_save()`][gradaccum.checkpoint.dcp_save] saved; return the accumulator state.

    The params and optimizer state are resharded to this world. The window that was in
    progress is restored on the same ranks (bit-identical); saved between windows, the
    accumulator resumes on any number of ranks at the next window.

    Args:
        checkpoint_id: Where it was saved.
        sharded: Shards of the same params, ``param_groups`` and ``bucket_mb``.
        optimizer: An optimizer over ``sharded.shards`` (its state is replaced), or ``None``.
        accumulator: The [`Accumulator`][gradaccum.Accumulator] to resume, or ``None``.

    Returns:
        The accumulator's state (``None`` without ``accumulator``).

    Raises:
        GradAccumError: The checkpoint is of another layout, or it holds a window in progress
            and this world differs from the one that saved it.

    Examples:
        >>> import tempfile, torch, torch.distributed as dist, gradaccum
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> def build(value):
        ...     sharded = gradaccum.shard({"w": torch.full((3,), value)})
        ...     opt = torch.optim.AdamW(sharded.shards, lr=0.1)
        ...     sync = gradaccum.reduce_scatter(sharded)
        ...     return sharded, opt, gradaccum.Accumulator(2, sync=sync)
        >>> sharded, opt, acc = build(1.0)
        >>> state = acc.add(acc.init(sharded), {"w": torch.ones(3)}, size=1)
        >>> path = tempfile.mkdtemp()
        >>> gradaccum.checkpoint.dcp_save(path, sharded, opt, accumulator=acc, state=state)
        >>> sharded, opt, acc = build(0.0)  # elsewhere: other values, the same layout
        >>> state = gradaccum.checkpoint.dcp_load(path, sharded, opt, accumulator=acc)
        >>> sharded.gather()["w"], state.micro_step
        (tensor([1., 1., 1.]), 1)
        >>> dist.destroy_process_group()
    """
    from torch.distributed.checkpoint import state_dict_loader

    where = "dcp_load(checkpoint_id, sharded, optimizer, accumulator=...)"
    ckpt, mesh = _parts(where, sharded, optimizer)
    meta: dict[str, Any] = {}
    if accumulator is not None:  # first what it holds: refuse before anything is loaded
        head: dict[str, Any] = {"accumulator": {"meta": ""}}
        state_dict_loader.load(head, checkpoint_id=checkpoint_id)
        meta = json.loads(head["accumulator"]["meta"])
        if meta.get("mid_window") and meta["world"] != list(mesh.shape):
            raise GradAccumError(
                f"{where}: the checkpoint holds a window in progress, saved on a mesh of "
                f"{meta['world']} ranks, but this one is {list(mesh.shape)}; a window's running "
                f"sums are per rank. Resume it on {meta['world']} ranks, or save between windows "
                f"(after finalize) to change the number of ranks. Nothing was loaded."
            )
    if ckpt is not None:
        state_dict_loader.load({"train": ckpt}, checkpoint_id=checkpoint_id)
    if accumulator is None:
        return None
    names = meta.get("metrics", [])
    shapes = [tuple(s) for s in meta.get("metric_shapes", [()] * len(names))]
    fresh = accumulator.init(sharded, metrics=dict(zip(names, shapes)))
    width = sum(math.prod(s) for s in shapes)
    if not meta.get("mid_window"):
        return fresh._replace(window=meta["window"], epoch=meta.get("epoch", 0))
    counters = _per_rank(mesh, torch.zeros(4 + width, dtype=torch.float64))
    bufs = {
        f"b{i}": _per_rank(mesh, torch.zeros(n, dtype=getattr(torch, d.removeprefix("torch."))))
        for i, spec in enumerate(meta["buffers"])
        if spec is not None
        for d, n in [spec]
    }
    body = {"accumulator": {"counters": counters, "buffers": bufs}}
    state_dict_loader.load(body, checkpoint_id=checkpoint_id)
    weight, is_tensor, micro_step, steps, *sums = counters.to_local().reshape(-1).tolist()
    flat = [
        None if spec is None else bufs[f"b{i}"].to_local().reshape(-1)
        for i, spec in enumerate(meta["buffers"])
    ]
    sd = {
        **{k: meta[k] for k in ("format", "reduction", "policies", "accum_dtypes")},
        **sharded.checkpoint_meta(),
        "weight": torch.tensor(weight, dtype=torch.float64)
        if is_tensor
        else (int(weight) if meta["reduction"] == "mean" else weight),
        "micro_step": int(micro_step),
        "window": meta["window"],
        "epoch": meta.get("epoch", 0),
        "steps": int(steps),
        "full": flat[: meta["full"]],
        "out": flat[meta["full"] :],
        "metrics": {
            k: torch.tensor(v, dtype=torch.float64)
            for k, v in _metrics.unpack(tuple(zip(names, shapes)), sums).items()
        }
        if names
        else None,
    }
    return accumulator.load_state_dict(fresh, sd)


def _parts(where: str, sharded: Sharded, optimizer: Any) -> tuple[Any, Any]:
    """The params' checkpoint (``None`` for an FSDP2 model's: DCP's own) and the mesh."""
    if sharded.fsdp is None:
        ckpt = dcp_checkpoint(sharded, optimizer)
        return ckpt, ckpt._mesh
    if optimizer is not None:
        raise ValueError(
            f"{where}: sharded holds an FSDP2 model's parameters; save and load the model and "
            f"its optimizer with torch.distributed.checkpoint's get_state_dict / set_state_dict, "
            f"and pass optimizer=None here (this call then keeps the accumulator's window)."
        )
    return None, sharded.mesh
