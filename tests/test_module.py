"""nn.Module / torch.optim interop, BatchNorm buffers threaded through micro-batches."""

from __future__ import annotations

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
