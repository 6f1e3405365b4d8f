"""The documentation site: its pages, their code blocks and the words user documentation must not hold.

The pages are ``docs/**/*.md`` in the order of ``mkdocs.yml``'s nav. Their ```python blocks run as the README's do
(``tests/test_readme.py``): in nav order, in one namespace, so a page may continue Getting started's snippet
(``model``, ``tok``, ``enc_a`` ...), in a fresh interpreter in a temporary folder. A block preceded by
``<!-- not run: REASON -->`` is skipped visibly and checked statically (it compiles, its imports resolve, it
defines every name it reads; its ``hf-kvreuse`` commands use options the CLI has). Pages under ``docs/research/``
are research notes: their commands are records of how a figure was made and are all marked not run.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_readme import _env, _unbound_names, blocks, check_not_run_blocks

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_NOT_RUN = 20
# pages reached from the site through a snippet include rather than the nav
INCLUDED = {"changelog.md"}
# what user documentation never says: issue numbers, rounds of work, sessions of the people who did it
FORBIDDEN = re.compile(r"\bissue \d+|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|this|earlier|last|"
                       r"next|previous|later) round\b|\bdeliverable \d", re.IGNORECASE)


def nav_pages(nav=None) -> list[str]:
    """The pages of mkdocs.yml's nav, in order (paths relative to docs/)."""
    if nav is None:
        nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    out = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            out.extend([value] if isinstance(value, str) else nav_pages(value))
    return out


def page_blocks():
    """(page, block) for every code block of the nav's pages, in nav order."""
    return [(page, b) for page in nav_pages() for b in blocks((DOCS / page).read_text(), f"docs/{page}")]


def test_every_page_is_in_the_nav_and_exists():
    """A page not in the nav is unreachable; a nav entry without its file breaks the build."""
    pages = nav_pages()
    assert len(pages) == len(set(pages)), "a page listed twice"
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, missing
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert not (on_disk - set(pages) - INCLUDED), f"pages missing from mkdocs.yml's nav: {on_disk - set(pages)}"


def test_api_reference_covers_all():
    """Every public name (``hf_kvreuse.__all__``) has its entry in the API reference, and nothing else."""
    import hf_kvreuse

    listed = re.findall(r"^::: hf_kvreuse\.(\w+)\s*$", (DOCS / "api.md").read_text(), re.MULTILINE)
    assert sorted(listed) == sorted(hf_kvreuse.__all__)


def test_user_docs_name_no_issues_or_rounds():
    """README, CHANGELOG and every page (research notes included) are free of issue numbers and rounds; the check
    catches a planted ``(issue 24)``."""
    assert FORBIDDEN.search("measured (issue 24) here") and FORBIDDEN.search("in the Second round")
    assert not FORBIDDEN.search("3 agents x 3 rounds, the round before")
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for f in files
            for i, line in enumerate(f.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert not hits, "\n".join(hits)


def test_markers_and_names_in_order():
    """Not-run markers give a reason and stay few; every runnable python block reads only names that it, an
    earlier block (nav order) or builtins define, so the pages run in order as the test below runs them."""
    found = page_blocks()
    assert sum(b.lang == "python" and not b.skip for _, b in found) >= 6
    skipped = [(p, b) for p, b in found if b.skip]
    assert len(skipped) <= MAX_NOT_RUN, [(p, b.line, b.skip) for p, b in skipped]
    assert all(len(b.skip) > 10 for _, b in skipped)
    for page in nav_pages():
        text = (DOCS / page).read_text()
        n = sum(1 for p, b in skipped if p == page)
        assert text.count("<!-- not run") == n, f"docs/{page}: a not-run marker that precedes no code block"
    for page, b in found:
        if page.startswith("research/"):
            assert b.skip, f"docs/{page}:{b.line}: a research note's command runs in tests: mark it not run"
    defined: set[str] = set()
    for page, b in found:
        if b.lang != "python" or b.skip:
            continue
        unbound = _unbound_names(b.code) - defined
        assert not unbound, f"docs/{page}:{b.line} reads {unbound}, which no earlier block defines"
        for node in ast.walk(ast.parse(b.code)):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                defined.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)


def test_not_run_blocks_are_self_contained():
    """The README's static checks, on every page."""
    for page in nav_pages():
        check_not_run_blocks(blocks((DOCS / page).read_text(), f"docs/{page}"), f"docs/{page}")


@pytest.mark.slow
def test_docs_python_blocks_run(tmp_path):
    runnable = [(p, b) for p, b in page_blocks() if b.lang == "python" and not b.skip]
    script = ["import sys", "ns = {'__name__': '__main__'}"]
    for page, b in runnable:
        src = "\n" * (b.line - 1) + b.code + "\n"
        script.append(f"print('--- docs/{page}:{b.line}', flush=True)")
        script.append(f"exec(compile({src!r}, 'docs/{page}', 'exec'), ns)")
    (tmp_path / "docs_blocks.py").write_text("\n".join(script) + "\n")
    res = subprocess.run([sys.executable, "docs_blocks.py"], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=2400)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    assert res.stdout.count("--- docs/") == len(runnable)


@pytest.mark.slow
def test_docs_shell_blocks_run(tmp_path):
    for page, b in ((p, b) for p, b in page_blocks() if b.lang == "bash" and not b.skip):
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", b.code], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=1200)
        assert res.returncode == 0, f"docs/{page}:{b.line}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
