"""Does the session's first call on a model do more work than plain ``generate``? The operators both run.

A session's first call has nothing held to reuse: it runs plain prefill (``method="full"``) and keeps the cache.
Its first token was timed at 1.02-1.06x plain ``generate``'s on Gemma 3 270M (single calls), which a probe or an
extra pass would explain. This script runs one first-token call of each (after a warm-up of each) under
``torch.profiler`` and lists, per operator, the calls and CPU time of both: an extra pass shows as extra matmul or
attention calls, a copy as extra ``copy_`` / ``cat`` calls. JSON with config, commit and every operator whose count
or time differs::

    python research/performance/first_call_ops.py --model gemma3-270m --tokens 1536
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # common: the results scripts' shared helpers


def main(argv=None) -> None:
    from torch.profiler import ProfilerActivity, profile

    from gemma_workflow import document

    from hf_kvreuse import ReuseSession
    from hf_kvreuse.models import load_offline
    from hf_kvreuse.timing import TokenTimer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tokens", type=int, default=1536, help="document tokens (SQuAD passages)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=9, help="interleaved timed first calls of each (no profiler)")
    p.add_argument("--gc", action="store_true", help="gc.collect() before every timed call (the sessions of "
                   "earlier calls are freed before the next one starts)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "first_call_ops.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_offline(a.model, dtype=torch.float32)
    doc = document(tok, a.tokens, 0)
    ids = tok(f"Document:\n{doc}\n\nYou are the summarizer. Summarize the document.\nSummarizer:",
              return_tensors="pt").input_ids

    def first(fn):
        if a.gc:
            gc.collect()
        timer = TokenTimer().start()
        fn(ids, streamer=timer, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        return timer.ttft_s

    first(model.generate)
    first(ReuseSession(model).generate)
    timed = {"plain": [], "session": []}  # a fresh session per call: every call is a first call
    for r in range(a.reps):
        for name in (("plain", "session") if r % 2 == 0 else ("session", "plain")):
            timed[name].append(first(model.generate if name == "plain" else ReuseSession(model).generate))
    ratios = [y / x for x, y in zip(timed["plain"], timed["session"])]
    ops, ttft = {}, {}
    for name in ("plain", "session"):
        fn = model.generate if name == "plain" else ReuseSession(model).generate
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ttft[name] = first(fn)
        ops[name] = {e.key: {"count": e.count, "cpu_ms": e.cpu_time_total / 1e3} for e in prof.key_averages()}
    diff = {}
    for k in sorted(set(ops["plain"]) | set(ops["session"])):
        x = ops["plain"].get(k, {"count": 0, "cpu_ms": 0.0})
        y = ops["session"].get(k, {"count": 0, "cpu_ms": 0.0})
        if x["count"] != y["count"] or abs(x["cpu_ms"] - y["cpu_ms"]) > 5:
            diff[k] = {"plain": x, "session": y}
    from common import git_commit

    commit = git_commit(ROOT)
    res = {"command": "python research/performance/first_call_ops.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "args": vars(a), "git_commit": commit, "date": time.strftime("%F %T"), "prompt_tokens": int(ids.shape[1]),
           "ttft_s": timed, "ttft_ratio_median": statistics.median(ratios) if ratios else None,
           "ttft_ratio_max": max(ratios) if ratios else None, "ttft_ratios": ratios,
           "profiled_ttft_s": ttft, "differing_ops": diff,
           "heavy_ops_equal": all(ops["plain"].get(k, {}).get("count") == ops["session"].get(k, {}).get("count")
                                  for k in ("aten::mm", "aten::linear", "aten::scaled_dot_product_attention"))}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(table(res))


def table(doc: dict) -> str:
    """Markdown rows: the operators whose count or CPU time differ between the two first calls."""
    timing = (f"; timed without the profiler ({len(doc['ttft_ratios'])} interleaved pairs, {doc['args']['threads']} "
              f"thread(s)): session / plain median {doc['ttft_ratio_median']:.3f}x, max {doc['ttft_ratio_max']:.3f}x"
              if doc.get("ttft_ratios") else "")
    lines = [f"{doc['prompt_tokens']}-token prompt, {doc['args']['model']}{timing}; first token under the profiler: plain "
             f"{doc['profiled_ttft_s']['plain']:.2f} s, session {doc['profiled_ttft_s']['session']:.2f} s; "
             f"matmul / linear / attention calls equal: {'yes' if doc['heavy_ops_equal'] else 'NO'}", "",
             "| operator | plain: calls | plain: CPU ms | session: calls | session: CPU ms |", "|---|---|---|---|---|"]
    rows = sorted(doc["differing_ops"].items(), key=lambda kv: -max(kv[1]["plain"]["cpu_ms"], kv[1]["session"]["cpu_ms"]))
    for k, v in rows[:20]:
        lines.append(f"| `{k}` | {v['plain']['count']} | {v['plain']['cpu_ms']:.1f} | {v['session']['count']} | "
                     f"{v['session']['cpu_ms']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    from common import run_or_table

    run_or_table(main, table)
