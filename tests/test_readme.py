"""Every code block of README.md runs as written.

The ```python blocks run in order in one namespace (later sections continue the Usage snippet: ``model``, ``tok``,
``enc_a`` ...), in a fresh interpreter whose working folder is a temporary one, so tracebacks name README.md
lines. The ```bash blocks run with ``bash -euo pipefail`` in that folder, with this interpreter's ``bin`` first on
PATH (``hf-kvreuse``, ``python``). A block preceded by ``<!-- not run: REASON -->`` is skipped, visibly: the
reason is required, and few blocks may carry one. Those are still checked without running them: a python block
compiles, its imports resolve and it uses no name it does not define; a bash block's ``hf-kvreuse`` commands use
only options the CLI has.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->$")
MAX_NOT_RUN = 7


@dataclass
class Block:
    lang: str
    line: int          # README line of the first code line (1-based)
    code: str
    skip: str | None   # the not-run reason


def blocks(text: str | None = None, name: str = "README.md") -> list[Block]:
    """The fenced python / bash / sh blocks of the README (or of ``text``, a Markdown page called ``name`` in
    errors), with the not-run marker of each. ``tests/test_docs.py`` applies the same checks to the site's pages."""
    lines = (text if text is not None else README.read_text()).splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang, start = m.group(1), i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{name}:{i + 1}: unterminated ``` block")
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = NOT_RUN.match(prev)
        if lang in ("python", "bash", "sh"):
            out.append(Block("python" if lang == "python" else "bash", start + 1, "\n".join(lines[start:end]),
                             skip.group(1) if skip else None))
        i = end + 1
    return out


def test_extractor_and_markers():
    """The extractor finds the blocks; every not-run marker gives a reason, and they stay few."""
    sample = "x\n<!-- not run: needs a GPU -->\n```python\nprint(1)\n```\n\n```bash\necho hi\n```\n```text\nno\n```\n"
    got = blocks(sample)
    assert [(b.lang, b.line, b.code, b.skip) for b in got] == [("python", 4, "print(1)", "needs a GPU"),
                                                               ("bash", 8, "echo hi", None)]
    readme = blocks()
    assert sum(b.lang == "python" for b in readme) >= 6
    skipped = [b for b in readme if b.skip]
    assert len(skipped) <= MAX_NOT_RUN, [(b.line, b.skip) for b in skipped]
    assert all(len(b.skip) > 10 for b in skipped)
    text = README.read_text()
    assert text.count("<!-- not run") == len(skipped), "a not-run marker that precedes no code block"


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="2",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.setdefault("TRITON_INTERPRET", "1")
    return env


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path):
    runnable = [b for b in blocks() if b.lang == "python" and not b.skip]
    script = ["import sys", "ns = {'__name__': '__main__'}"]
    for b in runnable:
        # leading newlines: the compiled block's line numbers are the README's
        src = "\n" * (b.line - 1) + b.code + "\n"
        script.append(f"print('--- README.md:{b.line}', flush=True)")
        script.append(f"exec(compile({src!r}, 'README.md', 'exec'), ns)")
    (tmp_path / "readme_blocks.py").write_text("\n".join(script) + "\n")
    # the limit only catches a hang: on two idle cores the blocks take minutes, on a loaded machine (load ~15)
    # they took 15+ minutes
    res = subprocess.run([sys.executable, "readme_blocks.py"], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=2400)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    assert res.stdout.count("--- README.md:") == len(runnable)


@pytest.mark.slow
def test_readme_shell_blocks_run(tmp_path):
    for b in (b for b in blocks() if b.lang == "bash" and not b.skip):
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", b.code], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=1200)
        assert res.returncode == 0, f"README.md:{b.line}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"


def _unbound_names(code: str) -> set[str]:
    """Names a block reads that neither it (assignments, imports, defs, loop / with / comprehension targets) nor
    builtins define: what would raise ``NameError`` when run alone."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


OPTIONAL = {"vllm"}  # optional extras (hf_kvreuse[vllm]): their imports are checked where they are installed


def _absent_extra(module: str) -> bool:
    top = module.split(".")[0]
    return top in OPTIONAL and importlib.util.find_spec(top) is None


def _imports_resolve(code: str) -> list[str]:
    """The ``import`` / ``from ... import`` lines of a block that fail (module or attribute missing)."""
    bad = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                _absent_extra(m) for m in ([a.name for a in node.names] if isinstance(node, ast.Import)
                                           else [node.module or ""])):
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                try:
                    importlib.import_module(a.name)
                except ImportError as e:
                    bad.append(f"import {a.name}: {e}")
        elif isinstance(node, ast.ImportFrom):
            try:
                mod = importlib.import_module(node.module)
            except ImportError as e:
                bad.append(f"from {node.module}: {e}")
                continue
            for a in node.names:
                if not hasattr(mod, a.name):
                    try:
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        bad.append(f"from {node.module} import {a.name}")
    return bad


def test_unbound_name_check_catches_an_undefined_name():
    """The check that guards the not-run blocks fails on the bug this issue found (a snippet reading ``ids_a``
    that it never defines) and on a misspelt import."""
    assert _unbound_names("import torch\nx = torch.ones(2)\nprint(x, ids_a)") == {"ids_a"}
    assert _unbound_names("for i in range(2):\n    y = [j for j in range(i)]\nprint(y)") == set()
    assert _imports_resolve("from hf_kvreuse import NoSuchCache") == ["from hf_kvreuse import NoSuchCache"]


def test_not_run_blocks_are_self_contained():
    """Each not-run python block compiles, imports only what exists and defines every name it reads (so it runs as
    written where its model is at hand); each not-run bash block calls ``hf-kvreuse`` only with options its
    sub-command has."""
    check_not_run_blocks(blocks(), "README.md")


def check_not_run_blocks(found: list[Block], name: str) -> None:
    """The static checks of the not-run blocks of one Markdown file (see the test above)."""
    from hf_kvreuse import cli

    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for b in (b for b in found if b.skip):
        if b.lang == "python":
            compile(b.code, f"{name}:{b.line}", "exec")
            assert not _unbound_names(b.code), f"{name}:{b.line} reads undefined {_unbound_names(b.code)}"
            assert not _imports_resolve(b.code), f"{name}:{b.line}: {_imports_resolve(b.code)}"
            continue
        for line in b.code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i, w in enumerate(words):
                if w != "hf-kvreuse":
                    continue
                sub = words[i + 1]
                assert sub in commands, f"{name}:{b.line}: hf-kvreuse has no command {sub!r}"
                actions = commands[sub]._option_string_actions
                used = [x.split("=")[0] for x in words[i + 2:] if x.startswith("--")]
                unknown = [o for o in used if o not in actions]
                assert not unknown, f"{name}:{b.line}: hf-kvreuse {sub} has no {unknown}"
