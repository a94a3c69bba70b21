"""Sharded params and their optimizer state in ``torch.distributed.checkpoint`` (DCP).

Each bucket of a [`Sharded`][gradaccum.sharding.Sharded] is saved as one 1-D DTensor: the bucket's
leaves, unpadded, sharded on dim 0 over the shard group as ``torch.chunk`` cuts it (which is how
gradaccum cuts a bucket). Its global shape does not depend on the number of ranks, so DCP
reshards it on load: a checkpoint taken on 4 ranks loads on 2 and the other way round.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._errors import GradAccumError, describe
from ..sharding._fsdp import placements
from ..sharding._sharded import Sharded

__all__ = ["ShardedCheckpoint", "dcp_checkpoint"]

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
