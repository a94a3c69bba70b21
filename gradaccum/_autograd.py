"""``grad`` and ``grad_and_value`` on torch.autograd: torch.func's signatures, a faster engine.

Called on their own they return what ``torch.func.grad`` / ``torch.func.grad_and_value`` return.
Inside [`accumulate()`][gradaccum.accumulate] they are the fast path: each micro-batch's backward
adds its gradients in place into the accumulator (the boundary buckets, under a sync) as autograd
produces them, like a hand-written ``loss.backward()`` loop, and the boundary collective of a
bucket starts as soon as the last micro-batch has produced that bucket's gradients.

Also here: the one ``argnums`` rule (``check_argnums``), the refusal of a call under a
torch.func transform (``check_no_transform``), the guard that makes activation checkpointing
safe under that backward (``CheckpointGuard``), and the grad mode every gradaccum call runs in,
whatever its caller's (``grad_on``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from pathlib import PurePath
from typing import Any, ParamSpec, TypeVar

import torch

from . import _tree
from ._errors import describe, dtype_name
from ._layout import make_layout

__all__ = [
    "CheckpointGuard",
    "backward",
    "GradFn",
    "active_transform",
    "check_argnums",
    "check_no_transform",
    "explain_checkpoint",
    "from_torch_func",
    "grad",
    "grad_and_value",
    "grad_on",
    "holds_inference",
    "plain_tensors",
]

P = ParamSpec("P")
R = TypeVar("R")


def grad_on(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with autograd recording on and inference mode off, whatever the caller's mode.

    What ``torch.func.grad`` does inside: a gradient taken under ``torch.no_grad()`` or
    ``torch.inference_mode()`` is the gradient, not zeros, and the tensors a call makes (its
    running sums, its results) are plain tensors, usable outside inference mode. Under
    ``torch.compile`` the mode is the graph's, left as it is.
    """

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        ):
            return fn(*args, **kwargs)
        with torch.inference_mode(False), torch.enable_grad():
            return fn(*args, **kwargs)

    return run


def holds_inference(tree: Any) -> bool:
    """Whether ``tree`` holds an inference tensor (one made under ``torch.inference_mode()``).

    torch.autograd can neither make a leaf of one nor save one for backward, outside inference
    mode; ``torch.func.grad`` differentiates through them: the fast path hands them to it.
    """
    return any([isinstance(t, torch.Tensor) and t.is_inference() for t in _tree.flatten(tree)[0]])


