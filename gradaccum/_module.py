"""Interop with ``torch.nn.Module`` and ``torch.optim``: dicts of tensors in, ``.grad`` out."""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.func import functional_call

from ._errors import check_not_dtensor, describe, dtype_name
from .sharding._fsdp import quiet_fsdp

# The tensors params_of handed out, per module and name (weak: a dropped dict is forgotten), so
# that call_module can tell a dict taken before Module.to(...) (stale storage) from a user's own
# copy of the params (which is allowed).
_HANDED_OUT: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, list[weakref.ref[torch.Tensor]]]]
_HANDED_OUT = weakref.WeakKeyDictionary()

_MAX_NAMES = 8  # names listed in a message before "..."

# Each module's _Slots (weak: a dropped module is forgotten), built at its first call_module.
_SLOTS: weakref.WeakKeyDictionary[torch.nn.Module, _Slots] = weakref.WeakKeyDictionary()

__all__ = ["buffers_of", "call_module", "params_of", "update_buffers", "write_grads"]


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's trainable parameters as a ``{name: tensor}`` dict.

    The tensors are detached views that share storage with the module's parameters, so an
    optimizer step on the module is seen by the dict and no autograd graph reaches the module.
    Parameters with ``requires_grad=False`` (frozen) are left out.

    Take them again after ``module.to(...)`` (a new dtype or device gives the module new
    storage): [`call_module()`][gradaccum.call_module] refuses a dict taken before the move,
    which would otherwise keep training the old tensors.

    Examples:
        >>> import torch, gradaccum
        >>> sorted(gradaccum.params_of(torch.nn.Linear(2, 3)))
        ['bias', 'weight']

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
        GradAccumError: A parameter is a DTensor (a model wrapped with FSDP2's ``fully_shard``),
            which gradaccum does not support yet.
    """
    where = "params_of(module)"
    _check_module(where, module)
    out: dict[str, torch.Tensor] = {}
    for k, p in module.named_parameters():
        check_not_dtensor(where, f"parameter {k!r}", p)
        if p.requires_grad:
            out[k] = p.detach()
    record = _HANDED_OUT.setdefault(module, {})
    for k, t in out.items():  # the tensors of dropped dicts are forgotten
        record[k] = [r for r in record.get(k, ()) if r() is not None] + [weakref.ref(t)]
    return out


def buffers_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers (e.g. BatchNorm running statistics) as a ``{name: tensor}`` dict.

    Like [`params_of()`][gradaccum.params_of], the tensors share storage with the module.

    Examples:
        >>> import torch, gradaccum
        >>> sorted(gradaccum.buffers_of(torch.nn.BatchNorm1d(4)))
        ['num_batches_tracked', 'running_mean', 'running_var']

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
    """
    _check_module("buffers_of(module)", module)
    return {k: v.detach() for k, v in module.named_buffers()}


def _check_module(where: str, module: object) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"{where}: module must be a torch.nn.Module, got {describe(module)}; pass the model "
            f"itself (its tensors come from gradaccum.params_of(model) and buffers_of(model))."
        )


def _names(names: Any) -> str:
    names = sorted(names)
    shown = ", ".join(repr(k) for k in names[:_MAX_NAMES])
    return f"[{shown}{', ...' if len(names) > _MAX_NAMES else ''}]"


def _base(t: Any) -> Any:
    """The plain tensor under torch.func's wrappers (grad, vmap), whose storage can be compared."""
    functorch = torch._C._functorch
    while isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


