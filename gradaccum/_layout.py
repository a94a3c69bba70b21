"""The gradient layout: key paths, shapes and dtypes of a params tree, and checks against it.

A leaf module: what every other module agrees on about one window's gradients (its tree, its
accumulation dtypes), each micro-batch's weight (``micro_weight`` for ``Accumulator.add``,
``weigh`` for ``accumulate``), and the validation of a gradient tree against the layout (with
messages that name the key path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _reduce, _tree
from ._errors import check_not_dtensor, describe, dtype_name

__all__ = ["Layout", "check_grads", "make_layout", "micro_weight", "weigh", "with_accum"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a subclass (a DTensor is one)


@dataclass(frozen=True)
class Layout:
    """Static description of the gradient tree: structure, key paths, shapes, dtypes, devices."""

    spec: _tree.PyTreeSpec
    paths: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    accum_dtypes: tuple[torch.dtype, ...]
    devices: tuple[torch.device, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "same_dtypes", self.accum_dtypes == self.dtypes)
        wide = all([d in (torch.float32, torch.float64) for d in self.accum_dtypes])
        object.__setattr__(self, "wide", wide)

    # Derived: every leaf accumulates in its own dtype; every leaf accumulates in float32/64.
    same_dtypes: bool = dataclasses.field(init=False, repr=False, compare=False)
    wide: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:  # hashed once: layouts key the syncs' plan caches
        h = self.__dict__.get("_hash")
        if h is None:
            fields = (self.spec, self.paths, self.shapes, self.dtypes, self.accum_dtypes)
            h = hash((*fields, self.devices))
            object.__setattr__(self, "_hash", h)
        return h

    def zeros(self, i: int) -> torch.Tensor:
        """Zeros for leaf ``i``'s running sum: its shape, accumulation dtype and device."""
        return torch.zeros(self.shapes[i], dtype=self.accum_dtypes[i], device=self.devices[i])


def check_n(where: str, n: object) -> None:
    """Validate a number of micro-batches."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"{where}: n must be a positive int (the number of micro-batches), got "
            f"{describe(n)}; pass e.g. n=4."
        )
    if n < 1:
        raise ValueError(
            f"{where}: n must be a positive int (the number of micro-batches), got {n}; pass "
            f"n >= 1 (n=1 computes the whole batch in one micro-batch)."
        )


def check_accum_dtype(where: str, dtype: object) -> None:
    """Validate ``accum_dtype``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"{where}: accum_dtype must be None or a floating torch.dtype, got {describe(dtype)}; "
            f"pass e.g. accum_dtype=torch.float32."
        )


def make_layout(where: str, params: Any, accum_dtype: torch.dtype | None) -> Layout:
    """Describe the gradient tree from ``params``, validating that its leaves are float tensors."""
    paths, leaves, spec = _tree.flatten_with_paths(params)
    for path, leaf in zip(paths, leaves):
        if type(leaf) in _PLAIN and leaf.is_floating_point():
            continue  # the common case, checked without building the messages' arguments
        check_not_dtensor(where, f"params leaf {path}", leaf)
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{where}: params leaf {path} is {describe(leaf)}; every params leaf must be a "
                f"floating tensor. Move non-tensor values out of the params pytree."
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"{where}: params leaf {path} has dtype {dtype_name(leaf.dtype)}; gradients exist "
                f"only for floating tensors. Move it out of the params pytree (into buffers, or "
                f"another argument of step_fn)."
            )
    # List comprehensions, not generators: one call each (this runs at every accumulated call).
    dtypes = tuple([x.dtype for x in leaves])
    return Layout(
        spec=spec,
        paths=tuple(paths),
        shapes=tuple([x.shape for x in leaves]),
        dtypes=dtypes,
        accum_dtypes=_accum_dtypes(dtypes, accum_dtype),
        devices=tuple([x.device for x in leaves]),
    )


def _accum_dtypes(
    dtypes: tuple[torch.dtype, ...], accum_dtype: torch.dtype | None
) -> tuple[torch.dtype, ...]:
    if accum_dtype is not None:
        return (accum_dtype,) * len(dtypes)
    return tuple([torch.float32 if d in _LOW_PRECISION else d for d in dtypes])


def with_accum(lay: Layout, accum_dtype: torch.dtype | None) -> Layout:
    """``lay`` with the accumulation dtypes that ``accum_dtype`` gives."""
    return dataclasses.replace(lay, accum_dtypes=_accum_dtypes(lay.dtypes, accum_dtype))


