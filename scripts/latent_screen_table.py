"""The model screen of LatentRemedy (README): full-prefill accuracy and the direct-reuse drop per family, from the
JSON files of ``benchmarks/latent_remedy.py --methods full reuse`` runs, re-scored with the current
``is_correct`` (the records are regenerated from their seed), and (``--data``) from the screens that
``python -m hf_kvreuse.latent.data`` keeps in its shards (float32; direct reuse "keeps the answer" when its
teacher-forced argmax is the full prefill's answer at every position, so its accuracy there is
full-correct-and-kept).

    python scripts/latent_screen_table.py benchmarks/results/latent_screen_qwen2.5-0.5b.json [...]
    python scripts/latent_screen_table.py --data DATA/train DATA/dev DATA/dev_unused
"""

import json
import sys

from hf_kvreuse.workflows import conflict_records, is_correct


def main_data(paths):
    """``paths``: shard folders of ``python -m hf_kvreuse.latent.data`` (every ``<family>_<seed>-<start>.json``)."""
    from pathlib import Path

    table = {}
    for folder in paths:
        for shard in sorted(Path(folder).glob("*_*-*.json")):
            for row in json.load(open(shard)):
                table.setdefault(row["family"], []).append(row)
    print("| family | examples (records x 2) | full prefill | direct reuse | drop |")
    print("|---|---|---|---|---|")
    for fam, rows in sorted(table.items()):
        f = sum(r["full_ok"] for r in rows) / len(rows)
        u = sum(r["full_ok"] and r["reuse_agree"] for r in rows) / len(rows)
        print(f"| {fam} | {len(rows)} | {100 * f:.0f}% | {100 * u:.0f}% | {100 * (f - u):+.0f} pts |")


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
    if sys.argv[1:2] == ["--data"]:
        main_data(sys.argv[2:])
    else:
        main(sys.argv[1:])
