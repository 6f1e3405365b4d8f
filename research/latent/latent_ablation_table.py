"""README table of the LatentRemedy ablations: one row per ``python -m hf_kvreuse.latent.train ... --result J``
JSON (config, CPU seconds per stage, teacher-forced figures on the dev records).

    python research/latent/latent_ablation_table.py benchmarks/results/latent_ablation_*.json
    python research/latent/latent_ablation_table.py --paired-against benchmarks/results/latent_ablation_scratch_600.json \
        benchmarks/results/latent_ablation_*_600.json

``--paired-against J``: two last columns, the accuracy on `retrieval` + `extract` and on all held-out families of
each row minus that of run ``J`` on the same dev examples, in points with a Newcombe 95% interval: row by row where both runs evaluated the same sequence of
examples (one dev folder may hold records of several seeds, whose (family, record, direction) keys repeat), else
by (family, record, direction), keys met twice in a run left out.

Columns: the held-out dev families (no training record comes from them) and the training families' dev records
(other records of the same families); ``acc`` = the student's greedy answer is the teacher's and the teacher is
right (teacher-forced, no generation), ``rec`` = the share of what direct reuse loses that is recovered.
"""

import json
import sys

HELDOUT = ("retrieval", "extract", "code")
LOOKUP = ("retrieval", "extract")  # the held-out families of the training families' shape (code is another shape)


def pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.0f}%"


def _held_ok(d: dict, families=HELDOUT) -> list[tuple[tuple, int]]:
    """``((family, record, direction), right)`` of the bridge on ``families``, in evaluation order."""
    return [((r["family"], r["record"], r["direction"]), int(r["ok"]))
            for r in d.get("dev_rows", {}).get("bridge", []) if r["family"] in families]


def _paired(d: dict, ref: dict | None, families=HELDOUT) -> str:
    if ref is None:
        return ""
    from hf_kvreuse.cli import paired_difference

    a, b = _held_ok(d, families), _held_ok(ref, families)
    if [k for k, _ in a] == [k for k, _ in b]:  # the same dev folder: pair row by row (records of several seeds
        x, y = [v for _, v in a], [v for _, v in b]  # share (family, record, direction) keys)
    else:
        da, db = dict(a), dict(b)
        seen = [k for k, _ in a] + [k for k, _ in b]
        keys = sorted(k for k in set(da) & set(db) if seen.count(k) == 2)  # a key met twice in one run: left out
        x, y = [da[k] for k in keys], [db[k] for k in keys]
    if not x:
        return " - |"
    diff, lo, hi = paired_difference(x, y)
    return f" {100 * diff:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}] (n={len(x)}) |"


def main(argv: list[str]) -> None:
    ref = None
    if argv[:1] == ["--paired-against"]:
        ref_path, argv = argv[1], argv[2:]
        ref = json.load(open(ref_path))
    paths = argv
    name = ref_path.rsplit('latent_ablation_', 1)[-1].removesuffix('.json') if ref is not None else ""
    extra = f" retrieval + extract acc vs {name} (pts, paired) | held-out acc vs {name} (pts, paired) |" \
        if ref is not None else ""
    print("| ablation | n | read | hidden | tail | stages (CPU s) | steps | held-out acc (reuse / full) | held-out rec "
          "| code rec | train-family dev rec | dev KL |" + extra)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if ref is not None else ""))
    for path in paths:
        d = json.load(open(path))
        c, dev, br = d["config"], d.get("dev", {}), d["bridge"]
        held = [f for f in HELDOUT if f in dev]
        tr = [f for f in dev if f not in HELDOUT and f != "all"]

        def agg(fams, key):
            n = sum(dev[f]["n"] for f in fams)
            return sum(dev[f][key] * dev[f]["n"] for f in fams) / n if n else float("nan")

        def rec(fams):
            full, reuse, acc = agg(fams, "full_acc"), agg(fams, "reuse_acc"), agg(fams, "acc")
            return (acc - reuse) / (full - reuse) if full > reuse else float("nan")

        stages = ", ".join(f"{k[-1]}: {v:.0f}" for k, v in br.get("stage_cpu_s", {}).items())
        name = path.rsplit("latent_ablation_", 1)[-1].removesuffix(".json")
        read = f"{c['read']} {tuple(c['layers'])}" + (" + donor" if c.get("donor") else "")
        print(f"| {name} | {c['n_latent']} | {read} | {c['hidden']} | {c['tail_tokens']} | {stages} | {br['step']} | "
              f"{pct(agg(held, 'acc'))} ({pct(agg(held, 'reuse_acc'))} / {pct(agg(held, 'full_acc'))}) | "
              f"{pct(rec(held))} | {pct(rec(['code']) if 'code' in dev else float('nan'))} | {pct(rec(tr))} | "
              f"{agg(held + tr, 'kl'):.3f} |" + _paired(d, ref, LOOKUP) + _paired(d, ref))
        tail = d.get("dev_reuse_tail")
        if tail:  # the same dev records with Tail-k alone (no latents): the baseline of a latents + Tail-k row
            dev = tail
            print(f"| (Tail-{c['tail_tokens']} alone) | 0 | - | - | {c['tail_tokens']} | - | - | "
                  f"{pct(agg(held, 'acc'))} ({pct(agg(held, 'reuse_acc'))} / {pct(agg(held, 'full_acc'))}) | "
                  f"{pct(rec(held))} | {pct(rec(['code']) if 'code' in dev else float('nan'))} | {pct(rec(tr))} | "
                  f"{agg(held + tr, 'kl'):.3f} |" + (" - | - |" if ref is not None else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
