"""PReCache benchmark: NonShared vs PreLRShared vs ReBaseShared with the shipped role adapters of SmolLM2-135M
(fast smoke reading) or Qwen2.5-Coder-0.5B (a model that can do the task; 32k positions, so the full-size trace).

Two parts, every variant side by side in one run (CPU machines drift; ratios are taken per repeat):

1. **Efficiency** on a controlled ReAct trace in the shape of PReCache's ``traces/react_17.3k.csv``
   (prefill / decode tokens per turn: ``plan 512/32, plan 8/8, act 8/8, [plan 4096/32, plan 8/8, act 8/8] x4,
   reflect 32/32, reflect 8/8``), every prefill length multiplied by ``--scale`` (0.25 on CPU: ~4.4k tokens).
   The new tokens are real SQuAD text; each turn decodes exactly its budget. Per variant: time to first token
   (sum over the trace and per turn), per-request throughput (generated tokens / end-to-end seconds of the
   turn, as single-stream requests), the adapter-free rebuild time (after_turn), the K/V memory, and the peak
   memory growth of the largest turn (hf_kvreuse.timing.PeakMemory) beside nonshared's (full prefill per agent).
2. **Accuracy** on held-out SQuAD items (articles unseen by the adapters) as ReAct episodes: ``plan`` writes
   ``Thought/Action: Retrieve[topic]``; the environment appends a ~``--observation``-token observation (the
   answering passage among others) that ``plan`` reads while writing its next thought; ``act`` writes
   ``Finish[answer]``; ``reflect`` judges it. The scratchpad text is the same for every variant (agents'
   turns are scored, then the canonical text continues: reflect judges nonshared's answer in every variant),
   so only the cache method differs. Reported: each role's skill, act accuracy (gold answer contained) and
   agreement with ``nonshared``, with 95% Wilson intervals; and, per turn, how far each shared variant's
   first-token logits are from nonshared's (same top-1 token, KL, max |logit difference|): where answers diverge.

    python benchmarks/base_lr.py [--model smollm2] [--scale 0.25] [--repeats 2] [--items 30] [--observation 1024]
    python benchmarks/base_lr.py --model qwen2.5-0.5b --items 100 --repeats 1       # full trace + n=100
    python benchmarks/base_lr.py --model qwen2.5-0.5b --targets k_proj v_proj ...   # the key-adapter variant

``--parts`` runs the efficiency trace, the accuracy episodes or both; ``--first`` / ``--items`` pick a slice of the
held-out episodes (shards run in parallel, joined by ``--merge``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from hf_kvreuse import BaseLRCache
from hf_kvreuse.models.loaders import MODEL_KEYS, MODEL_NAMES, load_by_key
from hf_kvreuse.timing import PeakMemory, TokenTimer, now
from hf_kvreuse.workflows import react
from hf_kvreuse.workflows.datasets import passages_for, squad

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import markdown_table, paired_difference, wilson  # noqa: E402

VARIANTS = [("nonshared", "after_turn"), ("prelrshared", "after_turn"), ("rebaseshared", "after_turn"),
            ("rebaseshared", "alongside")]
# PReCache traces/react_17.3k.csv: (agent, prefill tokens, decode tokens) per turn
REACT_17_3K = ([("plan", 512, 32), ("plan", 8, 8), ("act", 8, 8)] + [("plan", 4096, 32), ("plan", 8, 8),
                                                                      ("act", 8, 8)] * 4
               + [("reflect", 32, 32), ("reflect", 8, 8)])


def label(method: str, schedule: str) -> str:
    return f"{method}/{schedule}" if method == "rebaseshared" else method


def scaled_trace(scale: float) -> list[tuple[str, int, int]]:
    return [(a, max(8, round(p * scale)) if p > 32 else p, d) for a, p, d in REACT_17_3K]


def text_stream(tok, items, n_tokens: int) -> torch.Tensor:
    """Real text for the trace: SQuAD passages, tokenized back to back."""
    ids, seen = [], set()
    for it in items:
        if it.passage not in seen:
            seen.add(it.passage)
            ids += tok(it.passage + "\n", add_special_tokens=False)["input_ids"]
            if len(ids) >= n_tokens:
                break
    return torch.tensor(ids[:n_tokens])[None]


def run_trace(pm, trace, text_ids, method, schedule) -> dict:
    cache = BaseLRCache(pm, method=method, schedule=schedule)
    seq, pos, turns = torch.empty(1, 0, dtype=torch.long), 0, []
    for agent, n_new, n_dec in trace:
        seq = torch.cat([seq, text_ids[:, pos: pos + n_new]], 1)
        pos += n_new
        pm.set_adapter(agent)
        timer = TokenTimer()
        with PeakMemory(seq.device, interval_s=0.004) as peak:
            t0 = timer.start().t0
            seq = pm.generate(input_ids=seq, cache=cache, max_new_tokens=n_dec, min_new_tokens=n_dec,
                              do_sample=False, streamer=timer)
            e2e = now() - t0
        st = cache.stats.last
        turns.append(dict(agent=agent, prefill_tokens=st.prefill_tokens, ttft_s=timer.ttft_s, e2e_s=e2e,
                          generated=n_dec, rebase_s=st.rebase_s, mem_mib=peak.peak_mib))
    base = cache.kv_bytes() - cache.lr_bytes()
    mem = dict(kv_bytes=cache.kv_bytes(), lr_bytes={a: cache.lr_bytes(a) for a in pm.peft_config},
               base_bytes=base if method != "nonshared" else None)
    return dict(turns=turns, memory=mem, total_tokens=seq.shape[1])


def efficiency(pm, tok, items, args) -> dict:
    trace = scaled_trace(args.scale)
    text_ids = text_stream(tok, items, sum(p for _, p, _ in trace))
    runs = {label(*v): [] for v in VARIANTS}
    run_trace(pm, trace[:3], text_ids, "prelrshared", "after_turn")  # warm-up
    for rep in range(args.repeats):
        order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
        for method, schedule in order:
            r = run_trace(pm, trace, text_ids, method, schedule)
            runs[label(method, schedule)].append(r)
            print(f"  repeat {rep} {label(method, schedule):24s} sum TTFT "
                  f"{sum(t['ttft_s'] for t in r['turns']):.2f} s", flush=True)
    ref = runs["nonshared"]
    rows = []
    for name, reps in runs.items():
        sum_ttft = [sum(t["ttft_s"] for t in r["turns"]) for r in reps]
        e2e = [sum(t["e2e_s"] for t in r["turns"]) for r in reps]
        gen = sum(t["generated"] for t in reps[0]["turns"])
        per_turn = [[t["ttft_s"] for t in r["turns"]] for r in reps]
        mem = reps[0]["memory"]
        rows.append(dict(
            variant=name, prefill_tokens=sum(t["prefill_tokens"] for t in reps[0]["turns"]),
            sum_ttft_s=statistics.median(sum_ttft),
            ttft_speedup=statistics.median(sum(t["ttft_s"] for t in a["turns"]) / s
                                           for a, s in zip(ref, sum_ttft)),
            mean_turn_ttft_speedup=statistics.median(
                statistics.mean(x / y for x, y in zip([t["ttft_s"] for t in a["turns"]], pt))
                for a, pt in zip(ref, per_turn)),
            e2e_s=statistics.median(e2e), throughput_tok_s=gen / statistics.median(e2e),
            throughput_gain=statistics.median((gen / e) / (gen / sum(t["e2e_s"] for t in a["turns"]))
                                              for a, e in zip(ref, e2e)),
            rebase_s=statistics.median(sum(t["rebase_s"] for t in r["turns"]) for r in reps),
            kv_mb=mem["kv_bytes"] / 2**20,
            # peak memory growth of the trace's largest turn (its generate, rebuild included), and per repeat
            # its ratio to nonshared's, whose agents each prefill into a plain cache (full prefill)
            peak_turn_mem_mib=statistics.median(max(t["mem_mib"] for t in r["turns"]) for r in reps),
            mem_ratio=statistics.median(max(t["mem_mib"] for t in r["turns"]) /
                                        max(1e-9, max(t["mem_mib"] for t in a["turns"])) for a, r in zip(ref, reps)),
            lr_per_agent_pct=(100 * max(mem["lr_bytes"].values()) / mem["base_bytes"]) if mem["base_bytes"] else None,
            per_turn_ttft_s=[statistics.median(x) for x in zip(*per_turn)]))
    return dict(trace=trace, rows=rows, runs=runs)


def heldout_episodes(items, n: int, first: int = 0) -> list[tuple[int, object]]:
    """Held-out episodes ``first .. first + n - 1`` (index, item) of one fixed order that takes the held-out
    articles in turn (round robin), so that any prefix or shard samples every article and shards never overlap."""
    _, held = react.split_items(items)
    by_title: dict[str, list] = {}
    for it in held:
        by_title.setdefault(it.title, []).append(it)
    queues = [by_title[t] for t in sorted(by_title)]
    order = [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]
    return list(enumerate(order))[first: first + n]


def accuracy(pm, tok, items, args) -> dict:
    results = {label(*v): [] for v in VARIANTS}
    episodes = heldout_episodes(items, args.items, args.first)
    for i, item in episodes:
        first: dict = {}  # (variant, turn) -> first-token logits
        passages = passages_for(items, item, tok, args.observation)
        act = react.act_example(item, passages)
        read_prompt = act.prompt[: act.prompt.rindex(react.ACT_THOUGHT)]
        for method, schedule in VARIANTS:
            cache = BaseLRCache(pm, method=method, schedule=schedule)
            rec = dict(item=i)

            def turn(agent, prompt, max_new, key=None):
                text, ttft, logits = react.agent_turn(pm, tok, cache, agent, prompt, max_new, first_logits=True)
                if key:
                    rec[f"{key}_ttft_s"] = ttft
                    first[(label(method, schedule), key)] = logits
                return text

            plan_text = turn("plan", react.plan_example(item).prompt, react.MAX_NEW_TOKENS["plan"], key="plan")
            turn("plan", read_prompt, 8, key="read")  # plan reads the long observation (its thought is not kept)
            answer = react.parse_finish(turn("act", act.prompt, react.MAX_NEW_TOKENS["act"], key="act"))
            # reflect judges the canonical answer (nonshared's), so its turn sees the same text in every variant
            canon = results["nonshared"][-1]["answer"] if method != "nonshared" else answer
            verdict = turn("reflect", react.reflect_example(item, passages, canon).prompt,
                           react.MAX_NEW_TOKENS["reflect"], key="reflect")
            rec.update(plan_ok=react.check_plan(plan_text, item), answer=answer,
                       act_ok=react.check_act(answer, item),
                       reflect_ok=react.check_reflect(verdict, react.is_right(canon, item)),
                       prompt_tokens=len(tok(act.prompt, add_special_tokens=False)["input_ids"]))
            if method != "nonshared":  # how far this variant's first-token logits are from nonshared's, per turn
                for key in ("plan", "read", "act", "reflect"):
                    a, b = first[(label(method, schedule), key)], first[("nonshared", key)]
                    rec[f"{key}_logit_maxdiff"] = float((a - b).abs().max())
                    rec[f"{key}_kl"] = float(torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1),
                                                                        log_target=True, reduction="sum"))
                    rec[f"{key}_top1_same"] = bool(a.argmax() == b.argmax())
            results[label(method, schedule)].append(rec)
        print(f"  item {i + 1}/{args.first + len(episodes)}: " + ", ".join(
            f"{k}={r[-1]['answer']!r}" for k, r in results.items()), flush=True)
    return dict(rows=accuracy_rows(results), items=results, observation_tokens=args.observation)


def accuracy_rows(results: dict) -> list[dict]:
    """Per variant: plan / act / reflect rates and agreement with nonshared's answer, with 95% Wilson intervals."""
    ref = results["nonshared"]
    rows = []
    for name, recs in results.items():
        n = len(recs)

        def rate(f):
            k = sum(bool(f(r)) for r in recs)
            lo, hi = wilson(k, n)
            return 100 * k / n, [100 * lo, 100 * hi]

        row = dict(variant=name, n=n)
        for key, f in (("plan", lambda r: r["plan_ok"]), ("act", lambda r: r["act_ok"]),
                       ("reflect", lambda r: r["reflect_ok"])):
            row[f"{key}_pct"], row[f"{key}_ci"] = rate(f)
        if name != "nonshared":  # paired: the same episodes, so shared failures cancel (Newcombe's interval)
            d, lo, hi = paired_difference([r["act_ok"] for r in recs], [r["act_ok"] for r in ref])
            row["act_minus_nonshared_pts"], row["act_minus_nonshared_ci"] = 100 * d, [100 * lo, 100 * hi]
        agree = [a["answer"] == b["answer"] for a, b in zip(recs, ref)]
        row["agree_pct"], row["agree_ci"] = rate(lambda r, it=iter(agree): next(it))
        for key in ("plan", "read", "act", "reflect"):  # where the answers diverge: per turn, vs nonshared
            if f"{key}_kl" in recs[0]:
                row[f"{key}_top1_same_pct"] = 100 * sum(r[f"{key}_top1_same"] for r in recs) / n
                row[f"{key}_kl_median"] = statistics.median(r[f"{key}_kl"] for r in recs)
                row[f"{key}_logit_maxdiff_median"] = statistics.median(r[f"{key}_logit_maxdiff"] for r in recs)
        row["act_ttft_s"] = statistics.median(r["act_ttft_s"] for r in recs)
        row["reflect_ttft_s"] = statistics.median(r["reflect_ttft_s"] for r in recs)
        rows.append(row)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in (result.get("efficiency") or {}).get("rows", []):
        a.plot(range(len(r["per_turn_ttft_s"])), r["per_turn_ttft_s"], marker="o", label=r["variant"])
    a.set_yscale("log")
    a.set_xlabel("turn of the ReAct trace")
    a.set_ylabel("time to first token (s)")
    if result.get("efficiency"):
        a.set_xticks(range(len(result["efficiency"]["trace"])),
                     [t[0][0] for t in result["efficiency"]["trace"]])
        a.legend()
    a.set_title(f"react_17.3k shape x{result['args']['scale']} ({MODEL_NAMES[result['args']['model']]}, CPU)")
    if not result.get("efficiency"):
        a.set_visible(False)
    if result.get("accuracy"):
        rows = result["accuracy"]["rows"]
        keys = [("plan_pct", "plan skill"), ("act_pct", "act accuracy"), ("reflect_pct", "reflect skill"),
                ("agree_pct", "answer = nonshared")]
        w = 0.8 / len(rows)
        for i, r in enumerate(rows):
            b.bar([k + i * w for k in range(len(keys))], [r[k] for k, _ in keys], w, label=r["variant"])
        b.set_xticks([k + 0.4 - w / 2 for k in range(len(keys))], [n for _, n in keys])
        b.set_ylabel("%")
        b.set_title(f"held-out SQuAD ReAct episodes (n={rows[0]['n']})")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODEL_KEYS[:2], default="smollm2")
    ap.add_argument("--targets", nargs="+", default=["v_proj"], choices=["k_proj", "v_proj"],
                    help="which shipped role adapters (v_proj: PReCache's setting; k_proj v_proj: with key LoRA)")
    ap.add_argument("--scale", type=float, default=None,
                    help="multiplies the trace's long prefills (default: 0.25 for SmolLM2, 1.0 for Qwen)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parts", choices=["both", "efficiency", "accuracy"], default="both")
    ap.add_argument("--items", type=int, default=30, help="held-out QA episodes for accuracy (0: skip)")
    ap.add_argument("--first", type=int, default=0, help="skip this many held-out episodes (shards)")
    ap.add_argument("--observation", type=int, default=1024, help="observation tokens per episode")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--adapters", type=Path, default=None,
                    help="role adapter folder (default: the shipped ones of --model / --targets)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", default=None, help="output name base_lr[_<model>][_kv][_<tag>].json")
    ap.add_argument("--merge", type=Path, nargs="+", help="join the accuracy of these shard JSONs and stop")
    args = ap.parse_args()
    if args.merge:
        return merge(args)
    if args.scale is None:
        args.scale = 0.25 if args.model == "smollm2" else 1.0
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_by_key(args.model)
    pm = react.load_role_adapters(model, args.adapters or react.role_adapters_dir(args.model, args.targets))
    items = squad()
    t0 = time.time()
    eff = acc = None
    if args.parts in ("both", "efficiency"):
        print("efficiency: react_17.3k-shaped trace", flush=True)
        eff = efficiency(pm, tok, items, args)
    if args.parts in ("both", "accuracy") and args.items:
        acc = accuracy(pm, tok, items, args)
    result = dict(args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  command=" ".join(["python"] + sys.argv), model=MODEL_NAMES[args.model],
                  env=dict(torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads(),
                           cpus=os.cpu_count(), device="cpu", dtype=str(model.dtype)),
                  efficiency=eff, accuracy=acc, wall_s=time.time() - t0)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "base_lr" + ("" if args.model == "smollm2" else "_" + args.model) + \
        ("_kv" if "k_proj" in args.targets else "") + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{name}.png")
    print_tables(eff, acc)
    print(f"\nwrote {args.out / name}.json and .png in {time.time() - t0:.0f} s")


