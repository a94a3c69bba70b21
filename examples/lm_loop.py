"""The job of docs/loop.md with gradaccum.loop, in one file: a tiny causal LM.

A causal LM in float64 on padded sequences of random lengths (labels -100 on the padding),
trained on the mean over the non-padding tokens of each whole global window of n = 4
micro-batches of 2 sequences, for 2 epochs, with AdamW, a warm-up LambdaLR stepped once per
optimizer step, clipping to 1.0, a progress bar of the global mean loss, and a checkpoint at
window 7 that a later run resumes from, bit-identically. With 81 sequences on 2 ranks the
loaders hold 21 and 20 micro-batches: the last window of each epoch is empty on rank 1.

Run it in one process, or in two (a run writes ./checkpoint; a run that finds it resumes)::

    python examples/lm_loop.py
    torchrun --standalone --nproc_per_node 2 examples/lm_loop.py

``python examples/compare/check_job.py examples/lm_loop.py --nproc 2`` checks it against a
one-process float64 reference that trains on each whole global window (docs/loop.md).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

import gradaccum
from gradaccum import loop

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


def summed(model, batch):  # what the loss is: a sum over that many tokens
    return gradaccum.Sum(*token_loss(model, batch))


def train(rows=81, path="checkpoint", save_at=7):
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(0)
    model = TinyLM().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 4))
    loader = DataLoader(sequences(rows)[rank::world], batch_size=2, shuffle=True, collate_fn=pad)
    data = loop.windows(loader, 4, sync=gradaccum.all_reduce() if world > 1 else None, epochs=2)
    step = loop.Step(model, summed, optimizer, data=data, scheduler=warmup, clip=1.0)
    if os.path.exists(path):  # an earlier run's checkpoint: go on from there
        loop.load(path, step)
    with loop.progress(data) as bar:
        for window in data:
            for batch in window:
                step.add(batch)
            if window.index == save_at:  # decided from the window alone: every rank saves
                loop.save(path, step)
            bar.update(step.apply())  # the window's global mean token loss
    return model, warmup, bar.history


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
    train()
    if dist.is_initialized():
        dist.destroy_process_group()  # nothing of the group left when the interpreter exits
