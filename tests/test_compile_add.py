import pytest
import torch

import gradaccum


def _loss(params, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(x @ params["w"] + params["b"], y)


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize(
    "grad",
    # A compile costs seconds: torch.func.grad's twins run in the slow tier.
    [pytest.param(torch.func.grad, marks=pytest.mark.slow), gradaccum.grad],
    ids=["func", "gradaccum"],
)
def test_compiled_micro_step_calls_add(grad, fullgraph) -> None:
    # The micro-step users compile: gradient and add in one function; finalize outside.
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 3, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.float64)}
    x, y = torch.randn(30, 5, dtype=torch.float64), torch.randint(0, 3, (30,))
    acc = gradaccum.Accumulator(n=4)

    @torch.compile(backend="aot_eager", fullgraph=fullgraph)
    def micro_step(params, state, xb, yb):
        return acc.add(state, grad(_loss)(params, (xb, yb)), size=xb.shape[0])

    def window():
        state = acc.init(params)
        for rows in (slice(0, 8), slice(8, 16), slice(16, 24), slice(24, 30)):  # ragged last
            state = micro_step(params, state, x[rows], y[rows])
        grads, _ = acc.finalize(state)
        torch.testing.assert_close(grads, torch.func.grad(_loss)(params, (x, y)))

    window()
    # The second window reuses the graphs: the state's ints (micro_step, weight) do not recompile.
    with torch.compiler.set_stance("fail_on_recompile"):
        window()


def test_compiled_add_reports_a_bad_gradient_tree() -> None:
    acc = gradaccum.Accumulator(n=2)
    params = {"w": torch.zeros(3), "b": torch.zeros(2)}
    step = torch.compile(lambda state, g: acc.add(state, g, size=1), backend="aot_eager")
    with pytest.raises(ValueError, match=r"do not match the params tree at <root>"):
        step(acc.init(params), {"w": torch.ones(3)})
