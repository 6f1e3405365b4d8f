"""LatentRemedy on conflicting tasks: accuracy and TTFT of every reuse method, side by side in one run.

For each record (two agents, one shared block, different gold answers) and each direction X -> Y (agent Y reuses
the block K/V that agent X computed under its own prefix), greedy answers of agent Y with:

* ``full``: Y's own full prefill (the teacher; reported per side as full A / full B);
* ``reuse``: direct reuse of X's block (RoPE-moved), Y's prefix and question computed;
* ``post``: reuse plus the harness's text bridge after the block ("Current task objective (takes priority): ...");
* ``tail16``: reuse, the block's last 16 tokens recomputed;
* ``focus16``: reuse, 16 block rows recomputed: those that mention what the two agents' prefixes disagree on
  (:class:`~hf_kvreuse.cache_classes.focus.FocusRecomputeCache`), the rest from the tail;
* ``focus4`` / ``focus8``: the same with 4 / 8 rows (fewer rows, a first token closer to direct reuse's);
  ``focusKwW``: ``K`` rows, ``W`` tokens after each mention (default 8), e.g. ``focus8w3``;
* ``blend``: CacheBlend (15% of the block rows recomputed after layer 1);
* ``latent``: LatentRemedyCache with the trained bridge (``--bridge``, default: the shipped checkpoint) and the tail
  it was trained with (``bridge.tail_tokens``: 0 for the checkpoints before 2026-12-02, 16 for the shipped one);
* ``latent_tail16``: the same bridge plus Tail-16 (the block's last 16 rows recomputed with the latents);
* ``latent_focus16``: the same bridge, its 16 recomputed rows chosen as ``focus16`` chooses them (``focus=tok``);
* ``--extra-bridges NAME=PATH``: more LatentRemedy variants (each with the rows its bridge was trained with: its
  tail, or focus rows for a bridge trained with them).

TTFT (streamer timestamps; the donor's block K/V are in the chunk store beforehand, as in the harness) is reported
as the median ratio to direct reuse. Accuracy has Wilson 95% intervals; "recovered" is the share of the accuracy
direct reuse loses that a method wins back, ``(acc - acc_reuse) / (acc_full - acc_reuse)``.

    python benchmarks/latent_remedy.py --model qwen2.5-0.5b [--families extract years order] [--n 50]
    python benchmarks/latent_remedy.py --model smollm2 --methods full reuse      # the model screen
    python benchmarks/latent_remedy.py --paired results.json focus16:tail16       # paired differences
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_kvreuse import (BlendCache, ChunkStore, DirectReuseCache, FocusRecomputeCache, LatentBridge,
                        LatentRemedyCache, TailRecomputeCache, enable)
from hf_kvreuse.models import load_offline
from hf_kvreuse.timing import TokenTimer
from hf_kvreuse.workflows import HELDOUT_FAMILIES, conflict_records, is_correct, prompt_parts

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import wilson  # noqa: E402
METHODS = ("full", "reuse", "post", "tail16", "focus16", "focus4", "focus8", "blend", "latent", "latent_tail16", "latent_focus16")
MODELS = {"smollm2": ("smollm2-135m-instruct", torch.float32), "qwen2.5-0.5b": ("qwen2.5-coder-0.5b-instruct",
                                                                                  torch.bfloat16)}


def run_full(model, tok, ids, span, store, donor_prefix, max_new=8) -> tuple[str, float]:
    """Full prefill of one agent's prompt; its block rows go to the store as that agent's block K/V (what
    ``store.get_or_compute`` under its prefix computes, without a second forward)."""
    from transformers import DynamicCache

    from hf_kvreuse.chunk_store import KVChunk, model_fingerprint
    from hf_kvreuse.compat import cache_kwargs

    timer = TokenTimer().start()
    x = torch.tensor([ids])
    cache = DynamicCache(config=model.config)
    out = model.generate(x, max_new_tokens=max_new, do_sample=False, streamer=timer, **cache_kwargs(cache))
    s, e = span
    kv = [(layer.keys[..., s:e, :].clone(), layer.values[..., s:e, :].clone()) for layer in cache.layers]
    store.put(model, KVChunk(torch.tensor(ids[s:e]), kv, start=s), donor_prefix, producer=model_fingerprint(model))
    return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True).strip(), timer.ttft_s


def run(model, tok, ids, cache=None, max_new=8) -> tuple[str, float]:
    timer = TokenTimer().start()
    x = torch.tensor([ids])
    out = model.generate(x, cache=cache, max_new_tokens=max_new, do_sample=False, streamer=timer) if cache is not None \
        else model.generate(x, max_new_tokens=max_new, do_sample=False, streamer=timer)
    return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True).strip(), timer.ttft_s


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    p.add_argument("--families", nargs="+", default=list(HELDOUT_FAMILIES))
    p.add_argument("--n", type=int, default=50, help="records per family (each gives two directions)")
    p.add_argument("--seed", type=int, default=1000, help="record seed (training uses other seeds)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), type=_method)
    p.add_argument("--bridge", default=None, help="LatentBridge folder (default: the shipped checkpoint)")
    p.add_argument("--extra-bridges", nargs="*", default=[], help="NAME=PATH: more LatentRemedy variants")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="model dtype (default: float32 for smollm2, bfloat16 for qwen)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--records", default=None, help="a:b, only these records of each family (to split a run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    name, dtype = MODELS[a.model]
    dtype = getattr(torch, a.dtype) if a.dtype else dtype
    model, tok = load_offline(name, dtype=dtype)
    enable(model)
    bridge = None
    if {"latent", "latent_tail16", "latent_focus16"} & set(a.methods):
        bridge = LatentBridge.from_pretrained(model, a.bridge)
    extra = {}
    for spec in a.extra_bridges:
        key, path = spec.split("=", 1)
        extra[key] = LatentBridge.load(path, model)
    methods = list(a.methods) + list(extra)
    focus_variants = {m: spec for m in methods if (spec := _focus_spec(m))}  # focus16, focus8, focus8w3, ...
    rows = []
    t_start = time.perf_counter()
    for fam in a.families:
        lo, hi = (int(x) for x in a.records.split(":")) if a.records else (0, a.n)
        for r_i, rec in enumerate(conflict_records(fam, a.n, seed=a.seed)):
            if not lo <= r_i < hi:
                continue
            parts = {s: prompt_parts(tok, rec, s) for s in "ab"}
            posts = {s: prompt_parts(tok, rec, s, post=True) for s in "ab"} if "post" in a.methods else {}
            store = ChunkStore()
            full = {}
            for side in "ab":
                ids, span = parts[side]
                ans, ttft = run_full(model, tok, ids, span, store, torch.tensor(ids[:span[0]]), a.max_new_tokens)
                full[side] = ans
                rows.append({"family": fam, "record": r_i, "direction": f"full_{side}", "method": "full",
                             "answer": ans, "ok": is_correct(ans, rec.gold(side)), "ttft_s": ttft})
            for src, tgt in (("a", "b"), ("b", "a")):
                donor_ids, (ds, de) = parts[src]
                ids, span = parts[tgt]
                prefix = torch.tensor(donor_ids[:ds])
                store.get_or_compute(model, torch.tensor(ids[span[0]:span[1]]), prefix)  # in the store (run_full)
                for method in methods:
                    if method == "full":
                        continue
                    use_ids, use_span = (posts[tgt] if method == "post" else (ids, span))
                    kw = dict(store=store, block_prefix_ids=prefix)
                    cache = {"reuse": lambda: DirectReuseCache(model, torch.tensor([use_ids]), [use_span], **kw),
                             "post": lambda: DirectReuseCache(model, torch.tensor([use_ids]), [use_span], **kw),
                             "tail16": lambda: TailRecomputeCache(model, torch.tensor([use_ids]), [use_span], **kw),
                             **{m: (lambda k=k, w=w: FocusRecomputeCache(model, torch.tensor([use_ids]), [use_span],
                                                                          tok, recompute_tokens=k, window=w, **kw))
                                for m, (k, w) in focus_variants.items()},
                             "blend": lambda: BlendCache(model, torch.tensor([use_ids]), [use_span], **kw),
                             # the bridge's own Tail-k (what it was trained with; 0 for a plain bridge)
                             "latent": lambda: LatentRemedyCache(model, torch.tensor([use_ids]), [use_span],
                                                                 bridge=bridge, **kw),
                             "latent_tail16": lambda: LatentRemedyCache(model, torch.tensor([use_ids]), [use_span],
                                                                        bridge=bridge, tail_tokens=16, **kw),
                             "latent_focus16": lambda: LatentRemedyCache(
                                 model, torch.tensor([use_ids]), [use_span], bridge=bridge, tail_tokens=16, focus=tok,
                                 **kw),
                             **{k: (lambda b=b: LatentRemedyCache(model, torch.tensor([use_ids]), [use_span], bridge=b,
                                                                 focus=tok if b.rows == "focus" else None, **kw))
                                for k, b in extra.items()}}[method]()
                    ans, ttft = run(model, tok, use_ids, cache, a.max_new_tokens)
                    rows.append({"family": fam, "record": r_i, "direction": f"{src}->{tgt}", "method": method,
                                 "answer": ans, "ok": is_correct(ans, rec.gold(tgt)), "agree_full": ans == full[tgt],
                                 "ttft_s": ttft})
            done = sum(1 for r in rows if r["method"] == "full") // 2
            if done % 5 == 0:
                print(f"{fam} {r_i + 1}/{a.n} ({(time.perf_counter() - t_start) / done:.1f} s/record)", flush=True)
    summary = summarize(rows, methods)
    out = Path(a.out or HERE / "results" / f"latent_remedy_{a.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/latent_remedy.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "args": vars(a), "bridge": None if bridge is None else {"n_latent": bridge.n_latent, **bridge.info},
            "extra_bridges": {k: {"n_latent": b.n_latent, "tail_tokens": b.tail_tokens, "readout": b.readout,
                                  "rows": b.rows, **b.info} for k, b in extra.items()},
            "date": time.strftime("%Y-%m-%d %H:%M")}
    out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    if len(methods) > 2:
        plot(summary, out.with_suffix(".png"))


def _focus_spec(method: str):
    """``(rows, window)`` of a ``focusK`` / ``focusKwW`` method name, or None."""
    m = re.fullmatch(r"focus(\d+)(?:w(\d+))?", method)
    return (int(m.group(1)), int(m.group(2) or 8)) if m else None


def _method(name: str) -> str:
    if name in METHODS or _focus_spec(name):
        return name
    raise argparse.ArgumentTypeError(f"unknown method {name!r}; choose from {METHODS} or focusK / focusKwW")


def summarize(rows: list[dict], methods) -> dict:
    """Accuracy (Wilson 95%), per direction, recovered share, agreement with full, TTFT ratio to direct reuse of
    the same run. Rows merged from several runs (``--merge``) count once per (family, record, direction, method):
    the first run's; TTFT ratios pair each row with the direct-reuse row of its own run."""
    out = {}
    seen, uniq = set(), []
    for r in rows:
        key = (r["family"], r["record"], r["direction"], r["method"])
        if key not in seen:
            seen.add(key)
            uniq.append(r)
    fams = sorted({r["family"] for r in rows}) + ["all"]
    for fam in fams:
        sel_all = [r for r in rows if fam == "all" or r["family"] == fam]
        sel = [r for r in uniq if fam == "all" or r["family"] == fam]
        res = {}
        for side in "ab":
            ok = [r["ok"] for r in sel if r["direction"] == f"full_{side}"]
            res[f"full_{side}"] = {"acc": sum(ok) / len(ok), "ci": wilson(sum(ok), len(ok)), "n": len(ok)}
        ok = [r["ok"] for r in sel if r["method"] == "full"]
        res["full"] = {"acc": sum(ok) / len(ok), "ci": wilson(sum(ok), len(ok)), "n": len(ok)}
        for m in methods:
            if m == "full":
                continue
            rs = [r for r in sel if r["method"] == m]
            k = sum(r["ok"] for r in rs)
            res[m] = {"acc": k / len(rs), "ci": wilson(k, len(rs)), "n": len(rs),
                      "agree_full": sum(r["agree_full"] for r in rs) / len(rs),
                      "ttft_s": statistics.median(r["ttft_s"] for r in rs)}
            for d in ("a->b", "b->a"):
                dk = [r["ok"] for r in rs if r["direction"] == d]
                res[m][d] = sum(dk) / max(1, len(dk))
        if "reuse" in res:
            lost = res["full"]["acc"] - res["reuse"]["acc"]
            for m in methods:
                if m in ("full", "reuse"):
                    continue
                res[m]["recovered"] = (res[m]["acc"] - res["reuse"]["acc"]) / lost if lost > 0 else float("nan")
                # TTFT ratio to direct reuse of the same run (side by side), per (record, direction), median;
                # none for a method whose run had no direct reuse (another run's load is not comparable)
                ratios = []
                for r in (x for x in sel if x["method"] == m):
                    base = next((x for x in sel_all if x["method"] == "reuse" and x["record"] == r["record"]
                                 and x["direction"] == r["direction"] and x["family"] == r["family"]
                                 and x.get("run") == r.get("run")), None)
                    if base is not None:
                        ratios.append(r["ttft_s"] / base["ttft_s"])
                if ratios:
                    res[m]["ttft_vs_reuse"] = statistics.median(ratios)
        out[fam] = res
    return out


