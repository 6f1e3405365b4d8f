"""The README's GPU tables from ``gpu_check.json`` (what ``scripts/gpu_check.sh`` writes on the GPU machine).

    python scripts/gpu_table.py benchmarks/results/gpu/gpu_check.json

Prints three markdown tables: the tests by outcome, every kernel against its eager torch reference (median speed-up
and, for the memory-bound ones, the fraction of the device's peak bandwidth, with the targets of issue 11: >= 3x,
>= 60 %), and OptimisticCache's TTFT against full prefill and its floor.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def tests_table(doc: dict) -> list[str]:
    by = collections.defaultdict(lambda: collections.Counter())
    failed = []
    for t in doc.get("tests", []):
        by[t["step"]][t["outcome"]] += 1
        if t["outcome"] in ("failed", "error"):
            failed.append(f"{t['step']}: {t['name']}")
    lines = ["| step | passed | failed | skipped |", "|---|---|---|---|"]
    for step, c in by.items():
        lines.append(f"| {step} | {c['passed']} | {c['failed'] + c['error']} | {c['skipped']} |")
    return lines + ([""] + [f"- failed: `{f}`" for f in failed] if failed else [])


def kernels_table(doc: dict) -> list[str]:
    rows = doc.get("kernels", {}).get("rows", [])
    tokens = sorted({r["tokens"] for r in rows})
    names = list(dict.fromkeys(r["kernel"] for r in rows))
    at = {(r["kernel"], r["tokens"]): r for r in rows}
    head = " | ".join(f"{t // 1024}k tokens" for t in tokens)
    lines = [f"| kernel (speed-up over torch; % of peak bandwidth) | {head} |", "|---|" + "---|" * len(tokens)]
    for name in names:
        cells = []
        for t in tokens:
            r = at.get((name, t))
            if r is None:
                cells.append("-")
                continue
            bw = f"; {100 * r['peak_fraction']:.0f} %" if r.get("memory_bound") else ""
            cells.append(f"{r['speedup']:.2f}x{bw}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def optimistic_table(doc: dict) -> list[str]:
    lines = ["| run | model | context | TTFT full | TTFT optimistic | floor | optimistic / floor | end to end opt / full "
             "| swap step |", "|---|---|---|---|---|---|---|---|---|"]
    for key in ("optimistic", "optimistic_chunked"):
        for r in doc.get(key, {}).get("rows", []) if isinstance(doc.get(key), dict) else []:
            lines.append(f"| {key} | {r['model']} | {r['context_tokens']} | {1e3 * r['full_ttft_s']:.1f} ms | "
                         f"{1e3 * r['opt_ttft_s']:.1f} ms | {1e3 * r['floor_s']:.1f} ms | {r['ttft_over_floor']:.2f} | "
                         f"{r['e2e_ratio']:.2f} | {r['swap_step']} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, help="gpu_check.json")
    args = ap.parse_args(argv)
    doc = json.loads(args.json.read_text())
    env = doc.get("steps", {}).get("env", {}).get("log_tail", "").strip().splitlines()
    print(f"device: {env[-1] if env else '?'}; wall {doc.get('wall_s')} s of {doc.get('budget_s')} s; "
          f"cut: {[c['step'] for c in doc.get('cut', [])]}\n")
    for table in (tests_table(doc), kernels_table(doc), optimistic_table(doc)):
        print("\n".join(table) + "\n")


if __name__ == "__main__":
    sys.exit(main())
