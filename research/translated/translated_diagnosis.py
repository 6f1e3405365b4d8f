"""Issue 24 diagnosis: where does the Qwen2.5-Coder 0.5B -> 1.5B linear KV map (the shipped kind) lose the target's
answers?

Held-out: the first ``--held`` SQuAD items prepared by ``research/translated/translated_retention.py prepare`` (the evaluation
prompts; the target's true K/V and queries stored); the map: the shipped kind (top-8 source layers by pooled R²,
K<-K, V<-V, ridge 0.01) solved with the library's ``KVMapper.from_moments`` from DROP calibration moments
(``research/translated/translated_maps.py moments``):

1. per target layer: held-out R² of K and V, and the cosine between the layer's attention output (after o_proj;
   the target's own queries) with the mapped and with the true K/V, the attention sinks (first 4 rows) taken exact
   as TranslatedCache always recomputes them (and mapped, beside);
2. how the error spreads over positions: the share of the total (layer-normalised, OracleScorer's) error in the
   worst 10/30/50% of the positions of each prompt (RaReCache's premise: "failures concentrate in a few tokens");
3. the recomputed rows, which read the mapped K/V of the others: from a retention run
   (``--retention``, per item and layer the relative K/V error of recomputed and of mapped rows), their error per
   layer beside the mapped rows'.

    python research/translated/translated_diagnosis.py --moments /tmp/tr24/mom/a.safetensors /tmp/tr24/mom/b.safetensors \\
        --retention benchmarks/results/translated_retention.json
    python research/translated/translated_diagnosis.py --table benchmarks/results/translated_diagnosis.json

``--from-ablation ABLATION_JSON VARIANT`` takes parts 1-2 from a variant that ``translated_maps.py ablate`` already
scored on the same held-out items (the same solve and scoring code; no sinks-mapped column) instead of redoing them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import translated_research as R  # noqa: E402

from hf_kvreuse.translation.mapper import KVMapper, MapperConfig  # noqa: E402


def recompute_table(path: str | Path, configs: list[str] | None = None) -> dict:
    """Mean relative K/V error per layer of recomputed and mapped rows, per configuration of a retention JSON."""
    res = json.loads(Path(path).read_text())
    out = {}
    keys = configs or [c["key"] for c in res.get("configs", [])]
    for key in keys:
        rows = [r["runs"][key]["rel_err"] for r in res["items"].values() if key in r["runs"]]
        if not rows:
            continue
        n_layers = len(rows[0])
        layers = []
        for t in range(n_layers):
            vals = []
            for j in range(4):
                xs = [r[t][j] for r in rows if r[t][j] is not None]
                vals.append(sum(xs) / len(xs) if xs else None)
            layers.append(dict(zip(("recomputed_k", "recomputed_v", "mapped_k", "mapped_v"), vals)))
        out[key] = {"items": len(rows), "per_layer": layers}
    return out


def table(path: str) -> str:
    d = json.loads(Path(path).read_text())
    h, hm = d["heldout"], d.get("heldout_sinks_mapped")
    rc = d.get("recompute", {})
    key = next(iter(rc), None)
    sm = hm is not None
    lines = ["| target layer | R² K | R² V | attn-output cos (sinks exact) |" + (" (sinks mapped) |" if sm else "")
             + " share of error |" + (" recomputed rows rel. err K / V | mapped rows rel. err K / V |" if key else ""),
             "|---|---|---|---|" + ("---|" if sm else "") + "---|" + ("---|---|" if key else "")]
    for t in range(len(h["r2_k"])):
        line = (f"| {t} | {h['r2_k'][t]:.2f} | {h['r2_v'][t]:.2f} | {h['attn_cos'][t]:.3f} | "
                + (f"{hm['attn_cos'][t]:.3f} | " if sm else "") + f"{100 * h['error_share_by_layer'][t]:.1f}% |")
        if key:
            e = rc[key]["per_layer"][t]
            f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            line += f" {f(e['recomputed_k'])} / {f(e['recomputed_v'])} | {f(e['mapped_k'])} / {f(e['mapped_v'])} |"
        lines.append(line)
    lines.append(f"| mean | {h['r2_k_mean']:.2f} | {h['r2_v_mean']:.2f} | {h['attn_cos_mean']:.3f} | "
                 + (f"{hm['attn_cos_mean']:.3f} | " if sm else "") + "|" + (" | |" if key else ""))
    w = h["error_share_worst"]
    lines += ["", f"Share of the error in the worst 10% / 30% / 50% of positions (sinks excluded): "
              f"{100 * w['top10']:.0f}% / {100 * w['top30']:.0f}% / {100 * w['top50']:.0f}% "
              "(uniform: 10 / 30 / 50%)."]
    if key:
        lines.append(f"Recomputed / mapped rows' relative K/V error (sinks excluded): configuration {key}, "
                     f"{rc[key]['items']} items of the retention run.")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moments", nargs="+")
    p.add_argument("--feats", default="/tmp/tr24/feats")
    p.add_argument("--squad", default="/tmp/tr24/squad")
    p.add_argument("--held", type=int, default=16)
    p.add_argument("--attn-prompts", type=int, default=8)
    p.add_argument("--retention", default=None, help="a retention JSON with rel_err records (part 3)")
    p.add_argument("--retention-configs", nargs="*", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table", default=None, help="print the README table of a diagnosis JSON")
    p.add_argument("--from-ablation", nargs=2, metavar=("ABLATION_JSON", "VARIANT"), default=None,
                   help="parts 1-2 from a variant that translated_maps.py ablate scored on the same held-out set "
                        "(same map, same scoring code) instead of solving and scoring again")
    p.add_argument("--out", default=str(HERE.parents[1] / "benchmarks" / "results" / "translated_diagnosis.json"))
    a = p.parse_args(argv)
    if a.table:
        print(table(a.table))
        return
    if a.moments is None and not a.from_ablation:  # refresh part 3 of an existing diagnosis from a (longer) retention run
        result = json.loads(Path(a.out).read_text())
        result["recompute"] = recompute_table(a.retention, a.retention_configs)
        result["recompute_command"] = "python research/translated/translated_diagnosis.py " + " ".join(
            sys.argv[1:] if argv is None else argv)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(table(a.out))
        return
    if a.from_ablation:
        abl = json.loads(Path(a.from_ablation[0]).read_text())
        v = abl["variants"][a.from_ablation[1]]
        result = {"command": "python research/translated/translated_diagnosis.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                               cwd=HERE).stdout.strip(),
                  "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a),
                  "from_ablation": {"path": a.from_ablation[0], "variant": a.from_ablation[1],
                                    "command": abl.get("reproduce", abl.get("command")),
                                    "git_commit": abl["git_commit"], "date": abl["date"]},
                  "map_config": v["config"], "calibration_rows": v["calibration_rows"],
                  "held_out": f"{abl['held_out']}; attention cosine on the first {v.get('attn_prompts')}",
                  "heldout": v}
        if a.retention:
            result["recompute"] = recompute_table(a.retention, a.retention_configs)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(table(a.out))
        return
    torch.set_num_threads(a.threads)
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    m = R.load_moments(Path(a.moments[0]))
    for f in a.moments[1:]:
        m.merge(R.load_moments(Path(f)))
    mapper = KVMapper.from_moments(m, R.GEOMETRY, MapperConfig(inputs="kv"))
    src_sh, tgt_sh = R.qwen_shifters()
    o_proj = load_file(str(Path(a.feats) / "tgt_o_proj.safetensors"))
    o_proj = [o_proj[str(t)].float() for t in range(R.LT)]
    held = R.HeldOut([R.squad_item(a.squad, i, src_sh, tgt_sh) for i in range(a.held)], tgt_sh, o_proj,
                     attn_prompts=a.attn_prompts)
    pred = R.mapper_predict(mapper)
    result = {"command": "python research/translated/translated_diagnosis.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=HERE).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a), "map": repr(mapper),
              "calibration_rows": m.n, "sources": [lm.sources for lm in mapper.layers],
              "held_out": f"SQuAD items 0..{a.held - 1}; attention cosine on the first {a.attn_prompts}"}
    result["heldout"] = held.score(pred, attn=True, exact_sinks=True)
    result["heldout_sinks_mapped"] = {k: v for k, v in held.score(pred, attn=True, exact_sinks=False).items()
                                      if k.startswith("attn")}
    if a.retention:
        result["recompute"] = recompute_table(a.retention, a.retention_configs)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(table(a.out))
    print(f"wrote {a.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
