"""Markdown table of an ``hf-kvreuse bench`` (or ``merge``) result, as README shows it.

    python scripts/bench_table.py benchmarks/results/bench/optimistic_fidelity_16/bench.json

Columns: accuracy and final-answer agreement with full prefill (Wilson 95% intervals), the accuracy difference with
full prefill on the same questions (paired Newcombe interval), median TTFT / full (the first token decoded: a draft
under ``rebase="verify"``), median first-verified-token / full, end-to-end / full, accepted share of drafts.
"""

import argparse
import json
from pathlib import Path


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ci(ci) -> str:
    return f"[{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"


def table(result: dict) -> str:
    rows = result["summary"]
    lines = ["| method | n | accuracy [95% CI] | accuracy - full [paired 95% CI] | final answer = full's [95% CI] "
             "| TTFT / full | first verified / full | end-to-end / full | drafts accepted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = (f"{100 * r['accuracy_minus_full']:+.0f} {_ci(r['accuracy_minus_full_ci'])}"
                if "accuracy_minus_full" in r else "-")
        kept = _pct(r["accepted_share"]) if "accepted_share" in r else "-"
        lines.append(f"| {r['method']} | {r['n']} | {_pct(r['accuracy'])} {_ci(r['accuracy_ci'])} | {diff} | "
                     f"{_pct(r['agreement'])} {_ci(r['agreement_ci'])} | {r['ttft_ratio']:.2f} | "
                     f"{r['first_verified_ratio']:.2f} | {r['e2e_ratio']:.2f} | {kept} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench_json")
    a = p.parse_args(argv)
    print(table(json.loads(Path(a.bench_json).read_text())))


if __name__ == "__main__":
    main()
