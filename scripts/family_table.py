"""The model-family table: what ``ReuseSession()`` does on each family, and which reuse caches serve or refuse it.

For one tiny random-init model per family of the installed transformers (dense RoPE, every sliding-window family of
:data:`hf_kvreuse.models.arch_zoo.SLIDING`, the linear-attention hybrids of
:data:`~hf_kvreuse.models.arch_zoo.HYBRIDS`, GPT-2's absolute positions, dynamic RoPE):

- the session default (policy ``"auto"``) runs a three-call workflow: agent A over a document, A's next turn (the
  transcript plus a question), agent B over the same document; each answer is compared with plain ``generate``'s
  (tokens, and every step's scores to 1e-4), and the methods the session chose are recorded with its reason;
- OptimisticCache, DirectReuseCache and BlendCache are built and checked as ``tests/test_architectures.py`` checks
  them (:func:`hf_kvreuse.models.arch_zoo.run_check`): "works", or the refusal's reason.

Writes ``benchmarks/results/model_families.json`` (transformers version, commit, rows); the table in
docs/model-families.md is generated from it (``scripts/docs_tables.py``):

    .venv/bin/python scripts/family_table.py        # ~2 min on one CPU core
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from arch_table import cache_outcome  # noqa: E402
from hf_kvreuse import ReuseSession, enable  # noqa: E402
from hf_kvreuse.models.arch_zoo import HYBRIDS, SLIDING, hybrid_model, zoo_model  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "model_families.json"
CACHES = {"OptimisticCache": ("optimistic",), "DirectReuseCache": ("direct", "reposition"),
          "BlendCache": ("blend", "blend_full")}
GEN = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)


def families() -> list[tuple[str, str, object]]:
    """``(family, architecture, builder)`` rows."""
    rows = [("Dense, RoPE, full attention", "llama", lambda: zoo_model("llama"))]
    rows += [("Sliding-window layers", name, lambda name=name: zoo_model(name, **SLIDING[name])) for name in SLIDING]
    rows += [("Linear-attention hybrid", kind, lambda kind=kind: hybrid_model(kind)) for kind in HYBRIDS]
    rows += [("Absolute positions", "gpt2", lambda: zoo_model("gpt2")),
             ("Dynamic RoPE", "llama@dynamic", lambda: zoo_model("llama@dynamic"))]
    return rows


@torch.no_grad()
def session_row(model) -> dict:
    """The three-call workflow under ``ReuseSession(model)``: methods, reasons, whether every answer is plain
    generate's, and the largest score difference."""
    g = torch.Generator().manual_seed(0)
    vocab = min(int(model.config.vocab_size), 128)
    doc = torch.randint(3, vocab, (1, 64), generator=g)
    role_a, role_b, question = (torch.randint(3, vocab, (1, k), generator=g) for k in (5, 7, 4))
    session = ReuseSession(model)
    methods, reasons, same, worst = [], [], True, 0.0
    prompts = [torch.cat([doc, role_a], 1), None, torch.cat([doc, role_b], 1)]
    last = None
    for i, ids in enumerate(prompts):
        ids = torch.cat([last, question], 1) if ids is None else ids
        out = session.generate(ids, **GEN)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
        same &= torch.equal(out.sequences, ref.sequences)
        worst = max([worst] + [float((a - b).abs().max()) for a, b in zip(out.scores, ref.scores)])
        st = session.last_stats
        methods.append(st.method)
        reasons.append(st.reason or "")
        last = out.sequences
    return {"methods": methods, "reasons": reasons, "plain_generate": bool(same and worst <= 1e-4),
            "max_score_diff": worst}


def cache_outcomes(model) -> dict:
    return {cache: cache_outcome(model, checks) for cache, checks in CACHES.items()}


def table(doc: dict) -> str:
    """The markdown table of a results JSON."""
    lines = ["| family | architecture (tiny) | `ReuseSession()` methods, 3 calls | answers = plain generate "
             "| OptimisticCache | DirectReuseCache | BlendCache |", "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if "missing" in r:
            lines.append(f"| {r['family']} | {r['arch']} | not in transformers {doc['transformers']} | | | | |")
            continue
        s = r["session"]
        ok = ("yes" if s["plain_generate"] else "**NO**") + f" (max score diff {s['max_score_diff']:.1g})"
        cells = [r["caches"][c] for c in CACHES]
        lines.append(f"| {r['family']} | {r['arch']} | {' / '.join(s['methods'])} | {ok} | " + " | ".join(cells) + " |")
    lines += ["", "Calls: agent A over the document; A's next turn (its transcript plus a question); agent B over the "
              "same document. `prefix` = an exact held prefix was reused, `optimistic` = verified drafts, `full` = "
              "plain prefill. Between `prefix` and `full` the default chooses by what it has measured on this "
              "machine (a short prefix on a tiny model may not pay), so the third column can differ between runs; "
              "the answers may not. Hybrids reuse a held state only for exactly its tokens: agent B, who shares "
              "the document but not A's prompt, runs `full` there. On the hybrids, OptimisticCache `works` means: verified "
              "drafts from another prompt's cache (its attention rows re-positioned, its state copied at the end of "
              "the shared span) give plain `generate`'s tokens and logits; its rows cannot equal a prefill's, since "
              "they carry the other prompt's state."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers
    from common import git_commit

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = []
    for family, arch, build in families():
        try:
            model = build()
        except Exception as e:  # noqa: BLE001 - an architecture missing from this release
            rows.append({"family": family, "arch": arch, "missing": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        row = {"family": family, "arch": arch, "cls": type(model).__name__, "session": session_row(model)}
        row["caches"] = cache_outcomes(enable(model))
        rows.append(row)
        print(f"{arch}: {row['session']['methods']} plain={row['session']['plain_generate']} {row['caches']}",
              flush=True)
    doc = {"config": {"script": "scripts/family_table.py", "threads": 1, "dtype": "float32",
                      "workflow": "A over a 64-token document, A's next turn (transcript + 4 tokens), B over the "
                                  "same document; 4 greedy tokens each"},
           "command": "python scripts/family_table.py", "transformers": transformers.__version__,
           "torch": torch.__version__, "commit": git_commit(), "rows": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(table(doc))
    bad = [r["arch"] for r in rows if "session" in r and (not r["session"]["plain_generate"] or any(
        o.startswith(("WRONG", "ERROR")) for o in r["caches"].values()))]
    if bad:
        print(f"library bugs: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
