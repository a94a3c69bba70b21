"""Lightning: gradaccum's accumulated step inside a LightningModule (manual optimization).

The recipe (``GradaccumLM`` below): ``automatic_optimization = False``; the DataLoader's batch is
this rank's share of one accumulation window, and ``training_step`` is one optimizer step:
gradaccum splits the batch into ``-n`` micro-batches, accumulates the gradient of their *summed*
token loss (padded sequences, so micro-batches and ranks hold different numbers of tokens),
all-reduces it once with the window's token count (``reduction="count"``,
``sync=gradaccum.all_reduce()``), and the step writes it to ``.grad``, clips it, steps the
optimizer and the LR scheduler once. Lightning runs the loop, the ``DistributedSampler`` (its
shuffling and ``set_epoch``) and the logging; gradaccum alone sends the gradients (the DDP
wrapper Lightning puts around the module sees no gradient: the micro-steps differentiate with
respect to ``gradaccum.params_of(model)``, and in manual optimization Lightning also keeps DDP
from preparing its reducer after ``training_step``).

The processes: ``python examples/lightning_recipe.py`` is one; ``torchrun --standalone
--nproc_per_node 2 examples/lightning_recipe.py`` two. Either way the script creates the gloo
process group itself (on the loopback interface; one process gets a world of one on 127.0.0.1
and a free port), and Lightning's ``DDPStrategy`` reuses it instead of launching anything.

With ``--check`` the script also:

1. trains a plain PyTorch reference in one process on each whole global window (the same
   windows the ``DistributedSampler`` makes, the last one short), and fails (status 1) if any
   parameter differs by more than 1e-10 (float64);
2. profiles every training step and fails unless the only collectives in it are gradaccum's
   (the fingerprint and one ``all_reduce`` of the gradients), and no gradient reached the
   module's parameters through autograd (what DDP's reducer would all-reduce);
3. trains the same model with Lightning's own ``Trainer(accumulate_grad_batches=n)`` (automatic
   optimization, per-micro-batch token-mean loss, micro-batches from the DataLoader) and prints
   how far each of its windows' gradients is from the window's token-mean gradient, how its
   last short window is scaled, how many all-reduces DDP made per window, and the optimizer and
   scheduler steps: the numbers quoted in docs/lightning.md. Then once more with each
   micro-batch's loss divided by the window's token count (known in advance here), which must
   match (1e-10).

Run it (10 to 20 seconds on 2 CPU cores)::

    python examples/lightning_recipe.py --check
    torchrun --standalone --nproc_per_node 2 examples/lightning_recipe.py --check
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import math
import os
import socket
import sys
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import gradaccum

PAD, VOCAB = 0, 24  # token 0 pads
TOLERANCE = 1e-10
DTYPE = torch.float64

# Lightning asks for more DataLoader workers on machines with many cores; the data here is a
# tensor in memory. Lightning 2.6.6 with torch 2.13 also trips over a deprecation in torch's
# pytree (its own code, not this script's).
warnings.filterwarnings("ignore", ".*does not have many workers", PossibleUserWarning)
warnings.filterwarnings(
    "ignore",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    FutureWarning,
    r"lightning\.pytorch\.utilities\._pytree",
)


class TinyLM(nn.Module):
    """A tiny causal model: token embeddings, their running mean over the prefix, an MLP and a
    linear head (padding is on the right, so no real token sees it)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        prefix = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
        return self.head(torch.tanh(self.mix(torch.cat([h, prefix], dim=-1))))


def make_data(rows: int, max_len: int, seed: int) -> torch.Tensor:
    """``rows`` right-padded sequences of 2..max_len tokens (``i + 1`` often follows ``i``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len + 1, (rows,), generator=gen)
    start = torch.randint(1, VOCAB, (rows, 1), generator=gen)
    steps = torch.where(torch.rand(rows, max_len, generator=gen) < 0.7, 1, 5)
    tokens = (start + steps.cumsum(1) - steps[:, :1] - 1) % (VOCAB - 1) + 1
    return tokens.masked_fill(torch.arange(max_len) >= lengths[:, None], PAD)


def summed_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The summed cross-entropy over the non-padding next tokens, and their count."""
    targets = tokens[:, 1:]
    loss = nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=PAD, reduction="sum"
    )
    return loss, (targets != PAD).sum()


