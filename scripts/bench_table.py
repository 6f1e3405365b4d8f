"""Markdown table of an ``hf-kvreuse bench`` (or ``merge``) result, as README shows it.

    python scripts/bench_table.py benchmarks/results/bench/optimistic_fidelity_16/bench.json

Columns: accuracy and final-answer agreement with full prefill (Wilson 95% intervals), the accuracy difference with
full prefill on the same questions (paired Newcombe interval), median TTFT / full (the first token decoded: a draft
under ``rebase="verify"``), median first-verified-token / full, end-to-end / full, accepted share of drafts.

``--paired-against METHOD`` adds a second table: every other method's final-answer agreement and accuracy minus
METHOD's, over the questions both ran (paired Newcombe 95% intervals), and how many questions each changes.

    python scripts/bench_table.py benchmarks/results/bench/optimistic_modes_fp32/bench.json --paired-against auto-commit

``--with OTHER.json`` (repeatable) adds the methods of other runs on the same questions to the paired table (a
method already in the first file keeps its records there): e.g. a new mode against the table it extends.

``--same-questions OTHER.json LABEL`` adds each method's final-answer agreement here and in OTHER (another setting
of the same questions, e.g. 16 instead of 128 new tokens), paired by question.

``--calls`` adds, per method, how many replies equal full prefill's and how many calls decoded optimistically, were
gated (at the first token) and had rows repaired.

``--ttft-against METHOD`` adds a third: every other method's TTFT over METHOD's call by call (the same workflow,
question and turn), the median of those per-call ratios, the ratio of the medians, and the share of calls at or
under half of METHOD's, and the median per question of the end-to-end time over METHOD's. Use it on runs where
both methods ran in the same process (``bench --methods prefix,...``): TTFTs from runs of different days are not comparable on a shared CPU.

    python scripts/bench_table.py benchmarks/results/bench/gate_repair_fp32/bench.json --ttft-against prefix

``--by-turn`` splits that table by the call's place in the workflow (turn 0 = the first agent of round 0): METHOD's
own TTFT over full prefill's there says how much of each prompt METHOD already reuses, and the count of calls that
decoded optimistically, and of those that waited for the exact cache at the first token (a gate), says why a
method's ratio is what it is.
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
             "| first token received / full | first draft / full | end-to-end / full | drafts accepted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = (f"{100 * r['accuracy_minus_full']:+.0f} {_ci(r['accuracy_minus_full_ci'])}"
                if "accuracy_minus_full" in r else "-")
        kept = _pct(r["accepted_share"]) if "accepted_share" in r else "-"
        # summaries written before the draft had its own name: ttft_ratio was the draft's
        received = r.get("first_verified_ratio", r["ttft_ratio"])
        draft = r["ttft_ratio"] if "first_verified_ratio" in r else r.get("draft_ttft_ratio")
        draft = f"{draft:.2f}" if draft is not None else "-"
        lines.append(f"| {r['method']} | {r['n']} | {_pct(r['accuracy'])} {_ci(r['accuracy_ci'])} | {diff} | "
                     f"{_pct(r['agreement'])} {_ci(r['agreement_ci'])} | {received:.2f} | "
                     f"{draft} | {r['e2e_ratio']:.2f} | {kept} |")
    return "\n".join(lines)


def with_methods_of(result: dict, others: list[dict]) -> dict:
    """``result`` plus the records of methods it does not have from ``others`` (in order; first one wins)."""
    records = list(result["records"])
    have = {r["method"] for r in records}
    for other in others:
        new = [r for r in other["records"] if r["method"] not in have]
        records += new
        have |= {r["method"] for r in new}
    return dict(result, records=records)


def by_method(result: dict, against: str, flag: str) -> dict:
    """``{method: {(workflow, context, question): record}}``; ``against`` must be one of the methods."""
    by = {}
    for r in result["records"]:
        by.setdefault(r["method"], {})[(r["workflow"], r["context_tokens"], r["question"])] = r
    if against not in by:
        raise SystemExit(f"{flag} {against!r}: the result has methods {sorted(by)}")
    return by


def compared(by: dict, against: str, *need: str):
    """``(method, its records, the cells it shares with against and every method in need)``, for each method other
    than ``against`` and full prefill that shares at least one cell."""
    shared = set(by[against]).intersection(*(by[n] for n in need))
    for m, recs in by.items():
        keys = sorted(set(recs) & shared)
        if m not in (against, "full") and keys:
            yield m, recs, keys


def paired_table(result: dict, against: str) -> str:
    """Per method: (agreement, accuracy) minus ``against``'s on the same (workflow, context, question) cells."""
    from hf_kvreuse.cli import paired_difference

    by = by_method(result, against, "--paired-against")
    base = by[against]
    lines = [f"| method | n (paired) | final answer = full's, minus {against}'s [95% CI] | questions won / lost "
             f"| accuracy minus {against}'s [95% CI] |", "|---|---|---|---|---|"]
    for m, recs, keys in compared(by, against):
        x, y = [bool(recs[k]["agrees"]) for k in keys], [bool(base[k]["agrees"]) for k in keys]
        d, lo, hi = paired_difference(x, y)
        cx, cy = [bool(recs[k]["correct"]) for k in keys], [bool(base[k]["correct"]) for k in keys]
        cd, clo, chi = paired_difference(cx, cy)
        won, lost = sum(a and not b for a, b in zip(x, y)), sum(b and not a for a, b in zip(x, y))
        lines.append(f"| {m} | {len(keys)} | {100 * d:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}] | {won} / {lost} | "
                     f"{100 * cd:+.0f} [{100 * clo:+.0f}, {100 * chi:+.0f}] |")
    return "\n".join(lines)


