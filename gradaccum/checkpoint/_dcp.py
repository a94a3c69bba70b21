"""Sharded params and their optimizer state in ``torch.distributed.checkpoint`` (DCP).

Each bucket of a [`Sharded`][gradaccum.sharding.Sharded] is saved as one 1-D DTensor: the bucket's
leaves, unpadded, sharded on dim 0 over the shard group as ``torch.chunk`` cuts it (which is how
gradaccum cuts a bucket). Its global shape does not depend on the number of ranks, so DCP
reshards it on load: a checkpoint taken on 4 ranks loads on 2 and the other way round.

[`dcp_save()`][gradaccum.checkpoint.dcp_save] and [`dcp_load()`][gradaccum.checkpoint.dcp_load]
save and load the shards, the optimizer state and an accumulator's window, one call each way.
The params and optimizer state go through ``dcp_checkpoint()`` (resharded on load). A window in
progress is per rank: each of its tensors is saved as one row of a DTensor with a row per rank
of the mesh, so it loads on the same ranks only.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

from .. import _metrics
from .._errors import GradAccumError, describe
from ..sharding._fsdp import placements
from ..sharding._sharded import Sharded

__all__ = ["ShardedCheckpoint", "dcp_checkpoint", "dcp_load", "dcp_save"]

FORMAT = "gradaccum.Sharded.dcp/1"


class ShardedCheckpoint:
    """Sharded params (and an optimizer's state on them) for ``torch.distributed.checkpoint``.

    Make one with [`dcp_checkpoint()`][gradaccum.checkpoint.dcp_checkpoint] and put it in the dict
    given to ``dcp.save`` / ``dcp.load``, which call its ``state_dict`` and
    ``load_state_dict`` (DCP's ``Stateful`` protocol).

    Examples:
        >>> import tempfile, torch, torch.distributed as dist, gradaccum
        >>> import torch.distributed.checkpoint as dcp
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sharded = gradaccum.shard({"w": torch.ones(3)})
        >>> path = tempfile.mkdtemp()
        >>> state = {"train": gradaccum.checkpoint.dcp_checkpoint(sharded)}
        >>> _ = dcp.save(state, checkpoint_id=path)
        >>> other = gradaccum.shard({"w": torch.zeros(3)})
        >>> dcp.load({"train": gradaccum.checkpoint.dcp_checkpoint(other)}, checkpoint_id=path)
        >>> other.gather()["w"]
        tensor([1., 1., 1.])
        >>> dist.destroy_process_group()
    """

    def __init__(self, sharded: Sharded, optimizer: torch.optim.Optimizer | None) -> None:
        self.sharded, self.optimizer = sharded, optimizer
        sp = sharded
        self._mesh = sp.mesh if sp.mesh is not None else _mesh_of(sp.group)
        self._placements = placements(self._mesh.ndim)

    def _layout(self) -> list[str]:
        """What must match on load: leaves, groups, bucket_mb (not the number of ranks)."""
        sp = self.sharded
        lines = [d for d in sp.plan.description if d.startswith("params leaf ")]
        return [*lines, f"bucket_mb={sp.bucket_mb}"]

    def _dtensors(self, flat: torch.Tensor, s: int) -> dict[str, Any]:
        """Shard tensor ``s`` (or a tensor shaped like it) as one DTensor per bucket."""
        from torch.distributed.tensor import DTensor

        sp, out = self.sharded, {}
        for k, b in enumerate(sp.plan.buckets):
            if b.shard != s:
                continue
            (last, off) = (b.members[-1], b.offsets[-1])
            total = off + sp.layout.shapes[last].numel()
            mine = max(0, min(b.chunk, total - sp.rank * b.chunk))
            local = flat[b.start : b.start + mine].clone()  # loaded into, checked, then copied
            out[f"bucket{k}"] = DTensor.from_local(
                local,
                self._mesh,
                self._placements,
                run_check=False,
                shape=torch.Size([total]),
                stride=(1,),
            )
        return out

    def _write(self, flat: torch.Tensor, s: int, loaded: dict[str, Any]) -> None:
        """Copy the loaded DTensors' local rows back into ``flat`` (shard tensor ``s``)."""
        for k, b in enumerate(self.sharded.plan.buckets):
            if b.shard == s:
                local = loaded[f"bucket{k}"].to_local()
                flat[b.start : b.start + local.numel()].copy_(local)

    def state_dict(self) -> dict[str, Any]:
        """The DCP state: one DTensor per bucket, the optimizer's state likewise."""
        sp = self.sharded
        out: dict[str, Any] = {"format": FORMAT, "layout": self._layout()}
        out["params"] = {
            k: v for s, t in enumerate(sp.shards) for k, v in self._dtensors(t, s).items()
        }
        opt = self.optimizer
        if opt is not None:
            if not opt.state:
                _init_state(opt)
            index = {id(t): s for s, t in enumerate(sp.shards)}
            state: dict[str, Any] = {}
            for p, st in opt.state.items():
                s = index[id(p)]
                for name, v in st.items():
                    key = f"shard{s}.{name}"
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.ndim == 1:
                        state[key] = self._dtensors(v, s)
                    else:
                        state[key] = v.clone() if isinstance(v, torch.Tensor) else v
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            out["optimizer"] = {"state": state, "param_groups": groups}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check what DCP loaded (in place, into the shards and the optimizer's state)."""
        where = "ShardedCheckpoint.load_state_dict(state_dict)"
        if state_dict.get("format") != FORMAT:
            raise GradAccumError(
                f"{where}: expected a checkpoint of format {FORMAT!r}, got "
                f"{describe(state_dict.get('format'))}; load what dcp_checkpoint() saved."
            )
        mine, saved = self._layout(), list(state_dict.get("layout") or [])
        if saved != mine:
            diff = next((f"{a!r} here but {b!r} saved" for a, b in zip(mine, saved) if a != b), "")
            diff = diff or "a different number of leaves"
            raise GradAccumError(
                f"{where}: the checkpoint was saved for another sharded layout ({diff}); shard "
                f"the same params with the same param_groups and bucket_mb as when it was saved "
                f"(on any number of ranks)."
            )
        with torch.no_grad():
            for t, shard in enumerate(self.sharded.shards):
                self._write(shard, t, state_dict["params"])
            opt = self.optimizer
            if opt is None:
                return
            for g, loaded in zip(opt.param_groups, state_dict["optimizer"]["param_groups"]):
                g.update(loaded)
            index = {id(t): i for i, t in enumerate(self.sharded.shards)}
            for p, st in opt.state.items():
                s = index[id(p)]
                for name, v in list(st.items()):
                    got = state_dict["optimizer"]["state"][f"shard{s}.{name}"]
                    if isinstance(got, dict):
                        self._write(v, s, got)
                    elif isinstance(v, torch.Tensor) and isinstance(got, torch.Tensor):
                        v.copy_(got)
                    else:
                        st[name] = got


def dcp_checkpoint(
    sharded: Sharded, optimizer: torch.optim.Optimizer | None = None
) -> ShardedCheckpoint:
    """Sharded params and an optimizer's state on them, for ``torch.distributed.checkpoint``.

    Each bucket is saved as one DTensor of the bucket's unpadded length, so DCP reshards on
    load: a checkpoint saved on 4 ranks loads on 2 and the other way round, with the same
    params, ``param_groups`` and ``bucket_mb``. The optimizer must step on
    ``sharded.shards``; a fresh one gets its state created (one step with ``lr=0`` on zero
    gradients, as ``torch.distributed.checkpoint.state_dict`` does) before it is loaded.

    Args:
        sharded: What [`shard()`][gradaccum.shard] returned (not an FSDP2 model's shards:
            checkpoint those with DCP's own ``get_state_dict``).
        optimizer: An optimizer over ``sharded.shards``, or ``None``.

    Returns:
        A [`ShardedCheckpoint`][gradaccum.checkpoint.ShardedCheckpoint]: a value for the dict given
        to ``dcp.save`` and ``dcp.load``.

    Raises:
        GradAccumError: ``sharded`` holds an FSDP2 model's parameters.
        ValueError: ``optimizer`` steps on tensors that are not ``sharded.shards``.

    Examples:
        One process ([`ShardedCheckpoint`][gradaccum.checkpoint.ShardedCheckpoint] loads too):

        >>> import tempfile, torch, torch.distributed as dist, gradaccum
        >>> import torch.distributed.checkpoint as dcp
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> sharded = gradaccum.shard({"w": torch.ones(3)})
        >>> opt = torch.optim.AdamW(sharded.shards, lr=0.1)
        >>> ckpt = gradaccum.checkpoint.dcp_checkpoint(sharded, opt)
        >>> sorted(ckpt.state_dict())
        ['format', 'layout', 'optimizer', 'params']
        >>> _ = dcp.save({"train": ckpt}, checkpoint_id=tempfile.mkdtemp())
        >>> dist.destroy_process_group()

        In a training loop:

        ```python
        import torch.distributed.checkpoint as dcp

        ckpt = gradaccum.checkpoint.dcp_checkpoint(sharded, opt)
        dcp.save({"train": ckpt}, checkpoint_id="ckpt/step100")
        # later, on any number of ranks, with sharded and opt built the same way:
        ckpt = gradaccum.checkpoint.dcp_checkpoint(sharded, opt)
        dcp.load({"train": ckpt}, checkpoint_id="ckpt/step100")
        ```
    """
    where = "dcp_checkpoint(sharded, optimizer)"
    if not isinstance(sharded, Sharded):
        raise TypeError(
            f"{where}: sharded must be what gradaccum.shard() returned, got "
            f"{describe(sharded)}; pass sharded = gradaccum.shard(params)."
        )
    if sharded.fsdp is not None:
        raise GradAccumError(
            f"{where}: these shards are an FSDP2 model's parameters; checkpoint the model and "
            f"optimizer with torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)."
        )
    if optimizer is not None:
        mine = {id(t) for t in sharded.shards}
        others = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
        if others:
            raise ValueError(
                f"{where}: the optimizer steps on {len(others)} tensor(s) that are not "
                f"sharded.shards; build it on sharded.shards (or sharded.group_shards(name))."
            )
    return ShardedCheckpoint(sharded, optimizer)


def _mesh_of(group: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    pg: Any = dist.group.WORLD if group is None else group
    return DeviceMesh.from_group(pg, "cpu" if dist.get_backend(pg) == "gloo" else "cuda")


def _init_state(opt: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state: one step with ``lr=0`` on zero gradients."""
    saved = [g["lr"] for g in opt.param_groups]
    params = [p for g in opt.param_groups for p in g["params"]]
    try:
        for g in opt.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, saved):
            g["lr"] = lr
        for p in params:
            p.grad = None


# -- one call each way, with an accumulator's window in progress ------------------------------
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
