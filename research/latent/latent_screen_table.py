"""The model screen of LatentRemedy (README): full-prefill accuracy and the direct-reuse drop per family, from the
JSON files of ``benchmarks/latent_remedy.py --methods full reuse`` runs, re-scored with the current
``is_correct`` (the records are regenerated from their seed), and (``--data``) from the screens that
``python -m hf_kvreuse.latent.data`` keeps in its shards (float32; direct reuse "keeps the answer" when its
teacher-forced argmax is the full prefill's answer at every position, so its accuracy there is
full-correct-and-kept).

    python research/latent/latent_screen_table.py benchmarks/results/latent_screen_qwen2.5-0.5b.json [...]
    python research/latent/latent_screen_table.py --data DATA/train DATA/dev DATA/dev_unused [--json OUT]
    python research/latent/latent_screen_table.py --from-json OUT
"""

import json
import sys

from hf_kvreuse.workflows import conflict_records, is_correct


def main_data(paths, out=None):
    """``paths``: shard folders of ``python -m hf_kvreuse.latent.data`` (every ``<family>_<seed>-<start>.json``);
    ``out``: also write the figures as JSON (the README table is printed from it: ``--from-json``)."""
    from pathlib import Path

    table = {}
    for folder in paths:
        for shard in sorted(Path(folder).glob("*_*-*.json")):
            seed = shard.stem.rsplit("_", 1)[1].split("-")[0]
            for row in json.load(open(shard)):
                table.setdefault((Path(folder).name, row["family"], seed), []).append(row)
    res = {"command": "python research/latent/latent_screen_table.py --data " + " ".join(paths)
           + (f" --json {out}" if out else ""), "rows": []}
    for (folder, fam, seed), rows in sorted(table.items()):
        f = sum(r["full_ok"] for r in rows) / len(rows)
        u = sum(r["full_ok"] and r["reuse_agree"] for r in rows) / len(rows)
        res["rows"].append({"folder": folder, "family": fam, "record_seed": int(seed), "examples": len(rows),
                            "full_acc": f, "reuse_acc": u})
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    print_data(res)


def print_data(res):
    print("| shards | family | record seed | examples (records x 2) | full prefill | direct reuse | drop |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        f, u = r["full_acc"], r["reuse_acc"]
        print(f"| {r['folder']} | {r['family']} | {r['record_seed']} | {r['examples']} | {100 * f:.0f}% | "
              f"{100 * u:.0f}% | {100 * (f - u):+.0f} pts |")


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
        args = sys.argv[2:]
        out = None
        if "--json" in args:
            i = args.index("--json")
            out, args = args[i + 1], args[:i] + args[i + 2:]
        main_data(args, out)
    elif sys.argv[1:2] == ["--from-json"]:
        print_data(json.load(open(sys.argv[2])))
    else:
        main(sys.argv[1:])
