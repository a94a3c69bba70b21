"""Hugging Face transformers: a tiny GPT-2 trained on padded ``BatchEncoding`` batches with the
token-count reduction, against the whole batch in float64 (1 and 2 gloo processes), and the
splitting of mappings that optree keeps as leaves (``UserDict``, ``BatchEncoding``).
"""

from __future__ import annotations

import collections
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import run, values
from test_docs import DOCS, python_blocks
from test_examples import EXAMPLES, run_example, run_torchrun

import gradaccum

TOL = 1e-10


# -- mappings that optree keeps as leaves (no transformers needed) ------------------------------


def _linear_loss(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch["x"], batch["y"]
    return ((x @ params["w"] - y) ** 2).mean(), None


def _linear(rows: int = 10) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, dtype=torch.float64, generator=gen)}
    x = torch.randn(rows, 3, dtype=torch.float64, generator=gen)
    return params, x, torch.randn(rows, dtype=torch.float64, generator=gen)


def test_a_user_dict_batch_is_split_by_its_values() -> None:
    params, x, y = _linear()
    seen: list[tuple[type, int]] = []

    def loss(params: dict[str, torch.Tensor], batch: Any) -> tuple[torch.Tensor, None]:
        seen.append((type(batch), len(batch["x"])))
        return _linear_loss(params, batch)

    step = gradaccum.accumulate(gradaccum.grad(loss, has_aux=True), 3, has_aux=True)
    grads, _ = step(params, collections.UserDict(x=x, y=y))
    whole = torch.func.grad(lambda p: _linear_loss(p, {"x": x, "y": y})[0])(params)
    assert seen == [(collections.UserDict, 4), (collections.UserDict, 3), (collections.UserDict, 3)]
    torch.testing.assert_close(grads["w"], whole["w"], rtol=0, atol=TOL)


