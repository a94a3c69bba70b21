"""The figures under docs/benchmarks/ are drawn from the data beside them, by today's code.

Each figure's PNG metadata names the file it was drawn from (``Source``) and that file's SHA-256
(``Source-SHA256``); ``benchmarks/_figures.py`` writes them. A figure whose data changed since it
was drawn (or that never said) fails here, and the fix is a redraw from the data, with no
benchmark run: ``python benchmarks/<script> --replot``. The redraw itself is tested too, so a
change to the plotting code or to the data's layout that breaks it fails here as well.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from png import check as png_check

ROOT = Path(__file__).resolve().parents[1]
FIGURES_DIR = ROOT / "docs" / "benchmarks"
# figure -> (the script that draws it, the data it is drawn from)
FIGURES = {
    "benchmarks.png": ("suite.py", "results.json"),
    "compression.png": ("compression.py", "compression.json"),
}
CASES = FIGURES


# docs figure -> (the example that draws it, its arguments besides --plot)
EXAMPLE_FIGURES = {"images/quickstart-loss.png": ("quickstart.py", ("--steps", "100"))}


def test_every_figure_is_known() -> None:
    found = sorted(p.relative_to(ROOT / "docs").as_posix() for p in ROOT.glob("docs/**/*.png"))
    known = sorted([f"benchmarks/{name}" for name in FIGURES] + list(EXAMPLE_FIGURES))
    assert found == known, (
        f"figures under docs/ without a known source: {sorted(set(found) - set(known))}; add "
        f"them to FIGURES or EXAMPLE_FIGURES in tests/test_figures.py with what draws them"
    )


@pytest.mark.parametrize("name", CASES)
def test_figure_is_drawn_from_the_data_beside_it(name: str) -> None:
    script, data = FIGURES[name]
    meta = png_check(FIGURES_DIR / name)
    redraw = f"redraw it: python benchmarks/{script} --replot (no benchmark is run)"
    assert meta.get("Source") == data, (
        f"docs/benchmarks/{name} does not say it was drawn from {data} (metadata {meta}); {redraw}"
    )
    digest = hashlib.sha256((FIGURES_DIR / data).read_bytes()).hexdigest()
    assert meta["Source-SHA256"] == digest, (
        f"docs/benchmarks/{name} was drawn from another {data} (SHA-256 "
        f"{meta['Source-SHA256'][:12]}..., the file's is {digest[:12]}...); {redraw}"
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", CASES)
def test_figure_redraws_from_its_data(name: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the figures need the [plot] extra")
    script, data = FIGURES[name]
    shutil.copy(FIGURES_DIR / data, tmp_path / data)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--replot", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    redrawn = png_check(tmp_path / name, min_size=(800, 300))
    assert redrawn["Source"] == data
    assert redrawn["Source-SHA256"] == hashlib.sha256((tmp_path / data).read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(EXAMPLE_FIGURES))
def test_example_figure_is_what_the_example_draws_today(name: str, tmp_path: Path) -> None:
    # The curves are hashed (rounded to 10 digits) in the PNG: the example run here must draw
    # the same ones, or the figure on the page shows another run than the code makes.
    pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra")
    pytest.importorskip("tqdm", reason="the examples need the [examples] extra")
    example, args = EXAMPLE_FIGURES[name]
    png = tmp_path / "figure.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), *args, "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    drawn = png_check(ROOT / "docs" / name)["Data-SHA256"]
    assert png_check(png)["Data-SHA256"] == drawn, (
        f"docs/{name} shows other curves than examples/{example} {' '.join(args)} draws today; "
        f"redraw it: python examples/{example} {' '.join(args)} --plot docs/{name}"
    )
