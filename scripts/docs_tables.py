"""Generate the documentation's results tables from ``benchmarks/results/*.json``.

One script for every generated table of the site: ``docs/benchmarks/tables.md`` holds, for each results JSON the
documentation cites, the command that made it (as the JSON records it), its commit and date where recorded, and the
table that JSON's own benchmark renders (the same renderer its ``--table`` option prints), followed by an index of
every results file. ``tests/test_docs_tables.py`` fails when the committed page differs from what this script
generates::

    python scripts/docs_tables.py            # rewrite docs/benchmarks/tables.md
    python scripts/docs_tables.py --check    # exit 1 (with a diff) if the committed page is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks" / "tables.md"
# research scripts moved from scripts/ to research/<method>/ after some JSONs recorded their commands
MOVED = {"scripts/gate_": "research/optimistic/gate_", "scripts/verify_start_probe": "research/optimistic/verify_start_probe",
         "scripts/assembly_profile": "research/performance/assembly_profile",
         "scripts/cpu_dtype_speed": "research/performance/cpu_dtype_speed",
         "scripts/selected_attention_cpu": "research/performance/selected_attention_cpu",
         "scripts/memory_breakdown": "research/performance/memory_breakdown",
         "scripts/latent_": "research/latent/latent_", "scripts/translated_": "research/translated/translated_"}


# results that do not record their command: the one their page gives
KNOWN_COMMANDS = {"vllm_connector.json": "PYTHONPATH=. .venvs/vllm/bin/python benchmarks/vllm_connector.py --workflows 8",
                  "vllm_connector_redis.json":
                      "PYTHONPATH=. .venvs/vllm/bin/python benchmarks/vllm_connector.py --workflows 8 --redis",
                  "redis_store.json": "PYTHONPATH=. python benchmarks/redis_store.py --repeats 3"}


def _bench(name: str):
    """A benchmark module of ``benchmarks/`` (they import their siblings as top-level modules)."""
    for folder in (ROOT / "benchmarks", ROOT / "scripts", ROOT):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    return __import__(name)


def _research(folder: str, name: str):
    """A research script of ``research/<folder>/`` (its ``table`` renders its JSON)."""
    path = str(ROOT / "research" / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return __import__(name)


def _latent_remedy(path: Path) -> str:
    """A LatentRemedy generation JSON as ``benchmarks/latent_remedy.py --table`` prints it."""
    return _bench("latent_remedy").markdown(str(path))


def _retention(path: Path) -> str:
    """A TranslatedCache retention JSON as ``research/translated/translated_retention.py table`` prints it."""
    folder = str(ROOT / "research" / "translated")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return __import__("translated_retention").table(str(path))


def _printed(fn, *args) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue().strip()


def _session_bench(path: Path) -> str:
    result = json.loads(path.read_text())
    try:
        return _bench("bench_table").table(result)
    except KeyError:  # a run from before the verified-token columns: the columns it has
        return _summary_table(result["summary"])


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, float) for x in v):
        return f"[{v[0]:.3g}, {v[1]:.3g}]"
    return str(v)


def _summary_table(rows: list[dict]) -> str:
    """Every scalar column the summary rows share, in the order of the first row."""
    cols = [k for k in rows[0] if all(k in r and not isinstance(r[k], dict) for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[k]) for k in cols) + " |" for r in rows]
    return "\n".join(lines)


def _optimistic(path: Path) -> str:
    return _printed(_bench("optimistic").print_table, json.loads(path.read_text())["rows"])


def _family_table(path: Path) -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    import family_table

    return family_table.table(json.loads(path.read_text()))


def _vllm(path: Path) -> str:
    return _bench("vllm_connector").table(json.loads(path.read_text()))


def _fidelity(path: Path) -> str:
    return _bench("fidelity").table(json.loads(path.read_text()))


#: (section title, results file relative to benchmarks/results, renderer, the page that discusses it)
TABLES = [
    ("Fidelity frontier: role-first agents, task accuracy against first token", "fidelity.json", _fidelity,
     "../guide/speed-or-exactness.md"),
    ("ReuseSession workflows, Qwen2.5-Coder-0.5B (accuracy)", "bench/qwen/bench.json", _session_bench,
     "session-workflows.md"),
    ("ReuseSession workflows, SmolLM2-135M (timing)", "bench/smollm2_timing/bench.json", _session_bench,
     "session-workflows.md"),
    ("OptimisticCache modes on Qwen2.5-Coder-0.5B, float32, 16 new tokens", "bench/optimistic_modes_fp32/bench.json",
     _session_bench, "../research/optimistic.md"),
    ("OptimisticCache modes, 128 new tokens", "bench/optimistic_modes_long_fp32_n50/bench.json", _session_bench,
     "../research/optimistic.md"),
    ("OptimisticCache vs full prefill, SmolLM2-135M", "optimistic.json", _optimistic, "optimistic.md"),
    ("OptimisticCache vs full prefill at 2k tokens, SmolLM2-135M", "optimistic_2048.json", _optimistic,
     "optimistic.md"),
    ("TranslatedCache, Qwen2.5-Coder 0.5B -> 1.5B", "translated.json", lambda p: _bench("translated").markdown(str(p)),
     "../methods/translated.md"),
    ("TranslatedCache selectors at ratio 0.3, SQuAD", "translated_retention_squad_sel.json", _retention,
     "../research/translated-selection.md"),
    ("TranslatedCache selectors at ratio 0.3, CoQA first turns", "translated_retention_coqa_sel.json", _retention,
     "../research/translated-selection.md"),
    ("TranslatedCache selectors at ratio 0.3, DROP", "translated_retention_drop_sel.json", _retention,
     "../research/translated-selection.md"),
    ("TranslatedCache selectors at ratio 0.3, SQuAD with the question before the passage",
     "translated_retention_squad-qfirst_sel.json", _retention, "../research/translated-selection.md"),
    ("TranslatedCache: layer-aware budgets and cheaper settings, SQuAD", "translated_layers_squad.json", _retention,
     "../research/translated-selection.md"),
    ("TranslatedCache: layer-aware budgets and cheaper settings, DROP", "translated_layers_drop.json", _retention,
     "../research/translated-selection.md"),
    ("TranslatedCache first token: fused, not fused and without exact layers (SQuAD, 2 threads)",
     "translated_timing_fused_fp32.json", _retention, "../methods/translated.md"),
    ("TranslatedCache default selector: time to first token against the target's full prefill (SQuAD, 2 threads)",
     "translated_timing_auto_fp32.json", _retention, "../methods/translated.md"),
    ("LatentRemedy, held-out conflicting-task families", "latent_remedy_qwen2.5-0.5b.json",
     _latent_remedy, "../methods/latent-remedy.md"),
    ("LatentRemedy and FocusRecompute, generated answers", "latent_remedy_focus_qwen2.5-0.5b.json",
     _latent_remedy, "../methods/focus-recompute.md"),
    ("LatentRemedy with a gated read-out trained with focus rows, generated answers",
     "latent_remedy_gated_qwen2.5-0.5b.json", _latent_remedy,
     "../methods/latent-remedy.md"),
    ("LatentRemedy: the shipped gated bridge beside the bridge it reproduces, generated answers",
     "latent_remedy_shipped_qwen2.5-0.5b.json", _latent_remedy,
     "../methods/latent-remedy.md"),
    ("FocusRecompute with fewer rows (4, 8; tokens after each mention), generated answers",
     "latent_remedy_focus_k_qwen2.5-0.5b.json", _latent_remedy,
     "../research/latent-remedy.md"),
    ("LatentRemedy with a gated read-out: role-different instructions (order, minmax)",
     "latent_remedy_role_qwen2.5-0.5b.json", _latent_remedy,
     "../research/latent-remedy.md"),
    ("LatentRemedy TTFT at 1k, 4k and 8k-token blocks (fused first step)", "latent_ttft_fused_qwen2.5-0.5b.json",
     lambda p: _bench("latent_ttft").markdown(str(p)), "../methods/latent-remedy.md"),
    ("FocusRecompute TTFT at 1k, 4k and 8k-token blocks", "latent_ttft_focus_qwen2.5-0.5b.json",
     lambda p: _bench("latent_ttft").markdown(str(p)), "../methods/focus-recompute.md"),
    ("FocusRecompute and Tail-k first token against direct reuse: what grows with the block",
     "latent_ttft_profile_qwen2.5-0.5b.json",
     lambda p: _research("latent", "latent_ttft_profile").table(json.loads(p.read_text())),
     "../research/latent-remedy.md"),
    ("The shipped gated LatentRemedy bridge and FocusRecompute with 4 / 8 rows: first token against direct reuse",
     "latent_ttft_profile_gated_qwen2.5-0.5b.json",
     lambda p: _research("latent", "latent_ttft_profile").table(json.loads(p.read_text())),
     "../research/latent-remedy.md"),
    ("vLLM fresh vs vLLM with the connector", "vllm_connector.json", _vllm, "../guide/vllm.md"),
    ("vLLM fresh vs vLLM with the connector, store on Redis", "vllm_connector_redis.json", _vllm, "../guide/vllm.md"),
    ("The default (ReuseSession 'auto') against plain generate, SmolLM2-135M, 1 and 2 threads", "defaults_vs_plain.json",
     lambda p: _bench("defaults_vs_plain").table(json.loads(p.read_text())), "../defaults.md"),
    ("K/V store: save and load latency, folder vs Redis (loopback)", "redis_store.json",
     lambda p: _bench("redis_store").table(json.loads(p.read_text())), "../redis-store.md"),
    ("Model families: the session default and the reuse caches on tiny models of each family", "model_families.json",
     lambda p: _family_table(p), "../model-families.md"),
    ("Gemma 3 270M: the default against plain generate, three agents over a document of three windows",
     "gemma_workflow.json", lambda p: _bench("gemma_workflow").table(json.loads(p.read_text())),
     "../model-families.md"),
    ("Gemma 3 270M: a session's first call against plain generate (operators and first token)",
     "first_call_ops.json", lambda p: _research("performance", "first_call_ops").table(json.loads(p.read_text())),
     "../model-families.md"),
    ("A Qwen3.5-shaped hybrid: the default and verified drafts against plain generate, three agents over a document",
     "hybrid_workflow.json", lambda p: _bench("hybrid_workflow").table(json.loads(p.read_text())),
     "../model-families.md"),
    ("Drafts on tiny linear-attention hybrids: acceptance by state", "hybrid_draft_probe.json",
     lambda p: _research("optimistic", "hybrid_draft_probe").table(json.loads(p.read_text())),
     "../research/optimistic.md"),
]


def _cli_command(cfg: dict) -> str:
    """An ``hf-kvreuse`` command line rebuilt from the arguments a bench JSON records (its ``config``)."""
    words = ["hf-kvreuse", str(cfg["command"])]
    for key, value in cfg.items():
        if key == "command" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            sep = " " if all(isinstance(v, (int, float)) for v in value) else ","
            words.append(f"{flag} {sep.join(map(str, value))}")
        else:
            words.append(f"{flag} {value}")
    return " ".join(words)


def command_of(doc) -> str | None:
    """The command a results JSON records (top level, ``meta``, ``config`` or ``args``), research paths updated;
    for an ``hf-kvreuse bench`` / ``merge`` result, the command line rebuilt from its recorded arguments."""
    if not isinstance(doc, dict):
        return None
    cfg = doc.get("config")
    if isinstance(cfg, dict) and cfg.get("command") in ("bench", "merge"):
        return _cli_command(cfg)
    if isinstance(cfg, list) and cfg and all(isinstance(c, dict) and c.get("command") == "bench" for c in cfg):
        return " ; ".join(_cli_command(c) for c in cfg) + " ; then hf-kvreuse merge of their bench.json files"
    cmd = doc.get("command") or doc.get("reproduce")
    for key in ("meta", "config", "args"):
        if not cmd and isinstance(doc.get(key), dict):
            cmd = doc[key].get("command")
    if isinstance(cmd, list):
        cmd = " && ".join(map(str, cmd))
    if not cmd:
        return None
    cmd = str(cmd)
    for old, new in MOVED.items():
        cmd = cmd.replace(old, new)
    return cmd


def _provenance(doc) -> str:
    parts = []
    for key in ("git_commit", "date"):
        for d in (doc, doc.get("meta") if isinstance(doc, dict) else None):
            if isinstance(d, dict) and d.get(key):
                parts.append(f"{key.replace('_', ' ')} {str(d[key])[:19]}")
                break
    return "; ".join(parts)


def generate() -> str:
    out = ["# Results tables", "",
           "<!-- generated by `python scripts/docs_tables.py` from benchmarks/results/*.json: do not edit by hand "
           "(tests/test_docs_tables.py checks it) -->", "",
           "Each table is rendered from one results JSON by the renderer of the benchmark that wrote it; the command "
           "is the one the JSON records. CPU timings are from the project's 2-core machine.", ""]
    for title, rel, render, page in TABLES:
        path = RESULTS / rel
        doc = json.loads(path.read_text())
        out += [f"## {title}", "", f"From `benchmarks/results/{rel}`, discussed in [its page]({page}).", ""]
        cmd = command_of(doc) or KNOWN_COMMANDS.get(rel)
        out += [f"Made by: `{cmd}`" if cmd else "Made by: the command on its page (this JSON does not record it)."]
        prov = _provenance(doc)
        out += ["", f"Recorded: {prov}." if prov else "", "", render(path).strip(), ""]
    out += ["## Every results file", "", "| file | command it records |", "|---|---|"]
    for path in sorted(RESULTS.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            doc = None
        cmd = command_of(doc) or KNOWN_COMMANDS.get(str(path.relative_to(RESULTS)))
        cmd = f"`{cmd[:160]}{'...' if len(cmd) > 160 else ''}`" if cmd else "-"
        out.append(f"| `{path.relative_to(RESULTS)}` | {cmd.replace('|', '/')} |")
    text = "\n".join(out) + "\n"
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the committed page instead of writing it")
    a = p.parse_args(argv)
    text = generate()
    if a.check:
        old = PAGE.read_text() if PAGE.exists() else ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       str(PAGE.relative_to(ROOT)), "generated"))
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
