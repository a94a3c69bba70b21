import re
import textwrap
from pathlib import Path

import pytest
import torch
from public import public_objects

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXECUTED_PAGES = ["index.md", "getting-started.md", "concepts.md"]

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})\s*(?P<lang>[\w+-]*)[^\n]*$")
SKIP = "<!-- skip -->"
API_ENTRY = re.compile(r"^:::[ \t]+(\S+)[ \t]*$", re.MULTILINE)


def nav_pages():
    """The .md paths named in mkdocs.yml's top-level ``nav:`` block (no YAML parser needed)."""
    text = (ROOT / "mkdocs.yml").read_text()
    match = re.search(r"^nav:[ \t]*\n((?:[ \t]+.*\n|[ \t]*\n)*)", text, re.MULTILINE)
    assert match, "mkdocs.yml has no top-level nav:"
    return set(re.findall(r"[\w./-]+\.md\b", match[1]))


def python_blocks(page):
    """The page's ```python fences, as (first line number, dedented source), minus skipped ones."""
    lines = page.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, ticks, lang = match["indent"], match["ticks"], match["lang"]
        start = i + 1
        end = start
        closing = re.compile(rf"^{re.escape(indent)}{ticks}`*\s*$")
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        assert end < len(lines), f"{page.name}:{i + 1}: unclosed code fence"
        previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        if lang == "python" and previous != SKIP:
            source = textwrap.dedent("\n".join(lines[start:end]))
            blocks.append((start + 1, source))
        i = end + 1
    return blocks


def test_every_public_name_has_an_api_entry():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented.update(API_ENTRY.findall(page.read_text()))
    missing = [name for name in public_objects() if name not in documented]
    assert not missing, f"no '::: NAME' entry in docs/api/*.md for: {', '.join(missing)}"


def test_every_api_entry_is_public():
    public = public_objects()
    unknown = [
        f"{page.name}: {entry}"
        for page in sorted((DOCS / "api").glob("*.md"))
        for entry in API_ENTRY.findall(page.read_text())
        if entry not in public
    ]
    assert not unknown, f"'::: NAME' entries for names in no public __all__: {unknown}"


def test_every_page_is_in_the_nav():
    nav = nav_pages()
    pages = {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}
    assert not pages - nav, f"pages missing from the mkdocs.yml nav: {sorted(pages - nav)}"
    assert not nav - pages, f"nav entries without a page: {sorted(nav - pages)}"


def test_skip_marker_is_honoured(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n<!-- skip -->\n```python\nraise SystemExit\n```\n")
    assert python_blocks(page) == [(2, "x = 1")]


def fenced(text, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_install_commands_match_the_readme():
    readme = fenced((ROOT / "README.md").read_text(), "bash")
    page = fenced((DOCS / "getting-started.md").read_text(), "bash")
    assert readme, "README.md has no bash blocks"
    stale = [block for block in readme if block not in page]
    assert not stale, f"README install commands not in docs/getting-started.md: {stale}"


def test_home_page_example_matches_the_readme():
    readme = fenced((ROOT / "README.md").read_text(), "python")
    assert readme, "README.md has no python block"
    assert readme[0] in fenced((DOCS / "index.md").read_text(), "python")


@pytest.mark.parametrize("name", EXECUTED_PAGES)
def test_page_code_runs(name, tmp_path, monkeypatch):
    page = DOCS / name
    blocks = python_blocks(page)
    assert name == "index.md" or blocks, f"{name} has no python code blocks"
    monkeypatch.chdir(tmp_path)  # snippets may write files (checkpoints)
    torch.manual_seed(0)
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for line, source in blocks:
        # Pad with blank lines so that tracebacks give the line numbers of the page.
        code = compile("\n" * (line - 1) + source, str(page), "exec")
        exec(code, namespace)
