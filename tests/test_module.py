"""nn.Module / torch.optim interop, BatchNorm buffers threaded through micro-batches."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from models import F64, max_diff
from torch.func import functional_call, grad, grad_and_value

import gradaccum


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(), torch.nn.Linear(6, 1)
    ).to(F64)


def _data(rows: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(rows, 4, generator=g, dtype=F64), torch.randn(rows, generator=g, dtype=F64)


def test_params_of_shares_storage_and_skips_frozen() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].bias.requires_grad_(False)
    params = gradaccum.params_of(model)
    assert sorted(params) == ["0.weight", "1.bias", "1.weight"]
    with torch.no_grad():
        model[1].weight.add_(1.0)
    assert torch.equal(params["1.weight"], model[1].weight)
    assert not params["1.weight"].requires_grad


def test_batchnorm_buffers_thread_through_micro_batches_like_a_hand_loop() -> None:
    n, (x, y) = 4, _data()
    # Reference: the hand-written loop, one forward per micro-batch in training mode.
    ref_model = _bn_model()
    for xb, yb in zip(x.chunk(n), y.chunk(n), strict=True):
        loss = ((ref_model(xb).squeeze(-1) - yb) ** 2).mean() * (len(xb) / len(x))
        loss.backward()

    model = _bn_model()
    params, buffers = gradaccum.params_of(model), gradaccum.buffers_of(model)

    def loss_fn(params, batch):
        xb, yb = batch
        out, new_buffers = gradaccum.call_module(model, params, buffers, xb)
        return ((out.squeeze(-1) - yb) ** 2).mean(), new_buffers

    def step(params, batch):
        grads, (loss, new_buffers) = grad_and_value(loss_fn, has_aux=True)(params, batch)
        gradaccum.update_buffers(buffers, new_buffers)  # outside the transform, in order
        return grads, loss

    grads, _ = gradaccum.accumulate(step, n, has_aux=True)(params, (x, y))
    ref_grads = {k: p.grad for k, p in ref_model.named_parameters()}
    assert max_diff(grads, ref_grads) < 1e-12
    for k, b in ref_model.named_buffers():
        assert torch.allclose(model.get_buffer(k).to(b.dtype), b, rtol=0, atol=1e-12), k
    assert int(model.get_buffer("1.num_batches_tracked")) == n


def test_batchnorm_breaks_whole_batch_equivalence_and_the_checker_says_so() -> None:
    model, (x, y) = _bn_model(), _data()
    model.train()

    def loss_fn(params, batch):
        xb, yb = batch
        out, _ = gradaccum.call_module(model, params, gradaccum.buffers_of(model), xb)
        return ((out.squeeze(-1) - yb) ** 2).mean()

    result = gradaccum.testing.compare(grad(loss_fn), gradaccum.params_of(model), (x, y), 4)
    assert not result.ok
    assert result.worst.path.startswith("['")


def test_write_grads_then_optimizer_and_scheduler_step_once_per_boundary() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(F64)
    twin = torch.nn.Linear(4, 1).to(F64)
    twin.load_state_dict(model.state_dict())
    x, y = _data(32)

    def loss_fn(params, batch):
        xb, yb = batch
        return ((functional_call(model, params, (xb,)).squeeze(-1) - yb) ** 2).mean()

    step = gradaccum.accumulate(grad(loss_fn), 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    twin_sched = torch.optim.lr_scheduler.StepLR(twin_opt, step_size=1, gamma=0.5)
    for _ in range(3):
        gradaccum.write_grads(model, step(gradaccum.params_of(model), (x, y)))
        opt.step()
        sched.step()
        twin_opt.zero_grad()
        ((twin(x).squeeze(-1) - y) ** 2).mean().backward()
        twin_opt.step()
        twin_sched.step()
    assert sched.get_last_lr() == twin_sched.get_last_lr() == [0.1 * 0.5**3]
    for (k, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-12), k


def test_write_grads_casts_to_param_dtype_and_replaces() -> None:
    lin = torch.nn.Linear(2, 1)
    lin.weight.grad = torch.full((1, 2), 7.0)
    gradaccum.write_grads(lin, {"weight": torch.ones(1, 2, dtype=F64), "bias": torch.ones(1)})
    assert lin.weight.grad.dtype == torch.float32
    assert torch.equal(lin.weight.grad, torch.ones(1, 2))


def test_update_buffers_accepts_a_module() -> None:
    bn = torch.nn.BatchNorm1d(2)
    gradaccum.update_buffers(bn, {"running_mean": torch.ones(2)})
    assert torch.equal(bn.running_mean, torch.ones(2))


# -- call_module's cached slots (issue 28: no module walk per call) ------------------------------


class _Tied(torch.nn.Module):
    """An embedding and an output head that share one weight, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.mid = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.ones(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(idx)) + self.shift))


