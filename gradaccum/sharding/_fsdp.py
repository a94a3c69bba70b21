"""FSDP2 models: their DTensor parameters read as a sharded layout, and their hooks kept quiet.

FSDP2's ``fully_shard`` keeps rank ``r``'s rows ``[r * c, (r + 1) * c)`` of each parameter, ``c =
ceil(rows / world)`` (``torch.chunk`` on dim 0), on a 1-D mesh, or on the shard dim of a 2-D
(replicate, shard) mesh (HSDP). A bucket holding one parameter padded to ``world * c`` rows has
exactly those rows as rank ``r``'s chunk, so gradaccum's sharded buckets, one per parameter,
are FSDP2's layout: its all-gathers and reduce-scatters work on the parameters' own shards and
the gradient shards come back in the shape of the DTensors' local tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .. import _tree
from .._errors import GradAccumError, describe, dtype_name, is_dtensor
from .._layout import Layout, with_accum

__all__ = [
    "FsdpParams",
    "dtensor_grads",
    "fill_from_locals",
    "fsdp_params",
    "placements",
    "quiet_fsdp",
]


class FsdpParams:
    """The trainable DTensor parameters of an FSDP2 model: their layout, mesh and placements."""

    def __init__(self, layout: Layout, params: tuple[Any, ...], mesh: Any) -> None:
        self.layout, self.params, self.mesh = layout, params, mesh


def _is_fsdp(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "_get_fsdp_state", None))


def fsdp_params(where: str, module: torch.nn.Module, group: Any) -> FsdpParams:
    """The model's trainable parameters by name, checked to be FSDP2's dim-0 shards."""
    named: dict[str, Any] = {k: p for k, p in module.named_parameters() if p.requires_grad}
    plain = sorted(k for k, p in named.items() if not is_dtensor(p))
    if not any(_is_fsdp(m) for m in module.modules()) or plain:
        raise ValueError(
            f"{where}: params is a module that is not wholly wrapped with FSDP2's fully_shard "
            f"(parameters that are not DTensors: {plain[:8]}); pass a fully_shard-ed model, or "
            f"the params of a plain one (gradaccum.params_of(model))."
        )
    mesh = next(iter(named.values())).device_mesh
    want = placements(mesh.ndim)
    for k, p in named.items():
        if p.device_mesh != mesh or tuple(p.placements) != want:
            raise GradAccumError(
                f"{where}: parameter {k!r} is sharded as {list(p.placements)} on "
                f"{p.device_mesh}; gradaccum supports fully_shard on one 1-D or 2-D mesh with "
                f"its default placement, {list(want)} on {mesh} here (no shard_placement_fn). "
                f"Shard every module on the same mesh, with the default placement."
            )
        if not p.is_floating_point() or p.ndim == 0:
            raise TypeError(
                f"{where}: parameter {k!r} is {dtype_name(p.dtype)} of shape {list(p.shape)}; "
                f"only floating parameters of at least one dim are supported."
            )
    if group is not None and group != mesh:
        raise ValueError(
            f"{where}: group is {describe(group)}, but the model is sharded on {mesh}; pass "
            f"group=None (the model's own mesh is used)."
        )
    paths, leaves, spec = _tree.flatten_with_paths(named)
    lay = Layout(
        spec=spec,
        paths=tuple(paths),
        shapes=tuple(p.shape for p in leaves),
        dtypes=tuple(p.dtype for p in leaves),
        accum_dtypes=(),
        devices=tuple(p.to_local().device for p in leaves),
    )
    return FsdpParams(with_accum(lay, None), tuple(leaves), mesh)


def placements(ndim: int) -> tuple[Any, ...]:
    """Dim-0 shards on a 1-D mesh; on a 2-D mesh, replicated on dim 0, sharded on dim 1 (HSDP)."""
    from torch.distributed.tensor import Replicate, Shard

    return (Shard(0),) if ndim == 1 else (Replicate(), Shard(0))


def fill_from_locals(sharded: Any) -> None:
    """Copy each DTensor's local rows into its chunk of ``sharded.shards`` (zero-padded)."""
    with torch.no_grad():
        for b in sharded.plan.buckets:
            (i,) = b.members
            local = sharded.fsdp.params[i].to_local().reshape(-1)
            region = sharded.shards[b.shard][b.start : b.start + b.chunk]
            if local.numel() > region.numel():
                raise GradAccumError(
                    f"Sharded: parameter {sharded.layout.paths[i]} holds {local.numel()} elements "
                    f"on rank {sharded.rank}, more than FSDP2's dim-0 chunk of {region.numel()}; "
                    f"the model was sharded in a way gradaccum does not know."
                )
            region[: local.numel()].copy_(local)
            region[local.numel() :].zero_()


def dtensor_grads(sharded: Any, grads: Any) -> list[Any]:
    """The gradient shards as DTensors like the parameters (local rows only), in leaf order."""
    from torch.distributed.tensor import DTensor

    out: list[Any] = [None] * len(sharded.fsdp.params)  # in leaf order
    for b in sharded.plan.buckets:
        (i,) = b.members
        p = sharded.fsdp.params[i]
        local = p.to_local()
        g = grads[b.shard][b.start : b.start + local.numel()].view(local.shape)
        out[i] = DTensor.from_local(
            g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return out


@contextlib.contextmanager
def quiet_fsdp(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` without FSDP2's forward hooks (which would gather and reduce on their own).

    Only hooks bound to an FSDP2 state are lifted, and all are put back in their order.
    """
    saved = []
    for m in module.modules():
        if not _is_fsdp(m):
            continue
        state = m._get_fsdp_state()  # type: ignore[operator]
        pre, post = dict(m._forward_pre_hooks), dict(m._forward_hooks)
        ours = [k for k, h in {**pre, **post}.items() if getattr(h, "__self__", None) is state]
        if not ours:
            raise GradAccumError(
                f"call_module(module, ...): {type(m).__name__} is wrapped with FSDP2's "
                f"fully_shard but carries none of its forward hooks in a form gradaccum knows "
                f"(torch {torch.__version__}); running it would let FSDP2 gather and reduce "
                f"on its own. Report this with your torch version."
            )
        saved.append((m, pre, post))
        for k in ours:
            m._forward_pre_hooks.pop(k, None)
            m._forward_hooks.pop(k, None)
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks.clear()
            m._forward_pre_hooks.update(pre)
            m._forward_hooks.clear()
            m._forward_hooks.update(post)
