"""The model screen of LatentRemedy (README): full-prefill accuracy and the direct-reuse drop per family, from the
JSON files of ``benchmarks/latent_remedy.py --methods full reuse`` runs, re-scored with the current
``is_correct`` (the records are regenerated from their seed).

    python scripts/latent_screen_table.py benchmarks/results/latent_screen_qwen2.5-0.5b.json [...]
"""

import json
import sys

from hf_kvreuse.workflows import conflict_records, is_correct


def main(paths):
    table = {}
    for path in paths:
        d = json.load(open(path))
        seed, n = d["meta"]["args"]["seed"], d["meta"]["args"]["n"]
        model = d["meta"]["args"]["model"]
        recs = {}
        for r in d["rows"]:
            fam = r["family"]
            if fam not in recs:
                recs[fam] = conflict_records(fam, n, seed=seed)
            rec = recs[fam][r["record"]]
            side = r["direction"][-1]
            ok = is_correct(r["answer"], rec.gold(side))
            key = (model, fam)
            t = table.setdefault(key, {"full": [], "reuse": []})
            t["full" if r["method"] == "full" else "reuse"].append(ok)
    print("| model | family | n records | full prefill | direct reuse | drop |")
    print("|---|---|---|---|---|---|")
    for (model, fam), t in sorted(table.items()):
        f = sum(t["full"]) / len(t["full"])
        u = sum(t["reuse"]) / len(t["reuse"])
        print(f"| {model} | {fam} | {len(t['full']) // 2} | {100 * f:.0f}% | {100 * u:.0f}% | {100 * (f - u):+.0f} pts |")


if __name__ == "__main__":
    main(sys.argv[1:])