class _Slots:
    """Where each parameter and buffer of a module lives: what ``call_module`` swaps, built once.

    ``torch.func.functional_call`` walks the whole module tree twice per call (to find tied
    tensors, then each name's submodule): on a model of a few hundred tensors that is about a
    millisecond of Python per micro-batch, as much as the forward's own kernel launches on a GPU.
    A ``_Slots`` walks it once and keeps, for each name, the dict that holds the tensor.

    The tree can change between calls (a submodule replaced, a parameter registered, removed or
    untied, ``module.to()`` on a module whose conversion replaces the parameters):
    ``current()`` checks, with two passes in C (``map``), that every child module, parameter
    and buffer is still the object it was and every dict still has its size, and the caller
    builds a new one otherwise.

    Attributes:
        where: Each name (tied names included) -> (the ``_parameters`` or ``_buffers`` dict that
            holds it, its key there).
        params: The module's parameters by name, one name per tensor (``named_parameters()``).
        buffers: Its buffers' names, one per tensor (``named_buffers()``).
        tied: Each name of a tensor that has several -> all of its names.
        fsdp: Some submodule is wrapped with FSDP2's ``fully_shard`` (its hooks must be lifted),
            or keeps its tensors in something other than plain dicts (a ``ScriptModule``), or
            the module is a ``DataParallel``: the call goes through ``functional_call``.
    """

    __slots__ = (
        "_dicts",
        "_keys",
        "_values",
        "_stores",
        "_sizes",
        "_trainable",
        "_accepted",
        "_wrapped",
        "where",
        "params",
        "buffers",
        "tied",
        "fsdp",
    )

    def __init__(self, module: torch.nn.Module) -> None:
        self._dicts: list[dict[str, Any]] = []  # each entry of each store, to check its identity
        self._keys: list[str] = []
        self._values: list[Any] = []
        self._stores: list[dict[str, Any]] = []
        self.where: dict[str, tuple[dict[str, Any], str]] = {}
        by_tensor: dict[int, list[str]] = {}
        # functional_call refuses DataParallel (and jit): left to it, for its error
        self.fsdp = isinstance(module, torch.nn.DataParallel)
        self._wrapped = False  # some store is not a plain dict (a ScriptModule's wrappers)
        for name, sub in module.named_modules(remove_duplicate=False):
            prefix = f"{name}." if name else ""
            self.fsdp = self.fsdp or callable(getattr(sub, "_get_fsdp_state", None))
            stores = (sub._parameters, sub._buffers, sub._modules)
            if not all(type(store) is dict for store in stores):  # a ScriptModule's wrappers
                # not swapped here: functional_call decides (and refuses jit)
                self.fsdp = self._wrapped = True
            for store in (sub._parameters, sub._buffers, sub._modules):
                self._stores.append(store)
                for key, value in store.items():
                    self._dicts.append(store)
                    self._keys.append(key)
                    self._values.append(value)
            for store in (sub._parameters, sub._buffers):
                for key, value in store.items():
                    if value is not None:
                        self.where[prefix + key] = (store, key)
                        by_tensor.setdefault(id(value), []).append(prefix + key)
        self._sizes = list(map(len, self._stores))
        self.params = dict(module.named_parameters())
        self.buffers = frozenset(dict(module.named_buffers()))
        self.tied = {k: names for names in by_tensor.values() if len(names) > 1 for k in names}
        self._trainable: list[bool] = []
        self._accepted: tuple[Any, ...] = ()  # the last key sets that passed the strict check

    def current(self) -> bool:
        """Every module, parameter and buffer is where (and what) it was when this was built.

        A ``ScriptModule``'s stores are not dicts: its ``_Slots`` is never current (rebuilt).
        """
        if self._wrapped:
            return False
        return list(map(len, self._stores)) == self._sizes and all(
            map(operator.is_, map(dict.get, self._dicts, self._keys), self._values)
        )

    def check_keys(self, where: str, params: Mapping[str, Any], buffers: Mapping[str, Any]) -> None:
        """With ``strict``: every key names a tensor of the module, every trainable one is given."""
        trainable = [p.requires_grad for p in self.params.values()]
        given = (tuple(params), tuple(buffers))
        if trainable == self._trainable and given == self._accepted:
            return
        known = self.params.keys() | self.buffers
        unknown = (set(params) | set(buffers)) - known
        needed = {k for k, p in self.params.items() if p.requires_grad}
        missing = needed - set(params) - set(buffers)
        if unknown or missing:
            raise ValueError(
                f"{where}: params and buffers do not match the module's names: missing "
                f"trainable parameters {_names(missing)}, unknown keys {_names(unknown)}; a "
                f"misspelled or missing key would silently get no gradient. Pass "
                f"gradaccum.params_of(module) and gradaccum.buffers_of(module), or strict=False "
                f"to use the module's own tensors for missing names and ignore unknown ones."
            )
        self._trainable, self._accepted = trainable, given

    @contextlib.contextmanager
    def swapped(self, given: dict[str, Any]) -> Iterator[None]:
        """The module with the tensors of ``given`` (tied names all swapped) in place."""
        done: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for name, value in given.items():
                for twin in self.tied.get(name, (name,)):
                    store, key = self.where[twin]
                    done.append((store, key, store[key]))
                    store[key] = value
            yield
        finally:
            for store, key, old in reversed(done):
                store[key] = old

    def fits(self, given: dict[str, Any]) -> bool:
        """``swapped`` does what ``functional_call`` would: known names, one value per tensor."""
        where, tied = self.where, self.tied
        if not all(map(where.__contains__, given)):
            return False  # unknown keys (strict=False): functional_call sets them as attributes
        for name in given.keys() & tied.keys():
            if any(twin in given and given[twin] is not given[name] for twin in tied[name]):
                return False  # functional_call raises its own error
        return True