def make_optimizer(params, lr: float, windows: int):
    """AdamW with a linear warm-up over the first quarter of the windows, then constant."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, windows // 4)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )


# -- the recipe ---------------------------------------------------------------------------------


class GradaccumLM(L.LightningModule):
    """One ``training_step`` per window: gradaccum accumulates ``n`` micro-batches and syncs."""

    def __init__(self, n: int, lr: float, windows: int, max_norm: float, seed: int) -> None:
        super().__init__()
        self.automatic_optimization = False  # gradaccum makes the window's gradient
        torch.manual_seed(seed)
        self.model = TinyLM().to(DTYPE)  # the same weights on every rank
        self.n, self.lr, self.windows, self.max_norm = n, lr, windows, max_norm

    def configure_optimizers(self):
        optimizer, scheduler = make_optimizer(self.model.parameters(), self.lr, self.windows)
        return [optimizer], [scheduler]

    def on_train_start(self) -> None:
        # The process group exists and the model is on its device: build the accumulated step.
        self.params = gradaccum.params_of(self.model)  # views: optimizer steps update them
        buffers = gradaccum.buffers_of(self.model)

        def summed_loss(params, tokens):
            logits, _ = gradaccum.call_module(self.model, params, buffers, tokens)
            return summed_token_loss(logits, tokens)

        self.accumulated = gradaccum.accumulate(
            gradaccum.grad_and_value(summed_loss, has_aux=True),
            self.n,
            has_aux=True,
            reduction="count",  # divide by the window's token count over all ranks
            count=lambda aux: aux[1],
            sync=gradaccum.all_reduce() if dist.is_initialized() else None,
        )

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> None:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        grads, (token_loss, _) = self.accumulated(self.params, tokens)
        grads, norm = gradaccum.boundary.clip_by_global_norm(grads, self.max_norm)
        gradaccum.write_grads(self.model, grads)
        optimizer.step()
        scheduler.step()  # once per window
        # This rank's token mean (the global one would need the ranks' sums: another all_reduce).
        self.log("token_loss", token_loss, prog_bar=True)
        self.log("grad_norm", norm)


# -- checks -------------------------------------------------------------------------------------


def init_distributed() -> tuple[int, int]:
    """The default gloo process group: torchrun's, or a world of one on 127.0.0.1."""
    names = [name for _, name in getattr(socket, "if_nameindex", list)()]
    if os.environ.get("WORLD_SIZE", "1") == os.environ.get("LOCAL_WORLD_SIZE", "1"):
        # Every rank is on this machine: keep gloo's traffic on the loopback interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if "lo0" in names else "lo")
    timeout = datetime.timedelta(seconds=120)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=timeout)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", init_method=url, rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def trainer(world: int, epochs: int, callbacks: list, **kwargs) -> L.Trainer:
    """A Trainer on the process group that exists (Lightning skips its own initialisation)."""
    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def global_windows(data: torch.Tensor, epochs: int, rows: int) -> list[torch.Tensor]:
    """The global windows the DistributedSampler makes: ``rows`` consecutive indices of each
    epoch's permutation (rank ``r`` holds every ``world``-th of them), the last one short."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        out += [data[idx] for idx in order.split(rows)]
    return out


def token_mean_grad(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of the window's token-mean loss at the model's current parameters."""
    params = {k: p.detach() for k, p in model.named_parameters()}

    def token_mean(params):
        loss, count = summed_token_loss(
            torch.func.functional_call(model, params, (tokens,)), tokens
        )
        return loss / count

    return torch.func.grad(token_mean)(params)


class Collectives(L.Callback):
    """Counts the collectives of every training batch with the profiler (gloo's own events, so
    DDP's reducer counts too) and the gradients autograd accumulates into the parameters."""

    def __init__(self, model: nn.Module) -> None:
        self.per_batch: list[list[str]] = []
        self.autograd_grads = 0
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._seen)

    def _seen(self, p: torch.Tensor) -> None:
        self.autograd_grads += 1

    def on_train_start(self, trainer, pl_module) -> None:
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.mark = torch.profiler.record_function("train batch")
        self.mark.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.mark.__exit__(None, None, None)

    def on_train_end(self, trainer, pl_module) -> None:
        self.profiler.__exit__(None, None, None)
        events = self.profiler.events()
        gloo = sorted((e.time_range.start, e.name) for e in events if e.name.startswith("gloo:"))
        for mark in sorted(
            (e.time_range.start, e.time_range.end) for e in events if e.name == "train batch"
        ):
            self.per_batch.append([name for at, name in gloo if mark[0] <= at <= mark[1]])