def micro_weight(
    where: str,
    reduction: _reduce.Reduction,
    size: int | None,
    count: int | float | torch.Tensor | None,
) -> tuple[int, _reduce.Weight]:
    """``(alpha, weight)`` of one micro-batch: its gradient is scaled by alpha, adds weight."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        error = ValueError if isinstance(size, int) and not isinstance(size, bool) else TypeError
        raise error(
            f"{where}: size must be the micro-batch's number of rows, a positive int, got "
            f"{describe(size)}; pass size=len(micro_batch)."
        )
    if count is not None and reduction != "count":
        raise ValueError(
            f"{where}: count= is used only with reduction='count', got reduction={reduction!r}; "
            f"pass size= (the micro-batch's rows), or use Accumulator(n, reduction='count')."
        )
    if reduction == "mean":
        if size is None:
            raise ValueError(
                f"{where}: reduction='mean' needs size=, the micro-batch's number of rows, to "
                f"weight it exactly; pass size=len(micro_batch)."
            )
        return size, size
    if reduction == "count":
        if count is None:
            raise ValueError(
                f"{where}: reduction='count' needs count=, the number of items the micro-batch's "
                f"summed loss covers; pass e.g. count=(labels != pad_id).sum()."
            )
        return 1, _reduce.check_count(where, count)
    return 1, size if size is not None else 1


def weigh(
    call: str,
    reduction: _reduce.Reduction,
    count: Callable[[Any], Any] | None,
    rows: int,
    aux: Any,
) -> tuple[Any, _reduce.Weight | None, int, _reduce.Weight]:
    """One micro-batch's ``(raw count, checked count, alpha, weight)`` in ``accumulate``.

    ``rows`` comes from the split (a positive int); under ``count``, ``count(aux)`` is checked.
    The pair ``(alpha, weight)`` is what ``micro_weight`` gives for those values.
    """
    if count is None:  # mean or sum: weighted by the rows
        return None, None, rows if reduction == "mean" else 1, rows
    raw = count(aux)
    items = _reduce.check_count(call, raw)
    return raw, items, 1, items


def check_grads(where: str, lay: Layout, grads: Any) -> list[torch.Tensor]:
    """Flatten ``grads`` and check it against the layout; the message names the key path."""
    if torch.compiler.is_compiling():
        return _check_traced(where, lay, grads)
    leaves, spec = _tree.flatten(grads)
    if spec == lay.spec:
        # Fast path; the slow path below runs only to name the offending leaf.
        try:
            if tuple(g.shape for g in leaves) == lay.shapes and all(
                g.is_floating_point() for g in leaves
            ):
                return leaves
        except AttributeError:
            pass
    else:
        for path in _tree.none_paths(grads):
            if path in lay.paths:
                shape = tuple(lay.shapes[lay.paths.index(path)])
                raise TypeError(
                    f"{where}: gradient leaf {path} is None, expected a tensor of shape {shape}; "
                    f"step_fn must return a tensor for every params leaf (torch.autograd.grad "
                    f"returns None for an unused parameter: pass materialize_grads=True, or use "
                    f"torch.func.grad)."
                )
        expected = _tree.unflatten(lay.spec, [0] * lay.spec.num_leaves)
        got = _tree.map_(lambda _: 0, grads)
        hint = (
            "; if step_fn returns (grads, aux), pass has_aux=True"
            if isinstance(grads, tuple) and len(grads) == 2
            else ""
        )
        raise ValueError(
            f"{where}: the gradients do not match the params tree "
            f"{_tree.first_difference(expected, got)}; step_fn must return one gradient per "
            f"params leaf, in a tree of the same structure (as torch.func.grad does){hint}."
        )
    for path, g, shape in zip(lay.paths, leaves, lay.shapes):
        if not isinstance(g, torch.Tensor):
            raise TypeError(
                f"{where}: gradient leaf {path} is {describe(g)}, expected a tensor of shape "
                f"{tuple(shape)}; step_fn must return tensors (as torch.func.grad does)."
            )
        if not g.is_floating_point():
            raise TypeError(
                f"{where}: gradient leaf {path} has dtype {dtype_name(g.dtype)}; gradients must "
                f"be real floating tensors (integer and complex gradients are not supported). "
                f"Check that step_fn returns gradients, not inputs or indices."
            )
        if g.shape != shape:
            raise ValueError(
                f"{where}: gradient leaf {path} has shape {tuple(g.shape)} but the params leaf "
                f"has shape {tuple(shape)}; step_fn must return gradients shaped like params "
                f"(per-sample gradients must be reduced inside step_fn)."
            )
    raise AssertionError("unreachable")  # pragma: no cover


# Under torch.compile, optree's polyfill PyTreeSpec cannot be compared with the layout's: the
# traced check matches key paths (folded at trace time); a bad tree goes to the eager check, out
# of the graph (under fullgraph=True, Dynamo's error carries this reason, where torch has reason=).
_MISMATCH = (
    "gradaccum: the gradients do not match the params tree (key paths, shapes or floating "
    "dtypes); run the step without fullgraph=True, or eagerly, for the error naming the leaf"
)
try:
    _check_eager = torch.compiler.disable(check_grads, reason=_MISMATCH)  # type: ignore[no-untyped-call]
except TypeError:  # torch < 2.8: no reason=
    _check_eager = torch.compiler.disable(check_grads)  # type: ignore[no-untyped-call]


def _check_traced(where: str, lay: Layout, grads: Any) -> list[torch.Tensor]:
    paths, leaves, _ = _tree.flatten_with_paths(grads)
    if (
        tuple(paths) == lay.paths
        and all(isinstance(g, torch.Tensor) and g.is_floating_point() for g in leaves)
        and tuple(g.shape for g in leaves) == lay.shapes
    ):
        return leaves
    return _check_eager(where, lay, grads)  # type: ignore[no-any-return]


def spec_of(lay: Layout, tree: Any) -> _tree.PyTreeSpec:
    """``lay.spec``; under torch.compile, the (polyfill) structure of ``tree``, checked like it."""
    return _tree.flatten(tree)[1] if torch.compiler.is_compiling() else lay.spec
