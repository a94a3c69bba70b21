"""CLIP with a learned temperature: two towers, a symmetric contrastive loss, micro-batched exactly.

Two towers learn a shared embedding space from generated pairs: an image tower (an MLP over
"image-like" feature vectors) and a text tower (token embeddings, mean-pooled, then an MLP over
"captions" of token ids). Each pair comes from one hidden concept: the image is a fixed random
function of it plus noise, the caption's words are drawn from a distribution it sets. The loss
is CLIP's: the cross-entropy of every image against every caption of the global batch and of
every caption against every image, averaged, with the logits scaled by a learned
``logit_scale`` (the inverse temperature, ``exp(logit_scale)``), a parameter that only the loss
uses.

``gradaccum.coupled(embed, loss, n)`` gives the gradient of that loss over the whole global
batch, over ``-n`` micro-batches per rank: ``embed`` returns ``{"image": ..., "text": ...}``
(both towers on one micro-batch), the loss gets every rank's rows of both and returns this
rank's share (its images against all captions, its captions against all images, over the global
rows; the targets are global offsets, ``rows.arange()``), and ``logit_scale`` gets its gradient
from the loss directly. Under torchrun, with ``sync=gradaccum.all_reduce()``, the embeddings of
every rank are gathered and each rank's embedding gradient includes the terms of every rank's
share.

The script compares the gradient at the initial parameters with the gradient of the loss on the
whole global batch at once, in one process (and shows plain per-micro-batch accumulation, with
the in-batch negatives of each micro-batch only, giving another one); then trains both side by
side with AdamW and compares the parameters. It exits with status 1 if a difference exceeds its
tolerance (in float64 1e-12 for the gradient and 1e-9 for the parameters, 1e-4 in float32).

Run it (5 to 15 s on 2 CPU cores)::

    python examples/clip.py
    torchrun --standalone --nproc_per_node 2 examples/clip.py --dtype float64 --batch 45 -n 3
    python examples/clip.py --plot loss.png   # both runs' loss curves (needs matplotlib)
"""

from __future__ import annotations

import argparse
import copy
import math
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
CONCEPT, PIXELS, VOCAB, WORDS = 8, 48, 256, 12  # hidden concept, image size, vocab, caption length