class GradFn:
    """What [`grad()`][gradaccum.grad] / ``grad_and_value()`` return: call it like torch.func's."""

    def __init__(
        self,
        fn: Callable[..., Any],
        argnums: int | tuple[int, ...],
        has_aux: bool,
        with_value: bool,
        origin: str = "gradaccum",
    ) -> None:
        self.fn = fn
        self.argnums = argnums
        self._positions = (argnums,) if isinstance(argnums, int) else argnums
        self.has_aux = has_aux
        self.with_value = with_value
        functools.update_wrapper(self, fn)
        self._kind = f"{origin}.{'grad_and_value' if with_value else 'grad'}"
        self._name = getattr(fn, "__name__", None) or type(fn).__name__

    def __repr__(self) -> str:
        return f"{self._kind}({self._name}, argnums={self.argnums!r}, has_aux={self.has_aux!r})"

    @property
    def returns_aux(self) -> bool:
        """Whether the output is ``(grads, something)`` rather than ``grads``."""
        return self.with_value or self.has_aux

    @grad_on
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        where = f"{self!r}(...)"
        make_layout(where, self._target(where, args), None)  # floating leaves only
        if (
            torch.compiler.is_compiling()
            or active_transform() is not None
            or holds_inference((args, kwargs))
        ):
            # Dynamo does not trace torch.autograd.grad on fresh leaves, a torch.func
            # transform around this call (vmap for per-sample gradients, jacrev for a Hessian)
            # cannot see through torch.autograd, and torch.autograd refuses inference tensors:
            # the torch.func function of the same name computes the same gradients, inside the
            # graph, composed with the transform, through inference tensors.
            func = torch.func.grad_and_value if self.with_value else torch.func.grad
            return func(self.fn, self.argnums, self.has_aux)(*args, **kwargs)
        new_args, leaves, spec = self.alias(where, args)
        value, aux = self.forward(where, new_args, kwargs)
        if leaves and value.requires_grad:
            grads = CheckpointGuard(where).grad(value, leaves, (new_args, kwargs))
        else:  # the output does not depend on the params: their gradient is zero
            grads = tuple(torch.zeros_like(leaf) for leaf in leaves)
        tree = _tree.unflatten(spec, grads)
        return (tree, aux) if self.returns_aux else tree

    def _target(self, where: str, args: Sequence[Any]) -> Any:
        """The differentiated argument(s): one tree, or a tuple of trees for tuple argnums."""
        pos = self._positions
        if len(args) <= max(pos):
            raise TypeError(
                f"{where}: expected the params at position(s) {list(pos)}, got {len(args)} "
                f"positional argument(s); pass them positionally, e.g. step(params, batch)."
            )
        return args[pos[0]] if isinstance(self.argnums, int) else tuple(args[i] for i in pos)

    # -- the pieces accumulate uses --------------------------------------------------------------

    def alias(
        self, where: str, args: Sequence[Any]
    ) -> tuple[list[Any], list[torch.Tensor], _tree.PyTreeSpec]:
        """The args with fresh autograd leaves (sharing storage), the leaves, the target's spec."""
        target = self._target(where, args)
        flat, spec = _tree.flatten(target)
        leaves = [leaf.detach().requires_grad_(True) for leaf in flat]
        aliased = _tree.unflatten(spec, leaves)
        new_args = list(args)
        parts = (aliased,) if isinstance(self.argnums, int) else aliased
        for i, part in zip(self._positions, parts):
            new_args[i] = part
        return new_args, leaves, spec

    def forward(
        self, where: str, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, Any]:
        """Run ``fn`` (under ``grad_on``): the attached loss, and the detached output beside it."""
        out = self.fn(*args, **kwargs)
        if self.has_aux:
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError(
                    f"{where}: with has_aux=True the function must return a pair (loss, aux), "
                    f"got {describe(out)}; return (loss, aux) or pass has_aux=False."
                )
            value, aux = out
        else:
            value, aux = out, None
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            if isinstance(value, torch.Tensor):
                got = f"a tensor of shape {tuple(value.shape)}"
            elif isinstance(value, (tuple, list)):
                got = f"{describe(value)} of length {len(value)}"
            else:
                got = describe(value)
            hint = (
                "; if it returns (loss, aux), pass has_aux=True"
                if isinstance(value, tuple) and not self.has_aux
                else ""
            )
            raise TypeError(
                f"{where}: the function must return a scalar (0-dim) loss tensor, got {got}; "
                f"reduce it with .mean() or .sum(){hint}."
            )
        if not value.is_floating_point():
            raise TypeError(
                f"{where}: the loss has dtype {dtype_name(value.dtype)}; it must be a floating "
                f"tensor to be differentiated."
            )
        if self.has_aux:
            aux = _tree.map_(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
        if self.with_value:
            return value, ((value.detach(), aux) if self.has_aux else value.detach())
        return value, aux


def grad(
    fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> GradFn:
    """``torch.func.grad`` on torch.autograd: the gradient of a scalar function of pytrees.

    Same signature and result as ``torch.func.grad`` (first-order), computed by
    ``torch.autograd`` on leaves that share the params' storage (nothing is copied and no
    ``.grad`` of yours is touched); inside [`accumulate()`][gradaccum.accumulate], the fast path.
    Under a ``torch.func`` transform (``vmap`` for per-sample gradients, ``jacrev`` or
    ``jacfwd`` for a Hessian) and under ``torch.compile`` it runs ``torch.func.grad``, which
    composes with them.

    Args:
        fn: A function of the params (and more arguments) returning a scalar loss tensor, or
            ``(loss, aux)`` with ``has_aux=True``.
        argnums: The positional argument(s) to differentiate with respect to; an int gives a
            gradient tree shaped like that argument, a tuple gives a tuple of them.
        has_aux: ``fn`` returns ``(loss, aux)``; the result is then ``(grads, aux)`` with the aux
            detached.

    Returns:
        A function with ``fn``'s signature returning ``grads`` (or ``(grads, aux)``). A params
        leaf the loss does not depend on gets a zero gradient, as with torch.func.

    Raises:
        TypeError: (when called) ``fn`` does not return a scalar floating tensor, or a params
            leaf is not a floating tensor.
        ValueError: (when called) ``fn`` uses activation checkpointing that this backward would
            get wrong: reentrant (``use_reentrant=True``), or a recompute that reads other
            weights than the params given (see the Activation checkpointing page).

    Examples:
        >>> import torch, gradaccum
        >>> def loss_fn(params, x):
        ...     return (x @ params["w"]).pow(2).sum()
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> gradaccum.grad(loss_fn)(params, torch.tensor([[1.0, 0.0]]))
        {'w': tensor([2., 0.])}
    """
    return _make("grad", fn, argnums, has_aux, False)


def grad_and_value(
    fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> GradFn:
    """``torch.func.grad_and_value`` on torch.autograd: the gradient and the loss.

    As [`grad()`][gradaccum.grad], returning ``(grads, loss)``, or ``(grads, (loss, aux))`` with
    ``has_aux=True``, the loss and aux detached. On CPU it runs as fast as a hand-written
    ``loss.backward()`` loop, where ``torch.func.grad_and_value`` is 10-30% slower.

    Args:
        fn: As in [`grad()`][gradaccum.grad].
        argnums: The positional argument(s) to differentiate with respect to.
        has_aux: ``fn`` returns ``(loss, aux)``.

    Returns:
        A function with ``fn``'s signature returning ``(grads, loss)`` or
        ``(grads, (loss, aux))``.

    Raises:
        TypeError: As in [`grad()`][gradaccum.grad].
        ValueError: As in [`grad()`][gradaccum.grad].

    Examples:
        >>> import torch, gradaccum
        >>> from torch.func import functional_call
        >>> model = torch.nn.Linear(3, 1)
        >>> def loss_fn(params, batch):
        ...     x, y = batch
        ...     return ((functional_call(model, params, (x,)).squeeze(1) - y) ** 2).mean()
        >>> params = gradaccum.params_of(model)
        >>> x, y = torch.randn(16, 3), torch.randn(16)
        >>> step = gradaccum.accumulate(gradaccum.grad_and_value(loss_fn), n=4, has_aux=True)
        >>> grads, loss = step(params, (x, y))
        >>> expected = torch.func.grad(loss_fn)(params, (x, y))
        >>> all(torch.allclose(grads[k], expected[k], atol=1e-6) for k in grads)
        True
    """
    return _make("grad_and_value", fn, argnums, has_aux, True)


# The code objects of the functions torch.func.grad / grad_and_value return, to recognise them.
_TORCH_FUNC = {
    torch.func.grad(lambda x: x).__code__: False,
    torch.func.grad_and_value(lambda x: x).__code__: True,
}


def from_torch_func(fn: object) -> GradFn | None:
    """The ``grad()`` twin of what ``torch.func.grad``/``grad_and_value`` returned, or None."""
    code = getattr(fn, "__code__", None)
    with_value = _TORCH_FUNC.get(code) if code is not None else None
    closure = getattr(fn, "__closure__", None)
    if with_value is None or not closure:
        return None
    try:
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))  # type: ignore[union-attr]
        func, argnums, has_aux = cells["func"], cells["argnums"], cells["has_aux"]
        check_argnums("torch.func.grad(fn, argnums=...)", argnums)
        has_aux = _check_has_aux("grad", has_aux)
    except (KeyError, ValueError, TypeError):
        return None
    if not callable(func):
        return None
    return GradFn(func, argnums, has_aux, with_value, origin="torch.func")


def _make(name: str, fn: Any, argnums: object, has_aux: object, with_value: bool) -> GradFn:
    if not callable(fn):
        raise TypeError(
            f"gradaccum.{name}(fn): fn must be callable (a function returning a scalar loss), "
            f"got {describe(fn)}; pass the loss function itself, e.g. gradaccum.{name}(loss_fn) "
            f"with loss_fn(params, batch) -> loss."
        )
    check_argnums(f"gradaccum.{name}(fn, argnums=...)", argnums)
    return GradFn(fn, argnums, _check_has_aux(name, has_aux), with_value)  # type: ignore[arg-type]


def check_argnums(where: str, argnums: object) -> tuple[int, ...]:
    """Validate ``argnums`` as torch.func does; return its positions as a tuple.

    One rule for ``grad``, ``grad_and_value`` and ``accumulate``: a non-negative int, or a
    non-empty tuple of distinct non-negative ints. A wrong kind raises ``TypeError``, a wrong
    value (negative, repeated) ``ValueError``, with the same message.

    Examples:
        >>> check_argnums("f(argnums=...)", (0, 2))
        (0, 2)
        >>> check_argnums("f(argnums=...)", (0, 0))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: f(argnums=...): argnums must be a non-negative int or a non-empty tuple of ...
    """
    nums: Any = (argnums,) if isinstance(argnums, int) else argnums
    kind_ok = (
        isinstance(nums, tuple)
        and len(nums) > 0
        and all(isinstance(i, int) and not isinstance(i, bool) for i in nums)
    )
    if kind_ok and min(nums) >= 0 and len(set(nums)) == len(nums):
        return nums  # type: ignore[no-any-return]
    raise (ValueError if kind_ok else TypeError)(
        f"{where}: argnums must be a non-negative int or a non-empty tuple of distinct "
        f"non-negative ints, as in torch.func.grad, got {type(argnums).__name__} {argnums!r}; "
        f"pass e.g. argnums=0, or argnums=(0, 2) for several arguments."
    )


def _check_has_aux(name: str, has_aux: object) -> bool:
    if not isinstance(has_aux, bool):
        raise TypeError(
            f"gradaccum.{name}(fn, has_aux=...): has_aux must be a bool, got {describe(has_aux)}; "
            f"pass has_aux=True if fn returns (loss, aux), else has_aux=False."
        )
    return has_aux


# -- torch.func transforms around gradaccum (accumulate's docstring) --------------------------

# torch's own test for a running torch.func transform (torch.autograd.Function.apply uses it): a
# functorch dynamic layer is in this thread's dispatch keys. Dynamo traces it as a constant.
_transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active

# The kind of the innermost transform -> the torch.func functions that run one around a call.
# jacrev runs its function under a grad level (its vmap batches the backward, not the call);
# jacfwd is vmap over jvp, so the innermost level is jvp; hessian is jacfwd over jacrev.
_KINDS = {
    "Grad": "torch.func.grad, grad_and_value, vjp, jacrev or hessian",
    "Jvp": "torch.func.jvp or jacfwd",
    "Vmap": "torch.func.vmap",
    "Functionalize": "torch.func.functionalize",
}


def active_transform() -> str | None:
    """The innermost torch.func transform running around the caller, in words; None if none.

    E.g. ``"torch.func.vmap"``, or ``"torch.func.grad, grad_and_value, vjp, jacrev or hessian"``
    (the functions that run a grad level: which one is not recorded).
    """
    if not _transforms_active():
        return None
    top = torch._C._functorch.peek_interpreter_stack()
    kind = top.key().name if top is not None else "unknown"
    return _KINDS.get(kind, f"a torch.func transform ({kind})")


def check_no_transform(where: str) -> None:
    """Refuse a call of the accumulation under a torch.func transform, naming the transform.

    The window adds each micro-batch's gradient into running sums in place, outside autograd
    and one window per call: a derivative through it would silently be zeros (jacrev), and
    vmap cannot batch it. Gradients are accumulated, never differentiated through.
    """
    names = active_transform()
    if names is None:
        return
    if names == _KINDS["Vmap"]:
        why, fix = (
            "accumulation cannot be batched: it adds each micro-batch's gradient into running "
            "sums in place, one window at a time",
            "for per-sample gradients, vmap the gradient function, inside the accumulation: "
            "e.g. accumulate(torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0)), "
            "n, micro_transform=gradaccum.privacy.clip_per_sample(1.0)); for several batches, "
            "accumulate each in a Python loop, outside vmap",
        )
    elif names == _KINDS["Functionalize"]:
        why, fix = (
            "accumulation is not a pure function: it adds each micro-batch's gradient into "
            "running sums in place, kept between calls",
            "call it outside torch.func.functionalize; to compile it, pass the accumulated "
            "function to torch.compile, which functionalizes what it traces itself",
        )
    else:
        why, fix = (
            "accumulation is not differentiable: gradients are accumulated, never "
            "differentiated through, and each micro-batch's gradient is added into running "
            "sums in place, outside autograd, so a derivative taken through them would be "
            "zeros (torch.func.jacrev's Hessian) or fail",
            "differentiate the whole-batch gradient, outside gradaccum: "
            "torch.func.hessian(loss_fn)(params, batch), or torch.func.jacrev / jacfwd / jvp "
            "over torch.func.grad(loss_fn) (a Hessian-vector product); over the same batch it "
            "is the derivative of the accumulated gradient",
        )
    raise ValueError(f"{where}: called under {names}; {why}. Instead, {fix}.")


# -- activation checkpointing (docs/activation-checkpointing.md) -----------------------------------

# torch's error when a reentrant checkpoint meets torch.autograd.grad or backward(inputs=...).
_REENTRANT = re.compile(r"(not compatible|incompatible) with \.grad\(\)")
# torch.func's errors for a checkpoint (saved tensor hooks; reentrant's autograd.Function).
_FUNC_ERRORS = ("don't yet support saved tensor hooks", "must override the setup_context")
_CHECKPOINT_PY = ("torch", "utils", "checkpoint.py")
_NON_REENTRANT = (
    "pass use_reentrant=False to torch.utils.checkpoint.checkpoint (or checkpoint_sequential), "
    "which gradaccum supports, selective checkpointing (context_fn=) included"
)


def _key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Two tensors with the same key are the same memory; None for one without storage."""
    try:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
    except RuntimeError:  # a tensor subclass without storage (e.g. a DTensor): not checked
        return None


# torch.autograd.backward, less its Python per input (a generator step and is_tensor_like for
# each leaf, on every call: 2 Python calls per parameter per micro-batch). Its own engine call,
# made directly where torch has it, for plain tensors (no __torch_function__ to dispatch).
_ENGINE_RUN: Callable[..., Any] | None = getattr(torch.autograd.graph, "_engine_run_backward", None)
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def plain_tensors(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is a plain ``Tensor`` or ``Parameter`` (no subclass to dispatch to).

    C-level iteration (``map``, ``set``): no Python call per tensor.
    """
    return set(map(type, tensors)) <= _PLAIN


def backward(
    value: torch.Tensor, seed: torch.Tensor | None, inputs: tuple[torch.Tensor, ...], plain: bool
) -> None:
    """``torch.autograd.backward(value, seed, inputs=inputs)``; ``plain``: ``plain_tensors(...)``.

    Where ``value``, ``seed`` and the inputs are plain tensors and the seed has the value's
    shape, the engine runs directly (torch's own call, with its checks in C++: a value that
    does not require grad, an input that is not a leaf); otherwise through the public function.
    """
    if (
        plain
        and _ENGINE_RUN is not None
        and seed is not None
        and type(value) is torch.Tensor
        and type(seed) is torch.Tensor
        and seed.shape == value.shape
    ):
        _ENGINE_RUN(
            (value,), (seed,), False, False, inputs, allow_unreachable=True, accumulate_grad=True
        )
    else:
        torch.autograd.backward(value, seed, inputs=inputs)


# The running backward's id (-1 outside one), as torch.utils.checkpoint reads it; without it
# (another torch), every module run while the guard is on is checked.
_graph_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: 0)


