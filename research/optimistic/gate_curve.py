"""Confidence-gate threshold curve of ``rebase="commit"``, computed from one ``auto-verify`` bench run (issue 23).

    python research/optimistic/gate_curve.py benchmarks/results/bench/verify/bench.json \
        --out benchmarks/results/gate_curve.json

Why one verify run is enough. Under ``rebase="verify"`` every call of the workflow sees exactly full prefill's
prompt (the verified output is plain ``generate``'s), and each optimistic call records, per draft step, the top-1
minus top-2 probability of its scores (``draft_margins``) and how many drafts exact decoding accepted before the
first one it rejected (``accepted_tokens``). ``commit`` with ``gate=t`` emits the same drafts from the same cache
until the first step whose margin is below ``t`` (that step's token comes from the exact cache) or the swap. So for
every threshold this script knows, per call, whether ``commit + gate=t`` would have emitted only tokens exact
decoding chooses ("clean"). A workflow whose calls are all clean gives full prefill's answers token for token
(its prompts stay identical by induction), so the share of all-clean workflows is a **lower bound** on final-answer
agreement: an unclean call may still end with the same final answer. The bound at ``t = 0`` (no gate) and at the
session's ``gate=0.5`` can be checked against measured ``auto-commit`` / ``auto-commit-gate`` runs (``--measured``).

TTFT under a gate: the first draft's (``draft_ttft_s``) when the gate fires after the first token; when it fires at
the first token, the call waits for the exact prefill, estimated as the first draft's TTFT plus the background prefill
(``background_prefill_s``, measured while drafts ran beside it: a slight overestimate on this 2-core CPU). Ratios
are per call against the full-prefill call at the same question and turn (same prompt), then the median.

``--repaired METHOD`` (e.g. ``auto-commit-repair``, an ungated commit run whose cache was repaired before the first
token) replays the gate on that cache too: its ``draft_margins`` say where a gate would fire and its
``first_divergence`` whether a token before it was wrong. Calls are compared only where the prompt is full prefill's
in both runs (every earlier reply of the workflow equal to full prefill's), so both columns count the same calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from hf_kvreuse.cli import wilson

THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def call_under_gate(c: dict, t: float) -> tuple[bool, int | None]:
    """``(clean, gated_step)`` of one verified optimistic call's stats under ``commit + gate=t``."""
    margins = c.get("draft_margins")
    if margins is None:
        raise SystemExit("this bench.json has no draft_margins: rerun auto-verify with a library that records them")
    drafts = (c.get("accepted_tokens") or 0) + (c.get("rejected_tokens") or 0)
    wrong = c["accepted_tokens"] if c.get("rejected_tokens") else None
    gated = next((i for i, m in enumerate(margins) if m < t), None)
    emitted = drafts if gated is None else min(gated, drafts)
    return (wrong is None or wrong >= emitted), gated


def curve(records: list[dict], thresholds=THRESHOLDS) -> dict:
    full = {(r["workflow"], r["context_tokens"], r["question"]): r for r in records if r["method"] == "full"}
    verify = [r for r in records if r["method"] == "auto-verify"]
    if not verify:
        raise SystemExit("no auto-verify records in this bench.json")
    rows = []
    for t in thresholds:
        clean_calls = calls = gated_first = 0
        all_clean = 0
        ratios = []
        for r in verify:
            ref = full.get((r["workflow"], r["context_tokens"], r["question"]))
            ok = True
            for i, turn in enumerate(r["turns"]):
                s, c = turn["stats"], turn["stats"].get("cache_stats") or {}
                # the first token decoded (a draft under verify; the session's ttft_s is the first verified one)
                ttft = turn.get("draft_ttft_s", s["ttft_s"])
                if s.get("method") == "optimistic" and c.get("rebase") == "verify":
                    calls += 1
                    clean, gated = call_under_gate(c, t)
                    clean_calls += clean
                    ok &= clean
                    if gated == 0:
                        gated_first += 1
                        ttft = ttft + (c.get("background_prefill_s") or 0.0)
                if ref is not None:
                    ratios.append(ttft / ref["turns"][i]["stats"]["ttft_s"])
            all_clean += ok
        n = len(verify)
        rows.append(dict(gate=t, workflows=n, agreement_lower_bound=all_clean / n,
                         agreement_lower_bound_ci=wilson(all_clean, n), optimistic_calls=calls,
                         clean_call_share=clean_calls / max(calls, 1), gated_at_first_token=gated_first,
                         ttft_ratio=statistics.median(ratios) if ratios else None))
    # where exact decoding first rejects a draft (index of the first wrong optimistic token), over every call
    first_wrong = [t["stats"]["cache_stats"]["accepted_tokens"] for r in verify for t in r["turns"]
                   if (t["stats"].get("cache_stats") or {}).get("rejected_tokens")]
    calls = sum(1 for r in verify for t in r["turns"] if (t["stats"].get("cache_stats") or {}).get("rebase") == "verify")
    return dict(rows=rows, optimistic_calls=calls, calls_with_a_wrong_draft=len(first_wrong),
                first_wrong_draft_index={str(i): first_wrong.count(i) for i in sorted(set(first_wrong))})