def _slots(module: torch.nn.Module) -> _Slots:
    """The module's ``_Slots``, rebuilt when its tree changed."""
    slots = _SLOTS.get(module)
    if slots is None or not slots.current():
        slots = _SLOTS[module] = _Slots(module)
    return slots


def _check_call(
    module: torch.nn.Module, params: Mapping[str, Any], buffers: Mapping[str, Any], strict: bool
) -> _Slots:
    """Refuse wrong kinds, keys the module does not have, missing trainable params, stale params."""
    where = "call_module(module, params, buffers, ...)"
    _check_module(where, module)
    for name, value in (("params", params), ("buffers", buffers)):
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{where}: {name} must be a dict of tensors by name, got {describe(value)}; pass "
                f"gradaccum.{name}_of(module)."
            )
    slots = _slots(module)
    if strict:
        slots.check_keys(where, params, buffers)
    values = list(params.values())
    if not {type(v) for v in values} <= _PLAIN:
        for k, value in params.items():
            check_not_dtensor(where, f"params[{k!r}]", value)
    record = _HANDED_OUT.get(module)
    if record is None or torch.compiler.is_compiling():
        return slots
    own = slots.params
    keys = [k for k in params if k in own]
    try:  # the usual case, in C: every value shares its parameter's storage
        if len(keys) == len(values) and list(map(_PTR, values)) == [_PTR(own[k]) for k in keys]:
            return slots
    except RuntimeError:  # a torch.func wrapper, or a tensor without storage: look one by one
        pass
    for k, value in params.items():
        refs, p = record.get(k), own.get(k)
        if not refs or p is None or not isinstance(value, torch.Tensor):
            continue
        base = _base(value)
        if base.numel() == 0 or base.data_ptr() == p.data_ptr():
            continue
        ptr = base.data_ptr()
        if any(t is not None and t.data_ptr() == ptr for t in (r() for r in refs)):
            raise ValueError(
                f"{where}: params[{k!r}] is no longer the module's storage: it is "
                f"{dtype_name(base.dtype)} on {base.device}, the module's parameter is "
                f"{dtype_name(p.dtype)} on {p.device}. The params were taken with "
                f"params_of(module) before the module was moved or converted (module.to(...), "
                f".double(), .cuda()), and training them would leave the module unchanged. Take "
                f"params = gradaccum.params_of(module) again after moving the module (and "
                f"rebuild the optimizer on its parameters)."
            )
    return slots


_PLAIN = {torch.Tensor, torch.nn.Parameter}
_PTR = torch.Tensor.data_ptr


