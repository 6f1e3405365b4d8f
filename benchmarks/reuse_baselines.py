"""Block-reuse baselines on a RAG workload: SmolLM2-135M-Instruct, SQuAD passages as precomputed chunks (CPU).

Each question gets a document of about `--contexts` tokens made of SQuAD passages (the answering one in the
middle), grouped into at most 8 chunks. The prompt is: system text, the chunks separated by blank lines,
then the question. Chunks are precomputed once into a ChunkStore, standalone at position 0 (for OffsetCache:
after the system text and the token that precedes the chunk in the prompt, the shared anchor), then every
method assembles the same prompt, side by side with full prefill:

    full prefill | DirectReuseCache | TailRecomputeCache(16) | EPICCache(16) | BlendCache(0.15) | OffsetCache

Reported per context length (medians over questions): TTFT and its speed-up over full prefill (ratios taken
per question), the fraction of prompt tokens recomputed, agreement with full prefill (identical answer, same
first token), task accuracy (gold answer contained in the answer), and the peak memory growth of each
``generate`` beside full prefill's (hf_kvreuse.timing.PeakMemory). Writes JSON and a PNG plot.

    python benchmarks/reuse_baselines.py [--contexts 1024 2048] [--questions 8] [--two-forwards]

``--two-forwards`` adds ``direct-2fwd``, ``tail-16-2fwd`` and ``epic-16-2fwd``: the same caches with
``fuse_first_step=False`` (a forward over the rows to compute, then ``generate``'s one-token step; the default fuses
the two, :mod:`hf_kvreuse.generation.fused`), run right after their fused twin on the same prompt; the JSON's
``fused_over_two_forwards`` holds the median per-question TTFT ratio of each pair.
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

import hf_kvreuse
from hf_kvreuse import BlendCache, ChunkStore, DirectReuseCache, EPICCache, OffsetCache, TailRecomputeCache
from hf_kvreuse.alignment import segment_prompt
from hf_kvreuse.cli import _git_commit
from hf_kvreuse.models import load_smollm2
from hf_kvreuse.timing import PeakMemory, TokenTimer
from hf_kvreuse.workflows.datasets import contains_answer, passages_for, squad

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import markdown_table  # noqa: E402

SYSTEM = "Answer the question using the passages. Reply with a short phrase taken from the passages."
METHODS = {
    "direct": lambda m, ids, blocks, store, sys_ids: DirectReuseCache(m, ids, blocks, store=store),
    "tail-16": lambda m, ids, blocks, store, sys_ids: TailRecomputeCache(m, ids, blocks, store=store),
    "epic-16": lambda m, ids, blocks, store, sys_ids: EPICCache(m, ids, blocks, store=store),
    "blend-0.15": lambda m, ids, blocks, store, sys_ids: BlendCache(m, ids, blocks, store=store),
    "offset": lambda m, ids, blocks, store, sys_ids: OffsetCache(m, ids, blocks, store=store,
                                                                 block_prefix_ids=anchor_prefixes(ids, blocks, sys_ids)),
}
#: the fusing methods with two forwards before the first token (``--two-forwards``)
TWO_FORWARDS = {
    "direct-2fwd": lambda m, ids, blocks, store, sys_ids: DirectReuseCache(m, ids, blocks, store=store,
                                                                           fuse_first_step=False),
    "tail-16-2fwd": lambda m, ids, blocks, store, sys_ids: TailRecomputeCache(m, ids, blocks, store=store,
                                                                              fuse_first_step=False),
    "epic-16-2fwd": lambda m, ids, blocks, store, sys_ids: EPICCache(m, ids, blocks, store=store,
                                                                     fuse_first_step=False),
}


def anchor_prefixes(ids, blocks, sys_ids):
    """Per block: the system text, then the token that precedes the block in the prompt (the shared anchor)."""
    return [torch.cat([sys_ids, ids[0, s - 1: s]]) for s, _ in blocks]


def build_prompt(tok, passages, question, n_chunks=8):
    """Chat prompt ids and the token span of every chunk (cut from the full prompt's tokens)."""
    size = -(-len(passages) // min(n_chunks, len(passages)))
    groups = ["\n\n".join(passages[i:i + size]) for i in range(0, len(passages), size)]
    user = "Passages:\n" + "\n\n".join(groups) + f"\n\nQuestion: {question}"
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                                   add_generation_prompt=True, tokenize=False)
    blocks, start = [], text.index("Passages:\n") + len("Passages:\n")
    for g in groups:
        s = text.index(g, start)
        blocks.append((s, s + len(g)))
        start = s + len(g)
    ids, spans = segment_prompt(tok, text, blocks)
    sys_text = text[: text.index(SYSTEM) + len(SYSTEM)]
    sys_ids = tok(sys_text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return ids, spans, sys_ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=HERE / "results" / "reuse_baselines.json")
    ap.add_argument("--two-forwards", action="store_true",
                    help="also run direct, tail-16 and epic-16 with fuse_first_step=False, each after its fused twin")
    args = ap.parse_args()
    methods = dict(METHODS)
    if args.two_forwards:
        methods = {}
        for name, make in METHODS.items():
            methods[name] = make
            if name + "-2fwd" in TWO_FORWARDS:
                methods[name + "-2fwd"] = TWO_FORWARDS[name + "-2fwd"]
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    model = hf_kvreuse.enable(model)
    items = squad()
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    model.generate(tok("warm up", return_tensors="pt")["input_ids"], max_new_tokens=2)

    rows, all_samples = [], []
    for ctx in args.contexts:
        samples = []
        for q in range(args.questions):
            item = items[(q * 61 + ctx) % len(items)]
            ids, spans, sys_ids = build_prompt(tok, passages_for(items, item, tok, ctx), item.question)
            store = ChunkStore()
            # precompute the documents once (not timed): standalone, and after the system text + anchor token
            for (s, e), prefix in zip(spans, anchor_prefixes(ids, spans, sys_ids)):
                store.get_or_compute(model, ids[0, s:e])
                store.get_or_compute(model, ids[0, s:e], prefix_ids=prefix)
            n = ids.shape[1]
            with PeakMemory(ids.device, interval_s=0.004) as mem:
                timer = TokenTimer().start()
                full = model.generate(ids, streamer=timer, **gen)
            full_text = tok.decode(full[0, n:], skip_special_tokens=True)
            res = dict(question=q, prompt_tokens=n, chunks=len(spans), full_ttft=timer.ttft_s,
                       full_mem_mib=mem.peak_mib,
                       full_correct=contains_answer(full_text, item.answers))
            line = f"ctx {ctx} q {q} N={n} chunks={len(spans)} full {timer.ttft_s:.3f}s {mem.peak_mib:.0f} MiB"
            for name, make in methods.items():
                cache = make(model, ids, spans, store, sys_ids)
                with PeakMemory(ids.device, interval_s=0.004) as mem:
                    t = TokenTimer().start()
                    out = model.generate(ids, cache=cache, streamer=t, **gen)
                text = tok.decode(out[0, n:], skip_special_tokens=True)
                res[name] = dict(ttft=t.ttft_s, recompute_frac=cache.stats.recomputed_tokens / (n - 1),
                                 identical=bool(torch.equal(out, full)), first_token=bool(out[0, n] == full[0, n]),
                                 correct=contains_answer(text, item.answers), store_misses=cache.stats.store_misses,
                                 mem_mib=mem.peak_mib)
                line += f" | {name} {t.ttft_s:.3f}s {mem.peak_mib:.0f} MiB same={res[name]['identical']}"
            print(line, flush=True)
            samples.append(res)
            all_samples.append(dict(res, context_tokens=ctx))
        for name in methods:
            rs = [s[name] for s in samples]
            rows.append(dict(context_tokens=ctx, method=name, n=len(samples),
                             prompt_tokens=statistics.median(s["prompt_tokens"] for s in samples),
                             chunks=statistics.median(s["chunks"] for s in samples),
                             full_ttft_s=statistics.median(s["full_ttft"] for s in samples),
                             ttft_s=statistics.median(r["ttft"] for r in rs),
                             ttft_speedup=statistics.median(s["full_ttft"] / s[name]["ttft"] for s in samples),
                             recompute_frac=statistics.median(r["recompute_frac"] for r in rs),
                             identical_rate=sum(r["identical"] for r in rs) / len(rs),
                             first_token_agreement=sum(r["first_token"] for r in rs) / len(rs),
                             accuracy=sum(r["correct"] for r in rs) / len(rs),
                             full_accuracy=sum(s["full_correct"] for s in samples) / len(samples),
                             store_misses=sum(r["store_misses"] for r in rs),
                             full_mem_mib=statistics.median(s["full_mem_mib"] for s in samples),
                             mem_mib=statistics.median(r["mem_mib"] for r in rs),
                             mem_ratio=statistics.median(s[name]["mem_mib"] / max(s["full_mem_mib"], 1e-9)
                                                         for s in samples)))
    meta = dict(command=" ".join(["python"] + sys.argv), date=time.strftime("%Y-%m-%d %H:%M"),
                torch=torch.__version__, transformers=transformers.__version__, threads=args.threads,
                max_new_tokens=args.max_new_tokens, git_commit=_git_commit())
    result = dict(meta=meta, rows=rows, samples=all_samples)  # every context length (with its context_tokens)
    if args.two_forwards:  # per (context, method): median over questions of fused TTFT / two-forward TTFT
        result["fused_over_two_forwards"] = {
            f"{ctx}/{name}": statistics.median(s[name]["ttft"] / s[name + "-2fwd"]["ttft"]
                                               for s in all_samples if s["context_tokens"] == ctx)
            for ctx in args.contexts for name in METHODS if name + "-2fwd" in TWO_FORWARDS}
        for k, v in result["fused_over_two_forwards"].items():
            print(f"fused / two forwards, median TTFT per question, {k}: {v:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    columns = [("ctx", lambda r: str(r["context_tokens"])), ("method", lambda r: r["method"]),
               ("prompt", lambda r: f"{r['prompt_tokens']:.0f}"), ("chunks", lambda r: f"{r['chunks']:.0f}"),
               ("TTFT full", lambda r: f"{r['full_ttft_s']:.3f} s"), ("TTFT", lambda r: f"{r['ttft_s']:.3f} s"),
               ("speed-up", lambda r: f"{r['ttft_speedup']:.1f}x"),
               ("recomputed", lambda r: f"{r['recompute_frac']:.0%}"),
               ("same answer", lambda r: f"{r['identical_rate']:.0%}"),
               ("same 1st token", lambda r: f"{r['first_token_agreement']:.0%}"),
               # no accuracy column: SmolLM2 cannot do the task (the JSON keeps it); accuracy: hf-kvreuse bench
               ("mem full", lambda r: f"{r['full_mem_mib']:.0f} MiB" if "full_mem_mib" in r else "-"),
               ("mem", lambda r: f"{r['mem_mib']:.0f} MiB" if "mem_mib" in r else "-"),
               ("mem ratio", lambda r: f"{r['mem_ratio']:.2f}" if "mem_ratio" in r else "-")]
    print("\n" + markdown_table(rows, columns))
    plot(rows, args.out.with_suffix(".png"), list(methods))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(rows, path, names):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({r["context_tokens"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(ctxs)
    for i, c in enumerate(ctxs):
        rr = {r["method"]: r for r in rows if r["context_tokens"] == c}
        x = [j + i * width for j in range(len(names))]
        axes[0].bar(x, [rr[n]["ttft_speedup"] for n in names], width, label=f"{c} tokens")
        axes[1].bar(x, [rr[n]["identical_rate"] for n in names], width, label=f"{c} tokens")
    for ax, title in zip(axes, ["TTFT speed-up over full prefill (median)", "answer identical to full prefill"]):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=20)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].axhline(2.5, color="red", ls="--", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
