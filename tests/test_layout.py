"""The package layout: generation/ never imports cache_classes/ (no import cycle)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "hf_kvreuse"


def _imported_modules(path: Path, package: str) -> list[str]:
    """Every module an ``import`` / ``from ... import`` anywhere in ``path`` names (function bodies included),
    relative imports resolved against ``package`` (the dotted name of the file's package)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
            # ``from .. import cache_classes`` names the subpackage as an imported name
            out += [f"{mod}.{a.name}" for a in node.names]
    return out


def test_import_resolution_sees_relative_and_nested_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from ..cache_classes.base import X\n"
                 "def g():\n    from .. import cache_classes\n    import hf_kvreuse.cache_classes.optimistic\n")
    mods = _imported_modules(f, "hf_kvreuse.generation")
    assert "hf_kvreuse.cache_classes.base" in mods
    assert "hf_kvreuse.cache_classes" in mods
    assert "hf_kvreuse.cache_classes.optimistic" in mods


def test_generation_never_imports_cache_classes():
    files = sorted((PKG / "generation").rglob("*.py"))
    assert files
    for path in files:
        package = ".".join(path.relative_to(PKG.parent).parts[:-1])  # the same for __init__.py and a module
        bad = [m for m in _imported_modules(path, package)
               if m == "hf_kvreuse.cache_classes" or m.startswith("hf_kvreuse.cache_classes.")]
        assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}"
