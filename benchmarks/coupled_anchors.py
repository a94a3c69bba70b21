"""gradaccum.coupled against sentence-transformers' CachedMultipleNegativesRankingLoss (GradCache).

One tiny BERT (built from a ``BertConfig`` and a vocabulary written to a temporary folder:
nothing is downloaded), one batch of (anchor, positive) token-id pairs of uneven lengths, and
three ways to get the gradient of sentence-transformers' multiple-negatives ranking loss (InfoNCE
over in-batch negatives, cosine similarity times ``scale=20``, one direction: anchor -> every
positive):

- ``MNRL``: ``MultipleNegativesRankingLoss`` on the whole batch, one graph: the reference;
- ``CMNRL m``: ``CachedMultipleNegativesRankingLoss(mini_batch_size=m)``, sentence-transformers'
  GradCache;
- ``pairs n``: ``gradaccum.coupled(embed, mnrl_share, n)`` with ``n = batch / m``: ``m`` pairs
  per micro-batch, so one graph holds ``2m`` sequences (anchors and positives together);
- ``stacked n``: ``coupled`` over the anchors' rows then the positives' (``stack``), ``n = 2 *
  batch / m``: CMNRL's own mini-batches of ``m`` sequences, in its order (so that, with dropout,
  it draws the same masks).

For each ``m`` the script prints, side by side in one run: the largest absolute difference of the
gradients from ``MNRL``'s in float64, the peak of live tensor memory and the median time of one
step in float32. Memory is the peak of the bytes of live tensors that the step allocates
(activations, embeddings, gradients, temporaries; not the parameters and the batch, which exist
before), counted by a dispatch mode (``LiveBytes``) that sees every op's outputs, forward and
backward; not the process's RSS, which glibc's allocator blurs at this size. Times are the
median of ``--repeats`` interleaved rounds on ``--threads`` CPU threads.

Before sentence-transformers 6.2, the gradients of ``CMNRL`` in float64 are about 1e-7 from the
reference, not 1e-15: its backward hook forms the surrogate ``dot(reps.float(),
cached_grad.float())`` (a cast meant for autocast), which rounds the cached gradient of the
embeddings to float32 whatever the model's dtype (6.2 keeps the wider dtype). The second table
shows it: ``coupled`` with a loss that rounds its embeddings' gradient to float32
(``float32_cache``) equals such a ``CMNRL`` to float64 precision; from 6.2 on, ``coupled`` as it
is does. With dropout on (sequences of full length, so that CMNRL trims no padding and its masks
have coupled's shapes), the two agree to the bit.

    python benchmarks/coupled_anchors.py            # batch 128, m in 4 16 64
    python benchmarks/coupled_anchors.py --quick    # batch 16, m in 4 8 (a few seconds)

An optional last part runs open_clip's ``ClipLoss(gather_with_grad=True, local_loss=True)`` on 2
gloo ranks against ``coupled`` over ``all_reduce``; it is skipped, saying why, when open_clip does
not import (it needs torchvision, whose wheel does not import beside torch 2.13's CPU wheel).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import sentence_transformers
import torch
import torch.nn.functional as F
from huggingface_hub import utils as hub_utils
from packaging.version import Version
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary
from transformers import BertConfig, BertModel, BertTokenizerFast
from transformers.utils import logging as hf_logging

import gradaccum

# CMNRL's backward hook rounds the cached gradient to float32 before sentence-transformers 6.2
# (``dot(reps.float(), grad.float())``); 6.2 keeps the wider of the two dtypes.
CMNRL_CASTS = Version(sentence_transformers.__version__) < Version("6.2")

VOCAB = 100  # [PAD] [UNK] [CLS] [SEP] [MASK] and 95 words
PAD, CLS, SEP, FIRST_WORD = 0, 2, 3, 5
SCALE = 20.0  # CMNRL's default scale (1 / temperature)

Features = dict[str, torch.Tensor]
Grads = dict[str, torch.Tensor]


def tiny_bert(
    dtype: torch.dtype = torch.float64,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 2,
    max_len: int = 64,
    dropout: float = 0.0,
    seed: int = 0,
) -> SentenceTransformer:
    """A SentenceTransformer (BERT, then mean pooling) built from a config, without the hub.

    ``models.Transformer`` loads from a folder, so the config, the random weights and a tokenizer
    (a ``BertTokenizerFast`` over a 100-word vocabulary) are written to a temporary one first.
    """
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_len,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    bars = hf_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # "Writing model shards", "Loading weights"
    hub_utils.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        words += [f"w{i}" for i in range(VOCAB - len(words))]
        vocab = Path(tmp) / "vocab.txt"
        vocab.write_text("\n".join(words) + "\n")
        BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(tmp)
        torch.manual_seed(seed)
        BertModel(config).save_pretrained(tmp)
        model = SentenceTransformer(
            modules=[Transformer(tmp), Pooling(hidden, pooling_mode="mean")], device="cpu"
        )
    if bars[0]:
        hf_logging.enable_progress_bar()
    if bars[1]:
        hub_utils.enable_progress_bars()
    return model.to(dtype)


def token_batch(rows: int, seq: int, seed: int, *, ragged: bool = True) -> Features:
    """``rows`` sequences of [CLS] words [SEP]: 3 to ``seq`` tokens right-padded (``ragged``), or
    all of ``seq`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = (
        torch.randint(3, seq + 1, (rows,), generator=g) if ragged else torch.full((rows,), seq)
    )
    ids = torch.randint(FIRST_WORD, VOCAB, (rows, seq), generator=g)
    ids[:, 0] = CLS
    ids[torch.arange(rows), lengths - 1] = SEP
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "token_type_ids": torch.zeros_like(ids),
    }


def pairs(rows: int, seq: int, seed: int = 1, *, ragged: bool = True) -> tuple[Features, Features]:
    """A batch of (anchor, positive) features: two independent token batches of ``rows``."""
    return (
        token_batch(rows, seq, seed, ragged=ragged),
        token_batch(rows, seq, seed + 1000, ragged=ragged),
    )


def st_grads(model: SentenceTransformer, loss: torch.nn.Module, batch: tuple[Features, Features]):
    """A sentence-transformers loss's value and gradients (``.grad``; zeros for unused params)."""
    model.zero_grad(set_to_none=True)
    value = loss([dict(batch[0]), dict(batch[1])], None)
    value.backward()
    grads = {
        k: p.grad if p.grad is not None else torch.zeros_like(p)
        for k, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def embedder(model: SentenceTransformer, layout: str = "pairs") -> Callable[[Grads, Any], Any]:
    """``embed(params, micro_batch)`` for ``coupled``: the model's sentence embeddings.

    ``pairs``: a micro-batch is ``(anchor, positive)`` features of the same rows, its
    representations ``{"anchor": ..., "positive": ...}``. ``stacked``: a micro-batch is one
    features dict (rows of the anchors, then of the positives: ``stack(batch)``), its
    representations one tensor.
    """

    def one(params: Grads, features: Features) -> torch.Tensor:
        # The Transformer module writes its output into the dict: give it a fresh one.
        return functional_call(model, params, (dict(features),))["sentence_embedding"]

    def embed(params: Grads, micro_batch: tuple[Features, Features]) -> dict[str, torch.Tensor]:
        anchor, positive = micro_batch
        return {"anchor": one(params, anchor), "positive": one(params, positive)}

    return one if layout == "stacked" else embed


def stack(batch: tuple[Features, Features]) -> Features:
    """The anchors' rows, then the positives': CMNRL's order of mini-batches."""
    return {k: torch.cat([batch[0][k], batch[1][k]]) for k in batch[0]}


class _Float32Cache(torch.autograd.Function):
    """Identity forward; the backward rounds the gradient to float32 and back (CMNRL's cast)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.float().to(g.dtype)


def mnrl_share(
    params: Any, reps: Any, rows: gradaccum.Rows, *, float32_cache: bool = False
) -> torch.Tensor:
    """MultipleNegativesRankingLoss as ``coupled``'s loss: this rank's anchors, all positives.

    ``scale * cos_sim(anchor_i, positive_j)``, cross-entropy with target ``j = i`` (global
    offsets), a mean over the global window's anchors. ``reps`` is ``embedder``'s: a dict
    (``pairs``), or one tensor of the anchors' rows then the positives' (``stacked``, one process
    only). ``float32_cache`` rounds the embeddings' gradient to float32, as CMNRL's backward hook
    does.
    """
    if float32_cache:
        if isinstance(reps, dict):
            reps = {k: _Float32Cache.apply(v) for k, v in reps.items()}
        else:
            reps = _Float32Cache.apply(reps)
    if isinstance(reps, dict):
        anchor, positive, total = reps["anchor"][rows.local], reps["positive"], rows.total
        target = rows.arange(positive.device)
    else:
        if rows.world != 1:
            raise ValueError("mnrl_share: the stacked layout runs in one process only")
        total = rows.total // 2
        anchor, positive = reps[:total], reps[total:]
        target = torch.arange(total, device=reps.device)
    logits = SCALE * F.normalize(anchor, dim=-1) @ F.normalize(positive, dim=-1).T
    return F.cross_entropy(logits, target, reduction="sum") / total


def coupled_grads(
    model: SentenceTransformer,
    n: int,
    batch: tuple[Features, Features] | Features,
    *,
    layout: str = "pairs",
    float32_cache: bool = False,
) -> tuple[torch.Tensor, Grads]:
    """``gradaccum.coupled``'s value and gradients, ``n`` micro-batches, one process.

    ``stacked`` takes the pairs (stacked here) or ``stack(pairs)`` (stacked once, outside).
    """
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(params: Any, reps: Any, rows: gradaccum.Rows) -> torch.Tensor:
        return mnrl_share(params, reps, rows, float32_cache=float32_cache)

    data = stack(batch) if layout == "stacked" and isinstance(batch, tuple) else batch
    grads, value = gradaccum.coupled(embedder(model, layout), loss, n)(params, data)
    return value, grads


def max_diff(a: Grads, b: Grads) -> float:
    """The largest absolute difference over every leaf."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of tensor storages allocated while the mode is on and still alive.

    Every op's outputs are seen at dispatch (forward and backward alike); a storage counts from
    its first appearance until it is freed (a weakref callback). The storages of ``existing``
    (the parameters, the batch) are known from the start and never counted, whatever view of
    them an op returns; views share their storage and count once.
    """

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in existing:
            self.seen[t.untyped_storage()] = None
        self.now = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.now -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage not in self.seen:
                    nbytes = storage.nbytes()
                    self.seen[storage] = weakref.finalize(storage, self._free, nbytes)
                    self.now += nbytes
                    self.peak = max(self.peak, self.now)
        return out


def peak_mib(fn: Callable[[], Any], existing: list[torch.Tensor]) -> float:
    """The peak of tensor memory (MiB) that ``fn()`` allocates, its result included."""
    mode = LiveBytes(existing)
    with mode:
        out = fn()
    del out
    return mode.peak / 2**20


class Row(NamedTuple):
    """One contender: its name, the sequences of one graph, its CMNRL twin, one step."""

    name: str
    seqs: int
    twin: str | None
    step: Callable[[], tuple[torch.Tensor, Grads]]


def contenders(
    model: SentenceTransformer, ms: list[int], batch: tuple[Features, Features], stacked: Features
):
    """MNRL, then for each ``m``: CMNRL, coupled over pairs, coupled over ``stacked`` rows."""
    rows = len(batch[0]["input_ids"])
    out = [
        Row(
            "MNRL",
            2 * rows,
            None,
            lambda: st_grads(model, MultipleNegativesRankingLoss(model, scale=SCALE), batch),
        )
    ]
    for m in ms:
        cmnrl = CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=m)
        twin = f"CMNRL m={m}"
        out += [
            Row(twin, m, None, lambda c=cmnrl: st_grads(model, c, batch)),
            Row(
                f"pairs n={rows // m}",
                2 * m,
                twin,
                lambda n=rows // m: coupled_grads(model, n, batch),
            ),
            Row(
                f"stacked n={2 * rows // m}",
                m,
                twin,
                lambda n=2 * rows // m: coupled_grads(model, n, stacked, layout="stacked"),
            ),
        ]
    return out


def compare(args: argparse.Namespace) -> int:
    """The tables; returns 1 when a gradient is off by more than its stated tolerance."""
    torch.set_num_threads(args.threads)
    kw = {"hidden": args.hidden, "layers": args.layers, "max_len": max(64, args.seq)}
    batch = pairs(args.batch, args.seq)
    for m in args.ms:
        if args.batch % m:
            raise SystemExit(f"--ms: {m} does not divide --batch {args.batch}")

    # Gradients, float64: every contender against MNRL; CMNRL against coupled with its cast.
    model64 = tiny_bert(torch.float64, **kw)
    rows64 = contenders(model64, args.ms, batch, stack(batch))
    ref_value, ref = rows64[0].step()
    top = max(g.abs().max().item() for g in ref.values())
    diffs, values = {}, {}
    for row in rows64:
        value, grads = row.step()
        diffs[row.name], values[row.name] = max_diff(grads, ref), abs(value - ref_value).item()
    explain = []
    for m in args.ms:
        _, c = next(r for r in rows64 if r.name == f"CMNRL m={m}").step()
        _, g = coupled_grads(model64, 2 * args.batch // m, batch, layout="stacked")
        _, g32 = coupled_grads(
            model64, 2 * args.batch // m, batch, layout="stacked", float32_cache=True
        )
        explain.append((m, max_diff(c, g), max_diff(c, g32)))
    # Dropout 0.1, sequences of full length (no padding for CMNRL to trim, so that its
    # mini-batches draw masks of the same shapes): coupled over CMNRL's mini-batches, in its
    # order, replays the same masks.
    drop64 = tiny_bert(torch.float64, dropout=0.1, **kw).train()
    full = pairs(args.batch, args.seq, ragged=False)
    m = args.ms[0]
    torch.manual_seed(7)
    _, c = st_grads(drop64, CachedMultipleNegativesRankingLoss(drop64, mini_batch_size=m), full)
    torch.manual_seed(7)
    _, g32 = coupled_grads(
        drop64, 2 * args.batch // m, full, layout="stacked", float32_cache=CMNRL_CASTS
    )
    torch.manual_seed(7)
    _, whole = st_grads(drop64, MultipleNegativesRankingLoss(drop64), full)
    dropout = (m, max_diff(c, g32), max_diff(c, whole))

    # Memory and time, float32.
    model32 = tiny_bert(torch.float32, **kw)
    stacked = stack(batch)
    rows32 = contenders(model32, args.ms, batch, stacked)
    # The params, the batch and its stacked copy exist before each step: not counted.
    existing = [*model32.parameters(), *model32.buffers(), *stacked.values()]
    existing += [t for part in batch for t in part.values()]
    peaks = {row.name: peak_mib(row.step, existing) for row in rows32}
    times: dict[str, list[float]] = {row.name: [] for row in rows32}
    for row in rows32:  # warm-up
        row.step()
    for _ in range(args.repeats):
        for row in rows32:
            t0 = time.perf_counter()
            row.step()
            times[row.name].append(time.perf_counter() - t0)
    ms_ = {name: 1e3 * statistics.median(t) for name, t in times.items()}

    n_params = sum(p.numel() for p in model32.parameters())
    print(
        f"tiny BERT: {args.layers} layers, hidden {args.hidden}, vocab {VOCAB}, {n_params} params; "
        f"batch {args.batch} (anchor, positive) pairs of 3-{args.seq} tokens; scale {SCALE:g}, "
        f"cos_sim; {args.threads} thread(s), {args.repeats} rounds; torch {torch.__version__}"
    )
    print(
        f"max|dg|: largest |gradient - MNRL's| in float64 (largest |gradient| {top:.3g}); "
        "seqs: sequences in one graph;\npeak: MiB of live tensors the step allocates, float32; "
        "ms: median step, float32; pairs/stacked: gradaccum.coupled"
    )
    head = f"{'method':<14} {'seqs':>5} {'max|dg|':>9} {'peak MiB':>9} {'ms':>8}"
    print(f"{head} {'peak/MNRL':>9} {'ms/MNRL':>8} {'peak/CMNRL':>10} {'ms/CMNRL':>9}")
    for row in rows32:
        name = row.name
        vs = f"{'':>10} {'':>9}"
        if row.twin is not None:
            vs = f"{peaks[name] / peaks[row.twin]:>10.2f} {ms_[name] / ms_[row.twin]:>9.2f}"
        print(
            f"{name:<14} {row.seqs:>5} {diffs[name]:>9.1e} {peaks[name]:>9.3f} {ms_[name]:>8.1f} "
            f"{peaks[name] / peaks['MNRL']:>9.2f} {ms_[name] / ms_['MNRL']:>8.2f} {vs}"
        )
    print()
    version = sentence_transformers.__version__
    if CMNRL_CASTS:
        print(f"Why CMNRL is ~1e-7 off in float64 (sentence-transformers {version}): its backward")
        print("hook's surrogate is dot(reps.float(), cached_grad.float()), which rounds the cached")
        print("gradient to float32. coupled (stacked) with a loss that rounds it the same way:")
    else:
        print(f"sentence-transformers {version} keeps float64 in CMNRL's surrogate (6.2 on);")
        print("coupled (stacked), as it is and with the float32 rounding of earlier versions:")
    print(f"{'m':>5} {'|CMNRL - coupled|':>18} {'|CMNRL - coupled, f32 cache|':>29}")
    for m, plain, f32 in explain:
        print(f"{m:>5} {plain:>18.1e} {f32:>29.1e}")
    m, same, whole_diff = dropout
    cache = ", f32 cache" if CMNRL_CASTS else ""
    print(
        f"dropout 0.1, m={m}: |CMNRL - coupled stacked{cache}| {same:.1e} (the same masks); "
        f"|CMNRL - MNRL| {whole_diff:.1e} (other masks)"
    )
    tol = 1e-12 * max(top, 1.0)
    # Every contender is the reference to 1e-12, but a CMNRL that rounds its cache (before 6.2).
    exempt = ("CMNRL",) if CMNRL_CASTS else ()
    bad = [k for k, v in diffs.items() if not k.startswith(exempt) and v > tol]
    bad += [k for k, v in values.items() if v > 1e-12 * max(abs(ref_value).item(), 1.0)]
    bad += [
        f"CMNRL m={m} vs coupled"
        for m, plain, f32 in explain
        if (f32 if CMNRL_CASTS else plain) > tol
    ]
    bad += ["dropout"] if same > tol else []
    if bad:
        print(f"FAILED: off by more than 1e-12 x the largest gradient (or the loss): {bad}")
        return 1
    return 0


# --- optional: open_clip's ClipLoss on 2 gloo ranks --------------------------------------------


def _clip_rank(rank: int, world: int, job: dict[str, Any]) -> dict[str, float]:
    """One rank: open_clip's gradients (two settings) and coupled's, against the whole batch."""
    if job.get("loss_py"):  # open_clip's own loss.py, loaded alone (it imports only torch)
        spec = importlib.util.spec_from_file_location("open_clip_loss", job["loss_py"])
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ClipLoss = module.ClipLoss  # noqa: N806 - the class, under its own name
    else:
        from open_clip.loss import ClipLoss

    g = torch.Generator().manual_seed(0)
    rows, d_img, d_txt, d = job["rows"], 12, 10, 8
    params = {
        "img": torch.randn(d_img, d, generator=g, dtype=torch.float64),
        "txt": torch.randn(d_txt, d, generator=g, dtype=torch.float64),
        "log_scale": torch.tensor(2.0, dtype=torch.float64),
    }
    images = torch.randn(rows, d_img, generator=g, dtype=torch.float64)
    texts = torch.randn(rows, d_txt, generator=g, dtype=torch.float64)
    local = slice(rank * rows // world, (rank + 1) * rows // world)

    def embed(p: Any, batch: Any) -> dict[str, torch.Tensor]:
        return {
            "image": F.normalize(batch[0] @ p["img"], dim=-1),
            "text": F.normalize(batch[1] @ p["txt"], dim=-1),
        }

    def clip_share(p: Any, z: Any, r: gradaccum.Rows) -> torch.Tensor:
        s, target = p["log_scale"].exp(), r.arange()
        img_txt = s * z["image"][r.local] @ z["text"].T
        txt_img = s * z["text"][r.local] @ z["image"].T
        ce = F.cross_entropy(img_txt, target, reduction="sum")
        return (ce + F.cross_entropy(txt_img, target, reduction="sum")) / (2 * r.total)

    def whole(p: Any) -> torch.Tensor:
        return clip_share(p, embed(p, (images, texts)), gradaccum.Rows(0, rows, rows, (rows,)))

    ref = torch.func.grad(whole)(params)

    def open_clip_grads(**kw: bool) -> Grads:
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        z = embed(p, (images[local], texts[local]))
        loss = ClipLoss(rank=rank, world_size=world, **kw)(
            z["image"], z["text"], p["log_scale"].exp()
        )
        loss.backward()
        out = {}
        for k, v in p.items():  # DDP's average over the ranks
            torch.distributed.all_reduce(v.grad)
            out[k] = v.grad / world
        return out

    defaults = open_clip_grads()
    sync = gradaccum.all_reduce()
    mine, _ = gradaccum.coupled(embed, clip_share, job["n"], sync=sync)(
        params, (images[local], texts[local])
    )
    return {
        "open_clip gather_with_grad+local_loss": max_diff(
            open_clip_grads(gather_with_grad=True, local_loss=True), ref
        ),
        "open_clip defaults": max_diff(defaults, ref),
        # Each rank's full loss reaches the encoders only through its own rows; DDP's average
        # then leaves them 1/world of the gradient, and the logit scale the whole of it.
        "open_clip defaults, encoders x world": max_diff(
            {k: v * (world if k != "log_scale" else 1) for k, v in defaults.items()}, ref
        ),
        f"coupled n={job['n']}, all_reduce": max_diff(mine, ref),
    }


def clip_section(args: argparse.Namespace) -> None:
    """The open_clip comparison, or why it was skipped."""
    what = "open_clip ClipLoss(gather_with_grad=True, local_loss=True) on 2 gloo ranks"
    if args.open_clip_loss is None:
        try:
            import open_clip.loss  # noqa: F401
        except ImportError as err:
            print(
                f"\n{what}: skipped ({type(err).__name__}: {err}); pass --open-clip-loss with "
                f"open_clip's loss.py (it imports only torch: unzip -p "
                f"open_clip_torch-*.whl open_clip/loss.py > loss.py)."
            )
            return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _launch import launch

    job = {"rows": 16, "n": 2, "pg_timeout": 60, "loss_py": args.open_clip_loss}
    results = launch(_clip_rank, job, world=2, timeout=300, what="open_clip comparison")
    print(f"\n{what}: largest |gradient - the whole batch's| (float64, 16 rows, rank 0)")
    for name, diff in results[0].items():
        print(f"  {name:<40} {diff:.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 16, m in 4 8, 3 rounds")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--ms", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-clip", action="store_true", help="skip the open_clip part")
    parser.add_argument(
        "--open-clip-loss",
        default=None,
        help="open_clip's loss.py, loaded by path where the open_clip package does not import",
    )
    args = parser.parse_args()
    if args.quick:
        args.batch, args.ms, args.seq, args.repeats = 16, [4, 8], 12, 3
    status = compare(args)
    if not args.no_clip:
        clip_section(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
