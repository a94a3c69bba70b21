"""A user's 2-rank script, written top to bottom, that finishes and exits normally.

``tests/test_exit.py`` runs it as torchrun would, ``python exit_shapes.py SHAPE`` on each of 2
ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set), and checks that each rank
exits with code 0. Everything lives in module globals, as in such a script: the windows, the
step, the sync, the sharded params, the model. The script calls
``dist.destroy_process_group()`` as docs/reliability.md says, then returns: the interpreter
finalizes by itself.

The shapes (issue 35 measured 2 to 6 aborts in 20 runs of the first five before the fix):

- ``windows``: ``loop.windows(data, n, sync=all_reduce())`` iterated, nothing else;
- ``windows_timeout``: the same with ``all_reduce(timeout=15)``;
- ``step``: a plain ``loop.Step`` + ``loop.windows`` job;
- ``coupled``: a ``loop.Coupled`` job (``Step.add_window``);
- ``accumulate``: ``gradaccum.accumulate`` with an ``all_reduce`` sync;
- ``fsdp2``: an FSDP2 (``fully_shard``) model through ``gradaccum.shard`` and
  ``reduce_scatter``; the model's DTensors keep their ``DeviceMesh``, which keeps its process
  groups, past ``destroy_process_group()``: the user's own reference;
- ``dcp``: ``gradaccum.shard`` params saved with ``gradaccum.checkpoint.dcp_save`` (torch's DCP
  runs its own collectives) on a mesh the script keeps;
- ``pure``: no gradaccum: a module-level reference to the default group, one ``all_reduce``
  (torch's own abort, the control of the stress run; its ``--keep-group`` twin is every shape
  with ``KEEP_GROUP=1``).

With ``KEEP_GROUP=1`` the script also keeps the default group in a global, as the ``pure`` shape
does: then no gradaccum object frees it, and the process exits with it alive.

Each rank prints one line ``RESULT rank=R shape=S freed=F kept=K`` after
``destroy_process_group()``: ``freed`` whether the default group object was freed by then
(no garbage collection pass in between: what a reference cycle holds is not freed), ``kept``
how many of gradaccum's ended CPU collectives on it are still referenced from Python (so that no
gloo worker thread frees them; see ``gradaccum/_dist/inflight.py``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from gradaccum import loop
from gradaccum._dist import inflight

SHAPE = sys.argv[1]
N = 4  # micro-batches per window
WINDOWS = 3

dist.init_process_group("gloo")
RANK = dist.get_rank()
GROUP = weakref.ref(dist.distributed_c10d._get_default_group())
if os.environ.get("KEEP_GROUP") == "1" or SHAPE == "pure":
    KEPT_GROUP = dist.distributed_c10d._get_default_group()

torch.manual_seed(RANK)
data = [(torch.randn(3, 5), torch.randn(3, 1)) for _ in range(N * WINDOWS)]
model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(m(x), y)


def embed(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return m(batch[0])


def coupled_loss(m: nn.Module, reps: torch.Tensor, rows: gradaccum.Rows) -> torch.Tensor:
    return (reps.square().sum(-1)[rows.local]).sum() / rows.total


def functional_loss(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> Any:
    x, y = batch
    return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


def whole(w: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*data[w * N : (w + 1) * N])
    return torch.cat(xs), torch.cat(ys)


if SHAPE in ("windows", "windows_timeout"):
    sync = gradaccum.all_reduce(timeout=15 if SHAPE == "windows_timeout" else None)
    windows = loop.windows(data, N, sync=sync)
    for window in windows:
        batches = list(window)
elif SHAPE in ("step", "coupled"):
    windows = loop.windows(data, N, sync=gradaccum.all_reduce())
    loss = loss_fn if SHAPE == "step" else loop.Coupled(embed, coupled_loss)
    step = loop.Step(model, loss, optimizer, data=windows)
    for window in windows:
        if SHAPE == "step":
            for batch in window:
                step.add(batch)
        else:
            step.add_window(window)
        stats = step.apply()
elif SHAPE == "accumulate":
    params = {k: v.detach() for k, v in model.named_parameters()}
    accumulated = gradaccum.accumulate(
        torch.func.grad(functional_loss), N, sync=gradaccum.all_reduce()
    )
    for w in range(WINDOWS):
        grads = accumulated(params, whole(w))
elif SHAPE == "fsdp2":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = gradaccum.shard(model)

    def fsdp_loss(params: object, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        out, _ = gradaccum.call_module(model, params, {}, x)
        return nn.functional.mse_loss(out, y)

    accumulated = gradaccum.accumulate(
        gradaccum.grad(fsdp_loss), N, sync=gradaccum.reduce_scatter(sharded)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for w in range(WINDOWS):
        grads = accumulated(sharded, whole(w))
        sharded.write_grads(grads)
        optimizer.step()
        optimizer.zero_grad()
elif SHAPE == "dcp":
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    sharded = gradaccum.shard(params, mesh)
    optimizer = torch.optim.SGD(sharded.shards, lr=0.1)
    accumulated = gradaccum.accumulate(
        torch.func.grad(functional_loss), N, sync=gradaccum.reduce_scatter(sharded)
    )
    for w in range(WINDOWS):
        grads = accumulated(sharded.gather(), whole(w))
        sharded.write_grads(grads)
        optimizer.step()
        optimizer.zero_grad()
    # Each rank writes its own folder's worth under one id that rank 0 picks (shared /tmp).
    folder = os.path.join(tempfile.gettempdir(), f"gradaccum-exit-{os.environ['MASTER_PORT']}")
    gradaccum.checkpoint.dcp_save(folder, sharded, optimizer)
elif SHAPE == "pure":
    t = torch.ones(3)
    dist.all_reduce(t)
else:
    raise SystemExit(f"exit_shapes.py: unknown shape {SHAPE!r}")

ended = getattr(inflight, "ended", None)  # (the stress run also runs older gradaccums)
kept = len(ended(GROUP())) if ended is not None and GROUP() is not None else 0
dist.destroy_process_group()
print(f"RESULT rank={RANK} shape={SHAPE} freed={GROUP() is None} kept={kept}", flush=True)