class Clip(nn.Module):
    """Two towers into one space, and the learned logit scale (CLIP's initial 1 / 0.07)."""

    def __init__(self, dim: int = 32, width: int = 64) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(PIXELS, width), nn.GELU(), nn.Linear(width, dim))
        self.words = nn.Embedding(VOCAB, width)
        self.text = nn.Sequential(nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.text_out = nn.Linear(width, dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, captions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Both towers, unit-length embeddings: ``{"image": [rows, dim], "text": [rows, dim]}``."""
        text = self.text_out(self.text(self.words(captions).mean(dim=1)))
        return {
            "image": nn.functional.normalize(self.image(images), dim=-1),
            "text": nn.functional.normalize(text, dim=-1),
        }


def make_pairs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (image, caption) pairs: float64 images ``[rows, PIXELS]``, token ids.

    A fixed random "world" maps each pair's hidden concept to its image and to its caption's
    word distribution; only the concepts and the noise depend on ``seed``, so every rank makes the
    same global batch without talking.
    """
    world = torch.Generator().manual_seed(1234)
    to_image = torch.randn(CONCEPT, PIXELS, generator=world, dtype=torch.float64)
    to_words = torch.randn(CONCEPT, VOCAB, generator=world, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    concept = torch.randn(rows, CONCEPT, generator=gen, dtype=torch.float64)
    noise = torch.randn(rows, PIXELS, generator=gen, dtype=torch.float64)
    images = torch.tanh(concept @ to_image / CONCEPT**0.5) + 0.3 * noise
    words = torch.softmax(2.0 * concept @ to_words / CONCEPT**0.5, dim=1)
    captions = torch.multinomial(words, WORDS, replacement=True, generator=gen)
    return images, captions


def run(args: argparse.Namespace, rank: int, world: int) -> int:
    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    model = Clip().to(dtype)  # the same initial weights on every rank
    reference = copy.deepcopy(model)  # the whole-batch run, in this process

    def embed(params, batch, m: nn.Module = model) -> dict[str, torch.Tensor]:
        images, captions = batch
        return functional_call(m, params, (images, captions))

    def clip_loss(params, reps: dict[str, torch.Tensor], rows: gradaccum.Rows) -> torch.Tensor:
        """This rank's share of the symmetric CLIP loss over the global batch.

        ``reps`` holds every rank's rows of both towers. This rank's images are scored against
        all captions and its captions against all images; pair ``i`` of the global batch is the
        target of row ``i`` (global offsets). The two cross-entropies are summed over this
        rank's rows and divided by twice the global rows: the ranks' shares add up to the mean
        of the image-to-text and text-to-image losses. ``logit_scale`` is used here directly.
        """
        scale = params["logit_scale"].exp().clamp(max=100.0)
        image, text = reps["image"], reps["text"]
        target = rows.arange(image.device)
        per_image = scale * image[rows.local] @ text.T
        per_text = scale * text[rows.local] @ image.T
        ce = nn.functional.cross_entropy
        both = ce(per_image, target, reduction="sum") + ce(per_text, target, reduction="sum")
        return both / (2 * rows.total)

    def whole_loss(params, batch, m: nn.Module = model) -> torch.Tensor:
        """The loss on a whole batch at once: one process, all its rows (the reference)."""
        rows = len(batch[0])
        return clip_loss(params, embed(params, batch, m), gradaccum.Rows(0, rows, rows, (rows,)))

    sync = gradaccum.all_reduce() if world > 1 else None
    step = gradaccum.coupled(embed, clip_loss, args.n, sync=sync)
    ref_step = grad_and_value(lambda p, b: whole_loss(p, b, reference))
    params, ref_params = gradaccum.params_of(model), gradaccum.params_of(reference)

    def batch_of(seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The global batch, whole and this rank's shard of it."""
        images, captions = make_pairs(args.batch, seed)
        images = images.to(dtype)
        shard = (images.tensor_split(world)[rank], captions.tensor_split(world)[rank])
        return (images, captions), shard

    shard_rows = [len(s) for s in torch.arange(args.batch).tensor_split(world)]
    micro_rows = [len(m) for m in torch.arange(shard_rows[rank]).tensor_split(args.n)]
    say(
        f"{world} process(es); global batch {args.batch} pairs = {shard_rows} per rank, "
        f"{args.n} micro-batches per rank of {micro_rows} pairs (rank 0), {args.dtype}; "
        f"{sum(p.numel() for p in params.values())} parameters"
    )

    # 1. The gradient at the initial parameters, against the whole batch and plain accumulation.
    whole, shard = batch_of(args.seed * 100_000 - 2)
    grads, loss = step(params, shard)
    ref_grads, ref_loss = ref_step(ref_params, whole)
    # Plain accumulation: each micro-batch's CLIP loss with its own in-batch negatives only.
    naive = gradaccum.accumulate(
        grad_and_value(lambda p, b: whole_loss(p, b, model)), args.n, sync=sync
    )
    naive_grads, _ = naive(params, shard)
    grad_diff, scale_diff, naive_diff = worst_over_ranks(
        max_diff(grads, ref_grads),
        (grads["logit_scale"] - ref_grads["logit_scale"]).abs().item(),
        max_diff(naive_grads, ref_grads),
    )
    grad_tol, tol = GRAD_TOLERANCES[dtype], TOLERANCES[dtype]
    grad_ok = grad_diff <= grad_tol
    say(
        f"loss at the initial parameters: coupled {loss.item():.6f}, whole batch "
        f"{ref_loss.item():.6f}",
        f"gradient of logit_scale (used by the loss only): coupled "
        f"{grads['logit_scale'].item():.6f}, whole batch {ref_grads['logit_scale'].item():.6f}, "
        f"difference {scale_diff:.3e}",
        f"max gradient difference vs the whole batch: {grad_diff:.3e} (tolerance {grad_tol:g}) "
        f"{'OK' if grad_ok else 'FAILED'}",
        f"plain accumulation (per-micro-batch negatives) is another gradient: max difference "
        f"{naive_diff:.3e}",
    )
    # Plain accumulation must differ, or the micro-batches were too large to show anything.
    grad_ok = grad_ok and naive_diff > 1e3 * grad_tol

    # 2. Training, side by side with the whole-batch run.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.01)
    coupled_name = f"coupled, n={args.n} per rank"
    curves: dict[str, list[float]] = {"whole batch": [], coupled_name: []}
    started = time.perf_counter()
    progress = tqdm(range(args.steps), unit="step", disable=rank != 0)
    for i in progress:
        whole, shard = batch_of(args.seed * 100_000 + i)
        grads, loss = step(params, shard)  # the global batch's, on every rank
        ref_grads, ref_loss = ref_step(ref_params, whole)
        curves[coupled_name].append(loss.item())
        curves["whole batch"].append(ref_loss.item())
        for m, g, opt in ((model, grads, optimizer), (reference, ref_grads, ref_optimizer)):
            gradaccum.write_grads(m, g)
            opt.step()
        if i % 10 == 0 or i == args.steps - 1:
            temperature = 1 / params["logit_scale"].exp().item()
            progress.set_postfix(loss=f"{loss.item():.4f}", temperature=f"{temperature:.4f}")
    progress.close()
    elapsed = time.perf_counter() - started

    (images, captions), _ = batch_of(args.seed * 100_000 - 1)  # held out
    with torch.no_grad():
        out = model(images, captions)
        found = (out["image"] @ out["text"].T).argmax(dim=1) == torch.arange(args.batch)
    say(
        f"trained {args.steps} steps in {elapsed:.1f} s; final loss: coupled "
        f"{curves[coupled_name][-1]:.6f}, whole batch {curves['whole batch'][-1]:.6f}; "
        f"temperature {1 / params['logit_scale'].exp().item():.4f} (from 0.07); held-out "
        f"image-to-caption accuracy (1 in {args.batch}): {found.double().mean().item():.1%}"
    )
    curve_diff = max(abs(a - b) for a, b in zip(curves[coupled_name], curves["whole batch"]))
    curve_diff, param_diff = worst_over_ranks(curve_diff, max_diff(params, ref_params))
    ok = grad_ok and curve_diff <= tol and param_diff <= tol
    say(
        f"max loss-curve difference: {curve_diff:.3e} (tolerance {tol:g}) "
        f"{'OK' if curve_diff <= tol else 'FAILED'}",
        f"max parameter difference: {param_diff:.3e} (tolerance {tol:g}) "
        f"{'OK' if param_diff <= tol else 'FAILED'}",
    )
    if args.plot and rank == 0:
        title = f"clip.py: {world} process(es), batch {args.batch} pairs, {args.dtype}"
        say(f"wrote {loss_curves(args.plot, curves, title=title)}")
    say("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    # Not --n: torchrun would take it for an abbreviation of its own --nnodes / --nproc-per-node.
    parser.add_argument(
        "-n", "--micro-batches", dest="n", type=int, default=8, help="per rank (default 8)"
    )
    parser.add_argument("--batch", type=int, default=256, help="global batch, in pairs")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PATH", help="write both runs' loss curves (PNG)")
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
