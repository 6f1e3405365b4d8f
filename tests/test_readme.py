"""Every code block of README.md runs as written.

The ```python blocks run in order in one namespace (later sections continue the Usage snippet: ``model``, ``tok``,
``enc_a`` ...), in a fresh interpreter whose working folder is a temporary one, so tracebacks name README.md
lines. The ```bash blocks run with ``bash -euo pipefail`` in that folder, with this interpreter's ``bin`` first on
PATH (``hf-kvreuse``, ``python``). A block preceded by ``<!-- not run: REASON -->`` is skipped, visibly: the
reason is required, and few blocks may carry one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->$")
MAX_NOT_RUN = 6


@dataclass
class Block:
    lang: str
    line: int          # README line of the first code line (1-based)
    code: str
    skip: str | None   # the not-run reason


def blocks(text: str | None = None) -> list[Block]:
    """The fenced python / bash / sh blocks of the README, with the not-run marker of each."""
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
            raise ValueError(f"README.md:{i + 1}: unterminated ``` block")
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
    res = subprocess.run([sys.executable, "readme_blocks.py"], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    assert res.stdout.count("--- README.md:") == len(runnable)


@pytest.mark.slow
def test_readme_shell_blocks_run(tmp_path):
    for b in (b for b in blocks() if b.lang == "bash" and not b.skip):
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", b.code], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"README.md:{b.line}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
