"""README table of the LatentRemedy ablations: one row per ``python -m hf_kvreuse.latent.train ... --result J``
JSON (config, CPU seconds per stage, teacher-forced figures on the dev records).

    python scripts/latent_ablation_table.py benchmarks/results/latent_ablation_*.json
    python scripts/latent_ablation_table.py --paired-against benchmarks/results/latent_ablation_scratch_600.json \
        benchmarks/results/latent_ablation_*_600.json

``--paired-against J``: a last column, the held-out accuracy of each row minus that of run ``J`` on the same dev
examples (family, record, direction), in points with a Newcombe 95% interval.

Columns: the held-out dev families (no training record comes from them) and the training families' dev records
(other records of the same families); ``acc`` = the student's greedy answer is the teacher's and the teacher is
right (teacher-forced, no generation), ``rec`` = the share of what direct reuse loses that is recovered.
"""

import json
import sys

HELDOUT = ("retrieval", "extract", "code")


def pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.0f}%"


def _held_ok(d: dict) -> dict:
    """(family, record, direction) -> the bridge's answer right, on the held-out families."""
    return {(r["family"], r["record"], r["direction"]): int(r["ok"]) for r in d.get("dev_rows", {}).get("bridge", [])
            if r["family"] in HELDOUT}


def _paired(d: dict, ref: dict | None) -> str:
    if ref is None:
        return ""
    from hf_kvreuse.cli import paired_difference

    a, b = _held_ok(d), _held_ok(ref)
    keys = sorted(set(a) & set(b))
    if not keys:
        return " - |"
    diff, lo, hi = paired_difference([a[k] for k in keys], [b[k] for k in keys])
    return f" {100 * diff:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}] (n={len(keys)}) |"


def main(argv: list[str]) -> None:
    ref = None
    if argv[:1] == ["--paired-against"]:
        ref_path, argv = argv[1], argv[2:]
        ref = json.load(open(ref_path))
    paths = argv
    extra = f" held-out acc vs {ref_path.rsplit('latent_ablation_', 1)[-1].removesuffix('.json')} (pts, paired) |" \
        if ref is not None else ""
    print("| ablation | n | read | hidden | tail | stages (CPU s) | steps | held-out acc (reuse / full) | held-out rec "
          "| code rec | train-family dev rec | dev KL |" + extra)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if ref is not None else ""))
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
              f"{agg(held + tr, 'kl'):.3f} |" + _paired(d, ref))
        tail = d.get("dev_reuse_tail")
        if tail:  # the same dev records with Tail-k alone (no latents): the baseline of a latents + Tail-k row
            dev = tail
            print(f"| (Tail-{c['tail_tokens']} alone) | 0 | - | - | {c['tail_tokens']} | - | - | "
                  f"{pct(agg(held, 'acc'))} ({pct(agg(held, 'reuse_acc'))} / {pct(agg(held, 'full_acc'))}) | "
                  f"{pct(rec(held))} | {pct(rec(['code']) if 'code' in dev else float('nan'))} | {pct(rec(tr))} | "
                  f"{agg(held + tr, 'kl'):.3f} |" + (" - |" if ref is not None else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
