"""The job of docs/loop.md with Hugging Face Accelerate, in one file, written to be exact.

The same job as ``examples/lm_loop.py`` (the same model, data and loss), written with
``accelerate.Accelerator`` as a careful user would to make it exact. What its defaults would get
wrong is avoided by hand: ``cpu=True`` (without it, on a machine without GPUs, each process
trains alone), the scheduler prepared with ``step_scheduler_with_optimizer=False`` (by default a
prepared scheduler steps once per process at each optimizer step), the loader not prepared
(``even_batches=True`` would repeat samples on the shorter rank, ``False`` lets the ranks'
windows drift apart); the window boundaries, the token count of each global window and the
global loss are computed by hand, an empty window joins the gradient all-reduce with a zero
backward, and ``save_state`` (taken after the step of window 7) is completed by the data
position and the RNG state that the epoch's shuffle was drawn from (it saves neither).

Needs ``pip install accelerate``. Run it in one process, or in two::

    python examples/compare/accelerate_loop.py
    torchrun --standalone --nproc_per_node 2 examples/compare/accelerate_loop.py

``python examples/compare/check_job.py examples/compare/accelerate_loop.py --nproc 2`` checks it.
"""

import contextlib
import itertools
import math
import os

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from tqdm import tqdm

VOCAB = 24  # token 0 is the padding


class TinyLM(nn.Module):  # token embeddings, a causal convolution, a linear head
    def __init__(self, dim=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=2)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):  # (batch, time) -> logits (batch, time, VOCAB)
        h = self.conv(self.embed(tokens).transpose(1, 2))[..., : tokens.shape[1]]
        return self.head(torch.relu(h).transpose(1, 2))  # position t saw tokens t-2, t-1, t


def sequences(rows):  # token sequences of 3 to 16 tokens, the same on every rank
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(3, 17, (rows,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (length,), generator=g) for length in lengths]


def pad(batch):  # a micro-batch: the inputs padded with 0, the next tokens with -100
    inputs = pad_sequence([s[:-1] for s in batch], batch_first=True)
    labels = pad_sequence([s[1:] for s in batch], batch_first=True, padding_value=-100)
    return inputs, labels


def token_loss(model, batch):  # summed over the tokens that are not padding, and their count
    inputs, labels = batch
    loss = nn.functional.cross_entropy(model(inputs).transpose(1, 2), labels, reduction="sum")
    return loss, (labels != -100).sum()


def train(rows=81, path="checkpoint", save_at=7):
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    model = TinyLM().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 4))
    model, optimizer, warmup = accelerator.prepare(model, optimizer, warmup)
    # The loader is not prepared: it would repeat samples, or desynchronise the ranks.
    loader = DataLoader(sequences(rows)[rank::world], batch_size=2, shuffle=True, collate_fn=pad)
    longest = accelerator.gather(torch.tensor([len(loader)])).max().item()
    per_epoch = math.ceil(longest / 4)  # windows per epoch, on every rank
    start, losses = 0, []
    if os.path.exists(path):  # an earlier run's checkpoint: go on from there
        accelerator.load_state(path)
        saved = torch.load(f"{path}/position.pt")
        torch.set_rng_state(saved["epoch_rng"])  # the shuffle of its epoch is drawn again
        start = saved["window"] + 1
    bar = tqdm(total=2 * per_epoch, initial=start, disable=rank > 0)
    for epoch in range(start // per_epoch, 2):
        epoch_rng = torch.get_rng_state()  # iter(loader) draws the shuffle from it
        batches = iter(loader)
        for index in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            window = list(itertools.islice(batches, 4))
            if index < start:  # done before the checkpoint
                continue
            count = sum(int((labels != -100).sum()) for _, labels in window)
            tokens = accelerator.reduce(torch.tensor(count), reduction="sum")
            loss_sum = torch.zeros((), dtype=torch.float64)
            for i, batch in enumerate(window):
                last = i == len(window) - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                    loss, _ = token_loss(model, batch)
                    accelerator.backward(loss * world / tokens)  # DDP averages over the ranks
                loss_sum += loss.detach()
            if not window:  # this rank's data ran out: join the gradient all-reduce with zeros
                accelerator.backward(model(torch.zeros(1, 1, dtype=torch.long)).sum() * 0)
            losses.append((accelerator.reduce(loss_sum, reduction="sum") / tokens).item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update()
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            warmup.step()
            optimizer.zero_grad()
            if index == save_at:  # after the step: what the next window needs
                accelerator.save_state(path)
                if accelerator.is_main_process:
                    torch.save({"window": index, "epoch_rng": epoch_rng}, f"{path}/position.pt")
    bar.close()
    return accelerator.unwrap_model(model), warmup, losses


if __name__ == "__main__":
    train()
