"""The default (``ReuseSession`` policy ``"auto"``) against plain ``generate`` on every workflow of
``hf-kvreuse bench``, at 1 and 2 torch threads, side by side in one run.

For each thread count it runs ``hf-kvreuse bench --methods full,auto`` (``full``: a fresh prefill of every prompt,
plain ``generate``'s work; both methods run each question one after the other, so the two are timed under the same
load) and reads every agent call's first token received (``ttft_s``) and every workflow's end-to-end time against
``full``'s on the same call. The claim checked: the default's first token and end to end are never later than
plain ``generate``'s, and its answers are plain ``generate``'s (``exact_output``, agreement 1).

Writes ``OUT`` (JSON: config, commit, per thread count and workflow the median and worst per-call TTFT ratio, the
median end-to-end ratio, the share of exact answers, agreement with full prefill, which methods ``auto`` chose) and
a plot beside it; the bench folders per thread count go under ``--work``::

    PYTHONPATH=. python benchmarks/defaults_vs_plain.py            # SmolLM2-135M, 4 workflows x 3 questions
    PYTHONPATH=. python benchmarks/defaults_vs_plain.py --table    # print the table of the JSON
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import git_commit  # noqa: E402
WORKFLOWS = ("chain", "fully_connected", "debate", "judge")



def summarize(bench: dict, threads: int) -> list[dict]:
    """One row per workflow: the default's per-call TTFT ratios to full prefill's, its end-to-end ratio."""
    rows = []
    by_q = collections.defaultdict(dict)
    for r in bench["records"]:
        by_q[(r["workflow"], r["question"])][r["method"]] = r
    for shape in WORKFLOWS:
        pairs = [(v["full"], v["auto"]) for (w, _), v in sorted(by_q.items()) if w == shape
                 and "full" in v and "auto" in v]
        if not pairs:
            continue
        ratios, e2e, methods, exact, agree = [], [], collections.Counter(), [], []
        for full, auto in pairs:
            for tf, ta in zip(full["turns"], auto["turns"]):
                ratios.append(ta["stats"]["ttft_s"] / tf["stats"]["ttft_s"])
                methods[ta["stats"]["method"]] += 1
                exact.append(bool(ta["stats"].get("exact_output", False)))
            e2e.append(auto["e2e_s"] / full["e2e_s"])
            agree.append(bool(auto["agrees"]))
        rows.append(dict(threads=threads, workflow=shape, questions=len(pairs), calls=len(ratios),
                         ttft_ratio_median=statistics.median(ratios), ttft_ratio_max=max(ratios),
                         e2e_ratio_median=statistics.median(e2e), e2e_ratio_max=max(e2e),
                         exact_output_share=sum(exact) / len(exact), agreement=sum(agree) / len(agree),
                         auto_methods=dict(methods)))
    return rows


def table(doc: dict) -> str:
    lines = ["| threads | workflow | calls | TTFT / plain (median, worst call) | end to end / plain (median, worst) "
             "| exact answers | agreement | auto chose |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        chose = ", ".join(f"{m} {n}" for m, n in sorted(r["auto_methods"].items()))
        lines.append(f"| {r['threads']} | {r['workflow']} | {r['calls']} | {r['ttft_ratio_median']:.2f}x, "
                     f"{r['ttft_ratio_max']:.2f}x | {r['e2e_ratio_median']:.2f}x, {r['e2e_ratio_max']:.2f}x | "
                     f"{r['exact_output_share']:.0%} | {r['agreement']:.0%} | {chose} |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = [f"{r['workflow']}\n{r['threads']} thr" for r in doc["rows"]]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [r["ttft_ratio_median"] for r in doc["rows"]], 0.4, label="TTFT (median call)")
    ax.bar([i + 0.2 for i in x], [r["e2e_ratio_median"] for r in doc["rows"]], 0.4, label="end to end")
    ax.scatter(list(x), [r["ttft_ratio_max"] for r in doc["rows"]], marker="v", color="k", label="TTFT, worst call",
               zorder=3)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("default / plain generate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--n", type=int, default=3, help="questions per workflow")
    p.add_argument("--context-tokens", type=int, default=600)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--work", default=str(ROOT / "benchmarks" / "results" / "bench" / "defaults"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "defaults_vs_plain.json"))
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.table:
        print(table(json.loads(out.read_text())))
        return 0
    from hf_kvreuse.cli import main as cli

    doc = dict(config=vars(args), commit=git_commit(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
               command="PYTHONPATH=. python benchmarks/defaults_vs_plain.py " + " ".join(argv or sys.argv[1:]),
               rows=[])
    for threads in (int(t) for t in args.threads.split(",")):
        work = Path(args.work) / f"t{threads}"
        rc = cli(["bench", "--model", args.model, "--workflows", ",".join(WORKFLOWS), "--methods", "full,auto",
                  "--n", str(args.n), "--context-tokens", str(args.context_tokens), "--rounds", str(args.rounds),
                  "--max-new-tokens", str(args.max_new_tokens), "--threads", str(threads), "--out", str(work)])
        if rc:
            return rc
        doc["rows"] += summarize(json.loads((work / "bench.json").read_text()), threads)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))  # after every thread count
    plot(doc, out.with_suffix(".png"))
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
