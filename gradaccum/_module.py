"""Interop with ``torch.nn.Module`` and ``torch.optim``.

gradaccum works on pytrees of tensors. These helpers take a module's parameters and buffers
out as dicts, run the module functionally (also inside ``torch.func`` transforms, BatchNorm
included), and write gradients back into ``.grad`` so any ``torch.optim`` optimizer can step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.func import functional_call

from ._errors import describe

__all__ = ["buffers_of", "call_module", "params_of", "update_buffers", "write_grads"]


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's trainable parameters as a ``{name: tensor}`` dict.

    The tensors are detached views that share storage with the module's parameters, so an
    optimizer step on the module is seen by the dict and no autograd graph reaches the module.
    Parameters with ``requires_grad=False`` (frozen) are left out.

    Examples:
        >>> import torch, gradaccum
        >>> sorted(gradaccum.params_of(torch.nn.Linear(2, 3)))
        ['bias', 'weight']
    """
    return {k: v.detach() for k, v in module.named_parameters() if v.requires_grad}


def buffers_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers (e.g. BatchNorm running statistics) as a ``{name: tensor}`` dict.

    Like [`params_of()`][gradaccum.params_of], the tensors share storage with the module.

    Examples:
        >>> import torch, gradaccum
        >>> sorted(gradaccum.buffers_of(torch.nn.BatchNorm1d(4)))
        ['num_batches_tracked', 'running_mean', 'running_var']
    """
    return {k: v.detach() for k, v in module.named_buffers()}


def call_module(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    *args: Any,
    **kwargs: Any,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Call ``module`` with the given params and buffers; return ``(output, new_buffers)``.

    Safe inside ``torch.func.grad``: the module updates copies of the buffers (a BatchNorm in
    training mode updates its running statistics), which are returned instead of mutating the
    tensors passed in (``torch.func`` refuses such mutation). Return ``new_buffers`` in the aux
    of your loss, and commit them with [`update_buffers()`][gradaccum.update_buffers] after each
    micro-batch, outside the gradient transform, so that statistics thread through the
    micro-batches in order, as ``n`` forward passes of a hand-written loop would.

    With [`accumulate()`][gradaccum.accumulate], commit them inside the step function (second
    example) and return only the loss as aux. Do not return the buffers as aux of the accumulated
    function: its aux reductions would average ``n`` updates made from the same starting
    statistics instead of chaining them.

    Args:
        module: The module whose forward to run.
        params: Parameters by name (e.g. from [`params_of()`][gradaccum.params_of]).
        buffers: Buffers by name (e.g. from [`buffers_of()`][gradaccum.buffers_of]).
        *args: Positional arguments of the module's forward.
        **kwargs: Keyword arguments of the module's forward.

    Returns:
        The module's output, and the buffers after the call.

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
    fresh = {k: v.clone() for k, v in buffers.items()}
    out = functional_call(module, ({**params, **fresh},), args, kwargs, strict=False)
    return out, fresh


def update_buffers(
    buffers: Mapping[str, torch.Tensor] | torch.nn.Module, new_buffers: Mapping[str, torch.Tensor]
) -> None:
    """Copy ``new_buffers`` into ``buffers`` in place.

    ``buffers`` is a dict from [`buffers_of()`][gradaccum.buffers_of], or a module.

    Call it outside ``torch.func`` transforms, after each micro-batch: see
    [`call_module()`][gradaccum.call_module].

    Examples:
        >>> import torch, gradaccum
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> gradaccum.update_buffers(bn, {"running_mean": torch.tensor([0.5, 1.0])})
        >>> bn.running_mean
        tensor([0.5000, 1.0000])

    Raises:
        KeyError: ``new_buffers`` names a buffer that ``buffers`` does not have.
        TypeError: ``new_buffers`` is not a dict.
        ValueError: A new buffer's shape differs from the buffer's. Nothing is written then.
    """
    target = buffers_of(buffers) if isinstance(buffers, torch.nn.Module) else buffers
    if not isinstance(new_buffers, Mapping):
        raise TypeError(
            f"update_buffers(buffers, new_buffers): new_buffers must be a dict of tensors by "
            f"buffer name, got {describe(new_buffers)}; pass the new_buffers that call_module "
            f"returned."
        )
    unknown = sorted(set(new_buffers) - set(target))
    if unknown:
        raise KeyError(
            f"update_buffers(buffers, new_buffers): new_buffers has {unknown}, which buffers "
            f"does not have (it has {sorted(target)}); pass the buffers of the same module."
        )
    for k, v in new_buffers.items():
        if not isinstance(v, torch.Tensor) or v.shape != target[k].shape:
            raise ValueError(
                f"update_buffers(buffers, new_buffers): new_buffers[{k!r}] is {describe(v)}, "
                f"expected shape {tuple(target[k].shape)}; pass the new_buffers that call_module "
                f"returned for the same module."
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
        TypeError: ``grads`` is not a dict, or a gradient is not a real floating tensor.
        ValueError: The names of ``grads`` and of the module's trainable parameters differ,
            or a gradient has the wrong shape.
    """
    named = {k: v for k, v in module.named_parameters() if v.requires_grad}
    if not isinstance(grads, Mapping):
        raise TypeError(
            f"write_grads(module, grads): grads must be a dict of tensors by parameter name, "
            f"got {describe(grads)}; use the params dict from gradaccum.params_of(module)."
        )
    missing, extra = sorted(set(named) - set(grads)), sorted(set(grads) - set(named))
    if missing or extra:
        raise ValueError(
            f"write_grads(module, grads): grads and the module's trainable parameters differ: "
            f"missing {missing}, unknown {extra}; compute grads with respect to "
            f"gradaccum.params_of(module)."
        )
    for k, p in named.items():
        g = grads[k]
        if not isinstance(g, torch.Tensor) or g.shape != p.shape:
            raise ValueError(
                f"write_grads(module, grads): grads[{k!r}] is {describe(g)}, expected shape "
                f"{tuple(p.shape)}; compute grads with respect to gradaccum.params_of(module)."
            )
        if not g.is_floating_point():
            raise TypeError(
                f"write_grads(module, grads): grads[{k!r}] has dtype "
                f"{str(g.dtype).removeprefix('torch.')}; gradients must be real floating tensors. "
                f"Compute grads with respect to gradaccum.params_of(module)."
            )
    for k, p in named.items():
        p.grad = grads[k].detach().to(p.dtype)
