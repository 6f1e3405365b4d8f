"""TranslatedCache (RaReCache) on the offline Qwen2.5-Coder 0.5B -> 1.5B pair: retention, scorer validation, time.

Three parts, one run, one JSON (``benchmarks/results/translated.json``) and two plots:

1. **Time, side by side** (first, on a quiet CPU): for ``--timing-n`` SQuAD prompts of about
   ``--timing-tokens`` tokens, alternating per prompt, the time to the first token of the target's full prefill,
   of TranslatedCache at ``--timing-ratio`` (source prefill, mapping, selection and recompute all counted) and of
   the source model answering alone. Reported beside the bound ``1 / (t_source/t_target + ratio + t_map/t_target)``.
2. **Scorer validation** (METHODS.md §2.4.b step 7), on ``--val-n`` held-out DROP prompts (the calibration
   set's dataset, prompts it did not use): the oracle error of each position (mapped vs the target's own K/V)
   is known; each scorer's Spearman correlation with it and the overlap of its top-30% set with the oracle's
   are reported, for the four rank-disagreement readings as well.
3. **Retention**: held-out SQuAD questions (single passage, chat QA prompt; the map was calibrated on DROP), for
   every recompute ratio and scorer: accuracy (a gold answer contained in the reply), retention = accuracy /
   the target's full-prefill accuracy (paired bootstrap 95% interval), agreement with the target's full-prefill
   answer (Wilson 95% interval); plus the source alone. The accuracy runs reuse one source prefill per item
   (``source_cache=``): it does not change the K/V, only the time, which part 1 measures.

    python benchmarks/translated.py [--n 100] [--ratios 0 0.1 0.3 0.5 1] [--timing-n 6]

``--timing-only`` runs part 1 alone; ``--timing-selectors`` times several scorers side by side (each prompt runs
full, every selector and the source alone in alternating order); the first one fills the summary's ``timing``,
each one ``timing_by_selector``. ``--dtype fp32`` on CPUs without native bf16 (about 5x faster here)::

    python benchmarks/translated.py --timing-only --dtype fp32 --timing-selectors first-layer rank \
        --out benchmarks/results/translated_timing_fp32.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

import hf_kvreuse
from hf_kvreuse import (FirstLayerDeviationScorer, KVMapper, OracleScorer, RandomScorer, RankDisagreementScorer, TranslatedCache,
                        enable)
from hf_kvreuse.compat import cache_kwargs, output_cache
from hf_kvreuse.kv import kv_of
from hf_kvreuse.models import load_qwen
from hf_kvreuse.translation.pairs import qwen_pair_mapper
from hf_kvreuse.workflows.datasets import contains_answer, context_for, qa_chat_ids, squad

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import wilson  # noqa: E402


def bootstrap_ratio(a: list[int], b: list[int], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap 95% interval of sum(a) / sum(b)."""
    rng = random.Random(seed)
    n = len(a)
    vals = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        sb = sum(b[i] for i in idx)
        if sb:
            vals.append(sum(a[i] for i in idx) / sb)
    vals.sort()
    return (vals[int(0.025 * len(vals))], vals[int(0.975 * len(vals)) - 1]) if vals else (float("nan"),) * 2


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.float().argsort().argsort().float()
    rb = b.float().argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def answer(tok, model, ids, max_new, **kw) -> tuple[str, float]:
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, **kw)
    dt = time.perf_counter() - t0
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip().split("\n")[0], dt


def ttft(model, ids, **kw) -> float:
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False, **kw)
    return time.perf_counter() - t0