def check_recipe(args, rank: int, world: int, data: torch.Tensor) -> tuple[bool, list[str]]:
    """Train the recipe; compare with a whole-window reference; count the collectives."""
    window_rows = args.window // world
    loader = DataLoader(data, batch_size=window_rows, shuffle=True)  # Lightning shards it
    windows = global_windows(data, args.epochs, args.window)
    lm = GradaccumLM(args.n, args.lr, len(windows), args.max_norm, args.seed)
    reference = copy.deepcopy(lm.model)
    counter = Collectives(lm.model)
    logged: list[list[gradaccum.sync.Collective]] = []

    class Record(L.Callback):  # what gradaccum says it sent, window by window
        def on_train_batch_start(self, *_) -> None:
            self.recording = gradaccum.sync.record_collectives()
            logged.append(self.recording.__enter__())

        def on_train_batch_end(self, *_) -> None:
            self.recording.__exit__(None, None, None)

    group = dist.group.WORLD
    fit = trainer(world, args.epochs, [counter, Record()])
    fit.fit(lm, loader)
    reused = dist.group.WORLD is group

    # The reference: plain PyTorch, one process, each whole global window.
    optimizer, scheduler = make_optimizer(reference.parameters(), args.lr, len(windows))
    for tokens in windows:
        optimizer.zero_grad()
        loss, count = summed_token_loss(reference(tokens), tokens)
        (loss / count).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), args.max_norm)
        optimizer.step()
        scheduler.step()
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(lm.model.parameters(), reference.parameters(), strict=True)
    )
    sizes = [len(t) for t in windows[: math.ceil(len(data) / args.window)]]
    ours = [[f"gloo:{c.kind}" for c in log] for log in logged]
    same = counter.per_batch == ours
    # The first window also agrees on the order its gradients became ready in (once, see
    # docs/sync.md); the later windows' buckets follow it.
    first = PER_WINDOW + [("all_reduce", "bucket order")] * (world > 1)
    expected = all(
        [(c.kind, c.purpose) for c in log] == (PER_WINDOW if i else first)
        for i, log in enumerate(logged)
    )
    worst = torch.tensor([diff, not same, not expected, counter.autograd_grads], dtype=DTYPE)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    diff, same, expected, autograd_grads = worst[0].item(), not worst[1], not worst[2], worst[3]
    ok = diff <= TOLERANCE and same and expected and autograd_grads == 0 and reused
    per_window = ", ".join(f"{c.kind} ({c.purpose})" for c in logged[-1])
    return ok, [
        f"{world} process(es), {type(fit.strategy).__name__} on the script's gloo group "
        f"(reused: {reused}); "
        f"{args.epochs} epochs of {len(data)} sequences, windows of {sizes} sequences "
        f"({window_rows} per rank and n={args.n} micro-batches, the last window short)",
        f"recipe: {fit.global_step} optimizer steps for {len(windows)} windows, scheduler at "
        f"step {fit.lr_scheduler_configs[0].scheduler.last_epoch}",
        f"recipe: collectives per window: {per_window}; all the profiler saw: {same}; "
        f"gradients autograd wrote into the module's parameters: {int(autograd_grads)}",
        f"max parameter difference: {diff:.3e} (tolerance {TOLERANCE:g}) "
        f"{'OK' if ok else 'FAILED'}",
    ]


PER_WINDOW = [("all_reduce", "fingerprint"), ("all_reduce", "gradients")]


# -- Lightning's own accumulate_grad_batches, measured ------------------------------------------


class LightningAccumLM(L.LightningModule):
    """The usual Lightning way: the per-micro-batch token-mean loss, automatic optimization."""

    def __init__(
        self, model: nn.Module, lr: float, windows: list[torch.Tensor], scale: int
    ) -> None:
        super().__init__()
        self.model, self.lr, self.windows, self.scale = model, lr, windows, scale
        self.errors: list[tuple[int, float, float]] = []  # (micro-batches, error, norm ratio)
        self.micro_batches = 0

    def configure_optimizers(self):
        optimizer, scheduler = make_optimizer(self.model.parameters(), self.lr, len(self.windows))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.micro_batches += 1
        loss, count = summed_token_loss(self.model(tokens), tokens)
        if not self.scale:
            return loss / count  # Lightning divides it by accumulate_grad_batches
        # The fix (HF's num_items_in_batch): the summed loss over the window's token count on
        # all ranks, known in advance here, times k * world against Lightning's / k and DDP's mean.
        window = self.windows[len(self.errors)]
        return loss * self.scale / (window[:, 1:] != PAD).sum()

    def on_before_optimizer_step(self, optimizer) -> None:
        # The gradient Lightning is about to step with (DDP's mean over the ranks), against the
        # token-mean gradient of the same global window at the same parameters.
        whole = token_mean_grad(self.model, self.windows[len(self.errors)])
        got = {k: p.grad for k, p in self.model.named_parameters()}
        g, g_window = (torch.cat([t[k].flatten() for k in whole]) for t in (got, whole))
        error = ((g - g_window).norm() / g_window.norm()).item()
        self.errors.append((self.micro_batches, error, (g.norm() / g_window.norm()).item()))
        self.micro_batches = 0