def commit_call_under_gate(c: dict, t: float) -> tuple[bool, int | None]:
    """``(clean, gated_step)`` of one ungated ``rebase="commit"`` call's stats under ``gate=t`` on the same cache:
    its optimistic tokens up to the gated step are the ones it emitted, and ``first_divergence`` says where the
    first of them differs from exact greedy decoding (the tokens after the gated step come from the exact cache)."""
    margins = c.get("draft_margins")
    if margins is None:
        raise SystemExit("this bench.json has no draft_margins for a commit call: rerun it with record_divergence")
    gated = next((i for i, m in enumerate(margins) if m < t), None)
    wrong = c.get("first_divergence")
    return (wrong is None or (gated is not None and wrong >= gated)), gated


def repair_curve(records: list[dict], method: str, thresholds=THRESHOLDS) -> dict:
    """The gate replayed on ``method``'s optimistic cache (an ungated commit run, e.g. ``auto-commit-repair``) beside
    the gate on the plain optimistic cache (the ``auto-verify`` drafts), over the same calls: those whose prompt is
    full prefill's under both runs (every earlier reply of the workflow equals full prefill's in both). Per threshold:
    the share of those calls that would emit only exact tokens, and how many would wait at the first token."""
    full = {(r["workflow"], r["context_tokens"], r["question"]): r for r in records if r["method"] == "full"}

    def same_prompt_calls(m: str) -> dict:
        out = {}
        for r in records:
            ref = full.get((r["workflow"], r["context_tokens"], r["question"]))
            if r["method"] != m or ref is None:
                continue
            for i, (turn, ft) in enumerate(zip(r["turns"], ref["turns"])):
                c = turn["stats"].get("cache_stats") or {}
                if c.get("draft_margins"):
                    out[(r["workflow"], r["context_tokens"], r["question"], i)] = c
                if turn["answer"] != ft["answer"]:
                    break  # later prompts differ from full prefill's
        return out

    verify, repaired = same_prompt_calls("auto-verify"), same_prompt_calls(method)
    if not repaired:
        raise SystemExit(f"no {method} calls with draft margins in these bench.json files")
    keys = sorted(set(verify) & set(repaired))
    rows = []
    for t in thresholds:
        row = dict(gate=t, calls=len(keys))
        for name, calls, under in (("plain", verify, call_under_gate), ("repaired", repaired, commit_call_under_gate)):
            outcome = [under(calls[k], t) for k in keys]
            row[f"{name}_clean"] = sum(c for c, _ in outcome)
            row[f"{name}_gated_at_first_token"] = sum(g == 0 for _, g in outcome)
        rows.append(row)
    return dict(method=method, rows=rows)