def ttft_table(result: dict, against: str) -> str:
    """Per method: TTFT (first token decoded; first verified token too) over ``against``'s, call by call."""
    import statistics

    by = by_method(result, against, "--ttft-against")
    base = by[against]
    lines = [f"| method | calls (questions) | TTFT / {against}'s, median per call | ratio of medians "
             f"| calls at <= 0.5x | first verified / {against}'s TTFT, median per call "
             f"| end to end / {against}'s, median per question |", "|---|---|---|---|---|---|---|"]
    for m, recs, keys in compared(by, against):
        first, verified, mine, theirs = [], [], [], []
        e2e = [recs[k]["e2e_s"] / base[k]["e2e_s"] for k in keys if "e2e_s" in recs[k] and "e2e_s" in base[k]]
        for k in keys:
            for t, b in zip(recs[k]["turns"], base[k]["turns"]):
                ref = b["stats"]["ttft_s"]
                shown = t.get("draft_ttft_s", t["stats"]["ttft_s"])
                first.append(shown / ref)
                verified.append(t["stats"]["ttft_s"] / ref)
                mine.append(shown)
                theirs.append(ref)
        if not first:
            continue
        lines.append(f"| {m} | {len(first)} ({len(keys)}) | {statistics.median(first):.2f} | "
                     f"{statistics.median(mine) / statistics.median(theirs):.2f} | "
                     f"{100 * sum(x <= 0.5 for x in first) / len(first):.0f}% | {statistics.median(verified):.2f} | "
                     f"{f'{statistics.median(e2e):.2f}' if e2e else '-'} |")
    return "\n".join(lines)


def ttft_by_turn(result: dict, against: str) -> str:
    """:func:`ttft_table` per turn index: medians of the per-call ratios, ``against``'s TTFT over full's, and how
    many calls decoded from an optimistic cache (and of those, waited at the first token)."""
    import statistics

    by = by_method(result, against, "--ttft-against")
    if "full" not in by:
        raise SystemExit(f"--by-turn needs 'full' records: the result has methods {sorted(by)}")
    lines = [f"| method | turn | calls | TTFT / {against}'s (median per call) | {against}'s TTFT / full's "
             f"| prompt share {against} reused | optimistic calls (waited at token 1) |",
             "|---|---|---|---|---|---|---|"]
    for m, recs, keys in compared(by, against, "full"):
        cells: dict[int, list] = {}
        for k in keys:
            for i, (t, b, f) in enumerate(zip(recs[k]["turns"], by[against][k]["turns"], by["full"][k]["turns"])):
                c = t["stats"].get("cache_stats") or {}
                cells.setdefault(i, []).append((t.get("draft_ttft_s", t["stats"]["ttft_s"]) / b["stats"]["ttft_s"],
                                                b["stats"]["ttft_s"] / f["stats"]["ttft_s"],
                                                t["stats"].get("method") == "optimistic", c.get("gated_step") == 0,
                                                1 - b["stats"]["new_tokens"] / b["stats"]["prompt_tokens"]))
        for i, xs in sorted(cells.items()):
            lines.append(f"| {m} | {i} | {len(xs)} | {statistics.median(x[0] for x in xs):.2f} | "
                         f"{statistics.median(x[1] for x in xs):.2f} | "
                         f"{100 * statistics.median(x[4] for x in xs):.1f}% | "
                         f"{sum(x[2] for x in xs)} ({sum(x[3] for x in xs)}) |")
    return "\n".join(lines)