def fit_lightning(args, world: int, data: torch.Tensor, scale: int = 0):
    """Trainer(accumulate_grad_batches=n) on the same data, windows and schedule."""
    micro_rows = args.window // world // args.n
    loader = DataLoader(data, batch_size=micro_rows, shuffle=True)
    windows = global_windows(data, args.epochs, args.window)
    torch.manual_seed(args.seed)
    lm = LightningAccumLM(TinyLM().to(DTYPE), args.lr, windows, scale)
    counter = Collectives(lm.model)
    callbacks = [] if scale else [counter]  # the fixed run's collectives are the plain run's
    fit = trainer(world, args.epochs, callbacks, accumulate_grad_batches=args.n)
    fit.fit(lm, loader)
    return lm, fit, counter, windows


def measure_lightning(args, rank: int, world: int, data: torch.Tensor) -> tuple[bool, list[str]]:
    """Lightning's accumulation measured: gradient errors, steps, collectives."""
    lm, fit, counter, windows = fit_lightning(args, world, data)
    fixed, _, _, _ = fit_lightning(args, world, data, scale=args.n * world)
    # The profiler's gloo events of each micro-batch, grouped into windows.
    patterns, others, at = set(), collections.Counter(), 0
    for micro, _, _ in lm.errors:
        window = counter.per_batch[at : at + micro]
        patterns.add(tuple(events.count("gloo:all_reduce") for events in window))
        others.update(e for events in window for e in events if e != "gloo:all_reduce")
        at += micro
    full = [e for e in lm.errors if e[0] == args.n]
    short = [e for e in lm.errors if e[0] < args.n]
    stats = torch.tensor(
        [
            max(e for _, e, _ in full),
            max((e for _, e, _ in short), default=0.0),
            max(e for _, e, _ in fixed.errors),
        ],
        dtype=DTYPE,
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    scheduler = fit.lr_scheduler_configs[0].scheduler
    per_epoch = [m for m, _, _ in lm.errors[: len(lm.errors) // args.epochs]]
    return stats[2].item() <= TOLERANCE, [
        f"accumulate_grad_batches={args.n}: {fit.global_step} optimizer steps for "
        f"{len(windows)} windows, scheduler at step {scheduler.last_epoch}, micro-batches per "
        f"window in an epoch {per_epoch}",
        f"accumulate_grad_batches={args.n}: gradient error |g - g_window| / |g_window| against "
        f"the window's token-mean gradient: full windows up to {stats[0].item():.1%}, short last "
        f"windows up to {stats[1].item():.1%}",
        f"accumulate_grad_batches={args.n}: short last windows ({short[0][0] if short else 0} of "
        f"{args.n} micro-batches): gradient norm / the token-mean gradient's norm: "
        f"{', '.join(f'{r:.3f}' for _, _, r in short)}",
        f"accumulate_grad_batches={args.n}, returning each micro-batch's summed loss * "
        f"{args.n} * {world} / the window's tokens on all ranks (counted in advance): gradient "
        f"error up to {stats[2].item():.1e}",
        f"accumulate_grad_batches={args.n}: all_reduce calls in the micro-batches of a window: "
        f"{' and '.join(str(list(p)) for p in sorted(patterns, key=len, reverse=True))}; other "
        f"collectives in the whole run: {dict(others) or 'none'}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    # Not --n: torchrun would take it for an abbreviation of its own --nnodes / --nproc-per-node.
    parser.add_argument("-n", "--micro-batches", dest="n", type=int, default=4)
    parser.add_argument("--window", type=int, default=16, help="global window, in sequences")
    parser.add_argument("--sequences", type=int, default=44, help="the dataset's size")
    parser.add_argument("--max-len", type=int, default=16, help="longest sequence, in tokens")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--check", action="store_true", help="compare; measure Lightning's own")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.window % (world * args.n) or args.sequences % world:
        parser.error(
            f"need --window a multiple of n * processes ({args.n * world}) and --sequences a "
            f"multiple of the processes ({world}): a DistributedSampler pads the dataset to a "
            f"multiple of the processes with repeated sequences"
        )
    torch.set_num_threads(1)  # the model is tiny: one intra-op thread per process is the fastest

    rank, world = init_distributed()
    try:
        data = make_data(args.sequences, args.max_len, args.seed)
        if not args.check:
            window_rows = args.window // world
            loader = DataLoader(data, batch_size=window_rows, shuffle=True)
            windows = math.ceil(len(data) / args.window) * args.epochs
            lm = GradaccumLM(args.n, args.lr, windows, args.max_norm, args.seed)
            trainer(world, args.epochs, []).fit(lm, loader)
            return 0
        ok, lines = check_recipe(args, rank, world, data)
        fixed, more = measure_lightning(args, rank, world, data)
        ok, lines = ok and fixed, lines + more
        if rank == 0:
            print(*lines, "OK" if ok else "FAILED", sep="\n", flush=True)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