def test_a_user_dict_inside_a_tuple_and_in_micro_batches() -> None:
    params, x, y = _linear()

    def loss(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        inputs, targets = batch
        assert isinstance(inputs, collections.UserDict)
        return ((inputs["x"] @ params["w"] - targets) ** 2).mean()

    step = gradaccum.accumulate(torch.func.grad(loss), 4)
    grads = step(params, (collections.UserDict(x=x), y))
    whole = torch.func.grad(lambda p: _linear_loss(p, {"x": x, "y": y})[0])(params)
    torch.testing.assert_close(grads["w"], whole["w"], rtol=0, atol=TOL)
    # MicroBatches of UserDicts are used as given, their rows counted through the mapping.
    micro = gradaccum.MicroBatches(
        [(collections.UserDict(x=x[:7]), y[:7]), (collections.UserDict(x=x[7:]), y[7:])]
    )
    grads = gradaccum.accumulate(torch.func.grad(loss), 2)(params, micro)
    torch.testing.assert_close(grads["w"], whole["w"], rtol=0, atol=TOL)


class _Pair(collections.abc.Mapping):
    """A mapping whose constructor does not take a dict."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._data = {"x": x, "y": y}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return 2


def test_a_mapping_that_cannot_be_rebuilt_is_refused() -> None:
    params, x, y = _linear()
    step = gradaccum.accumulate(gradaccum.grad(_linear_loss, has_aux=True), 2, has_aux=True)
    with pytest.raises(TypeError) as err:
        step(params, _Pair(x, y))
    assert str(err.value) == (
        "accumulate(_linear_loss, n=2)(...): the batch holds a mapping of type _Pair, which "
        "gradaccum splits by its values and rebuilds with _Pair(dict); that raised TypeError: "
        "_Pair.__init__() missing 1 required positional argument: 'y'. Pass its contents as a "
        "dict (dict(batch))."
    )


# -- a tiny GPT-2 on BatchEncoding batches ------------------------------------------------------


def _gpt2() -> Any:
    """examples/hf_gpt2.py as a module (its model, data and reference loss)."""
    pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
    return _example()


def _example() -> Any:
    if "hf_gpt2" not in sys.modules:
        if str(EXAMPLES) not in sys.path:  # its helpers (_ranks), as when run as a script
            sys.path.append(str(EXAMPLES))
        spec = importlib.util.spec_from_file_location("hf_gpt2", EXAMPLES / "hf_gpt2.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["hf_gpt2"] = module
        spec.loader.exec_module(module)
    return sys.modules["hf_gpt2"]


def _token_step(hf: Any, model: torch.nn.Module, n: int, sync: Any = None) -> Any:
    params, buffers = gradaccum.params_of(model), gradaccum.buffers_of(model)
    seen: list[type] = []

    def summed_loss(params: dict[str, torch.Tensor], batch: Any) -> Any:
        seen.append(type(batch))
        out, _ = gradaccum.call_module(
            model,
            params,
            buffers,
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
        )
        logits, targets = out.logits[:, :-1], batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=hf.IGNORE, reduction="sum"
        )
        return loss, (targets != hf.IGNORE).sum()

    step = gradaccum.accumulate(
        gradaccum.grad_and_value(summed_loss, has_aux=True),
        n,
        has_aux=True,
        reduction="count",
        count=lambda aux: aux[1],
        sync=sync,
    )
    return step, params, seen


@pytest.mark.slow  # 4 s; test_gpt2_with_the_accumulator stays in the fast tier
def test_gpt2_batch_encoding_matches_the_whole_batch() -> None:
    hf = _gpt2()
    from transformers import BatchEncoding

    model = hf.make_model(12, seed=0)
    batch = hf.make_batch(11, 12, seed=1)
    whole = hf.gradient(model, lambda: hf.token_mean(model, batch))
    step, params, seen = _token_step(hf, model, 3)  # 11 rows: 4, 4, 3
    grads, (loss_sum, count) = step(params, batch)
    assert seen == [BatchEncoding] * 3
    assert int(count) == hf.tokens(batch)
    assert max((grads[k] - whole[k]).abs().max().item() for k in whole) <= TOL

    # Micro-batches padded to their own lengths (as a length-bucketing sampler gives them): the
    # token count weights them exactly.
    parts = []
    for idx in torch.arange(11).tensor_split([5, 8]):
        length = int(batch["attention_mask"][idx].sum(1).max())
        parts.append(BatchEncoding({k: v[idx, :length] for k, v in batch.items()}))
    assert sorted({p["input_ids"].shape[1] for p in parts}) != [12]  # really padded differently
    grads, _ = step(params, gradaccum.MicroBatches(parts))
    assert max((grads[k] - whole[k]).abs().max().item() for k in whole) <= TOL


def test_gpt2_with_the_accumulator() -> None:
    hf = _gpt2()
    model = hf.make_model(12, seed=0)
    batch = hf.make_batch(9, 12, seed=2)
    whole = hf.gradient(model, lambda: hf.token_mean(model, batch))
    params, buffers = gradaccum.params_of(model), gradaccum.buffers_of(model)

    def summed_loss(params: dict[str, torch.Tensor], batch: Any) -> Any:
        out, _ = gradaccum.call_module(model, params, buffers, **batch)  # labels= too
        targets = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum"
        )
        return loss, (targets != hf.IGNORE).sum()

    acc = gradaccum.Accumulator(n=3, reduction="count")
    state = acc.init(params)
    for idx in torch.arange(9).tensor_split(3):
        mb = {k: v[idx] for k, v in batch.items()}
        grads, count = torch.func.grad(summed_loss, has_aux=True)(params, mb)
        state = acc.add(state, grads, count=count)
    grads, state = acc.finalize(state)
    assert max((grads[k] - whole[k]).abs().max().item() for k in whole) <= TOL


def _gpt2_ranks(rank: int, world: int) -> float:
    hf = _example()
    model = hf.make_model(12, seed=0)
    batch = hf.make_batch(13, 12, seed=3)  # 7 and 6 rows, n=3: 3+2+2 and 2+2+2
    step, params, _ = _token_step(hf, model, 3, sync=gradaccum.all_reduce())
    grads, _ = step(params, hf.shard(batch, rank, world))
    whole = hf.gradient(model, lambda: hf.token_mean(model, batch))
    return max((grads[k] - whole[k]).abs().max().item() for k in whole)


@pytest.mark.distributed
def test_gpt2_on_two_ranks_matches_the_whole_batch() -> None:
    _gpt2()
    assert max(values(run(_gpt2_ranks))) <= TOL


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 2], ids=["1-process", "2-ranks"])
def test_hf_gpt2_example(ranks: int) -> None:
    _gpt2()
    stdout = (run_example if ranks == 1 else run_torchrun)("hf_gpt2.py")
    assert stdout.rstrip().endswith("OK"), stdout
    assert f"{ranks} process(es); GPT2LMHeadModel" in stdout
    assert "(a BatchEncoding)" in stdout
    lines = dict(line.strip().split(": ", 1) for line in stdout.splitlines() if ": " in line)
    ours = lines["gradaccum, reduction='count'"]
    assert ours.endswith("OK")
    assert float(ours.split()[0]) <= TOL
    # HF's own loss is the same token mean computed in float32.
    assert (
        1e-12 < float(lines["HF's model(**batch).loss on the whole batch (a float32 loss)"]) < 1e-6
    )
    classic = lines["the classic model(**mb).loss / n per micro-batch"]
    assert float(classic.split()[0]) > 1e-4
    assert float(stdout.split("max parameter difference: ")[1].split()[0]) <= TOL
    # docs/huggingface.md quotes these runs.
    page = (DOCS / "huggingface.md").read_text()
    if ranks == 1:
        number, share = classic.split()[0], classic.split()[1].strip("(")
        assert f"off by {number} ({share} of the largest entry)" in page
    else:
        for key in ("  per micro-batch (n=4 per rank)", "  the classic model(**mb).loss / n"):
            line = next(x for x in stdout.splitlines() if x.startswith(key))
            assert line in page, line


@pytest.mark.slow  # 4 s; test_docs.py runs the page's code in the fast tier too
def test_the_page_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpt2()
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    page = DOCS / "huggingface.md"
    namespace = {"__name__": "docs_huggingface"}
    blocks = python_blocks(page)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile("\n" * (block.line - 1) + block.source, str(page), "exec"), namespace)
    assert "lm_head.weight" not in namespace["params"]  # tied to transformer.wte.weight
