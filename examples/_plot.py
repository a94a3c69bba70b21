"""Loss curves for the examples: the accumulated run beside the whole-batch run, as a PNG.

Shared by the examples that train (``--plot PATH``). Needs matplotlib: ``pip install -e
".[plot]"`` (the ``examples`` and ``test`` extras include it).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path


def loss_curves(
    path: str | Path,
    curves: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str = "optimizer step",
    ylabel: str = "training loss",
) -> Path:
    """Write ``curves`` (label -> loss per step, the reference first) to the PNG ``path``.

    Left: every curve against the step (the reference solid, the others dashed on top of it).
    Right: each other curve's absolute difference from the reference, on a log scale, which is
    where "the same training run" shows (float64 differences sit near 1e-15). The PNG's metadata
    holds the curves' SHA-256 (``Data-SHA256``, of the values as JSON), so a test can tell a
    figure from data it was not drawn from, and the curves themselves (``Data``, JSON with every
    float exact; ``read_curves`` reads them back). Returns the path written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit(
            f"--plot {path}: matplotlib is not installed; pip install -e '.[plot]' (or drop --plot)"
        ) from err
    names = list(curves)
    if not names or any(len(curves[k]) != len(curves[names[0]]) for k in names):
        raise ValueError(f"loss_curves: expected curves of one length, got {names}")
    ref = [float(v) for v in curves[names[0]]]
    steps = range(1, len(ref) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(names):
        style = {"lw": 2.5, "alpha": 0.5} if i == 0 else {"ls": "--", "lw": 1.2}
        left.plot(steps, [float(v) for v in curves[name]], label=name, color=f"C{i}", **style)
    drawn = []
    for i, name in enumerate(names[1:], start=1):
        diff = [abs(float(a) - b) for a, b in zip(curves[name], ref)]
        floor = min((d for d in diff if d > 0), default=1e-18) / 10
        drawn += [max(d, floor) for d in diff]
        right.plot(steps, drawn[-len(diff) :], ".", label=name, color=f"C{i}", ms=4)
    if drawn:  # explicit limits: equal values (all zero, say) would make a singular axis
        right.set_ylim(min(drawn) / 3, max(drawn) * 3)
    left.set_title(title, fontsize=10)
    left.set_ylabel(ylabel)
    right.set_yscale("log")
    right.set_title(f"|loss - {names[0]}| (log scale; 0 drawn at the floor)", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({k: [float(v) for v in vs] for k, vs in curves.items()})
    metadata = {"Title": title, "Data-SHA256": data_hash(curves), "Data": data}
    fig.savefig(out, dpi=100, metadata=metadata)
    plt.close(fig)
    return out


def data_hash(curves: Mapping[str, Sequence[float]]) -> str:
    """The SHA-256 of the curves, as JSON with the values rounded to 10 significant digits."""
    rounded = {k: [_round(float(v)) for v in vs] for k, vs in curves.items()}
    return hashlib.sha256(json.dumps(rounded, sort_keys=True).encode()).hexdigest()


def read_curves(metadata: Mapping[str, str]) -> dict[str, list[float]]:
    """The curves a PNG of ``loss_curves`` was drawn from, from its text metadata (a dict, as
    ``tests/png.py``'s ``check`` returns it), checked against its ``Data-SHA256``.
    """
    curves = json.loads(metadata["Data"])
    if data_hash(curves) != metadata["Data-SHA256"]:
        raise ValueError("read_curves: the PNG's Data does not match its Data-SHA256")
    return curves


def _round(v: float) -> float:
    return v if v == 0 or not math.isfinite(v) else float(f"{v:.10g}")