def scorer_set(mapper):
    return {
        "rank": RankDisagreementScorer(mapper),
        "rank-whitened-cov": RankDisagreementScorer(mapper, variant="whitened"),
        "rank-energy-svd": RankDisagreementScorer(mapper, basis="svd"),
        "rank-whitened-svd": RankDisagreementScorer(mapper, variant="whitened", basis="svd"),
        "random": RandomScorer(0),
        "first-layer": FirstLayerDeviationScorer(),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100, help="held-out SQuAD questions for accuracy")
    p.add_argument("--offset", type=int, default=0, help="first SQuAD item")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.1, 0.3, 0.5, 1.0])
    p.add_argument("--scorers", nargs="+", default=["rank", "random", "oracle", "first-layer"])
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--val-n", type=int, default=40, help="held-out DROP prompts for scorer validation")
    p.add_argument("--timing-n", type=int, default=6)
    p.add_argument("--timing-tokens", type=int, default=1024)
    p.add_argument("--timing-ratio", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=2, help="torch threads for the timing part")
    p.add_argument("--acc-threads", type=int, default=None, help="torch threads for parts 2-3 (default: --threads)")
    p.add_argument("--timing-selectors", nargs="+", default=["first-layer"],
                   help="scorers timed side by side in part 1 (the first fills summary.timing)")
    p.add_argument("--timing-only", action="store_true", help="run part 1 (time) only")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--map", default=None, help="a KVMapper folder (default: qwen_pair_mapper()'s, fitted if absent)")
    p.add_argument("--out", default=str(HERE / "results" / "translated.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    src, tok = load_qwen("0.5b", dtype=dtype)
    tgt, _ = load_qwen("1.5b", dtype=dtype)
    enable(tgt)
    enable(src)
    mapper = KVMapper.load(a.map, src, tgt) if a.map else qwen_pair_mapper(src, tgt, tok)
    items = squad()
    meta = {"command": "python benchmarks/translated.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "args": vars(a), "torch": torch.__version__, "transformers": transformers.__version__,
            "hf_kvreuse": hf_kvreuse.__version__, "machine": platform.processor() or platform.machine(),
            "threads": a.threads, "dtype": str(dtype).split(".")[-1], "mapper": repr(mapper), "map_path": a.map, "mapper_info": mapper.info,
            "date": time.strftime("%Y-%m-%d %H:%M")}
    print(meta["mapper"], flush=True)

    # -- 1. time, side by side --------------------------------------------------------------------------------
    timing = []
    for i in range(a.timing_n):
        it = items[500 + 7 * i]
        ctx = context_for(items, it, tok, a.timing_tokens)
        ids = torch.tensor([qa_chat_ids(tok, ctx, it.question)[0]])
        suffix = qa_chat_ids(tok, ctx, it.question)[1]
        if i == 0:
            ttft(tgt, ids)  # warm-up
        row = {"tokens": ids.shape[1], "by_selector": {}}
        order = ["full"] + [("translated", sel) for sel in a.timing_selectors] + ["source"]
        for what in (order if i % 2 == 0 else order[::-1]):
            if what == "full":
                row["full_s"] = ttft(tgt, ids)
            elif what == "source":
                row["source_s"] = ttft(src, ids)
            else:
                c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=a.timing_ratio, suffix_tokens=suffix,
                                    selector=what[1], tokenizer=tok)
                t = ttft(tgt, ids, cache=c)
                row["by_selector"][what[1]] = dict({f"t_{k}": v for k, v in c.stats.as_dict().items()},
                                                   translated_s=t)
        for sel, r in row["by_selector"].items():
            r["speedup"] = row["full_s"] / r["translated_s"]
            rec = r["t_recomputed_tokens"] / r["t_prompt_tokens"]
            r["bound"] = 1.0 / (r["t_source_prefill_s"] / row["full_s"] + rec + r["t_map_s"] / row["full_s"])
        row.update(row["by_selector"][a.timing_selectors[0]])  # the first selector's figures at the top level
        timing.append(row)
        print(f"timing {i}: {row['tokens']} tok, full {row['full_s']:.2f}s translated {row['translated_s']:.2f}s "
              f"(source {row['t_source_prefill_s']:.2f} map {row['t_map_s']:.3f} select {row['t_select_s']:.3f} "
              f"recompute {row['t_recompute_s']:.2f}) speedup {row['speedup']:.2f} bound {row['bound']:.2f}",
              flush=True)
    if a.timing_only:
        summary = {"timing": timing_summary(timing, a), "timing_by_selector": {
            sel: timing_summary([dict(r, **r["by_selector"][sel]) for r in timing], a) for sel in a.timing_selectors}}
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "summary": summary, "timing": timing}, indent=1))
        print(json.dumps(summary, indent=1))
        return

    # -- 2. scorer validation on held-out DROP prompts --------------------------------------------------------
    torch.set_num_threads(a.acc_threads or a.threads)
    from hf_kvreuse.translation.pairs import calibration_ids

    validation = {name: {"spearman": [], "overlap": []} for name in scorer_set(mapper)}
    n_calib = int(mapper.info.get("calibration_sequences", 64))
    for j, vids in enumerate(calibration_ids(tok, n_calib + a.val_n, 512)[n_calib:]):
        ids = vids.reshape(1, -1)
        n = ids.shape[1] - 1
        tc = DynamicCache(config=tgt.config)
        sc = DynamicCache(config=src.config)
        with torch.no_grad():
            tgt(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1, **cache_kwargs(tc))
            src(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1, **cache_kwargs(sc))
        true_kv = kv_of(tc)
        # validation: every scorer on the same translated K/V
        oracle = OracleScorer(true_kv)
        probe = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.0, source_cache=sc)
        scorers = scorer_set(mapper)
        for s in scorers.values():
            s.reset(n, ids.device)
        observers = [s.observe for s in scorers.values()]
        kv = mapper.translate(kv_of(sc), torch.arange(n), probe._src_shifter, probe._shifter, torch.bfloat16,
                              observe=lambda t, k, v: [f(t, k, v) for f in observers])
        oracle.reset(n, ids.device)
        err = oracle.scores(probe, kv)
        k30 = max(1, int(0.3 * n))
        top_oracle = set(torch.topk(err, k30).indices.tolist())
        for name, s in scorers.items():
            sco = s.scores(probe, [(k.clone(), v.clone()) for k, v in kv]) if name == "first-layer" else s.scores(probe, kv)
            validation[name]["spearman"].append(spearman(sco.cpu(), err))
            validation[name]["overlap"].append(len(top_oracle & set(torch.topk(sco.cpu(), k30).indices.tolist())) / k30)
    print("validation (Spearman with the oracle, top-30% overlap):", {k: (round(statistics.mean(v["spearman"]), 3),
          round(statistics.mean(v["overlap"]), 3)) for k, v in validation.items()}, flush=True)

    # -- 3. retention ----------------------------------------------------------------------------------------------
    configs = [(r, s) for r in a.ratios for s in (a.scorers if 0 < r < 1 else ["-"])]
    per_item = []
    t_start = time.perf_counter()
    for j, it in enumerate(items[a.offset:a.offset + a.n]):
        ids_list, suffix = qa_chat_ids(tok, it.passage, it.question)
        ids = torch.tensor([ids_list])
        n = ids.shape[1] - 1
        full_out = tgt.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False, return_dict_in_generate=True)
        full_ans = tok.decode(full_out.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip().split("\n")[0]
        true_kv = [(k[..., :n, :].clone(), v[..., :n, :].clone()) for k, v in kv_of(output_cache(full_out))]
        src_ans, _ = answer(tok, src, ids, a.max_new_tokens)
        sc = DynamicCache(config=src.config)
        with torch.no_grad():
            src(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1, **cache_kwargs(sc))
        rec = {"i": a.offset + j, "tokens": ids.shape[1], "gold": list(it.answers), "full": full_ans,
               "full_ok": contains_answer(full_ans, it.answers), "source": src_ans,
               "source_ok": contains_answer(src_ans, it.answers), "runs": {}}
        for ratio, sname in configs:
            sel = {"oracle": OracleScorer(true_kv), "-": "rank"}.get(sname, sname)
            c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=ratio, selector=sel, suffix_tokens=suffix,
                                source_cache=sc, tokenizer=tok)
            ans, dt = answer(tok, tgt, ids, a.max_new_tokens, cache=c)
            rec["runs"][f"{ratio}/{sname}"] = {"answer": ans, "ok": contains_answer(ans, it.answers),
                                              "agree": ans == full_ans, "recomputed": c.stats.recomputed_tokens}
        per_item.append(rec)
        el = time.perf_counter() - t_start
        print(f"item {j + 1}/{a.n} ({el / (j + 1):.1f} s/item): full {rec['full_ok']} src {rec['source_ok']} "
              + " ".join(f"{k}:{int(v['ok'])}{'=' if v['agree'] else '!'}" for k, v in rec["runs"].items()), flush=True)

    # -- summary ---------------------------------------------------------------------------------------------
    full_ok = [int(r["full_ok"]) for r in per_item]
    N = len(per_item)
    summary = {"n": N, "full_accuracy": sum(full_ok) / N, "full_ci": wilson(sum(full_ok), N)}
    src_ok = [int(r["source_ok"]) for r in per_item]
    summary["source_alone"] = {"accuracy": sum(src_ok) / N, "ci": wilson(sum(src_ok), N),
                               "retention": sum(src_ok) / max(1, sum(full_ok)),
                               "retention_ci": bootstrap_ratio(src_ok, full_ok),
                               "agreement": sum(r["source"] == r["full"] for r in per_item) / N}
    rows = []
    for ratio, sname in configs:
        key = f"{ratio}/{sname}"
        ok = [int(r["runs"][key]["ok"]) for r in per_item]
        agree = sum(r["runs"][key]["agree"] for r in per_item)
        rows.append({"ratio": ratio, "scorer": sname, "accuracy": sum(ok) / N, "accuracy_ci": wilson(sum(ok), N),
                     "retention": sum(ok) / max(1, sum(full_ok)), "retention_ci": bootstrap_ratio(ok, full_ok),
                     "agreement": agree / N, "agreement_ci": wilson(agree, N),
                     "recomputed_share": statistics.mean(r["runs"][key]["recomputed"] / (r["tokens"] - 1)
                                                         for r in per_item)})
    summary["rows"] = rows
    summary["validation"] = {k: {"spearman_mean": statistics.mean(v["spearman"]),
                                 "top30_overlap_mean": statistics.mean(v["overlap"])} for k, v in validation.items()}
    summary["timing"] = timing_summary(timing, a)
    summary["timing_by_selector"] = {sel: timing_summary([dict(r, **r["by_selector"][sel]) for r in timing], a)
                                     for sel in a.timing_selectors}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "timing": timing, "items": per_item}, indent=1))
    print(json.dumps(summary, indent=1))
    plot(summary, out.with_suffix(""))


