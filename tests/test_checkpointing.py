"""Activation checkpointing (torch.utils.checkpoint) with every kind of step function.

What works is proved exactly in float64 against the whole-batch gradient of the same model
without checkpointing, in one process and on 2 gloo ranks with an overlapped all-reduce. What
cannot work is refused with an error that says the fix: reentrant checkpointing under
gradaccum's backward, torch.func transforms over a checkpoint, and (the silent one) a recompute
that reads other weights than the forward did. ``docs/activation-checkpointing.md`` has the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as cp
from dist import run, values
from torch import nn
from torch.func import functional_call

import gradaccum
from gradaccum._autograd import CheckpointGuard  # the guard itself, for one edge case

F64 = torch.float64
ROWS = 10  # n=3 splits them 4, 3, 3: ragged micro-batches

MODES = ["non-reentrant", "sequential", "selective"]


def _selective() -> Any:
    # Save the matmuls' outputs, recompute the rest (tanh).
    return cp.create_selective_checkpoint_contexts([torch.ops.aten.addmm.default])


class Net(nn.Module):
    """An input layer, three checkpointed blocks (one partly frozen) and a head, in float64.

    ``mode``: None (no checkpointing: the reference), "non-reentrant", "sequential"
    (checkpoint_sequential, non-reentrant), "selective" (selective activation checkpointing),
    "reentrant", "sequential-reentrant", or "explicit" (the block's params passed into the
    checkpointed function, so that its recompute reads them, not the module's).
    """

    def __init__(self, mode: str | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.mode = mode
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)])
        self.blocks[1][0].bias.requires_grad_(False)  # frozen: read by forward and recompute
        self.head = nn.Linear(6, 1)
        self.to(F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        mode = self.mode
        if mode is None:
            h = self.blocks(h)
        elif mode in ("sequential", "sequential-reentrant"):
            h = cp.checkpoint_sequential(self.blocks, 2, h, use_reentrant=mode != "sequential")
        else:
            for block in self.blocks:
                h = self._block(block, h)
        return self.head(h).squeeze(-1)

    def _block(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.mode == "selective":
            return cp.checkpoint(block, h, use_reentrant=False, context_fn=_selective)
        if self.mode == "explicit":
            params = dict(block.named_parameters())  # inside functional_call: the params passed
            return cp.checkpoint(
                lambda h, p: functional_call(block, p, (h,)), h, params, use_reentrant=False
            )
        return cp.checkpoint(block, h, use_reentrant=self.mode == "reentrant")


def batch(rows: int = ROWS, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g, dtype=F64), torch.randn(rows, generator=g, dtype=F64)


def loss_of(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss_fn(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, params, (x,)) - y) ** 2).mean()

    return loss_fn


def whole_batch(params: dict[str, torch.Tensor], data: Any) -> dict[str, torch.Tensor]:
    """The reference: torch.func.grad on the whole batch, the same model unchecked."""
    return torch.func.grad(loss_of(Net(None)))(params, data)  # type: ignore[no-any-return]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def autograd_step(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """A plain step function: its own torch.autograd.grad (gradaccum's generic path)."""

    def step(params: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        grads = torch.autograd.grad(loss_fn(leaves, batch), list(leaves.values()))
        return dict(zip(leaves, grads))

    return step


def steps(loss_fn: Callable[..., torch.Tensor], n: int) -> dict[str, Callable[..., Any]]:
    """Every way to compute the window's gradient that checkpointing supports."""

    def streamed(params: dict[str, torch.Tensor], data: Any) -> dict[str, torch.Tensor]:
        acc = gradaccum.Accumulator(n=n)
        state = acc.init(params)
        per_micro = gradaccum.grad(loss_fn)
        for mb in zip(*(t.tensor_split(n) for t in data)):
            state = acc.add(state, per_micro(params, mb), size=len(mb[0]))
        grads, _ = acc.finalize(state)
        return grads  # type: ignore[no-any-return]

    return {
        "gradaccum.grad_and_value": lambda p, b: gradaccum.accumulate(
            gradaccum.grad_and_value(loss_fn), n
        )(p, b)[0],
        "gradaccum.grad": gradaccum.accumulate(gradaccum.grad(loss_fn), n),
        "torch.func.grad_and_value": lambda p, b: gradaccum.accumulate(
            torch.func.grad_and_value(loss_fn), n
        )(p, b)[0],
        "plain step function": gradaccum.accumulate(autograd_step(loss_fn), n),
        "Accumulator + gradaccum.grad": streamed,
    }


# -- what works, exactly ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("mode", [*MODES, "explicit"])
def test_checkpointed_window_equals_the_whole_batch(mode: str, n: int) -> None:
    model = Net(mode)
    params, data = gradaccum.params_of(model), batch()
    expected = whole_batch(params, data)
    for name, step in steps(loss_of(model), n).items():
        assert max_diff(step(params, data), expected) <= 1e-14, name


@pytest.mark.parametrize("mode", MODES)
def test_training_with_an_optimizer_matches_the_unchecked_model(mode: str) -> None:
    # params_of + an optimizer stepping the module in place: the recompute reads the new weights.
    runs = []
    for m in (mode, None):
        model = Net(m)
        params = gradaccum.params_of(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = gradaccum.accumulate(gradaccum.grad(loss_of(model)), 3)
        for seed in range(4):
            gradaccum.write_grads(model, step(params, batch(seed=seed)))
            optimizer.step()
        runs.append(gradaccum.params_of(model))
    assert max_diff(*runs) <= 1e-14


def test_compiled_gradaccum_grad_step_is_exact() -> None:
    # torch.compile: the fast path's window runs eagerly behind a graph break.
    model = Net("non-reentrant")
    params, data = gradaccum.params_of(model), batch()
    step = torch.compile(
        gradaccum.accumulate(gradaccum.grad(loss_of(model)), 3), backend="aot_eager"
    )
    assert max_diff(step(params, data), whole_batch(params, data)) <= 1e-14


def test_params_given_to_the_checkpointed_function_may_differ_from_the_module() -> None:
    # A functional update: new tensors every step, the module's own weights stale. Passing the
    # block's params into the checkpointed function keeps the recompute on the params given.
    model = Net("explicit")
    params = gradaccum.params_of(model)
    step = gradaccum.accumulate(gradaccum.grad(loss_of(model)), 3)
    for seed in range(3):
        data = batch(seed=seed)
        grads = step(params, data)
        assert max_diff(grads, whole_batch(params, data)) <= 1e-14
        params = {k: p - 0.1 * grads[k] for k, p in params.items()}


def test_a_trainable_module_parameter_passed_as_another_argument_is_allowed() -> None:
    # Only the blocks are differentiated; the input layer's and head's weights come in as an
    # argument of their own (views of the module's), so the recompute reads what was passed.
    model = Net("non-reentrant")
    everything = gradaccum.params_of(model)
    trained = {k: v for k, v in everything.items() if k.startswith("blocks.")}
    fixed = {k: v for k, v in everything.items() if k not in trained}

    def loss_fn(trained: Any, fixed: Any, batch: Any) -> torch.Tensor:
        return loss_of(model)({**trained, **fixed}, batch)

    data = batch()
    step = gradaccum.accumulate(gradaccum.grad(loss_fn), 3, batch_argnum=2)
    expected = {k: v for k, v in whole_batch(everything, data).items() if k in trained}
    assert max_diff(step(trained, fixed, data), expected) <= 1e-14


# -- what is refused, and why -------------------------------------------------------------------

REENTRANT = (
    "{where}: the loss function uses torch.utils.checkpoint with use_reentrant=True, which "
    "cannot run under gradaccum's backward: it refuses torch.autograd.grad and "
    "backward(inputs=...), and under functional_call its recomputation would differentiate the "
    "module's own parameters; pass use_reentrant=False to torch.utils.checkpoint.checkpoint (or "
    "checkpoint_sequential), which gradaccum supports, selective checkpointing (context_fn=) "
    "included."
)
OTHER_WEIGHTS = (
    "{where}: activation checkpointing recomputed a Linear during the backward, which read its "
    "own parameter 'weight' (Tensor(shape=(6, 6), dtype=float64)), not the params passed in: "
    "the recomputation runs after torch.func.functional_call has returned, so the gradient "
    "would use other weights than the forward did. Pass params that share storage with the "
    "module's (gradaccum.params_of(model), stepped in place by a torch.optim optimizer), or "
    "pass them into the checkpointed function: checkpoint(lambda h, p: functional_call(block, "
    "p, (h,)), h, dict(block.named_parameters()), use_reentrant=False); set requires_grad=False "
    "on a module parameter that is not trained."
)
TORCH_FUNC = (
    "{where}: step_fn runs a torch.func transform (torch.func.grad, vjp, vmap) over activation "
    "checkpointing (torch.utils.checkpoint), which torch.func does not support ({first}). Pass "
    "the function torch.func.grad / grad_and_value returned to accumulate as it is (not "
    "wrapped, and without micro_transform), or gradaccum.grad(loss_fn): both run on "
    "torch.autograd, where checkpointing works with use_reentrant=False; or drop the "
    "checkpointing."
)
SAVED_HOOKS = (
    "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks. Please open "
    "an issue with your use case."
)
SETUP_CONTEXT = (
    "In order to use an autograd.Function with functorch transforms (vmap, grad, jvp, jacrev, "
    "...), it must override the setup_context staticmethod. For more details, please see "
    "https://pytorch.org/docs/main/notes/extending.func.html"
)
ACC = "accumulate(loss_fn, n=3)(...)"
GRAD = "gradaccum.grad(loss_fn, argnums=0, has_aux=False)(...)"


def fast_steps(loss_fn: Callable[..., torch.Tensor]) -> dict[str, tuple[str, Callable[..., Any]]]:
    """The step functions gradaccum differentiates itself: (the call in messages, the step)."""
    return {
        "accumulate(gradaccum.grad)": (ACC, gradaccum.accumulate(gradaccum.grad(loss_fn), 3)),
        "accumulate(torch.func.grad)": (ACC, gradaccum.accumulate(torch.func.grad(loss_fn), 3)),
        "gradaccum.grad": (GRAD, gradaccum.grad(loss_fn)),
    }


@pytest.mark.parametrize("mode", ["reentrant", "sequential-reentrant"])
def test_reentrant_checkpointing_is_refused_with_the_fix(mode: str) -> None:
    model = Net(mode)
    params = gradaccum.params_of(model)
    for name, (where, step) in fast_steps(loss_of(model)).items():
        with pytest.raises(ValueError, match=r"use_reentrant=True") as info:
            step(params, batch())
        assert str(info.value) == REENTRANT.format(where=where), name
        assert isinstance(info.value.__cause__, RuntimeError)  # torch's own, chained


@pytest.mark.parametrize("mode", MODES)
def test_a_recompute_that_reads_other_weights_is_refused(mode: str) -> None:
    # The params differ from the module's own weights (a functional update, a copy): the
    # recompute would read the module's, silently, as plain torch does.
    model = Net(mode)
    params = {k: p * 1.5 for k, p in gradaccum.params_of(model).items()}
    data = batch()
    plain = autograd_step(loss_of(model))(params, data)
    assert max_diff(plain, whole_batch(params, data)) > 1e-3  # torch alone: a wrong gradient
    for name, (where, step) in fast_steps(loss_of(model)).items():
        with pytest.raises(ValueError, match=r"recomputed a Linear") as info:
            step(params, data)
        assert str(info.value) == OTHER_WEIGHTS.format(where=where), name


@pytest.mark.parametrize(
    ("mode", "first"),
    [("non-reentrant", SAVED_HOOKS), ("selective", SAVED_HOOKS), ("reentrant", SETUP_CONTEXT)],
)
def test_torch_func_over_a_checkpoint_says_the_fix(mode: str, first: str) -> None:
    model = Net(mode)
    params, data = gradaccum.params_of(model), batch()
    loss_fn = loss_of(model)
    torch_grad = torch.func.grad(loss_fn)
    wrapped = gradaccum.accumulate(lambda p, b: torch_grad(p, b), 3)  # not recognised: generic
    transformed = gradaccum.accumulate(torch_grad, 3, micro_transform=lambda g: g)
    for where, step in (("accumulate(<lambda>, n=3)(...)", wrapped), (ACC, transformed)):
        with pytest.raises(ValueError, match=r"torch.func does not support") as info:
            step(params, data)
        assert str(info.value) == TORCH_FUNC.format(where=where, first=first)
        assert isinstance(info.value.__cause__, RuntimeError)


def test_other_runtime_errors_of_a_generic_step_pass_through() -> None:
    def step_fn(params: Any, batch: Any) -> Any:
        raise RuntimeError("saved tensor hooks? no: the user's own error")

    with pytest.raises(RuntimeError, match=r"^saved tensor hooks\? no: the user's own error$"):
        gradaccum.accumulate(step_fn, 2)({"w": torch.zeros(2)}, torch.zeros(4, 2))


def test_reentrant_with_no_input_requiring_grad_warns_as_in_torch() -> None:
    # Reentrant checkpointing of a block whose input does not require grad (the raw batch)
    # detaches the block: torch warns, here and in a plain loop, and the block gets no gradient.
    block = nn.Linear(4, 1).to(F64)

    def loss_fn(params: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        out = cp.checkpoint(lambda x: functional_call(block, params, (x,)), x, use_reentrant=True)
        return ((out.squeeze(-1) - y) ** 2).mean()

    with pytest.warns(UserWarning, match=r"None of the inputs have requires_grad=True"):
        gradaccum.accumulate(gradaccum.grad(loss_fn), 2)(gradaccum.params_of(block), batch())


# -- data-parallel: 2 gloo ranks, all_reduce (overlapping the last backward), reduce_scatter ----

SPLIT = (6, 4)  # rows per rank: unequal


def _shard(data: Any, rank: int) -> Any:
    start = sum(SPLIT[:rank])
    return tuple(t[start : start + SPLIT[rank]] for t in data)


def _data_parallel(rank: int, world: int) -> dict[str, Any]:
    data = batch()
    out: dict[str, Any] = {}
    for mode in MODES:
        model = Net(mode)
        params = gradaccum.params_of(model)
        expected = whole_batch(params, data)
        for overlap in (True, False):
            sync = gradaccum.all_reduce(overlap=overlap, bucket_mb=1e-4)  # several buckets
            loss_fn = loss_of(model)
            for name, fn in (
                ("gradaccum.grad_and_value", gradaccum.grad_and_value(loss_fn)),
                ("torch.func.grad_and_value", torch.func.grad_and_value(loss_fn)),
            ):
                step = gradaccum.accumulate(fn, 3, sync=sync)
                grads, _ = step(params, _shard(data, rank))
                out[f"{mode} overlap={overlap} {name}"] = max_diff(grads, expected)
    # Sharded params: the gathered params are not the module's, so a block recomputed from the
    # module is refused; passing the block's params into the checkpointed function is exact.
    sharded_ok = Net("explicit")
    params = gradaccum.params_of(sharded_ok)
    sharded = gradaccum.shard(params)
    step = gradaccum.accumulate(
        gradaccum.grad(loss_of(sharded_ok)), 3, sync=gradaccum.reduce_scatter(sharded)
    )
    mine = step(sharded, _shard(data, rank))
    theirs = gradaccum.shard(whole_batch(params, data)).shards  # the same cut of the reference
    out["explicit reduce_scatter"] = max((a - b).abs().max().item() for a, b in zip(mine, theirs))
    # Refused on every rank, none left waiting at the boundary.
    errors = {}
    module = Net("non-reentrant")
    sharded = gradaccum.shard(gradaccum.params_of(module))
    step = gradaccum.accumulate(
        gradaccum.grad(loss_of(module)), 3, sync=gradaccum.reduce_scatter(sharded)
    )
    try:
        step(sharded, _shard(data, rank))
    except ValueError as err:
        errors["reduce_scatter"] = str(err)
    for mode, params_of in (
        ("reentrant", gradaccum.params_of),
        ("non-reentrant", lambda m: {k: p * 1.5 for k, p in gradaccum.params_of(m).items()}),
    ):
        model = Net(mode)
        step = gradaccum.accumulate(gradaccum.grad(loss_of(model)), 3, sync=gradaccum.all_reduce())
        try:
            step(params_of(model), _shard(data, rank))
        except ValueError as err:
            errors[mode] = str(err)
    out["errors"] = errors
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_data_parallel_equals_the_global_batch() -> None:
    for result in values(run(_data_parallel)):
        errors = result.pop("errors")
        assert len(result) == 13
        bad = {k: v for k, v in result.items() if not v <= 1e-14}
        assert not bad, bad
        assert errors["reentrant"] == REENTRANT.format(where=ACC)
        assert errors["non-reentrant"] == OTHER_WEIGHTS.format(where=ACC)
        assert errors["reduce_scatter"] == OTHER_WEIGHTS.format(where=ACC)


def test_the_reference_model_has_the_same_weights() -> None:
    assert max_diff(gradaccum.params_of(Net("non-reentrant")), gradaccum.params_of(Net())) == 0


def test_the_guard_checks_only_modules_run_inside_the_backward() -> None:
    # While a backward is guarded, a forward outside any backward (another thread's) is not ours.
    guard = CheckpointGuard("where")
    guard.leaves = [torch.zeros(2)]
    guard._check(nn.Linear(2, 2), ())  # the module-forward hook that a guarded backward sets