class CheckpointGuard:
    """Around a backward of ``leaves``: refuse what activation checkpointing would get wrong.

    One guard serves every backward of a window: each call names its leaves and arguments.
    """

    # A non-reentrant checkpoint recomputes its block during the backward, after functional_call
    # has returned, so the block reads the module's own parameters: each module run then must
    # hold the tensors of the leaves or of the call's args, or the gradient would silently use
    # other weights. A reentrant checkpoint refuses inputs=: its error is replaced by the fix.

    def __init__(self, where: str) -> None:
        self.where = where
        self.leaves: Sequence[torch.Tensor] = ()
        self.args: Any = None
        self.keys: set[tuple[Any, ...] | None] | None = None  # built at the first recompute

    def backward(
        self,
        value: torch.Tensor,
        seed: torch.Tensor | None,
        leaves: list[torch.Tensor],
        args: Any,
        plain: bool = False,
    ) -> None:
        """``torch.autograd.backward(value, seed, inputs=leaves)``, guarded; ``args``: the call.

        ``plain``: ``plain_tensors(leaves)``, known by the caller (see ``backward``).
        """
        self.leaves, self.args, self.keys = leaves, args, None
        handle = torch.nn.modules.module.register_module_forward_pre_hook(self._check)
        try:
            backward(value, seed, tuple(leaves), plain)
        except RuntimeError as err:
            self._reentrant(err)
            raise
        finally:
            handle.remove()

    def grad(
        self, value: torch.Tensor, leaves: list[torch.Tensor], args: Any
    ) -> tuple[torch.Tensor, ...]:
        """``torch.autograd.grad`` of ``value`` for ``leaves`` (zeros for unused ones), guarded."""
        self.leaves, self.args, self.keys = leaves, args, None
        handle = torch.nn.modules.module.register_module_forward_pre_hook(self._check)
        try:
            return torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)
        except RuntimeError as err:
            self._reentrant(err)
            raise
        finally:
            handle.remove()

    def _reentrant(self, err: RuntimeError) -> None:
        """Replace torch's error for a reentrant checkpoint by the fix."""
        if _REENTRANT.search(str(err)):
            raise ValueError(
                f"{self.where}: the loss function uses torch.utils.checkpoint with "
                f"use_reentrant=True, which cannot run under gradaccum's backward: it refuses "
                f"torch.autograd.grad and backward(inputs=...), and under functional_call its "
                f"recomputation would differentiate the module's own parameters; "
                f"{_NON_REENTRANT}."
            ) from err

    def _check(self, module: torch.nn.Module, _inputs: Any) -> None:
        if _graph_task() == -1:  # not inside a backward: another thread's forward
            return
        if self.keys is None:
            flat, _ = _tree.flatten(self.args)
            tensors = [*self.leaves, *(t for t in flat if isinstance(t, torch.Tensor))]
            self.keys = {_key(t) for t in tensors}
        for name, p in module._parameters.items():
            key = _key(p) if p is not None and p.requires_grad else None
            if key is not None and key not in self.keys:
                raise ValueError(
                    f"{self.where}: activation checkpointing recomputed a "
                    f"{type(module).__name__} during the backward, which read its own parameter "
                    f"{name!r} ({describe(p)}), not the params passed in: the recomputation runs "
                    f"after torch.func.functional_call has returned, so the gradient would use "
                    f"other weights than the forward did. Pass params that share storage with "
                    f"the module's (gradaccum.params_of(model), stepped in place by a "
                    f"torch.optim optimizer), or pass them into the checkpointed function: "
                    f"checkpoint(lambda h, p: functional_call(block, p, (h,)), h, "
                    f"dict(block.named_parameters()), use_reentrant=False); set "
                    f"requires_grad=False on a module parameter that is not trained."
                )


def explain_checkpoint(where: str, err: BaseException) -> ValueError | None:
    """A clear error for torch.func over activation checkpointing, or None for any other."""
    msg = str(err)
    if not isinstance(err, RuntimeError) or not any(m in msg for m in _FUNC_ERRORS):
        return None
    tb = err.__traceback__
    while tb is not None:
        if PurePath(tb.tb_frame.f_code.co_filename).parts[-3:] == _CHECKPOINT_PY:
            first = msg.strip().splitlines()[0]
            return ValueError(
                f"{where}: step_fn runs a torch.func transform (torch.func.grad, vjp, vmap) "
                f"over activation checkpointing (torch.utils.checkpoint), which torch.func does "
                f"not support ({first}). Pass the function torch.func.grad / grad_and_value "
                f"returned to accumulate as it is (not wrapped, and without micro_transform), "
                f"or gradaccum.grad(loss_fn): both run on torch.autograd, where checkpointing "
                f"works with use_reentrant=False; or drop the checkpointing."
            )
        tb = tb.tb_next
    return None
