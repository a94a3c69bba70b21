"""DP-SGD: per-sample clipping (a micro-batch transform) and one noise draw per window (a boundary).

Abadi et al. 2016; docs/reductions.md ("Differential privacy") says where each piece goes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import _tree
from ._core.protocol import Window, WindowSpec
from ._dist.mesh import axis
from ._errors import describe
from .compression import check_seed, finite_number, sum_flat
from .sync._custom import CustomReduce, custom_reduce

__all__ = ["clip_per_sample", "dp_noise"]

T = TypeVar("T")

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: mixes (seed, window) into one generator seed


def _positive(where: str, name: str, value: object, example: str) -> float:
    if not finite_number(value, 0, strict=True):
        raise ValueError(
            f"{where}: {name} must be a positive, finite number, got {describe(value)}; pass "
            f"e.g. {name}={example}."
        )
    return float(value)  # type: ignore[arg-type]


def clip_per_sample(max_norm: float) -> Callable[[T], T]:
    """A ``micro_transform``: clip each sample's gradient to ``max_norm``, then sum the samples.

    For [`accumulate(..., micro_transform=...)`][gradaccum.accumulate] with a step function that
    returns *per-sample* gradients (a leading sample dimension on every leaf, one sample per row
    of the micro-batch), such as ``torch.func.vmap(torch.func.grad(loss_of_one_sample),
    in_dims=(None, 0))``. Each sample's gradient is scaled by ``min(1, max_norm / (norm +
    1e-6))``, where ``norm`` is its 2-norm over all leaves together; the clipped samples are
    summed. The accumulated function then returns, over the window's rows (over every rank's,
    with ``sync=``):

    - ``reduction="mean"`` (the default): the **mean** of the clipped per-sample gradients, their
      sum divided by the number of rows;
    - ``reduction="sum"``: their **sum** (DP-SGD:
      [`dp_noise()`][gradaccum.privacy.dp_noise] adds the noise to it and divides by the
      expected batch size);
    - ``reduction="count"``: their sum divided by the window's total count.

    (The returned function has ``sums_rows = True``: its output is a sum over the micro-batch's
    rows, which ``accumulate`` then adds unweighted.)

    Args:
        max_norm: The clipping bound ``C``, a positive number.

    Returns:
        A function from per-sample gradients to their clipped sum (a tree shaped like the
        params).

    Raises:
        ValueError: ``max_norm`` is not a positive, finite number; (when called) the gradient
            leaves do not share one leading sample dimension; (in ``accumulate`` under
            ``"mean"``) that dimension is not the micro-batch's rows.

    Examples:
        >>> import torch, gradaccum
        >>> clip = gradaccum.privacy.clip_per_sample(1.0)
        >>> clip({"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])})  # norms 5 and 0.5
        {'w': tensor([0.9000, 1.2000])}

        Under the default ``reduction="mean"``, the mean over the rows of the clipped gradients:

        >>> from torch.func import grad, vmap
        >>> def loss_of_one(params, sample):
        ...     return (sample @ params["w"]) ** 2
        >>> step = gradaccum.accumulate(
        ...     vmap(grad(loss_of_one), in_dims=(None, 0)), n=2, micro_transform=clip
        ... )
        >>> x = torch.tensor([[3.0, 0.0], [0.1, 0.0], [0.1, 0.0]])  # gradients 18, 0.02, 0.02
        >>> step({"w": torch.tensor([1.0, 0.0])}, x)["w"]  # (1 + 0.02 + 0.02) / 3
        tensor([0.3467, 0.0000])
    """
    where = "clip_per_sample(max_norm)"
    return _ClippedSum(where, _positive(where, "max_norm", max_norm, "1.0"))


class _ClippedSum:
    """What [`clip_per_sample()`][gradaccum.privacy.clip_per_sample] returns."""

    # accumulate's micro_transform protocol: the output is a sum over the micro-batch's rows
    # (one sample per row), so under reduction="mean" it is added unweighted and the window is
    # divided by its total rows: the mean over the window's rows of the clipped gradients.
    sums_rows = True

    def __init__(self, where: str, bound: float) -> None:
        self.where, self.max_norm = where, bound

    def __repr__(self) -> str:
        return f"clip_per_sample({self.max_norm:g})"

    def __call__(self, grads: T) -> T:
        paths, leaves, spec = _tree.flatten_with_paths(grads)
        if not leaves:
            return grads
        rows = leaves[0].shape[0] if leaves[0].dim() else -1
        for path, g in zip(paths, leaves):
            if not isinstance(g, torch.Tensor) or g.dim() == 0 or g.shape[0] != rows:
                raise ValueError(
                    f"{self.where}: every gradient leaf needs the same leading sample dimension, "
                    f"but leaf {path} is {describe(g)} and the first has {rows} rows; the step "
                    f"function must return per-sample gradients, e.g. "
                    f"torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))."
                )
        with torch.no_grad():
            squares = sum(g.reshape(rows, -1).pow(2).sum(1) for g in leaves)
            assert isinstance(squares, torch.Tensor)
            factor = (self.max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
            out = [torch.einsum("b,b...->...", factor.to(g.dtype), g) for g in leaves]
        return _tree.unflatten(spec, out)  # type: ignore[no-any-return]


def dp_noise(
    noise_multiplier: float,
    max_norm: float,
    expected_batch_size: float,
    *,
    seed: int = 0,
    group: Any = None,
    timeout: float | None = None,
) -> CustomReduce:
    """The DP-SGD boundary: sum over the group, add Gaussian noise once, divide by ``L``.

    A [`custom_reduce()`][gradaccum.custom_reduce] for ``sync=``, with ``reduction="sum"`` (any
    other is refused when a window opens) and
    [`clip_per_sample()`][gradaccum.privacy.clip_per_sample] as the ``micro_transform``. The
    result is ``(sum of clipped per-sample gradients + N(0, (sigma C)^2 I)) / L``: an exact sum
    over the group (one flat ``all_reduce`` per dtype), then noise drawn **once per window**,
    the same on every rank, then a division by ``expected_batch_size`` (not by the rows seen, as
    Poisson sampling requires). The noise is drawn where the gradients are, in their dtype
    (float32 for float16 and bfloat16 accumulators): one draw per (device, dtype) group of
    leaves, from a generator of that device seeded with ``(seed, window, group)``. The window
    index is the state, so a resumed run draws the same noise; a CUDA generator draws other
    numbers than the CPU's from the same seed. The privacy accounting is not done here: see
    [Differential privacy](../reductions.md#differential-privacy-dp-sgd).

    Args:
        noise_multiplier: ``sigma``, the noise standard deviation in units of ``max_norm``.
        max_norm: ``C``, the per-sample clipping bound used in ``clip_per_sample``.
        expected_batch_size: ``L``, the expected number of samples per window over all ranks.
        seed: Seeds the noise; every rank must pass the same one.
        group: The process group or a 1-D ``DeviceMesh``; ``None`` for the default group (or
            one process).
        timeout: As in [`custom_reduce()`][gradaccum.custom_reduce].

    Returns:
        A [`CustomReduce`][gradaccum.sync.CustomReduce] whose state is the number of windows done.

    Raises:
        ValueError: A number is not positive and finite (``noise_multiplier`` may be 0: no
            noise), or ``seed`` is not an int; (when a window opens) the reduction is not
            ``"sum"``.

    Examples:
        >>> import torch, gradaccum
        >>> from torch.func import grad, vmap
        >>> def loss(params, sample):
        ...     x, y = sample
        ...     return (x @ params["w"] - y) ** 2
        >>> step = gradaccum.accumulate(
        ...     vmap(grad(loss), in_dims=(None, 0)),
        ...     n=2,
        ...     reduction="sum",
        ...     micro_transform=gradaccum.privacy.clip_per_sample(1.0),
        ...     sync=gradaccum.privacy.dp_noise(
        ...         noise_multiplier=0.0, max_norm=1.0, expected_batch_size=4
        ...     ),
        ... )
        >>> params = {"w": torch.zeros(2)}
        >>> x, y = torch.tensor([[1.0, 0.0]] * 4), torch.tensor([10.0, 10.0, 0.1, 0.1])
        >>> step(params, (x, y))["w"]  # each sample clipped to norm 1: (1 + 1 + 0.2 + 0.2) / 4
        tensor([-0.6000,  0.0000])
    """
    where = "dp_noise(noise_multiplier, max_norm, expected_batch_size, seed=...)"
    dim = axis(where, group).dim
    if not finite_number(noise_multiplier, 0, strict=False):
        raise ValueError(
            f"{where}: noise_multiplier must be a finite number >= 0 (0: no noise), got "
            f"{describe(noise_multiplier)}; pass the sigma your privacy accountant gives, e.g. "
            f"noise_multiplier=1.0."
        )
    bound = _positive(where, "max_norm", max_norm, "1.0")
    size = _positive(where, "expected_batch_size", expected_batch_size, "256")
    check_seed(where, seed)
    std = float(noise_multiplier) * bound

    def noisy_sum(grads: Any, window: Any, pg: Any) -> tuple[Any, Any]:
        leaves, spec = _tree.flatten(grads)
        sum_flat(leaves, pg, "gradients", dim)  # exact: one flat all-reduce per dtype
        for j, idx in enumerate(_groups(leaves)):
            group = [leaves[i] for i in idx]
            if std:
                torch._foreach_add_(group, _noise(group, seed, int(window), j, std))
            torch._foreach_div_(group, size)
        return _tree.unflatten(spec, leaves), int(window) + 1

    noisy_sum.__name__ = f"dp_noise(noise_multiplier={noise_multiplier:g}, max_norm={bound:g})"
    made = custom_reduce(noisy_sum, init=lambda _: 0, group=group, timeout=timeout)
    return _DPNoise(made.fn, made.init, made.group, made.timeout, made.name)


def _groups(leaves: list[torch.Tensor]) -> list[list[int]]:
    """Leaf indices by (device, dtype), in order of first appearance (the same on every rank)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(leaves):
        groups.setdefault((g.device, g.dtype), []).append(i)
    return list(groups.values())


def _noise(
    group: list[torch.Tensor], seed: int, window: int, j: int, std: float
) -> list[torch.Tensor]:
    """``N(0, std^2)`` noise shaped like ``group`` (leaves of one device and dtype), as views.

    One draw for the whole group, on its device, from a generator of that device seeded with
    ``(seed, window, j)`` (``j``: the group's position): the same on every rank and after a
    resume, and independent across groups. Drawn in the leaves' dtype, or float32 for float16
    and bfloat16 (added to them in their dtype).
    """
    first = group[0]
    dtype = first.dtype if first.dtype in (torch.float32, torch.float64) else torch.float32
    gen = torch.Generator(device=first.device)
    gen.manual_seed(((seed * _MIX + window) % 2**63 * _MIX + j) % 2**63)
    total = sum(g.numel() for g in group)
    flat = torch.randn(total, generator=gen, dtype=dtype, device=first.device).mul_(std)
    return list(torch._C._nn.unflatten_dense_tensors(flat, group))


class _DPNoise(CustomReduce):
    """What [`dp_noise()`][gradaccum.privacy.dp_noise] returns: it needs ``reduction="sum"``."""

    def open(self, spec: WindowSpec) -> Window:
        """Refuse a window that is not a plain sum, then open it as any custom reduction."""
        if spec.reduction != "sum":
            raise ValueError(
                f"{spec.where}: sync={self.name} needs reduction='sum', got "
                f"reduction={spec.reduction!r}: DP-SGD adds the noise to the sum of the clipped "
                f"per-sample gradients and divides by the expected batch size itself, so the "
                f"window must hold that sum (a mean or count would be divided twice, and the "
                f"noise would not match the clipping). Pass reduction='sum', and sum the "
                f"clipped per-sample gradients: "
                f"micro_transform=gradaccum.privacy.clip_per_sample(max_norm)."
            )
        return super().open(spec)

    def __repr__(self) -> str:
        return self.name
