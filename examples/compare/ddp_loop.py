"""The job of docs/loop.md with plain DDP and ``no_sync``, in one file, written to be exact.

The same job as ``examples/lm_loop.py`` (the same model, data and loss), written with
``DistributedDataParallel`` as a careful user would to make it exact: every rank makes as many
optimizer steps per epoch as the longest rank needs (an all-reduce of the loader lengths), the
token count of each global window is all-reduced before its first backward, a rank whose window
is empty still joins the gradient all-reduce (a backward of zero), the global loss for the bar
is one more all-reduce, and the checkpoint (taken after the step of window 7) holds the RNG
state that the epoch's shuffle was drawn from, so that a resumed run reads the same batches.

Run it in one process (a world of one: DDP needs a process group), or in two::

    python examples/compare/ddp_loop.py
    torchrun --standalone --nproc_per_node 2 examples/compare/ddp_loop.py

``python examples/compare/check_job.py examples/compare/ddp_loop.py --nproc 2`` checks it.
"""

import contextlib
import itertools
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
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
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(TinyLM().double())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 4))
    loader = DataLoader(sequences(rows)[rank::world], batch_size=2, shuffle=True, collate_fn=pad)
    longest = torch.tensor(len(loader))  # every rank steps as often as the longest one needs
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    per_epoch = math.ceil(longest.item() / 4)  # windows per epoch
    start, losses = 0, []
    if os.path.exists(path):  # an earlier run's checkpoint: go on from there
        saved = torch.load(path)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        warmup.load_state_dict(saved["scheduler"])
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
            tokens = torch.tensor(sum(int((labels != -100).sum()) for _, labels in window))
            dist.all_reduce(tokens)  # the window's global token count, before any backward
            loss_sum = torch.zeros((), dtype=torch.float64)
            for i, batch in enumerate(window):
                with model.no_sync() if i < len(window) - 1 else contextlib.nullcontext():
                    loss, _ = token_loss(model, batch)
                    (loss * world / tokens).backward()  # DDP averages over the ranks
                loss_sum += loss.detach()
            if not window:  # this rank's data ran out: join the gradient all-reduce with zeros
                (model(torch.zeros(1, 1, dtype=torch.long)).sum() * 0).backward()
            dist.all_reduce(loss_sum)
            losses.append(loss_sum.item() / tokens.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            warmup.step()
            optimizer.zero_grad()
            if index == save_at and rank == 0:  # after the step: what the next window needs
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                state |= {"scheduler": warmup.state_dict(), "window": index, "epoch_rng": epoch_rng}
                torch.save(state, path)
    bar.close()
    return model.module, warmup, losses


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
    else:  # python FILE: a world of one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    train()
    dist.destroy_process_group()  # nothing of the group left when the interpreter exits