def same_questions_table(result: dict, other: dict, label: str) -> str:
    """Per method run in both: final-answer agreement with full prefill here and in ``other`` (another setting,
    e.g. fewer new tokens) over the questions both ran, and the paired difference (Newcombe 95% interval)."""
    from hf_kvreuse.cli import paired_difference

    mine = by_method(result, "full", "this run's full prefill:")
    theirs = by_method(other, "full", f"{label}'s full prefill:")
    lines = [f"| method | n (paired) | final answer = full's here | in {label} | here minus {label} [95% CI] |",
             "|---|---|---|---|---|"]
    for m, recs in mine.items():
        keys = sorted(set(recs) & set(theirs.get(m, {})))
        if m == "full" or not keys:
            continue
        x, y = [bool(recs[k]["agrees"]) for k in keys], [bool(theirs[m][k]["agrees"]) for k in keys]
        d, lo, hi = paired_difference(x, y)
        lines.append(f"| {m} | {len(keys)} | {sum(x)}/{len(x)} | {sum(y)}/{len(y)} | "
                     f"{100 * d:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}] |")
    return "\n".join(lines)


def calls_table(result: dict) -> str:
    """Per method, over all its calls: how many replies equal full prefill's (same question and turn), how many
    decoded from an optimistic cache, were gated (at any step; at the first token), and the median rows repaired."""
    import statistics

    by = by_method(result, "full", "--calls: full prefill")
    lines = ["| method | calls = full's | optimistic calls | gated (at token 1) | repaired rows, median per optimistic "
             "call |", "|---|---|---|---|---|"]
    for m, recs, keys in compared(by, "full"):
        same = total = opt = gated = first = 0
        repaired = []
        for k in keys:
            for t, f in zip(recs[k]["turns"], by["full"][k]["turns"]):
                total += 1
                same += t["answer"] == f["answer"]
                if t["stats"].get("method") == "optimistic":
                    c = t["stats"].get("cache_stats") or {}
                    opt += 1
                    gated += c.get("gated_step") is not None
                    first += c.get("gated_step") == 0
                    repaired.append(c.get("repaired_tokens") or 0)
        rep = f"{statistics.median(repaired):g}" if repaired else "-"
        lines.append(f"| {m} | {same}/{total} | {opt} | {gated} ({first}) | {rep} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench_json")
    p.add_argument("--paired-against", metavar="METHOD", help="also: every method minus METHOD, paired by question")
    p.add_argument("--ttft-against", metavar="METHOD", help="also: every method's TTFT over METHOD's, call by call")
    p.add_argument("--by-turn", action="store_true", help="with --ttft-against: that table per turn of the workflow")
    p.add_argument("--calls", action="store_true",
                   help="also: replies equal to full prefill's, optimistic, gated and repaired counts per method")
    p.add_argument("--with", dest="others", action="append", default=[], metavar="OTHER_JSON",
                   help="with --paired-against: also the methods of these bench.json files (same questions)")
    p.add_argument("--same-questions", nargs=2, metavar=("OTHER_JSON", "LABEL"),
                   help="also: each method's final-answer agreement here and in OTHER_JSON (another setting) over "
                   "the questions both ran, paired")
    a = p.parse_args(argv)
    result = json.loads(Path(a.bench_json).read_text())
    print(table(result))
    if a.calls:
        print()
        print(calls_table(result))
    if a.paired_against:
        print()
        print(paired_table(with_methods_of(result, [json.loads(Path(f).read_text()) for f in a.others]),
                           a.paired_against))
    if a.same_questions:
        print()
        print(same_questions_table(result, json.loads(Path(a.same_questions[0]).read_text()), a.same_questions[1]))
    if a.ttft_against:
        print()
        print(ttft_table(result, a.ttft_against))
        if a.by_turn:
            print()
            print(ttft_by_turn(result, a.ttft_against))


if __name__ == "__main__":
    main()