def measured(records: list[dict]) -> list[dict]:
    """Agreement and median TTFT / full of the commit runs in the same file (to check the bound against)."""
    out = []
    # every commit run, the gate probe's thresholds included (research/optimistic/gate_probe.py: auto-commit-gate<t>), and
    # prefix, whose TTFT issue 23's gate target is stated against
    gates = sorted({r["method"] for r in records if r["method"].startswith("auto-commit-gate")})
    for m in ("prefix", "auto", "auto-commit", *gates):
        rs = [r for r in records if r["method"] == m]
        if rs:
            k = sum(bool(r.get("agrees")) for r in rs)
            out.append(dict(method=m, n=len(rs), agreement=k / len(rs), agreement_ci=wilson(k, len(rs)),
                            ttft_ratio=statistics.median(t["ttft_ratio"] for r in rs for t in r["turns"])))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench_json", nargs="+", help="bench.json files (merged in order; full and auto-verify needed)")
    p.add_argument("--out", default="benchmarks/results/gate_curve.json")
    p.add_argument("--repaired", default=None, metavar="METHOD",
                   help="also replay the gate on this ungated commit run's cache (e.g. auto-commit-repair), beside "
                        "the plain optimistic cache, on the calls whose prompt is full prefill's in both")
    a = p.parse_args(argv)
    records = [r for f in a.bench_json for r in json.loads(Path(f).read_text())["records"]]
    # measured points per input file: runs of different days are not pooled (their TTFT / full use the full-prefill
    # records of their own file, and a machine's speed can differ between days)
    per_file = [dict(m, input=f) for f in a.bench_json for m in measured(json.loads(Path(f).read_text())["records"])]
    result = dict(config=dict(command="research/optimistic/gate_curve.py", inputs=a.bench_json, thresholds=list(THRESHOLDS)),
                  **curve(records), measured=per_file)
    if a.repaired:
        result["gate_on_repaired_cache"] = repair_curve(records, a.repaired)
    try:
        result["config"]["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                        text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("| gate | optimistic calls clean | final answer = full's (lower bound) [95% CI] | gated at token 1 "
          "| TTFT / full |\n|---|---|---|---|---|")
    for r in result["rows"]:
        lo, hi = r["agreement_lower_bound_ci"]
        print(f"| {r['gate']:g} | {100 * r['clean_call_share']:.0f}% | {100 * r['agreement_lower_bound']:.0f}% "
              f"[{100 * lo:.0f}, {100 * hi:.0f}] | {r['gated_at_first_token']} / {r['optimistic_calls']} "
              f"| {r['ttft_ratio']:.2f} |")
    print(f"calls with a wrong draft: {result['calls_with_a_wrong_draft']} of {result['optimistic_calls']}; index of the "
          f"first wrong draft: {result['first_wrong_draft_index']}")
    if a.repaired:
        rc = result["gate_on_repaired_cache"]
        print(f"\nthe gate on {a.repaired}'s cache vs on the plain optimistic cache ({rc['rows'][0]['calls']} calls "
              "with full prefill's prompt in both runs):\n| gate | plain: clean calls | plain: wait at token 1 "
              "| repaired: clean calls | repaired: wait at token 1 |\n|---|---|---|---|---|")
        for r in rc["rows"]:
            print(f"| {r['gate']:g} | {r['plain_clean']} | {r['plain_gated_at_first_token']} | {r['repaired_clean']} "
                  f"| {r['repaired_gated_at_first_token']} |")
    for m in result["measured"]:
        lo, hi = m["agreement_ci"]
        print(f"measured {m['method']}: agreement {100 * m['agreement']:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}] "
              f"(n = {m['n']}), TTFT / full {m['ttft_ratio']:.2f} ({m['input']})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.6))
    xs = [r["ttft_ratio"] for r in result["rows"]]
    ys = [r["agreement_lower_bound"] for r in result["rows"]]
    ax.plot(xs, ys, "o-", label="commit + gate (lower bound, from verify)")
    for r in result["rows"]:
        ax.annotate(f"{r['gate']:g}", (r["ttft_ratio"], r["agreement_lower_bound"]), fontsize=6)
    for m in result["measured"]:
        run = Path(m["input"]).parent.name
        ax.plot([m["ttft_ratio"]], [m["agreement"]], "s", label=f"measured {m['method']} ({run})")
    ax.set_xlabel("median TTFT / full prefill")
    ax.set_ylabel("final answer = full prefill's")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
