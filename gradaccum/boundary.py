"""Boundary transforms: pure functions on a window's gradients, before the optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from . import _tree
from ._dist.buckets import group_device
from ._dist.comm import Comm
from ._dist.mesh import axes, check_group
from ._errors import describe

__all__ = ["LossScale", "LossScaleState", "clip_by_global_norm"]

_FIX = (
    "pass group=None (the gradients are the same on every rank, as after an all_reduce sync), "
    "or the group or mesh the gradients were reduce-scattered over (e.g. sharded.group)"
)
T = TypeVar("T")


def _leaves(where: str, grads: Any) -> tuple[list[torch.Tensor], _tree.PyTreeSpec]:
    paths, leaves, spec = _tree.flatten_with_paths(grads)
    for path, g in zip(paths, leaves):
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise TypeError(
                f"{where}: gradient leaf {path} is {describe(g)}; every leaf must be a floating "
                f"tensor. Pass the gradients that accumulate() or Accumulator.finalize() returned."
            )
    return leaves, spec


def clip_by_global_norm(
    grads: T, max_norm: float, *, group: Any = None, donate: bool = False
) -> tuple[T, torch.Tensor]:
    """Scale ``grads`` so that their global 2-norm is at most ``max_norm``.

    The same rule as ``torch.nn.utils.clip_grad_norm_`` (factor
    ``min(1, max_norm / (norm + 1e-6))``, a device tensor: the norm is never read on the host,
    and the gradients are always multiplied, by 1 when they are within the bound), with the
    same foreach kernels, one per (device, dtype). Pure by default: new tensors are returned and
    the input is not modified. With ``donate=True`` the caller gives ``grads`` up, as with
    ``jax.jit(..., donate_argnums=...)``: the result is written into their storage (in place,
    as ``clip_grad_norm_`` does, with no new gradient tree) and the returned leaves are the
    given tensors. The call reads the same either way, ``grads, norm = clip_by_global_norm(grads,
    ...)``. Apply it to the *window's* gradient, after the boundary, never per micro-batch.

    Args:
        grads: A pytree of floating tensors.
        max_norm: The largest allowed global norm, a positive number.
        group: ``None``: the norm of these gradients alone (enough after an ``all_reduce``
            sync, where they are the same on every rank). A process group: the gradients are
            shards (from a [`reduce_scatter()`][gradaccum.reduce_scatter] sync), and the norm
            is that of the whole gradient, from one one-element ``all_reduce`` of the squared
            norm. Padding is zero, so it does not count. A ``DeviceMesh``: its group, or for a
            2-D (replicate, shard) mesh its shard dim (replicas hold the same shards).
        donate: ``True``: clip ``grads`` in place and return them (do not use the tensors you
            passed for anything else than what is returned). ``False`` (the default): leave
            ``grads`` as they are and return new tensors.

    Returns:
        ``(clipped, norm)``: the clipped gradients and the global norm before clipping (a 0-dim
        float tensor on the first leaf's device, float64 if any leaf is float64, otherwise
        float32).

    Raises:
        TypeError: A leaf is not a floating tensor, ``group`` is neither ``None`` nor a
            process group, or ``donate`` is not a bool.
        ValueError: ``max_norm`` is not a positive number; or, with ``donate=True``, two
            leaves share memory (the same tensor twice, overlapping views) or a leaf overlaps
            itself: in place, it would be scaled twice.

    Examples:
        >>> import torch, gradaccum
        >>> from gradaccum.boundary import clip_by_global_norm
        >>> clipped, norm = clip_by_global_norm({"w": torch.tensor([3.0, 4.0])}, 1.0)
        >>> norm, clipped["w"]
        (tensor(5.), tensor([0.6000, 0.8000]))

        Donated, the gradients are clipped where they are:

        >>> grads = {"w": torch.tensor([3.0, 4.0])}
        >>> clipped, _ = clip_by_global_norm(grads, 1.0, donate=True)
        >>> clipped["w"] is grads["w"], grads["w"]
        (True, tensor([0.6000, 0.8000]))
    """
    where = "clip_by_global_norm(grads, max_norm)"
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(
            f"{where}: max_norm must be a positive number, got {describe(max_norm)}; pass e.g. "
            f"max_norm=1.0."
        )
    check_group(where, group, _FIX)
    _check_donate(where, donate)
    leaves, spec = _leaves(where, grads)
    if donate:
        _check_donated(where, grads)
    wide = torch.float64 if any(g.dtype == torch.float64 for g in leaves) else torch.float32
    if not leaves:
        return grads, torch.zeros((), dtype=wide)
    device = leaves[0].device
    groups = _by_device_and_dtype(leaves)
    with torch.no_grad():
        # One foreach norm per (device, dtype); each leaf's norm in its dtype, as clip_grad_norm_.
        norms = [
            torch.stack(torch._foreach_norm([leaves[i] for i in idx])) for idx in groups.values()
        ]
        total = torch.linalg.vector_norm(torch.cat([n.to(device, wide) for n in norms]))
        if group is not None:
            squared = (total * total).reshape(1)
            comm = Comm(where, axes(where, group)[0], what="group=")
            comm.wait(
                comm.all_reduce(squared, "the norm all_reduce", "norm"), "the norm all_reduce"
            )
            total = squared.sqrt().reshape(())
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # on the device: no host read
        out: list[torch.Tensor] = list(leaves)
        for (dev, dtype), idx in groups.items():
            group_leaves = [leaves[i] for i in idx]
            scale = factor.to(dev, dtype)
            if donate:
                torch._foreach_mul_(group_leaves, scale)
            else:
                for i, clipped in zip(idx, torch._foreach_mul(group_leaves, scale)):
                    out[i] = clipped
    return _tree.unflatten(spec, out), total


def _by_device_and_dtype(leaves: list[torch.Tensor]) -> dict[tuple[Any, Any], list[int]]:
    """Leaf indices grouped by (device, dtype), in order of first appearance: one foreach each."""
    groups: dict[tuple[Any, Any], list[int]] = {}
    for i, g in enumerate(leaves):
        groups.setdefault((g.device, g.dtype), []).append(i)
    return groups


def _check_donate(where: str, donate: object) -> None:
    if not isinstance(donate, bool):
        raise TypeError(
            f"{where}: donate must be a bool, got {describe(donate)}; pass donate=True to "
            f"overwrite the gradients you pass (no new tree), or leave the default (False)."
        )


def _check_donated(where: str, grads: Any) -> None:
    """With ``donate=True``: no two leaves (and no leaf with itself) may share memory.

    An in-place scale of memory that two leaves share would scale it twice, silently (the same
    tensor at two places of the tree, overlapping views, an ``expand``-ed tensor). The flat
    buckets gradaccum returns are views that do not overlap, so they pass.
    """
    paths, leaves, _ = _tree.flatten_with_paths(grads)
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for path, g in zip(paths, leaves):
        if g.numel() == 0:
            continue
        if torch._debug_has_internal_overlap(g) == 1:
            raise ValueError(
                f"{where}: with donate=True, gradient leaf {path} has elements that share memory "
                f"(an expand()-ed tensor, say): scaling it in place would scale them more than "
                f"once. Pass a tensor of its own (.clone()), or donate=False."
            )
        size = g.element_size()
        start = g.data_ptr()
        extent = sum((n - 1) * st for n, st in zip(g.shape, g.stride()) if n > 1) * size + size
        spans.setdefault(g.untyped_storage().data_ptr(), []).append((start, start + extent, path))
    for items in spans.values():
        items.sort()
        for (_, end, first), (start, _, second) in zip(items, items[1:]):
            if start < end:
                raise ValueError(
                    f"{where}: with donate=True, gradient leaves {first} and {second} share "
                    f"memory (the same tensor twice, or overlapping views): scaling them in place "
                    f"would scale it twice. Pass distinct tensors, or donate=False."
                )


class LossScaleState(NamedTuple):
    """The dynamic loss scale between windows (a pytree: checkpoint it with the model).

    Importing gradaccum registers it with ``torch.serialization.add_safe_globals``, so a
    checkpoint holding it loads with ``torch.load(path, weights_only=True)``.

    Attributes:
        scale: Multiply the loss by this before differentiating.
        good_steps: Consecutive finite windows since the scale last changed.

    Examples:
        >>> import io, torch, gradaccum
        >>> state = gradaccum.boundary.LossScale(init_scale=256.0).init()
        >>> state
        LossScaleState(scale=256.0, good_steps=0)
        >>> buffer = io.BytesIO()
        >>> torch.save({"loss_scale": state}, buffer)
        >>> _ = buffer.seek(0)
        >>> torch.load(buffer, weights_only=True)["loss_scale"]
        LossScaleState(scale=256.0, good_steps=0)
    """

    scale: float
    good_steps: int


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling for float16 training, as pure functions over a state.

    The state is a [`LossScaleState`][gradaccum.boundary.LossScaleState]. Multiply the loss by
    ``state.scale`` inside the step function; at the boundary,
    [`unscale()`][gradaccum.boundary.LossScale.unscale] divides the window's gradient by the scale
    and decides whether it is finite. After an ``all_reduce`` sync the gradients are the same on
    every rank, so the decision is the same everywhere: every rank skips the step or none does. The
    rule is ``torch.amp.GradScaler``'s: halve the scale on a non-finite window, double it after
    ``growth_interval`` finite windows in a row; but the scale never backs off below
    ``min_scale`` (``GradScaler``'s can reach 0) nor grows to infinity.

    Args:
        init_scale: The first scale, a finite number ``>= min_scale``.
        growth_factor: Factor applied after ``growth_interval`` finite windows, a finite
            number ``>= 1``.
        backoff_factor: Factor applied on a non-finite window, in ``(0, 1]``.
        growth_interval: Finite windows in a row before the scale grows.
        min_scale: The floor of the scale, a finite positive number. The default, ``2.0**-126``
            (the smallest normal float32), keeps the scale and ``1 / scale`` finite in float32;
            pass e.g. ``min_scale=1.0`` to never scale the loss down.

    Raises:
        ValueError: An argument is out of its range (the message names it), e.g. a zero,
            negative, NaN or infinite ``init_scale``.

    Examples:
        >>> import torch, gradaccum
        >>> scaler = gradaccum.boundary.LossScale(init_scale=1024.0)
        >>> state = scaler.init()
        >>> grads, finite, state = scaler.unscale({"w": torch.tensor([2048.0])}, state)
        >>> grads["w"], finite, state
        (tensor([2.]), True, LossScaleState(scale=1024.0, good_steps=1))
        >>> _, finite, state = scaler.unscale({"w": torch.tensor([float("inf")])}, state)
        >>> finite, state.scale  # skip this step; the scale backs off
        (False, 512.0)

        The scale stops at ``min_scale``:

        >>> scaler = gradaccum.boundary.LossScale(init_scale=4.0, min_scale=1.0)
        >>> state = scaler.init()
        >>> for _ in range(5):
        ...     _, finite, state = scaler.unscale({"w": torch.tensor([float("nan")])}, state)
        >>> finite, state.scale
        (False, 1.0)
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 2.0**-126

    def __post_init__(self) -> None:
        where = "LossScale(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)"
        if not _is_number(self.init_scale) or not self.init_scale > 0:
            raise ValueError(
                f"{where}: init_scale must be a positive number, got {describe(self.init_scale)}; "
                f"pass e.g. init_scale=2.0**16 (torch.amp.GradScaler's default)."
            )
        if not _is_number(self.growth_factor) or not 1 <= self.growth_factor < math.inf:
            raise ValueError(
                f"{where}: growth_factor must be a finite number >= 1, got "
                f"{describe(self.growth_factor)}; pass e.g. growth_factor=2.0 (the default), or "
                f"1.0 to never grow the scale."
            )
        if not _is_number(self.backoff_factor) or not 0 < self.backoff_factor <= 1:
            raise ValueError(
                f"{where}: backoff_factor must be a number in (0, 1], got "
                f"{describe(self.backoff_factor)}; pass e.g. backoff_factor=0.5 (the default), or "
                f"1.0 to never back off."
            )
        if math.isinf(self.init_scale):
            raise ValueError(
                f"{where}: init_scale must be a finite positive number, got "
                f"{describe(self.init_scale)}; an infinite scale makes every scaled loss "
                f"non-finite, so every window would be skipped. Pass e.g. init_scale=2.0**16 "
                f"(torch.amp.GradScaler's default)."
            )
        interval = self.growth_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"{where}: growth_interval must be a positive int (a number of windows), got "
                f"{describe(interval)}; pass e.g. growth_interval=2000 (the default)."
            )
        floor = self.min_scale
        if not _is_number(floor) or not (0 < floor < math.inf):
            raise ValueError(
                f"{where}: min_scale must be a finite positive number, got {describe(floor)}; "
                f"pass e.g. min_scale=1.0, or leave the default (2.0**-126)."
            )
        if self.init_scale < floor:
            raise ValueError(
                f"{where}: init_scale must be >= min_scale={floor!r}, got "
                f"{describe(self.init_scale)}; pass a larger init_scale or a smaller min_scale."
            )

    def init(self) -> LossScaleState:
        """The state before the first window."""
        return LossScaleState(float(self.init_scale), 0)

    def unscale(
        self, grads: T, state: LossScaleState, *, group: Any = None, donate: bool = False
    ) -> tuple[T, bool, LossScaleState]:
        """Divide the window's gradients by the scale; decide whether to take the step.

        The division is one foreach multiply per (device, dtype), and the found-inf check one
        foreach max-norm, both on the device; the decision stays a device tensor through the
        ``group`` all-reduce, and is read once, at the end: the skip decision needs it on the
        host, as ``GradScaler.step`` reads its ``found_inf``.

        Args:
            grads: The window's gradients (of the scaled loss).
            state: The current [`LossScaleState`][gradaccum.boundary.LossScaleState].
            group: ``None``: decide from these gradients alone (enough after an ``all_reduce``
                sync, where they are identical on every rank). A process group (or a mesh, as
                in [`clip_by_global_norm()`][gradaccum.boundary.clip_by_global_norm]): also
                agree over it with one one-element ``all_reduce`` (for gradients that differ per
                rank, e.g. shards). With no gradient leaves on this rank, the flag is built on
                the group's device (the current CUDA device for NCCL).
            donate: As in [`clip_by_global_norm()`][gradaccum.boundary.clip_by_global_norm]:
                ``True`` unscales ``grads`` in place (as ``GradScaler.unscale_`` does) and
                returns them; ``False`` (the default) returns new tensors.

        Returns:
            ``(grads, finite, new_state)``: the unscaled gradients, whether every element is
            finite on every rank (skip the optimizer step when not), and the next state.
            Reading ``finite`` synchronises with the device once per window.

        Raises:
            TypeError: A leaf is not a floating tensor, ``state`` is not a LossScaleState,
                ``group`` is neither ``None`` nor a process group, or ``donate`` is not a bool.
            ValueError: ``state.scale`` is not a finite positive number; or, with
                ``donate=True``, two leaves share memory (see ``clip_by_global_norm``).
        """
        where = "LossScale.unscale(grads, state)"
        if not isinstance(state, LossScaleState):
            raise TypeError(
                f"{where}: state must be a LossScaleState, got {describe(state)}; start with "
                f"state = scaler.init() and pass on the state unscale() returns."
            )
        if not _is_number(state.scale) or not (0 < state.scale < math.inf):
            raise ValueError(
                f"{where}: state.scale must be a finite positive number, got "
                f"{describe(state.scale)}; start with state = scaler.init() and pass on the "
                f"state unscale() returns."
            )
        check_group(where, group, _FIX)
        _check_donate(where, donate)
        leaves, spec = _leaves(where, grads)
        if donate:
            _check_donated(where, grads)
        shard = axes(where, group)[0] if group is not None else None
        with torch.no_grad():
            inv = 1.0 / state.scale
            out: list[torch.Tensor] = list(leaves)
            flags = []
            for (dev, dtype), idx in _by_device_and_dtype(leaves).items():
                group_leaves = [leaves[i] for i in idx]
                # 1 / scale as a device scalar in the leaves' compute dtype, as GradScaler's
                # inv_scale (the in-place foreach of a Python number rounds it to float16 on CPU)
                wide = torch.float64 if dtype == torch.float64 else torch.float32
                scale = torch.full((), inv, dtype=wide, device=dev)
                if donate:
                    torch._foreach_mul_(group_leaves, scale)
                else:
                    group_leaves = list(torch._foreach_mul(group_leaves, scale))
                    for i, unscaled in zip(idx, group_leaves):
                        out[i] = unscaled
                # max |g| per leaf: NaN propagates, finite values do not overflow
                peaks = torch.stack(torch._foreach_norm(group_leaves, float("inf")))
                flags.append((~torch.isfinite(peaks)).any().reshape(1))
            if flags:
                device = leaves[0].device
                bad = torch.cat([f.to(device) for f in flags]).any().to(torch.float32).reshape(1)
            else:  # nothing here: a zero flag where the group's collectives take their tensors
                device = group_device(shard.group) if shard is not None else torch.device("cpu")
                bad = torch.zeros(1, device=device)
            if shard is not None:
                comm = Comm(where, shard, what="group=")
                what = "the found_inf all_reduce"
                comm.wait(comm.all_reduce(bad, what, "found_inf", dist.ReduceOp.MAX), what)
            finite = not bool(bad.item())  # the window's one host read: the skip decision
        if finite:
            good = state.good_steps + 1
            if good >= self.growth_interval:
                grown = state.scale * self.growth_factor
                new = LossScaleState(grown if math.isfinite(grown) else state.scale, 0)
            else:
                new = LossScaleState(state.scale, good)
        else:
            new = LossScaleState(max(state.scale * self.backoff_factor, self.min_scale), 0)
        return _tree.unflatten(spec, out), finite, new


torch.serialization.add_safe_globals([LossScaleState])


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
