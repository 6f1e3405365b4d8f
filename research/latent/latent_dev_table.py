"""README table of a LatentRemedy training run's dev evaluation (issue 25): every variant the run evaluated
(the trained bridge, direct reuse, Tail-k, the bridges given with ``--compare``) on the same dev examples,
teacher-forced, from the ``dev_rows`` of ``python -m hf_kvreuse.latent.train ... --dev DIR --result JSON``.

    python research/latent/latent_dev_table.py benchmarks/results/latent_train_final_plain.json
    python research/latent/latent_dev_table.py RUN_A.json RUN_B.json ...   # several runs on the same dev shards

With several runs, the baselines (direct reuse, Tail-k, compared bridges) come from the first JSON and each run's
trained bridge is one more row, named after its JSON (``latent_train_<name>.json``); the runs must hold the same
dev examples in the same order (checked), so that every difference is paired.

Per group of families: ``acc`` = the variant's greedy answer (teacher-forced argmax at every answer position) is
the full prefill's and the full prefill is right, with its Wilson 95% interval; ``recovered`` = the share of the
accuracy direct reuse loses that the variant wins back; the paired differences to direct reuse and to Tail-16
(Newcombe 95% intervals: the same examples); ``agree`` = the answer is the full prefill's (right or wrong).
"""

import json
import sys

from hf_kvreuse.cli import paired_difference, wilson

HELDOUT = ("retrieval", "extract")
SHAPE = ("code",)          # held out, another shape than every training family


def pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.0f}%"


def run_name(path: str) -> str:
    stem = path.rsplit("/", 1)[-1].removesuffix(".json")
    return stem.removeprefix("latent_train_")


def merged_rows(paths) -> tuple[dict, dict]:
    """The first run's variants plus every other run's trained bridge; (rows, display names)."""
    rows = dict(json.load(open(paths[0]))["dev_rows"])
    names = {"bridge": f"trained bridge ({run_name(paths[0])})", "reuse": "direct reuse", "shipped": "shipped bridge"}
    key = [(r["family"], r["record"], r["direction"], r["full_ok"], r["reuse_ok"]) for r in rows["reuse"]]
    for path in paths[1:]:
        other = json.load(open(path))["dev_rows"]
        if [(r["family"], r["record"], r["direction"], r["full_ok"], r["reuse_ok"]) for r in other["reuse"]] != key:
            raise SystemExit(f"{path} was evaluated on other dev examples than {paths[0]}: not paired")
        name = f"bridge:{run_name(path)}"
        rows[name] = other["bridge"]
        names[name] = f"trained bridge ({run_name(path)})"
    return rows, names


def table(*paths: str) -> str:
    rows, names = merged_rows(paths)
    tail = next((k for k in rows if k.startswith("tail")), None)
    fams = sorted({r["family"] for r in rows["reuse"]})
    groups = [("held-out (retrieval, extract)", [f for f in fams if f in HELDOUT]),
              ("held-out, other shape (code)", [f for f in fams if f in SHAPE]),
              ("held-out, all three", [f for f in fams if f in HELDOUT + SHAPE]),
              ("training families, dev records", [f for f in fams if f not in HELDOUT + SHAPE])]
    lines = [f"| examples | variant | n | acc [95% CI] | recovered | vs direct reuse [95% CI] | vs {tail or 'Tail-k'} "
             "[95% CI] | agree with full |", "|---|---|---|---|---|---|---|---|"]
    for label, sel in groups:
        if not sel:
            continue
        pick = {k: [r for r in v if r["family"] in sel] for k, v in rows.items()}
        n = len(pick["reuse"])
        full = sum(r["full_ok"] for r in pick["reuse"]) / n
        base = sum(r["reuse_ok"] for r in pick["reuse"]) / n
        lines.append(f"| {label} | full prefill | {n} | {pct(full)} {ci(wilson(round(full * n), n))} | - | - | - | "
                     "100% |")
        for k, v in pick.items():
            ok = [r["ok"] for r in v]
            acc = sum(ok) / n
            rec = (acc - base) / (full - base) if full > base else float("nan")
            d_reuse = paired_difference(ok, [r["ok"] for r in pick["reuse"]]) if k != "reuse" else None
            d_tail = paired_difference(ok, [r["ok"] for r in pick[tail]]) if tail and k != tail else None
            lines.append(f"| {label} | {names.get(k, k)} | {n} | {pct(acc)} {ci(wilson(sum(ok), n))} | "
                         f"{'-' if k == 'reuse' else pct(rec)} | {diff(d_reuse)} | {diff(d_tail)} | "
                         f"{pct(sum(r['agree'] for r in v) / n)} |")
    return "\n".join(lines)


def ci(lo_hi) -> str:
    return f"[{100 * lo_hi[0]:.0f}, {100 * lo_hi[1]:.0f}]"


def diff(d) -> str:
    return "-" if d is None else f"{100 * d[0]:+.0f} pts [{100 * d[1]:+.0f}, {100 * d[2]:+.0f}]"


if __name__ == "__main__":
    print(table(*sys.argv[1:]))