def timing_summary(timing: list[dict], a) -> dict:
    """Medians over the timing prompts of one selector's rows."""
    med = lambda key: statistics.median(r[key] for r in timing)  # noqa: E731
    return {"n": len(timing), "tokens_median": med("tokens"), "full_s": med("full_s"),
            "translated_s": med("translated_s"), "source_alone_s": med("source_s"),
            "source_prefill_s": med("t_source_prefill_s"), "map_s": med("t_map_s"),
            "select_s": med("t_select_s"), "recompute_s": med("t_recompute_s"),
            "speedup": med("speedup"), "bound": med("bound"),
            "speedup_share_of_bound": med("speedup") / med("bound"), "ratio": a.timing_ratio,
            "selector": timing[0].get("t_selector")}


def markdown(path: str) -> str:
    """README tables from a results JSON: ``python benchmarks/translated.py --table results.json``."""
    d = json.load(open(path))
    s = d["summary"]
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    ci = lambda c: f"[{100 * c[0]:.0f}, {100 * c[1]:.0f}]"  # noqa: E731
    lines = []
    if "rows" in s:
        lines += [f"n = {s['n']} SQuAD questions; target full prefill accuracy {pct(s['full_accuracy'])} "
                  f"{ci(s['full_ci'])}; source alone {pct(s['source_alone']['accuracy'])} (retention "
                  f"{pct(s['source_alone']['retention'])} {ci(s['source_alone']['retention_ci'])}, agreement "
                  f"{pct(s['source_alone']['agreement'])})", "",
                  "| ratio | scorer | recomputed | accuracy | retention [95% CI] | agreement with full prefill [95% CI] |",
                  "|---|---|---|---|---|---|"]
        for r in s["rows"]:
            lines.append(f"| {r['ratio']} | {r['scorer']} | {pct(r['recomputed_share'])} | {pct(r['accuracy'])} | "
                         f"{pct(r['retention'])} {ci(r['retention_ci'])} | {pct(r['agreement'])} "
                         f"{ci(r['agreement_ci'])} |")
        v = s["validation"]
        lines += ["", "| scorer | Spearman with the oracle error | top-30% overlap with the oracle |", "|---|---|---|"]
        lines += [f"| {k} | {x['spearman_mean']:.2f} | {pct(x['top30_overlap_mean'])} |" for k, x in v.items()]
        lines.append("")
    by = s.get("timing_by_selector") or {s["timing"].get("selector") or "rank": s["timing"]}
    t0 = next(iter(by.values()))
    lines += [f"| ~tokens | scorer | full prefill | source alone | translated (ratio {t0['ratio']}) | source prefill | "
              "map | select | recompute | speed-up | bound | share of bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for sel, t in by.items():
        lines.append(f"| {t['tokens_median']:.0f} | {sel} | {t['full_s']:.2f} s | {t['source_alone_s']:.2f} s | "
                     f"{t['translated_s']:.2f} s | {t['source_prefill_s']:.2f} s | {t['map_s']:.2f} s | "
                     f"{t['select_s'] * 1000:.1f} ms | {t['recompute_s']:.2f} s | {t['speedup']:.2f}x | "
                     f"{t['bound']:.2f}x | {pct(t['speedup_share_of_bound'])} |")
    return "\n".join(lines)


def plot(summary: dict, stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    rows = summary["rows"]
    ends = [r for r in rows if r["scorer"] == "-"]
    for sname in sorted({r["scorer"] for r in rows} - {"-"}):
        pts = sorted([r for r in rows if r["scorer"] == sname] + ends, key=lambda r: r["ratio"])
        ax[0].errorbar([r["ratio"] for r in pts], [100 * r["retention"] for r in pts],
                       yerr=[[100 * (r["retention"] - r["retention_ci"][0]) for r in pts],
                             [100 * (r["retention_ci"][1] - r["retention"]) for r in pts]], label=sname, capsize=3,
                       marker="o")
    ax[0].axhline(100 * summary["source_alone"]["retention"], ls=":", c="gray", label="source alone")
    ax[0].axhline(95, ls="--", c="k", lw=0.8)
    ax[0].set_xlabel("recompute ratio")
    ax[0].set_ylabel("retention of full-prefill accuracy (%)")
    ax[0].set_title(f"Qwen2.5-Coder 0.5B -> 1.5B, SQuAD n={summary['n']}")
    ax[0].legend(fontsize=8)
    t = summary["timing"]
    parts = [("source prefill", t["source_prefill_s"]), ("map", t["map_s"]), ("select", t["select_s"]),
             ("recompute", t["recompute_s"])]
    left = 0.0
    for name, val in parts:
        ax[1].barh(["translated"], [val], left=left, label=name)
        left += val
    ax[1].barh(["full prefill"], [t["full_s"]], color="gray")
    ax[1].barh(["source alone"], [t["source_alone_s"]], color="lightgray")
    ax[1].set_xlabel(f"seconds to first token (~{int(t['tokens_median'])} tokens, ratio {t['ratio']})")
    ax[1].set_title(f"speed-up {t['speedup']:.2f}x (bound {t['bound']:.2f}x)")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=120)
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(markdown(sys.argv[2]))
    else:
        main()
