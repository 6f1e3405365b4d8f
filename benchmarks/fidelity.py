"""Fidelity frontier: task accuracy against first-token time for every reuse mode, per model and dataset.

Reads ``hf-kvreuse bench`` runs (``bench.json``: full prefill and the modes side by side, same questions) and
writes one JSON, one plot and one table:

* per (model, dataset, mode): questions, accuracy with its 95% Wilson interval, **accuracy minus full prefill's,
  paired** (the same questions; Newcombe's interval), final answers equal to full prefill's, the share of calls
  whose answer is guaranteed equal to plain ``generate``'s, and the median first-token ratio to full prefill's
  on the same call, over every call and over the **role-first calls** (calls that had another agent's K/V to reuse:
  ``donor_tokens > 0`` under the mode, the situation exact prefix caching cannot serve);
* the plot: first-token ratio (role-first calls) against the paired accuracy difference, one point per
  mode x model x dataset, with its interval.

Every run is recorded with its command and config; the table is what ``docs/benchmarks/tables.md`` shows
(``scripts/docs_tables.py``). ::

    hf-kvreuse bench --model qwen2.5-0.5b --dtype fp32 --workflows chain --dataset squad --context-tokens 1000 \\
        --methods full,fast,auto-commit-gate --n 100 --threads 1 --max-new-tokens 16 --out RUN
    python benchmarks/fidelity.py RUN/bench.json [MORE/bench.json ...] --out benchmarks/results/fidelity.json
    python benchmarks/fidelity.py --table benchmarks/results/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from hf_kvreuse.cli import paired_difference, wilson


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rows_of(bench: dict, source: str) -> list[dict]:
    """One row per (workflow, context, mode) of one ``bench.json``, paired against its full-prefill records."""
    cfgs = bench["config"] if isinstance(bench["config"], list) else [bench["config"]]
    model = cfgs[0].get("model")
    dataset = cfgs[0].get("dataset", "squad")
    recs = bench["records"]
    out = []
    for shape, ctx in sorted({(r["workflow"], r["context_tokens"]) for r in recs}):
        cell = [r for r in recs if r["workflow"] == shape and r["context_tokens"] == ctx]
        full = {r["question"]: r for r in cell if r["method"] == "full"}
        for mode in dict.fromkeys(r["method"] for r in cell):
            rs = [r for r in cell if r["method"] == mode and r["question"] in full]
            if not rs:
                continue
            n = len(rs)
            k = sum(bool(r["correct"]) for r in rs)
            agree = sum(bool(r["agrees"]) for r in rs)
            turns = [(t, f) for r in rs for t, f in zip(r["turns"], full[r["question"]]["turns"])]
            ratios = [t["stats"]["ttft_s"] / f["stats"]["ttft_s"] for t, f in turns]
            role_first = [t["stats"]["ttft_s"] / f["stats"]["ttft_s"] for t, f in turns
                          if (t["stats"].get("donor_tokens") or 0) > 0]
            e2e = [r["e2e_s"] / full[r["question"]]["e2e_s"] for r in rs]
            row = dict(model=model, dataset=dataset, workflow=shape, context_tokens=ctx, mode=mode, n=n,
                       calls=len(turns), accuracy=k / n, accuracy_ci=wilson(k, n),
                       agreement=agree / n, agreement_ci=wilson(agree, n),
                       exact_output_share=sum(bool(t["stats"].get("exact_output", True)) for t, _ in turns)
                       / len(turns),
                       ttft_ratio=_median(ratios), role_first_calls=len(role_first),
                       role_first_ttft_ratio=_median(role_first), e2e_ratio=_median(e2e), source=source,
                       side_by_side=not any(c.get("reference") for c in cfgs))
            if mode != "full":
                d, lo, hi = paired_difference([bool(r["correct"]) for r in rs],
                                              [bool(full[r["question"]]["correct"]) for r in rs])
                row.update(accuracy_minus_full=d, accuracy_minus_full_ci=(lo, hi))
            out.append(row)
    return out


def build(paths: list[str]) -> dict:
    rows, runs = [], []
    for p in paths:
        bench = json.loads(Path(p).read_text())
        rows += rows_of(bench, p)
        runs.append(dict(source=p, complete=bench.get("complete"), config=bench["config"]))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except OSError:
        commit = None
    return dict(command="python benchmarks/fidelity.py " + " ".join(paths), commit=commit, runs=runs, rows=rows)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ci(ci, signed=False) -> str:
    if ci is None:
        return ""
    f = "{:+.0f}" if signed else "{:.0f}"
    return f" [{f.format(100 * ci[0])}, {f.format(100 * ci[1])}]"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(doc: dict) -> str:
    lines = ["| model | dataset | mode | n | accuracy [95% CI] | minus full, paired [95% CI] | answer = full's | "
             "exact-output calls | first token / full (role-first calls) | first token / full (all) | "
             "end-to-end / full |", "|" + "---|" * 11]
    for r in doc["rows"]:
        diff = "-" if "accuracy_minus_full" not in r else \
            f"{100 * r['accuracy_minus_full']:+.0f}{_ci(r['accuracy_minus_full_ci'], True)}"
        mark = "" if r.get("side_by_side", True) else " *"
        lines.append(f"| {r['model']} | {r['dataset']} | {r['mode']} | {r['n']} | {_pct(r['accuracy'])}"
                     f"{_ci(r['accuracy_ci'])} | {diff} | {_pct(r['agreement'])} | {_pct(r['exact_output_share'])} | "
                     f"{_x(r['role_first_ttft_ratio'])}{mark} ({r['role_first_calls']}) | {_x(r['ttft_ratio'])}{mark} | "
                     f"{_x(r['e2e_ratio'])}{mark} |")
    if any(not r.get("side_by_side", True) for r in doc["rows"]):
        lines += ["", "\\* full prefill's records come from an earlier run of the same questions (its answers are "
                  "exact, its timings were not measured side by side): these ratios are indicative only."]
    return "\n".join(lines)


def plot(doc: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in doc["rows"]:
        if r["mode"] == "full" or r["role_first_ttft_ratio"] is None:
            continue
        d, (lo, hi) = r["accuracy_minus_full"], r["accuracy_minus_full_ci"]
        ax.errorbar(r["role_first_ttft_ratio"], 100 * d, yerr=[[100 * (d - lo)], [100 * (hi - d)]], fmt="o",
                    capsize=3, label=f"{r['mode']} ({r['model']}, {r['dataset']}, n={r['n']})")
    ax.axhline(0, color="k", lw=0.8)
    ax.axhline(-1, color="gray", lw=0.8, ls="--")
    ax.axvline(1, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("median first token / full prefill's (role-first calls)")
    ax.set_ylabel("accuracy minus full prefill's (points, paired)")
    ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("benches", nargs="*", help="bench.json files (hf-kvreuse bench)")
    p.add_argument("--out", default="benchmarks/results/fidelity.json")
    p.add_argument("--table", default=None, metavar="JSON", help="print the table of a fidelity JSON and exit")
    a = p.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return 0
    if not a.benches:
        p.error("give bench.json files, or --table JSON")
    doc = build(a.benches)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    try:
        plot(doc, out.with_suffix(".png"))
        plot(doc, Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "fidelity.png")  # the docs' copy
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
