"""FSDP2 models: their DTensor parameters read as a sharded layout, and their hooks kept quiet.

FSDP2's ``fully_shard`` keeps rank ``r``'s rows ``[r * c, (r + 1) * c)`` of each parameter, ``c =
ceil(rows / world)`` (``torch.chunk`` on dim 0), on a 1-D mesh, or on the shard dim of a 2-D
(replicate, shard) mesh (HSDP). gradaccum's buckets for such a model are FSDP2's units (one per
``fully_shard`` call), each rank's chunk the concatenation of its rows of every member, as
FSDP2's own all-gather and reduce-scatter (see ``_plan``): one collective per unit, and the
gradient shards come back in the shape of the DTensors' local tensors.

The all-gather reads each parameter's rows where FSDP2 keeps them (the local tensor's padded
storage), so that ``Sharded`` holds no copy of them. Each unit's ``MixedPrecisionPolicy`` is
honoured as FSDP2 honours it: the rows are cast to ``param_dtype`` for the all-gather (the
forward computes in it), gradients are reduce-scattered in ``reduce_dtype`` (or ``param_dtype``
when that is None) while the sums stay in the accumulation dtype, and the forward's inputs and
outputs are cast by ``cast_forward_inputs`` and ``output_dtype``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import _tree
from .._errors import GradAccumError, describe, dtype_name, is_dtensor
from .._layout import Layout, with_accum

__all__ = [
    "FsdpParams",
    "dtensor_grads",
    "fsdp_params",
    "local_chunk",
    "placements",
    "quiet_fsdp",
]


@dataclass(frozen=True, eq=False)
class FsdpParams:
    """The trainable DTensor parameters of an FSDP2 model, and what FSDP2 says of each.

    Per leaf (in leaf order): ``units``, the ``fully_shard`` unit it was sharded by (an
    index); ``param_dtypes``, the dtype its unit's ``MixedPrecisionPolicy`` computes in
    (``None``: its own); ``reduce_dtypes``, the dtype FSDP2 would reduce its gradient in
    (``None``: the gradient's own); ``offloaded``, whether its unit has a ``CPUOffloadPolicy``.
    """

    layout: Layout
    params: tuple[Any, ...]
    mesh: Any
    units: tuple[int, ...]
    param_dtypes: tuple[torch.dtype | None, ...]
    reduce_dtypes: tuple[torch.dtype | None, ...]
    offloaded: tuple[bool, ...]


def _is_fsdp(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "_get_fsdp_state", None))


def _param_groups(where: str, module: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups of one ``fully_shard``-ed module (its units)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    for g in groups:
        if not hasattr(g, "fsdp_params") or not hasattr(g, "mp_policy"):
            raise GradAccumError(
                f"{where}: {type(module).__name__} is wrapped with FSDP2's fully_shard, but its "
                f"parameter group is not in a form gradaccum knows (torch {torch.__version__}); "
                f"report this with your torch version."
            )
    return list(groups)


_Unit = tuple[int, "torch.dtype | None", "torch.dtype | None", bool]


def _units(where: str, module: torch.nn.Module, named: dict[str, Any]) -> dict[int, _Unit]:
    """For each trainable parameter (by id): its unit, param dtype, reduce dtype, offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    found: dict[int, _Unit] = {}
    unit = 0
    for m in module.modules():
        if not _is_fsdp(m):
            continue
        for g in _param_groups(where, m):
            mp, offload = g.mp_policy, isinstance(g.offload_policy, CPUOffloadPolicy)
            for fp in g.fsdp_params:
                p = fp.sharded_param
                param_dtype = mp.param_dtype if mp.param_dtype not in (None, p.dtype) else None
                reduce_dtype = mp.reduce_dtype if mp.reduce_dtype is not None else param_dtype
                found[id(p)] = (unit, param_dtype, reduce_dtype, offload)
            unit += 1
    missing = sorted(k for k, p in named.items() if id(p) not in found)
    if missing:
        raise GradAccumError(
            f"{where}: parameters {missing[:8]} are DTensors that no FSDP2 unit of the model "
            f"owns (torch {torch.__version__}); shard every module with fully_shard, or "
            f"report this with your torch version."
        )
    return found


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
    info = _units(where, module, named)
    units, param_dtypes, reduce_dtypes, offloaded = zip(*(info[id(p)] for p in leaves))
    return FsdpParams(
        with_accum(lay, None),
        tuple(leaves),
        mesh,
        units,
        param_dtypes,
        reduce_dtypes,
        offloaded,
    )


def placements(ndim: int) -> tuple[Any, ...]:
    """Dim-0 shards on a 1-D mesh; on a 2-D mesh, replicated on dim 0, sharded on dim 1 (HSDP)."""
    from torch.distributed.tensor import Replicate, Shard

    return (Shard(0),) if ndim == 1 else (Replicate(), Shard(0))


def _rows(sharded: Any, p: Any, path: str, part: int) -> torch.Tensor:
    """Parameter ``p``'s rows on this rank, padded to ``part`` elements, where FSDP2 keeps them.

    FSDP2 keeps each local tensor as the head of a padded buffer of the whole chunk: a view of
    that buffer is returned (no copy). Padding holds rows beyond the parameter's last, which no
    gathered leaf reads.
    """
    local: torch.Tensor = p.to_local()
    if local.numel() > part:
        raise GradAccumError(
            f"Sharded: parameter {path} holds {local.numel()} elements on rank {sharded.rank}, "
            f"more than FSDP2's dim-0 chunk of {part}; the model was sharded in a way gradaccum "
            f"does not know."
        )
    room = local.untyped_storage().nbytes() // local.element_size() - local.storage_offset()
    if local.is_contiguous() and room >= part:
        return local.as_strided((part,), (1,), local.storage_offset())
    padded = local.new_zeros(part)  # a storage without FSDP2's padding: a copy
    padded[: local.numel()].copy_(local.reshape(-1))
    return padded


def local_chunk(sharded: Any, k: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's chunk of bucket ``k`` in ``dtype``, for the all-gather (FSDP2's copy-in).

    A view of the parameter's own storage when the bucket has one member and no cast; else one
    new tensor of the chunk (the members' rows, concatenated and cast).
    """
    b, fsdp = sharded.plan.buckets[k], sharded.fsdp
    paths = sharded.layout.paths
    with torch.no_grad():
        if len(b.members) == 1 and dtype == b.dtype:
            (i,) = b.members
            return _rows(sharded, fsdp.params[i], paths[i], b.parts[0])
        out = torch.empty(b.chunk, dtype=dtype, device=b.device)
        for j, i in enumerate(b.members):
            start, size = b.part(j)
            out[start : start + size].copy_(_rows(sharded, fsdp.params[i], paths[i], size))
        return out


def dtensor_grads(sharded: Any, grads: Any) -> list[Any]:
    """The gradient shards as DTensors like the parameters (local rows only), in leaf order."""
    from torch.distributed.tensor import DTensor

    out: list[Any] = [None] * len(sharded.fsdp.params)  # in leaf order
    for b in sharded.plan.buckets:
        for j, i in enumerate(b.members):
            p = sharded.fsdp.params[i]
            local = p.to_local()
            start = b.start + b.part(j)[0]
            g = grads[b.shard][start : start + local.numel()].view(local.shape)
            out[i] = DTensor.from_local(
                g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
    return out


def _cast(dtype: torch.dtype, tree: Any) -> Any:
    """``tree`` with its floating tensors cast to ``dtype`` (FSDP2's ``_cast_fp_tensor``)."""
    return _tree.map_(
        lambda x: (
            x.to(dtype)
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype
            else x
        ),
        tree,
    )


@contextlib.contextmanager
def quiet_fsdp(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` without FSDP2's forward hooks (which would gather and reduce on their own).

    Only hooks bound to an FSDP2 state are lifted, and all are put back in their order. In
    their place, each unit's ``MixedPrecisionPolicy`` still casts the forward's floating inputs
    to ``param_dtype`` (``cast_forward_inputs``) and its outputs to ``output_dtype``, as FSDP2's
    hooks would.
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
        mp = getattr(state, "_mp_policy", None)
        if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
            m.register_forward_pre_hook(
                lambda _m, args, kwargs, dt=mp.param_dtype: (_cast(dt, args), _cast(dt, kwargs)),
                prepend=True,
                with_kwargs=True,
            )
        if mp is not None and mp.output_dtype is not None:
            m.register_forward_hook(lambda _m, _args, out, dt=mp.output_dtype: _cast(dt, out))
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks.clear()
            m._forward_pre_hooks.update(pre)
            m._forward_hooks.clear()
            m._forward_hooks.update(post)