def test_call_module_equals_functional_call_with_tied_weights() -> None:
    torch.manual_seed(0)
    model = _Tied().to(F64)
    idx = torch.tensor([0, 3, 4])
    params = {k: v + 0.5 for k, v in gradaccum.params_of(model).items()}  # others than the module's
    assert "head.weight" not in params  # one name per tied tensor, as named_parameters gives
    for _ in range(3):  # the first call builds the slots, the later ones reuse them
        out, _ = gradaccum.call_module(model, params, gradaccum.buffers_of(model), idx)
        want = functional_call(model, {**params, **gradaccum.buffers_of(model)}, (idx,))
        assert torch.equal(out, want)
    # The module's own tensors are back in place after each call.
    assert model.head.weight is model.emb.weight
    assert torch.equal(model(idx), functional_call(model, dict(model.named_parameters()), (idx,)))


def test_call_module_follows_a_replaced_submodule_and_a_new_parameter() -> None:
    torch.manual_seed(0)
    layers = (torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    model = torch.nn.Sequential(*layers).to(F64)
    x = torch.randn(4, 2, dtype=F64)
    gradaccum.call_module(model, gradaccum.params_of(model), {}, x)
    model[2] = torch.nn.Linear(3, 2).to(F64)  # replaced after the slots were built
    params = gradaccum.params_of(model)
    out, _ = gradaccum.call_module(model, params, {}, x)
    assert out.shape == (4, 2)
    assert torch.equal(out, model(x))
    model[0].register_parameter("extra", torch.nn.Parameter(torch.zeros(1, dtype=F64)))
    with pytest.raises(ValueError, match=re.escape("missing trainable parameters ['0.extra']")):
        gradaccum.call_module(model, params, {}, x)  # the new parameter is seen, and missing


def test_call_module_sees_a_parameter_unfrozen_between_calls() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)).to(F64)
    model[0].bias.requires_grad_(False)
    params, x = gradaccum.params_of(model), torch.randn(3, 2, dtype=F64)
    gradaccum.call_module(model, params, {}, x)
    model[0].bias.requires_grad_(True)  # no new object: only requires_grad changed
    with pytest.raises(ValueError, match=re.escape("missing trainable parameters ['0.bias']")):
        gradaccum.call_module(model, params, {}, x)


def test_call_module_puts_the_module_back_when_the_forward_raises() -> None:
    class Boom(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Boom(2, 1))
    own = dict(model.named_parameters())
    params = {k: torch.zeros_like(v) for k, v in own.items()}
    with pytest.raises(RuntimeError, match="boom"):
        gradaccum.call_module(model, params, {}, torch.randn(3, 2))
    assert all(p is own[k] for k, p in model.named_parameters())


def test_call_module_unknown_keys_without_strict_go_through_functional_call() -> None:
    model = torch.nn.Linear(2, 1).to(F64)
    x = torch.randn(3, 2, dtype=F64)
    params = {**gradaccum.params_of(model), "not_there": torch.zeros(1, dtype=F64)}
    out, _ = gradaccum.call_module(model, params, {}, x, strict=False)
    assert torch.equal(out, model(x))
    assert not hasattr(model, "not_there")  # set for the call only, as functional_call does


@pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")
def test_call_module_of_a_scripted_or_data_parallel_module_raises_as_functional_call() -> None:
    model = torch.nn.Linear(2, 1)
    x = torch.randn(3, 2)
    for wrapped in (torch.jit.script(model), torch.nn.DataParallel(model)):
        params = {k: v.detach() for k, v in wrapped.named_parameters()}
        with pytest.raises(RuntimeError) as want:
            functional_call(wrapped, params, (x,))
        with pytest.raises(RuntimeError, match=re.escape(str(want.value))):
            gradaccum.call_module(wrapped, params, {}, x)


class _Scale(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def _modules_of_every_shape() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    shared = torch.nn.Linear(3, 3)
    parametrized = torch.nn.Linear(3, 3)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", _Scale())
    return {
        "shared submodule": torch.nn.Sequential(shared, torch.nn.Tanh(), shared),
        "parametrization": torch.nn.Sequential(parametrized, torch.nn.Tanh()),
        "buffers": torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)),
        "tied": _Tied(),
    }


@pytest.mark.parametrize("name", list(_modules_of_every_shape()))
def test_call_module_equals_functional_call_on_every_module_shape(name: str) -> None:
    model = _modules_of_every_shape()[name].to(F64)
    x = torch.tensor([0, 3, 4]) if name == "tied" else torch.randn(5, 3, dtype=F64)
    params = {k: v * 1.5 for k, v in gradaccum.params_of(model).items()}
    own = dict(model.named_parameters(remove_duplicate=False))
    for _ in range(2):  # the first call builds the slots, the second reuses them
        buffers = gradaccum.buffers_of(model)
        before = {k: v.clone() for k, v in buffers.items()}
        out, new_buffers = gradaccum.call_module(model, params, buffers, x)
        # On a copy: torch's functional_call leaves a shared submodule's parameter replaced by
        # the given tensor (it restores the two names in order, not in reverse; torch 2.13).
        twin = copy.deepcopy(model)
        want = functional_call(twin, {**params, **{k: v.clone() for k, v in before.items()}}, (x,))
        assert torch.equal(out, want)
        for k, v in buffers.items():  # the buffers passed in are untouched; copies were updated
            assert torch.equal(v, before[k])
            assert new_buffers[k] is not v
    assert all(p is own[k] for k, p in model.named_parameters(remove_duplicate=False))
