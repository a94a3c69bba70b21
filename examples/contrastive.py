"""Contrastive sentence encoder: InfoNCE over a large global batch, in small micro-batches.

A tiny transformer sentence encoder (token and position embeddings, one self-attention block,
mean pooling, a linear projection, unit-length output) learns to match two noisy views of the
same random "sentence" (token ids; each view replaces a quarter of the tokens at random), with
the multiple-negatives ranking loss of sentence-transformers: InfoNCE with in-batch negatives,
where each anchor's positive is the other view of its sentence and every other positive of the
*global* batch is a negative.

The loss couples the batch's examples, so plain accumulation changes it: each micro-batch would
only see its own negatives. ``gradaccum.coupled(embed, loss, n)`` computes the loss of the whole
global batch exactly, over ``-n`` micro-batches per rank (GradCache: each micro-batch is embedded
once without a graph, the loss and its gradient for the embeddings are computed on all of them,
then each micro-batch is embedded again and back-propagates its slice). Under torchrun, with
``sync=gradaccum.all_reduce()``, the embeddings of every rank are gathered for the negatives and
the targets are global offsets, ``rows.arange()``.

Side by side, on the same batches with the same AdamW optimizer, the script trains:

- the coupled run (``gradaccum.coupled``, ``-n`` micro-batches per rank);
- the whole-batch run: the same model with the loss on the whole global batch at once, in one
  process (every rank computes it, without communicating);
- with ``--naive``, plain per-micro-batch accumulation (``gradaccum.accumulate`` of each
  micro-batch's InfoNCE with its own in-batch negatives only), which trains another model.

It prints the largest difference between the coupled and the whole-batch gradient at step 1,
between their loss curves and between their final parameters, and exits with status 1 if one
exceeds its tolerance (in float64 1e-12 for the gradient and 1e-9 for the others, 1e-4 in
float32); with ``--naive``, how far plain accumulation is from the whole-batch run. The loss
curves are the objective on the global batch (for the naive run too, evaluated on the global
batch before each step).

Run it (5 to 15 s on 2 CPU cores)::

    python examples/contrastive.py
    python examples/contrastive.py --dtype float64 --naive
    torchrun --standalone --nproc_per_node 2 examples/contrastive.py --dtype float64
    python examples/contrastive.py --naive --plot loss.png   # the loss curves (needs matplotlib)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
from _plot import loss_curves
from _ranks import init_distributed, max_diff, worst_over_ranks
from torch import nn
from torch.func import functional_call, grad_and_value
from tqdm import tqdm

import gradaccum

DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}
GRAD_TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-4}
VOCAB, LENGTH, NOISE = 512, 16, 0.25
SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss: cosine similarity x 20


class SentenceEncoder(nn.Module):
    """Token ids ``[rows, LENGTH]`` -> unit-length sentence embeddings ``[rows, out]``."""

    def __init__(self, dim: int = 32, heads: int = 2, out: int = 32) -> None:
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(LENGTH, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No bias on q, k, v: the key bias's gradient is zero in exact arithmetic (the softmax
        # ignores a score added to a whole row), so it would hold nothing but rounding noise,
        # which AdamW scales up to steps of the learning rate's size.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.out = nn.Linear(dim, out)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        h = h + self.mlp(self.norm2(h))
        return nn.functional.normalize(self.out(h.mean(dim=1)), dim=-1)


def make_pairs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random sentences, two noisy views of each: ``(anchors, positives)`` token ids.

    Generated from ``seed`` alone, so every rank makes the same global batch without talking.
    """
    gen = torch.Generator().manual_seed(seed)
    sentences = torch.randint(VOCAB, (rows, LENGTH), generator=gen)

    def view() -> torch.Tensor:
        replace = torch.rand(rows, LENGTH, generator=gen) < NOISE
        return torch.where(replace, torch.randint(VOCAB, (rows, LENGTH), generator=gen), sentences)

    return view(), view()