def markdown(path: str) -> str:
    """README table from a results JSON: ``python benchmarks/latent_remedy.py --table results.json``."""
    d = json.load(open(path))
    s = d["summary"]
    lines = ["| family | method | accuracy [95% CI] | A->B / B->A | recovered | agreement with full | TTFT / direct reuse |",
             "|---|---|---|---|---|---|---|"]
    for fam, res in s.items():
        for m in ["full_a", "full_b", "full"] + [k for k in res if k not in ("full_a", "full_b", "full")]:
            r = res[m]
            dirs = f"{100 * r['a->b']:.0f}% / {100 * r['b->a']:.0f}%" if "a->b" in r else "-"
            rec = f"{100 * r['recovered']:.0f}%" if "recovered" in r else "-"
            agree = f"{100 * r['agree_full']:.0f}%" if "agree_full" in r else "-"
            tt = f"{r['ttft_vs_reuse']:.2f}x" if "ttft_vs_reuse" in r else "-"
            lines.append(f"| {fam} | {m} | {100 * r['acc']:.0f}% [{100 * r['ci'][0]:.0f}, {100 * r['ci'][1]:.0f}] | "
                         f"{dirs} | {rec} | {agree} | {tt} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = summary["all"]
    methods = ["full"] + [m for m in res if m not in ("full", "full_a", "full_b")]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    accs = [100 * res[m]["acc"] for m in methods]
    errs = [[100 * (res[m]["acc"] - res[m]["ci"][0]) for m in methods],
            [100 * (res[m]["ci"][1] - res[m]["acc"]) for m in methods]]
    ax[0].bar(methods, accs, yerr=errs, capsize=3)
    ax[0].set_ylabel("accuracy on held-out families (%)")
    ttft = [res[m].get("ttft_vs_reuse", float("nan")) for m in methods if m not in ("full", "reuse")]
    ax[1].bar([m for m in methods if m not in ("full", "reuse")], ttft)
    for axis in ax:
        axis.tick_params(axis="x", rotation=30)
    ax[1].axhline(1.0, c="k", lw=0.8)
    ax[1].axhline(1.2, c="r", ls="--", lw=0.8)
    ax[1].set_ylabel("TTFT / direct reuse (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def merge(out_path: str, paths: list[str]) -> None:
    """``--merge OUT IN...``: rows of several runs over the same records (e.g. baselines, then LatentRemedy
    variants) in one JSON, summary recomputed, plot redrawn."""
    rows, metas = [], []
    for i, path in enumerate(paths):
        d = json.load(open(path))
        metas.append(d["meta"])
        # a run id per input file (a merged input keeps its own runs apart under its index)
        rows.extend({**r, "run": f"{i}.{r['run']}" if "run" in r else f"{i}"} for r in d["rows"])
    methods = list(dict.fromkeys(r["method"] for r in rows))
    summary = summarize(rows, methods)
    Path(out_path).write_text(json.dumps({"meta": {"merged_from": paths, "runs": metas,
                                                   "command": "python benchmarks/latent_remedy.py --merge " + " ".join(
                                                       [out_path] + paths)}, "summary": summary, "rows": rows},
                                         indent=1))
    plot(summary, Path(out_path).with_suffix(".png"))


def paired(path: str, specs: list[str]) -> str:
    """``--paired RESULTS A:B ...``: accuracy of method A minus method B on the same cases (family, record,
    direction), per family and over all, with Newcombe's paired 95% interval
    (:func:`hf_kvreuse.cli.paired_difference`).
    Merged runs count a case once, as :func:`summarize` does (the first run's row)."""
    from hf_kvreuse.cli import paired_difference

    rows = json.load(open(path))["rows"]
    by: dict[str, dict] = {}
    for r in rows:
        if r["method"] != "full":
            by.setdefault(r["method"], {}).setdefault((r["family"], r["record"], r["direction"]), r)
    fams = sorted({k[0] for m in by.values() for k in m})
    lines = ["| families | A - B | accuracy difference, pts [95% CI] | n |", "|---|---|---|---|"]
    for spec in specs:
        a, b = spec.split(":")
        if a not in by or b not in by:
            raise SystemExit(f"--paired {spec}: {path} has methods {sorted(by)}")
        for fam in fams + [None]:
            keys = sorted(k for k in by[a] if k in by[b] and (fam is None or k[0] == fam))
            d, lo, hi = paired_difference([by[a][k]["ok"] for k in keys], [by[b][k]["ok"] for k in keys])
            lines.append(f"| {fam or 'all'} | {a} - {b} | {100 * d:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}] "
                         f"| {len(keys)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(markdown(sys.argv[2]))
    elif len(sys.argv) > 3 and sys.argv[1] == "--paired":
        print(paired(sys.argv[2], sys.argv[3:]))
    elif len(sys.argv) > 3 and sys.argv[1] == "--merge":
        merge(sys.argv[2], sys.argv[3:])
    else:
        main()