def merge(args) -> None:
    """Join the accuracy records of shard JSONs (same model and adapters) into one result."""
    parts = [json.loads(p.read_text()) for p in args.merge]
    results: dict = {}
    for p in parts:
        for name, recs in p["accuracy"]["items"].items():
            results.setdefault(name, []).extend(recs)
    acc = dict(rows=accuracy_rows(results), items=results, observation_tokens=parts[0]["accuracy"]["observation_tokens"],
               shards=[str(p) for p in args.merge])
    eff = next((p["efficiency"] for p in parts if p.get("efficiency")), None)
    result = dict(parts[0], accuracy=acc, efficiency=eff, merged_from=[str(p) for p in args.merge])
    out = args.out / f"{args.tag or 'base_lr_merged'}.json"  # not with_suffix: tags hold dots (qwen2.5)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print_tables(eff, acc)
    print(f"\nwrote {out}")


def print_tables(eff, acc) -> None:
    if eff:
        print()
        print(markdown_table(eff["rows"], [
            ("variant", lambda r: r["variant"]), ("prefilled tokens", lambda r: str(r["prefill_tokens"])),
            ("sum TTFT", lambda r: f"{r['sum_ttft_s']:.2f} s"),
            ("TTFT speed-up", lambda r: f"{r['ttft_speedup']:.2f}x"),
            ("mean per-turn TTFT speed-up", lambda r: f"{r['mean_turn_ttft_speedup']:.2f}x"),
            ("throughput", lambda r: f"{r['throughput_tok_s']:.1f} tok/s ({r['throughput_gain']:.2f}x)"),
            ("rebuild", lambda r: f"{r['rebase_s']:.2f} s"),
            ("K/V", lambda r: f"{r['kv_mb']:.1f} MiB"),
            ("peak turn mem", lambda r: f"{r['peak_turn_mem_mib']:.0f} MiB" if "peak_turn_mem_mib" in r else "-"),
            ("mem ratio", lambda r: f"{r['mem_ratio']:.2f}" if "mem_ratio" in r else "-"),
            ("LR per extra agent",
             lambda r: "-" if r["lr_per_agent_pct"] is None else f"{r['lr_per_agent_pct']:.1f}%"),
        ]))
    if acc:
        ci = lambda r, k: f"{r[k + '_pct']:.1f}% [{r[k + '_ci'][0]:.0f}, {r[k + '_ci'][1]:.0f}]"  # noqa: E731
        print()
        print(markdown_table(acc["rows"], [
            ("variant", lambda r: r["variant"]), ("n", lambda r: str(r["n"])),
            ("plan skill", lambda r: ci(r, "plan")), ("act accuracy", lambda r: ci(r, "act")),
            ("reflect skill", lambda r: ci(r, "reflect")),
            ("act - nonshared (paired)", lambda r: "-" if "act_minus_nonshared_pts" not in r else
             f"{r['act_minus_nonshared_pts']:+.0f} pts [{r['act_minus_nonshared_ci'][0]:+.0f}, "
             f"{r['act_minus_nonshared_ci'][1]:+.0f}]"),
            ("answer = nonshared", lambda r: ci(r, "agree")),
            ("act TTFT", lambda r: f"{r['act_ttft_s'] * 1000:.0f} ms"),
            ("reflect TTFT", lambda r: f"{r['reflect_ttft_s'] * 1000:.0f} ms"),
        ]))
        shared = [r for r in acc["rows"] if "act_kl_median" in r]
        if shared:
            print("\nfirst-token logits against nonshared, per turn (same top-1 % / median KL / median max |diff|)")
            print(markdown_table(shared, [("variant", lambda r: r["variant"])] + [
                (key, lambda r, k=key: f"{r[k + '_top1_same_pct']:.0f}% / {r[k + '_kl_median']:.3g} / "
                                       f"{r[k + '_logit_maxdiff_median']:.2f}")
                for key in ("plan", "read", "act", "reflect")]))


if __name__ == "__main__":
    main()
