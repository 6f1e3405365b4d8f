"""The package layout: generation/ never imports cache_classes/ (no import cycle); the top level exports the
public API only; the moved modules import from their new homes."""

import ast
from pathlib import Path

import pytest
import torch

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


def test_top_level_exports_the_public_api_only():
    import importlib

    import hf_kvreuse

    names = hf_kvreuse.__all__
    assert len(names) == len(set(names))
    for low_level in ("cat_kv", "kv_of", "load_kv", "slice_kv", "dynamic_cache_from_kv", "RopeShifter", "rope_shift",
                      "check_rope_supported", "align_token_ids", "segment_prompt", "TokenTimer", "synchronize",
                      "BackgroundPrefill", "partial_forward", "load_smollm2", "load_qwen", "load_offline",
                      "tiny_model", "smollm2_path"):
        assert low_level not in names, low_level
    for public in ("OptimisticCache", "KVReuseCache", "enable", "disable", "is_enabled", "ChunkStore", "KVMapper",
                   "LatentBridge", "LoraSplit", "find_blocks", "KVReuseTextGenerationPipeline"):
        assert public in names, public
    module = importlib.import_module("hf_kvreuse")
    for name in names:
        assert getattr(module, name) is not None, name
        exec(f"from hf_kvreuse import {name}", {})  # noqa: S102 - every exported name imports


def test_moved_modules_import_from_their_new_homes():
    from hf_kvreuse.models import OFFLINE_MODELS, load_offline, load_qwen, load_smollm2, model_path, smollm2_path
    from hf_kvreuse.models import tiny_config, tiny_model
    from hf_kvreuse.models.arch_zoo import CHECKS, SPECS
    from hf_kvreuse.models.offline import cache_dir
    from hf_kvreuse.workflows import DEFAULT_AGENTS, Agent, agent_prompt, drop, qa_chat_ids, react, role_text, squad
    from hf_kvreuse.workflows.react import ROLE_ADAPTERS_DIR

    assert ROLE_ADAPTERS_DIR.is_dir() and (ROLE_ADAPTERS_DIR / "README.md").is_file()
    assert all(callable(f) for f in (load_offline, load_qwen, load_smollm2, model_path, smollm2_path, tiny_config,
                                     tiny_model, cache_dir, agent_prompt, role_text, drop, qa_chat_ids, squad))
    assert OFFLINE_MODELS and CHECKS and SPECS and DEFAULT_AGENTS and isinstance(DEFAULT_AGENTS[0], Agent)
    assert react.load_role_adapters


def test_loaders_take_dtype_names():
    """``load_qwen(dtype="bf16")`` (as the CLI spells it) works; an unknown name is refused before any loading."""
    from hf_kvreuse.models.loaders import as_dtype, load_offline

    assert as_dtype("bf16") is torch.bfloat16 and as_dtype("fp32") is torch.float32
    assert as_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="'int8'"):
        load_offline("no-such-model", dtype="int8")


def test_bf16_on_a_cpu_without_native_bf16_warns(monkeypatch):
    """Loading in bfloat16 on a CPU that lacks AVX512-BF16 / AMX warns (it runs several times slower than float32
    there); float32, a GPU device or a CPU with native bf16 does not."""
    import warnings

    from hf_kvreuse.models import loaders

    assert isinstance(loaders.native_cpu_bf16(), bool)
    monkeypatch.setattr(loaders, "native_cpu_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="dtype='fp32'"):
        loaders.warn_slow_dtype(torch.bfloat16, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaders.warn_slow_dtype(torch.float32, "cpu")
        loaders.warn_slow_dtype(torch.bfloat16, "cuda")
        monkeypatch.setattr(loaders, "native_cpu_bf16", lambda: True)
        loaders.warn_slow_dtype(torch.bfloat16, "cpu")
