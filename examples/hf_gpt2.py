"""A Hugging Face GPT-2 trained on padded batches: the token mean of the whole (global) window.

A tiny ``transformers.GPT2LMHeadModel`` is built from a ``GPT2Config`` (nothing is downloaded;
float64, dropout off) and trained on right-padded sequences of random lengths, given as a
``transformers.BatchEncoding`` with ``input_ids``, ``attention_mask`` and ``labels`` (-100 on
padding), as a tokenizer or a data collator would make it. gradaccum splits the
``BatchEncoding`` into micro-batches (each one a ``BatchEncoding`` again).

The loss to train on is what HF's ``model(**batch).loss`` is on the *whole* batch: the mean
cross-entropy over every non-padding target token (labels shifted by one). Under gradient
accumulation that is not what HF's loss gives per micro-batch: each micro-batch's ``.loss`` is
the mean over *its* tokens, so ``(model(**mb).loss / n).backward()`` per micro-batch (the classic
recipe, and what DDP then averages over ranks) weights a token of a short micro-batch more than
one of a long micro-batch: another gradient. So the micro-step here computes the *summed* token
loss from the logits and returns it with its token count; ``gradaccum.accumulate(...,
reduction="count")`` divides the summed gradients by the window's token count over all ranks,
which travels in the same ``all_reduce`` as the gradients (under torchrun).

The script:

1. compares that gradient with the gradient of the whole global batch's token mean, computed in
   float64 in one process; and measures, against the same gradient, HF's own ``.loss`` on the
   whole batch (the same token mean, but computed in float32: HF's loss upcasts the logits with
   ``.float()``, a downcast for a float64 model), HF's remedy ``num_items_in_batch=`` (the
   window's token count, which must be known before the first backward) and the classic
   per-micro-batch ``.loss / n`` recipe;
2. trains a few AdamW steps and compares the parameters with a plain whole-batch loop
   (``token_mean(model, batch).backward()``, float64) in one process.

It prints the differences and exits with status 1 if gradaccum's gradient or parameters differ
from the whole batch's by more than 1e-10 (or if the classic recipe does not differ, which
would mean the token counts were too even to show anything).

Run it (about ten seconds on 2 CPU cores)::

    python examples/hf_gpt2.py
    torchrun --standalone --nproc_per_node 2 examples/hf_gpt2.py
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from _ranks import init_distributed, max_diff, worst_over_ranks
from torch import nn
from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel

import gradaccum

VOCAB, PAD, IGNORE = 32, 0, -100  # token 0 pads; labels of -100 are ignored by the loss
TOLERANCE = 1e-10


def make_model(max_len: int, seed: int) -> GPT2LMHeadModel:
    """A tiny GPT-2 from a config (no download), float64, every dropout off."""
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=max_len,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(torch.float64)
    model.loss_type = "ForCausalLM"  # what HF would infer for a *ForCausalLM class name
    return model


def make_batch(rows: int, max_len: int, seed: int) -> BatchEncoding:
    """``rows`` right-padded sequences of 2..max_len tokens, as a tokenizer would return them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len + 1, (rows,), generator=gen)
    attention_mask = (torch.arange(max_len) < lengths[:, None]).long()
    input_ids = torch.randint(1, VOCAB, (rows, max_len), generator=gen) * attention_mask
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return BatchEncoding(
        {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    )


def shard(batch: BatchEncoding, rank: int, world: int) -> BatchEncoding:
    """This rank's rows of a global batch (a DistributedSampler would read only these)."""
    return BatchEncoding({k: v.tensor_split(world)[rank] for k, v in batch.items()})


def tokens(batch: BatchEncoding) -> int:
    """The number of target tokens: non-padding labels after the shift by one."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def token_mean(model: nn.Module, batch: BatchEncoding) -> torch.Tensor:
    """The plain loss: mean cross-entropy over the non-padding target tokens, in float64."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits, targets = out.logits[:, :-1], batch["labels"][:, 1:]
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def gradient(model: nn.Module, loss) -> dict[str, torch.Tensor]:
    """The gradient of ``loss()`` with respect to the model's parameters, by name."""
    model.zero_grad()
    loss().backward()
    out = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return out


def run(args: argparse.Namespace, rank: int, world: int) -> int:
    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    model = make_model(args.max_len, args.seed)  # the same weights on every rank
    reference = copy.deepcopy(model)  # a plain loop on the whole global batch, in this process
    params, buffers = gradaccum.params_of(model), gradaccum.buffers_of(model)

    # The micro-step: the *summed* cross-entropy over the non-padding target tokens, computed
    # from the logits with the labels shifted by one (as HF's loss does), and the token count.
    def summed_loss(params: dict[str, torch.Tensor], batch: BatchEncoding):
        out, _ = gradaccum.call_module(
            model,
            params,
            buffers,
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
        )
        logits, targets = out.logits[:, :-1], batch["labels"][:, 1:]
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        return loss, (targets != IGNORE).sum()

    # gradaccum.grad_and_value(has_aux=True) returns (grads, (summed loss, count)); count= picks
    # the count. Every backward adds into the window's sums in place (the fast path).
    step = gradaccum.accumulate(
        gradaccum.grad_and_value(summed_loss, has_aux=True),
        args.n,
        has_aux=True,
        reduction="count",
        count=lambda aux: aux[1],
        sync=gradaccum.all_reduce() if world > 1 else None,
    )

    # 1. The gradient at the initial parameters, against the whole global batch in one process.
    batch = make_batch(args.batch, args.max_len, seed=args.seed)
    grads, _ = step(params, shard(batch, rank, world))  # a BatchEncoding: split into n
    whole = gradient(reference, lambda: token_mean(reference, batch))
    # HF's own loss on the whole batch: the same token mean, but computed in float32 (its loss
    # function upcasts the logits with .float(), a downcast for a float64 model).
    hf_whole = gradient(reference, lambda: reference(**batch).loss)
    micro = [
        BatchEncoding({k: v[idx] for k, v in batch.items()})
        for part in torch.arange(args.batch).tensor_split(world)
        for idx in part.tensor_split(min(args.n, len(part)))
    ]
    # The classic recipe: (model(**mb).loss / n).backward() per micro-batch, then DDP's mean
    # over ranks: every micro-batch's own token mean, with equal weights.
    classic = gradient(reference, lambda: sum(reference(**mb).loss / len(micro) for mb in micro))
    # HF's remedy: num_items_in_batch = the window's token count over all ranks, known before
    # the first backward (a prefetched window, and across ranks one more all_reduce).
    remedy = gradient(
        reference,
        lambda: sum(reference(**mb, num_items_in_batch=tokens(batch)).loss for mb in micro),
    )

    grad_diff, hf_diff, classic_diff, remedy_diff = worst_over_ranks(
        *(max_diff(g, whole) for g in (grads, hf_whole, classic, remedy))
    )
    scale = max(g.abs().max().item() for g in whole.values())
    per_micro = [tokens(mb) for mb in micro]
    say(
        f"{world} process(es); GPT2LMHeadModel, {sum(p.numel() for p in params.values())} "
        f"float64 parameters; global batch {args.batch} sequences of 2..{args.max_len} tokens "
        f"(a BatchEncoding), {tokens(batch)} target tokens",
        f"  per micro-batch (n={args.n} per rank): {per_micro} tokens",
        "max difference from the gradient of the whole batch's token mean (float64):",
        f"  gradaccum, reduction='count': {grad_diff:.3e} (tolerance {TOLERANCE:g}) "
        f"{'OK' if grad_diff <= TOLERANCE else 'FAILED'}",
        f"  HF's model(**batch).loss on the whole batch (a float32 loss): {hf_diff:.3e}",
        f"  HF's num_items_in_batch= the window's tokens, per micro-batch: {remedy_diff:.3e}",
        f"  the classic model(**mb).loss / n per micro-batch: {classic_diff:.3e} "
        f"({classic_diff / scale:.1%} of the largest entry)",
    )
    # The classic recipe must differ here, or the token counts were too even to show anything.
    grad_ok = grad_diff <= TOLERANCE and classic_diff > 1e3 * TOLERANCE

    # 2. A few AdamW steps, side by side with a plain loop on the whole global batch.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01)
    for i in range(args.steps):
        batch = make_batch(args.batch, args.max_len, seed=args.seed * 100_000 + i + 1)
        grads, _ = step(params, shard(batch, rank, world))
        gradaccum.write_grads(model, grads)
        optimizer.step()

        ref_optimizer.zero_grad()
        loss = token_mean(reference, batch)
        loss.backward()
        ref_optimizer.step()
    (param_diff,) = worst_over_ranks(max_diff(params, gradaccum.params_of(reference)))
    param_ok = param_diff <= TOLERANCE
    say(
        f"{args.steps} AdamW steps: last whole-batch token loss {loss.item():.4f}",
        f"max parameter difference: {param_diff:.3e} (tolerance {TOLERANCE:g}) "
        f"{'OK' if param_ok else 'FAILED'}",
    )
    ok = grad_ok and param_ok
    say("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    # Not --n: torchrun would take it for an abbreviation of its own --nnodes / --nproc-per-node.
    parser.add_argument(
        "-n", "--micro-batches", dest="n", type=int, default=4, help="per rank (default 4)"
    )
    parser.add_argument("--batch", type=int, default=24, help="global batch, in sequences")
    parser.add_argument("--max-len", type=int, default=16, help="longest sequence, in tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.steps < 1 or args.n < 1 or args.batch < world * args.n or args.max_len < 2:
        parser.error("need --steps >= 1, -n >= 1, --batch >= n * ranks and --max-len >= 2")
    torch.set_num_threads(1)  # the model is tiny: one intra-op thread per process is the fastest

    rank, world = init_distributed()
    try:
        return run(args, rank, world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
