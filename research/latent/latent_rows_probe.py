"""Which reused block rows must be recomputed to undo the donor's focus? (issue 25, a diagnosis).

On the LatentRemedy dev shards (teacher-forced, as ``latent.train.evaluate_rows``), each example ``X -> Y`` holds
Y's own prefix and X's block (computed after X's prefix). The same shard holds ``Y -> X``, whose block rows are
Y's block computed after Y's own prefix: RoPE-moved to Y's span, they are the K/V full prefill gives. So per
example the true block K/V are known, and a row selection can be scored against the oracle that recomputes the
rows whose K/V deviate most from the true ones.

Selectors (``k`` rows of the block, recomputed together with the question and answer rows by
:func:`hf_kvreuse.generation.partial.partial_forward`; every other block row keeps the donor's K/V):

* ``tail``   the block's last ``k`` rows (Tail-k);
* ``oracle`` the ``k`` rows whose K/V (all layers) deviate most from the true ones;
* ``focus``  :func:`hf_kvreuse.focus.focus_then_tail`: the rows holding a word that one prefix has and the other
  lacks (the two agents' instructions differ in what they ask for) and the ``--window`` tokens after each, rarer
  words first, up to ``k`` rows; the rows left over go to the tail;
* ``none`` / ``all``: direct reuse / the whole block (sanity: all = full prefill up to the float16 storage).

    python research/latent/latent_rows_probe.py --data /work/i25data/dev_big --k 16 32 --out results.json
    python research/latent/latent_rows_probe.py --table benchmarks/results/latent_rows_probe.json   # the README table
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not in a checkout
        return "unknown"


def block_deviation(kv, true_kv, s: int, e: int) -> torch.Tensor:
    """Per block row: mean over layers of the relative K and V error (donor vs true)."""
    dev = torch.zeros(e - s)
    for (k, v), (tk, tv) in zip(kv, true_kv):
        for a, b in ((k[..., s:e, :], tk), (v[..., s:e, :], tv)):
            a, b = a.float(), b.float()
            dev += ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).mean(dim=(0, 1))
    return dev / (2 * len(kv))


@torch.no_grad()
def score(model, ex, block_rows: list[int]) -> tuple[bool, float]:
    """Teacher-forced: recompute ``block_rows`` and the question + answer rows; (agree, KL)."""
    from hf_kvreuse.generation.partial import partial_forward
    from hf_kvreuse.latent.train import kl_top_k

    dt = next(model.parameters()).dtype
    m = ex.tail_ids.shape[1]
    kv = []
    for k, v in ex.kv:
        kv.append((torch.cat([k.to(dt), k.new_zeros(*k.shape[:-2], m, k.shape[-1]).to(dt)], -2),
                   torch.cat([v.to(dt), v.new_zeros(*v.shape[:-2], m, v.shape[-1]).to(dt)], -2)))
    rows = torch.tensor(sorted(set(block_rows)) + list(range(ex.e, ex.e + m)))
    out = partial_forward(model, ex.ids, rows, kv, logits_to_keep=0)
    n_block = rows.numel() - m
    P = ex.top_idx.shape[0]
    lg = out.logits[0, n_block + ex.first: n_block + ex.first + P].float()
    return bool((lg.argmax(-1) == ex.top_idx[:, 0]).all()), float(kl_top_k(lg, ex))


def main(argv=None) -> None:
    from hf_kvreuse.focus import focus_then_tail
    from hf_kvreuse.latent.data import load_shard
    from hf_kvreuse.models import load_offline
    from hf_kvreuse.rope import RopeShifter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+")
    p.add_argument("--table", default=None, help="print the markdown table of a result JSON and stop")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--k", type=int, nargs="+", default=[16])
    p.add_argument("--selectors", nargs="+", default=["none", "tail", "oracle", "focus", "all"])
    p.add_argument("--window", type=int, default=8, help="focus: tokens after each occurrence")
    p.add_argument("--families", nargs="*", default=None)
    p.add_argument("--limit", type=int, default=0, help="examples per shard (0: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return
    if not a.data or not a.out:
        p.error("--data and --out are required (or --table)")
    torch.set_num_threads(a.threads)
    model, tok = load_offline(a.model, dtype=torch.float32)
    shifter = RopeShifter(model)
    out_path = Path(a.out)
    res = json.loads(out_path.read_text()) if out_path.exists() else {
        "command": "python research/latent/latent_rows_probe.py " + " ".join(argv or __import__("sys").argv[1:]),
        "git_commit": _git(), "model": a.model, "rows": []}
    done = {(r["shard"], r["i"]) for r in res["rows"]}
    t0 = time.perf_counter()
    shards = sorted(q for d in a.data for q in Path(d).glob("*.json") if not q.name.startswith("screen"))
    for shard in shards:
        fam = shard.stem.rsplit("_", 1)[0]
        if a.families and fam not in a.families:
            continue
        exs = load_shard(shard)
        by_key = {(ex.meta["record"], ex.meta["direction"]): ex for ex in exs}
        for i, ex in enumerate(exs[: a.limit or None]):
            if (str(shard), i) in done:
                continue
            src, _, tgt = ex.meta["direction"].partition("->")
            partner = by_key[(ex.meta["record"], f"{tgt}->{src}")]
            s, e = ex.s, ex.e
            # partner's block rows: the block after this example's own prefix, at partner's span
            true_kv = [(shifter.shift(k[..., partner.s:partner.e, :].float(), s - partner.s),
                        v[..., partner.s:partner.e, :].float()) for k, v in partner.kv]
            dev = block_deviation(ex.kv, true_kv, s, e)
            ids = ex.ids[0].tolist()
            row = {"shard": str(shard), "i": i, "family": fam, "record": ex.meta["record"],
                   "direction": ex.meta["direction"], "full_ok": bool(ex.meta["full_ok"]),
                   "reuse_agree": bool(ex.meta["reuse_agree"]), "block": e - s, "res": {}}
            for sel in a.selectors:
                for k in (a.k if sel in ("tail", "oracle", "focus") else [0]):
                    if sel == "none":
                        br = []
                    elif sel == "all":
                        br = list(range(s, e))
                    elif sel == "tail":
                        br = list(range(max(s, e - k), e))
                    elif sel == "oracle":
                        br = (s + dev.topk(min(k, e - s)).indices).tolist()
                    else:
                        rel, n_focus = focus_then_tail(tok, ids[s:e], ids[:s], partner.ids[0, :partner.s].tolist(), k,
                                                       a.window)
                        row.setdefault("focus_rows", {})[k] = n_focus
                        br = (s + rel).tolist()
                    agree, kl = score(model, ex, br)
                    row["res"][f"{sel}{k or ''}"] = {"agree": agree, "kl": round(kl, 4)}
            res["rows"].append(row)
            out_path.write_text(json.dumps(res, indent=0))
            print(f"{len(res['rows'])} {fam} {row['direction']} block {e - s} focus {row.get('focus_rows')} "
                  + " ".join(f"{n}:{int(v['agree'])}" for n, v in row["res"].items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    summarize(res)
    out_path.write_text(json.dumps(res, indent=0))


GROUPS = {"held-out (retrieval, extract)": ("retrieval", "extract"), "held-out, other shape (code)": ("code",),
          "held-out, all three": ("retrieval", "extract", "code"), "training families, dev records": None}


def table(res: dict, against: str = "tail16") -> str:
    """Markdown: per group and selection, accuracy [Wilson 95%], recovered share, paired difference against
    ``against`` (Newcombe), agreement with full prefill, mean KL to the teacher's top-k."""
    from hf_kvreuse.cli import paired_difference, wilson

    held = {"retrieval", "extract", "code"}
    lines = ["| examples | recomputed block rows | n | acc [95% CI] | recovered | vs " + against + " (pts, paired) "
             "| agree with full | KL |", "|---|---|---|---|---|---|---|---|"]
    names = list(res["rows"][0]["res"])
    for g, fams in GROUPS.items():
        rows = [r for r in res["rows"] if (r["family"] in fams if fams else r["family"] not in held)]
        if not rows:
            continue
        n = len(rows)
        full = sum(r["full_ok"] for r in rows) / n
        reuse = sum(r["full_ok"] and r["reuse_agree"] for r in rows) / n
        ref = [r["full_ok"] and r["res"][against]["agree"] for r in rows] if against in names else None
        for name in names:
            ok = [r["full_ok"] and r["res"][name]["agree"] for r in rows]
            k = sum(ok)
            lo, hi = wilson(k, n)
            rec = f"{100 * (k / n - reuse) / (full - reuse):.0f}%" if full > reuse else "-"
            if ref is not None and name != against:
                d, dlo, dhi = paired_difference(ok, ref)
                vs = f"{100 * d:+.0f} [{100 * dlo:+.0f}, {100 * dhi:+.0f}]"
            else:
                vs = "-"
            agree = sum(r["res"][name]["agree"] for r in rows) / n
            kl = sum(r["res"][name]["kl"] for r in rows) / n
            label = {"none": "none (direct reuse)", "all": "all (the whole block)"}.get(name, name)
            lines.append(f"| {g} | {label} | {n} | {100 * k / n:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}] | {rec} | {vs} "
                         f"| {100 * agree:.0f}% | {kl:.3f} |")
    return "\n".join(lines)