def call_module(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    *args: Any,
    strict: bool = True,
    **kwargs: Any,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Call ``module`` with the given params and buffers; return ``(output, new_buffers)``.

    Safe inside ``torch.func.grad``: the module updates copies of the buffers (a BatchNorm in
    training mode updates its running statistics), which are returned instead of mutating the
    tensors passed in (``torch.func`` refuses such mutation). Return ``new_buffers`` in the aux
    of your loss, and commit them with [`update_buffers()`][gradaccum.update_buffers] after each
    micro-batch, outside the gradient transform: inside the step function given to
    [`accumulate()`][gradaccum.accumulate] (second example), not as its aux, whose reductions
    would average ``n`` updates instead of chaining them.

    The module's tree is walked once, at the first call, to find where each parameter and buffer
    lives; later calls only check that nothing there was replaced (a changed tree is walked
    again), so the per-call cost is a swap of the given tensors, not a walk of the model.

    Args:
        module: The module whose forward to run.
        params: Parameters by name (e.g. from [`params_of()`][gradaccum.params_of]).
        buffers: Buffers by name (e.g. from [`buffers_of()`][gradaccum.buffers_of]).
        *args: Positional arguments of the module's forward.
        strict: ``True`` (default): every key of ``params`` and ``buffers`` must name a
            parameter or buffer of the module, and every trainable parameter must be given
            (frozen parameters and buffers left out are taken from the module). A misspelled
            key would otherwise get no gradient, silently. ``False``: unknown keys are ignored
            and missing ones are taken from the module.
        **kwargs: Keyword arguments of the module's forward.

    Returns:
        The module's output, and the buffers after the call.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
        ValueError: With ``strict``, a key is unknown or a trainable parameter is missing (the
            message lists both); or ``params`` came from [`params_of()`][gradaccum.params_of]
            before the module was moved to another dtype or device (``module.to(...)``).
        GradAccumError: A value of ``params`` is a DTensor (FSDP2's ``fully_shard``): pass
            the gathered params of [`shard(model)`][gradaccum.shard] instead. A module wrapped
            with ``fully_shard`` runs without FSDP2's hooks (they would gather and reduce on
            their own), on the params given.

    Examples:
        >>> import torch, gradaccum
        >>> from torch.func import grad_and_value
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> params, buffers = gradaccum.params_of(bn), gradaccum.buffers_of(bn)
        >>> def loss_fn(params, x):
        ...     out, new_buffers = gradaccum.call_module(bn, params, buffers, x)
        ...     return out.pow(2).mean(), new_buffers
        >>> grads, (loss, new_buffers) = grad_and_value(loss_fn, has_aux=True)(
        ...     params, torch.randn(8, 2))
        >>> gradaccum.update_buffers(buffers, new_buffers)
        >>> int(bn.num_batches_tracked)
        1

        Threaded through the micro-batches of [`accumulate()`][gradaccum.accumulate]:

        >>> def step(params, x):
        ...     grads, (loss, new_buffers) = grad_and_value(loss_fn, has_aux=True)(params, x)
        ...     gradaccum.update_buffers(buffers, new_buffers)  # after each micro-batch, in order
        ...     return grads, loss
        >>> grads, loss = gradaccum.accumulate(step, n=4, has_aux=True)(params, torch.randn(16, 2))
        >>> int(bn.num_batches_tracked)  # 1 + 4 micro-batches
        5
    """
    slots = _check_call(module, params, buffers, strict)
    fresh = {k: v.clone() for k, v in buffers.items()}
    given = {**params, **fresh}
    if slots.fsdp or torch.compiler.is_compiling() or not slots.fits(given):
        with quiet_fsdp(module):  # torch's own swap (and its errors), which Dynamo traces
            out = functional_call(module, (given,), args, kwargs, strict=False)
        return out, fresh
    with slots.swapped(given):
        out = module(*args, **kwargs)
    return out, fresh


def update_buffers(
    buffers: Mapping[str, torch.Tensor] | torch.nn.Module, new_buffers: Mapping[str, torch.Tensor]
) -> None:
    """Copy ``new_buffers`` into ``buffers`` in place.

    ``buffers`` is a dict from [`buffers_of()`][gradaccum.buffers_of], or a module. Call it
    outside ``torch.func`` transforms, after each micro-batch: see
    [`call_module()`][gradaccum.call_module].

    Examples:
        >>> import torch, gradaccum
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> gradaccum.update_buffers(bn, {"running_mean": torch.tensor([0.5, 1.0])})
        >>> bn.running_mean
        tensor([0.5000, 1.0000])

    Raises:
        KeyError: ``new_buffers`` names a buffer that ``buffers`` does not have.
        TypeError: ``buffers`` or ``new_buffers`` is not a dict, or a floating value is given for
            an integer buffer (e.g. BatchNorm's ``num_batches_tracked``), which would be
            truncated. Nothing is written then.
        ValueError: A new buffer's shape differs from the buffer's. Nothing is written then.
    """
    where = "update_buffers(buffers, new_buffers)"
    target = buffers_of(buffers) if isinstance(buffers, torch.nn.Module) else buffers
    if not isinstance(target, Mapping):
        raise TypeError(
            f"{where}: buffers must be a module or a dict from gradaccum.buffers_of(module), got "
            f"{describe(buffers)}; pass the module itself (update_buffers(model, new_buffers)) "
            f"or buffers = gradaccum.buffers_of(model)."
        )
    if not isinstance(new_buffers, Mapping):
        raise TypeError(
            f"{where}: new_buffers must be a dict of tensors by buffer name, got "
            f"{describe(new_buffers)}; pass the new_buffers that call_module returned."
        )
    unknown = sorted(set(new_buffers) - set(target))
    if unknown:
        raise KeyError(
            f"{where}: new_buffers has {unknown}, which buffers does not have (it has "
            f"{sorted(target)}); pass the buffers of the same module."
        )
    for k, v in new_buffers.items():
        if not isinstance(v, torch.Tensor) or v.shape != target[k].shape:
            raise ValueError(
                f"{where}: new_buffers[{k!r}] is {describe(v)}, expected shape "
                f"{tuple(target[k].shape)}; pass the new_buffers that call_module returned for "
                f"the same module."
            )
        if v.is_floating_point() and not (target[k].is_floating_point() or target[k].is_complex()):
            raise TypeError(
                f"{where}: new_buffers[{k!r}] is {describe(v)}, but the buffer is "
                f"{dtype_name(target[k].dtype)}: the value would be truncated. Pass an integer "
                f"tensor for it (e.g. the new_buffers that call_module returned)."
            )
    with torch.no_grad():
        for k, v in new_buffers.items():
            target[k].copy_(v)


def write_grads(module: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Set each parameter's ``.grad`` from ``grads`` (by name), ready for ``optimizer.step()``.

    Gradients replace (not add to) any existing ``.grad``, and are cast to the parameter's dtype.
    Every trainable parameter must have a gradient, and every gradient a parameter; nothing is
    written when they do not match.

    Examples:
        >>> import torch, gradaccum
        >>> lin = torch.nn.Linear(2, 1)
        >>> gradaccum.write_grads(lin, {"weight": torch.ones(1, 2), "bias": torch.ones(1)})
        >>> lin.weight.grad
        tensor([[1., 1.]])

    Raises:
        TypeError: ``module`` is not a module, ``grads`` is not a dict, or a gradient is not a
            real floating tensor.
        GradAccumError: A parameter is a DTensor (FSDP2's ``fully_shard``).
        ValueError: The names of ``grads`` and of the module's trainable parameters differ,
            or a gradient has the wrong shape.
    """
    where = "write_grads(module, grads)"
    _check_module(where, module)
    # named_parameters() as _Slots keeps it (checked in C): a walk of the tree costs ~6 Python
    # calls per parameter
    named = {k: v for k, v in _slots(module).params.items() if v.requires_grad}
    for k, p in named.items():
        if type(p) is not torch.nn.Parameter:  # a plain Parameter is not a DTensor
            check_not_dtensor(where, f"the module's parameter {k!r}", p)
    if not isinstance(grads, Mapping):
        raise TypeError(
            f"{where}: grads must be a dict of tensors by parameter name, got {describe(grads)}; "
            f"use the params dict from gradaccum.params_of(module)."
        )
    missing, extra = sorted(set(named) - set(grads)), sorted(set(grads) - set(named))
    if missing or extra:
        raise ValueError(
            f"{where}: grads and the module's trainable parameters differ: missing {missing}, "
            f"unknown {extra}; compute grads with respect to gradaccum.params_of(module)."
        )
    for k, p in named.items():
        g = grads[k]
        if not isinstance(g, torch.Tensor) or g.shape != p.shape:
            raise ValueError(
                f"{where}: grads[{k!r}] is {describe(g)}, expected shape {tuple(p.shape)}; "
                f"compute grads with respect to gradaccum.params_of(module)."
            )
        if not g.is_floating_point():
            raise TypeError(
                f"{where}: grads[{k!r}] has dtype {dtype_name(g.dtype)}; gradients must be real "
                f"floating tensors. Compute grads with respect to gradaccum.params_of(module)."
            )
    for k, p in named.items():
        g = grads[k]
        p.grad = g if g.dtype == p.dtype and not g.requires_grad else g.detach().to(p.dtype)
