"""README table of the LatentRemedy ablations: one row per ``python -m hf_kvreuse.latent.train ... --result J``
JSON (config, CPU seconds per stage, teacher-forced figures on the dev records).

    python scripts/latent_ablation_table.py benchmarks/results/latent_ablation_*.json

Columns: the held-out dev families (no training record comes from them) and the training families' dev records
(other records of the same families); ``acc`` = the student's greedy answer is the teacher's and the teacher is
right (teacher-forced, no generation), ``rec`` = the share of what direct reuse loses that is recovered.
"""

import json
import sys

HELDOUT = ("retrieval", "extract", "code")


def pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.0f}%"


def main(paths: list[str]) -> None:
    print("| ablation | n | read | hidden | tail | stages (CPU s) | steps | held-out acc (reuse / full) | held-out rec "
          "| code rec | train-family dev rec | dev KL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
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
        read = f"{c['read']} {tuple(c['layers'])}"
        print(f"| {name} | {c['n_latent']} | {read} | {c['hidden']} | {c['tail_tokens']} | {stages} | {br['step']} | "
              f"{pct(agg(held, 'acc'))} ({pct(agg(held, 'reuse_acc'))} / {pct(agg(held, 'full_acc'))}) | "
              f"{pct(rec(held))} | {pct(rec(['code']) if 'code' in dev else float('nan'))} | {pct(rec(tr))} | "
              f"{agg(held + tr, 'kl'):.3f} |")
        tail = d.get("dev_reuse_tail")
        if tail:  # the same dev records with Tail-k alone (no latents): the baseline of a latents + Tail-k row
            dev = tail
            print(f"| (Tail-{c['tail_tokens']} alone) | 0 | - | - | {c['tail_tokens']} | - | - | "
                  f"{pct(agg(held, 'acc'))} ({pct(agg(held, 'reuse_acc'))} / {pct(agg(held, 'full_acc'))}) | "
                  f"{pct(rec(held))} | {pct(rec(['code']) if 'code' in dev else float('nan'))} | {pct(rec(tr))} | "
                  f"{agg(held + tr, 'kl'):.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
