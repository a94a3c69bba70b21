"""Small float64 models and batches shared by the tests."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

F64 = torch.float64


class Layer(NamedTuple):
    w: torch.Tensor
    b: torch.Tensor


def mlp_params(seed: int = 0, kind: str = "dict", d_in: int = 5, d_hidden: int = 7) -> object:
    """An MLP's params as a flat dict, a nested tree (dict/list/namedtuple) or a namedtuple."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(d_in, d_hidden, generator=g, dtype=F64) / d_in**0.5
    b1 = torch.randn(d_hidden, generator=g, dtype=F64) * 0.1
    w2 = torch.randn(d_hidden, generator=g, dtype=F64) / d_hidden**0.5
    b2 = torch.randn((), generator=g, dtype=F64) * 0.1
    if kind == "dict":
        return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    if kind == "nested":
        return {"hidden": Layer(w1, b1), "out": [w2, {"bias": b2}]}
    if kind == "namedtuple":
        return (Layer(w1, b1), Layer(w2, b2))
    raise ValueError(kind)


def _unpack(params: object) -> tuple[torch.Tensor, ...]:
    if isinstance(params, dict) and "w1" in params:
        return params["w1"], params["b1"], params["w2"], params["b2"]
    if isinstance(params, dict):
        return (*params["hidden"], params["out"][0], params["out"][1]["bias"])
    (w1, b1), (w2, b2) = params  # type: ignore[misc]
    return w1, b1, w2, b2


def predict(params: object, x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = _unpack(params)
    return torch.tanh(x @ w1 + b1) @ w2 + b2


def mean_loss(params: object, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((predict(params, x) - y) ** 2).mean()


def sum_loss(params: object, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((predict(params, x) - y) ** 2).sum()


def regression_batch(rows: int, seed: int = 1, d_in: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d_in, generator=g, dtype=F64), torch.randn(
        rows, generator=g, dtype=F64
    )


def token_batch(rows: int, seq: int = 6, d_in: int = 5, seed: int = 2) -> dict[str, torch.Tensor]:
    """Variable-length padded sequences: x [rows, seq, d], y [rows, seq], mask [rows, seq]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(F64)
    return {
        "x": torch.randn(rows, seq, d_in, generator=g, dtype=F64),
        "y": torch.randn(rows, seq, generator=g, dtype=F64),
        "mask": mask,
    }


def token_sum_loss(
    params: object, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed per-token squared error over non-padding tokens, and the token count."""
    err = (predict(params, batch["x"]) - batch["y"]) ** 2
    return (err * batch["mask"]).sum(), batch["mask"].sum()


def token_mean_loss(params: object, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss, count = token_sum_loss(params, batch)
    return loss / count


def token_count_step(n: int, **kwargs: Any) -> Any:
    """``accumulate`` over the summed token loss, normalised by the token count (``count``)."""
    from torch.func import grad_and_value

    import gradaccum

    return gradaccum.accumulate(
        grad_and_value(token_sum_loss, has_aux=True),
        n,
        has_aux=True,
        reduction="count",
        count=lambda aux: aux[1],
        **kwargs,
    )


def max_diff(a: object, b: object) -> float:
    import optree

    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb, (sa, sb)
    return max(float((x - y).abs().max()) for x, y in zip(la, lb, strict=True))


def accumulated_steps(n: int, sync: Any, fast: bool) -> dict[str, Any]:
    """Accumulated mean, sum and count steps (count through a token loss), returning grads.

    ``fast``: gradaccum.grad step functions (the fast path); otherwise torch.func.grad.
    """
    from torch.func import grad

    import gradaccum

    if fast:
        mean = gradaccum.accumulate(gradaccum.grad(mean_loss), n, sync=sync)
        total = gradaccum.accumulate(gradaccum.grad(sum_loss), n, reduction="sum", sync=sync)
        count = gradaccum.accumulate(
            gradaccum.grad(token_sum_loss, has_aux=True),
            n,
            has_aux=True,
            reduction="count",
            count=lambda aux: aux,
            sync=sync,
        )
    else:
        mean = gradaccum.accumulate(grad(mean_loss), n, sync=sync)
        total = gradaccum.accumulate(grad(sum_loss), n, reduction="sum", sync=sync)
        count = token_count_step(n, sync=sync)
    return {"mean": mean, "sum": total, "count": lambda p, b: count(p, b)[0]}