def run(args: argparse.Namespace, rank: int, world: int) -> int:
    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    model = SentenceEncoder().to(dtype)  # the same initial weights on every rank
    reference = copy.deepcopy(model)  # the whole-batch run, in this process
    naive_model = copy.deepcopy(model) if args.naive else None

    def embed(params, batch, m: nn.Module = model) -> dict[str, torch.Tensor]:
        anchors, positives = batch
        return {
            "anchor": functional_call(m, params, (anchors,)),
            "positive": functional_call(m, params, (positives,)),
        }

    def info_nce(params, reps: dict[str, torch.Tensor], rows: gradaccum.Rows) -> torch.Tensor:
        """This rank's share of the global batch's InfoNCE (multiple-negatives ranking loss).

        ``reps`` holds every rank's rows; this rank's anchors (``rows.local``) are scored
        against all positives, and anchor ``i``'s positive is row ``i`` of the global batch: the
        targets are global offsets. Summed and divided by the global rows, the ranks' shares add
        up to the mean over the global batch.
        """
        scores = SCALE * reps["anchor"][rows.local] @ reps["positive"].T
        target = rows.arange(scores.device)
        return nn.functional.cross_entropy(scores, target, reduction="sum") / rows.total

    def whole_loss(params, batch, m: nn.Module = model) -> torch.Tensor:
        """The loss on a whole batch at once: one process, all its rows (the reference)."""
        rows = len(batch[0])
        return info_nce(params, embed(params, batch, m), gradaccum.Rows(0, rows, rows, (rows,)))

    sync = gradaccum.all_reduce() if world > 1 else None
    step = gradaccum.coupled(embed, info_nce, args.n, sync=sync)
    ref_step = grad_and_value(lambda p, b: whole_loss(p, b, reference))
    params, ref_params = gradaccum.params_of(model), gradaccum.params_of(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.01)
    if naive_model is not None:
        # Plain accumulation: each micro-batch's InfoNCE with its own in-batch negatives, the
        # micro-batches' mean losses averaged (weighted by rows) and all_reduced over the ranks.
        naive_step = gradaccum.accumulate(
            grad_and_value(lambda p, b: whole_loss(p, b, naive_model)), args.n, sync=sync
        )
        naive_params = gradaccum.params_of(naive_model)
        naive_optimizer = torch.optim.AdamW(naive_model.parameters(), lr=args.lr, weight_decay=0.01)

    shard_rows = [len(s) for s in torch.arange(args.batch).tensor_split(world)]
    micro_rows = [len(m) for m in torch.arange(shard_rows[rank]).tensor_split(args.n)]
    say(
        f"{world} process(es); global batch {args.batch} pairs = {shard_rows} per rank, "
        f"{args.n} micro-batches per rank of {micro_rows} pairs (rank 0), {args.dtype}; "
        f"{sum(p.numel() for p in params.values())} parameters"
    )

    coupled_name = f"coupled, n={args.n} per rank"
    naive_name = "plain accumulation (per-micro-batch negatives)"
    curves: dict[str, list[float]] = {"whole batch": [], coupled_name: []}
    if naive_model is not None:
        curves[naive_name] = []
    grad_diff = naive_grad_diff = 0.0
    started = time.perf_counter()
    progress = tqdm(range(args.steps), unit="step", disable=rank != 0)
    for i in progress:
        anchors, positives = make_pairs(args.batch, seed=args.seed * 100_000 + i)
        anchors, positives = anchors.tensor_split(world), positives.tensor_split(world)
        whole = (torch.cat(anchors), torch.cat(positives))
        grads, loss = step(params, (anchors[rank], positives[rank]))  # the global batch's
        ref_grads, ref_loss = ref_step(ref_params, whole)
        curves[coupled_name].append(loss.item())
        curves["whole batch"].append(ref_loss.item())
        if i == 0:
            grad_diff = max_diff(grads, ref_grads)
        if naive_model is not None:
            with torch.no_grad():  # its params' objective: the loss on the global batch
                curves[naive_name].append(whole_loss(naive_params, whole, naive_model).item())
            naive_grads, _ = naive_step(naive_params, (anchors[rank], positives[rank]))
            if i == 0:
                naive_grad_diff = max_diff(naive_grads, ref_grads)
            gradaccum.write_grads(naive_model, naive_grads)
            naive_optimizer.step()
        gradaccum.write_grads(model, grads)
        optimizer.step()
        gradaccum.write_grads(reference, ref_grads)
        ref_optimizer.step()
        if i % 10 == 0 or i == args.steps - 1:
            progress.set_postfix(
                loss_coupled=f"{loss.item():.4f}", loss_whole=f"{ref_loss.item():.4f}"
            )
    progress.close()
    elapsed = time.perf_counter() - started

    anchors, positives = make_pairs(1000, seed=args.seed * 100_000 - 1)  # held out
    with torch.no_grad():
        found = (model(anchors) @ model(positives).T).argmax(dim=1) == torch.arange(1000)
    say(
        f"trained {args.steps} steps in {elapsed:.1f} s; final loss: coupled "
        f"{curves[coupled_name][-1]:.6f}, whole batch {curves['whole batch'][-1]:.6f}; "
        f"held-out retrieval accuracy (1 in 1000): {found.double().mean().item():.1%}"
    )
    curve_diff = max(abs(a - b) for a, b in zip(curves[coupled_name], curves["whole batch"]))
    grad_diff, curve_diff, param_diff = worst_over_ranks(
        grad_diff, curve_diff, max_diff(params, ref_params)
    )
    grad_tol, tol = GRAD_TOLERANCES[dtype], TOLERANCES[dtype]
    ok = grad_diff <= grad_tol and curve_diff <= tol and param_diff <= tol

    def verdict(diff: float, bound: float) -> str:
        return f"{diff:.3e} (tolerance {bound:g}) {'OK' if diff <= bound else 'FAILED'}"

    say(
        f"max gradient difference at step 1: {verdict(grad_diff, grad_tol)}",
        f"max loss-curve difference: {verdict(curve_diff, tol)}",
        f"max parameter difference: {verdict(param_diff, tol)}",
    )
    if naive_model is not None:
        naive_curve = max(abs(a - b) for a, b in zip(curves[naive_name], curves["whole batch"]))
        naive_grad_diff, naive_curve, naive_param = worst_over_ranks(
            naive_grad_diff, naive_curve, max_diff(naive_params, ref_params)
        )
        say(
            f"plain accumulation is another training run: gradient at step 1 off by "
            f"{naive_grad_diff:.3e}, loss curve by {naive_curve:.3e}, parameters by "
            f"{naive_param:.3e}; final loss on the global batch {curves[naive_name][-1]:.6f}"
        )
        # It must differ, or the micro-batches were too large to show anything.
        ok = ok and naive_grad_diff > 1e3 * grad_tol
    if args.plot and rank == 0:
        title = f"contrastive.py: {world} process(es), batch {args.batch} pairs, {args.dtype}"
        say(f"wrote {loss_curves(args.plot, curves, title=title)}")
    say("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    # Not --n: torchrun would take it for an abbreviation of its own --nnodes / --nproc-per-node.
    parser.add_argument(
        "-n", "--micro-batches", dest="n", type=int, default=8, help="per rank (default 8)"
    )
    parser.add_argument("--batch", type=int, default=256, help="global batch, in pairs")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--naive", action="store_true", help="also train plain accumulation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PATH", help="write the runs' loss curves (PNG)")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.steps < 1 or args.n < 1 or args.batch < world * args.n:
        parser.error("need --steps >= 1, -n >= 1 and --batch >= n * the number of ranks")
    # The model is tiny: one intra-op thread per process is the fastest.
    torch.set_num_threads(1)

    rank, world = init_distributed()
    try:
        return run(args, rank, world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