def summarize(res: dict) -> None:
    """Per family group: accuracy (full prefill right and the selection agrees with it), recovered share."""
    held = {"retrieval", "extract", "code"}
    groups = {"held-out": lambda r: r["family"] in held, "training families": lambda r: r["family"] not in held}
    out = {}
    for g, f in groups.items():
        rows = [r for r in res["rows"] if f(r)]
        if not rows:
            continue
        n = len(rows)
        full = sum(r["full_ok"] for r in rows) / n
        reuse = sum(r["full_ok"] and r["reuse_agree"] for r in rows) / n
        out[g] = {"n": n, "full_acc": full, "reuse_acc": reuse}
        for name in rows[0]["res"]:
            acc = sum(r["full_ok"] and r["res"][name]["agree"] for r in rows) / n
            out[g][name] = {"acc": round(acc, 4), "agree": round(sum(r["res"][name]["agree"] for r in rows) / n, 4),
                            "recovered": round((acc - reuse) / (full - reuse), 4) if full > reuse else None,
                            "kl": round(sum(r["res"][name]["kl"] for r in rows) / n, 4)}
    res["summary"] = out
    for g, d in out.items():
        print(f"== {g}: n={d['n']} full {d['full_acc']:.2f} reuse {d['reuse_acc']:.2f}")
        for name, v in d.items():
            if isinstance(v, dict):
                print(f"  {name:10s} acc {v['acc']:.2f} rec {v['recovered']} agree {v['agree']:.2f} kl {v['kl']}")


if __name__ == "__main__":
    main()
