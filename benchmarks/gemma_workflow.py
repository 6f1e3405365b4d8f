"""Gemma 3 270M (5 sliding-window layers of window 512 to 1 global layer): ``ReuseSession``'s default against plain
``generate`` on a three-agent workflow, side by side in one run.

The workflow: three agents (summarizer, critic, question writer) over one document of about three windows (SQuAD
passages), two rounds; every prompt is the document, the transcript so far, then the agent's role and cue. Each call
runs plain ``generate`` (a fresh prefill of the whole prompt) and then the session's call on the same prompt, one
after the other, so both are timed under the same load. The first token the caller receives is timed by a streamer
around each call (the session's own lookup and bookkeeping included). The claims checked: every answer equals plain
``generate``'s (tokens, and logits to 1e-3), the median first token comes at least 2x sooner, no call is slower.

Writes ``OUT`` (JSON: config, commit, one row per call, the summary; rewritten after every call) and a plot beside it::

    PYTHONPATH=. python benchmarks/gemma_workflow.py                # 3 documents x 6 calls, 2 threads
    PYTHONPATH=. python benchmarks/gemma_workflow.py --table        # print the table of the JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import git_commit, write_json  # noqa: E402

ROLES = (("summarizer", "Summarize the document in two sentences."),
         ("critic", "Point out what the summary so far misses."),
         ("question writer", "Write one question the document answers."))



def document(tok, tokens: int, start: int) -> str:
    """SQuAD passages from ``start`` on, joined until they make at least ``tokens`` tokens."""
    from hf_kvreuse.workflows.datasets import squad

    items, seen, parts, i = squad(), set(), [], start
    while len(tok(" ".join(parts), add_special_tokens=False).input_ids) < tokens:
        p = items[i % len(items)].passage
        if p not in seen:
            seen.add(p)
            parts.append(p)
        i += 1
    return "\n\n".join(parts)


def _timed(fn, ids, **kw):
    from hf_kvreuse.timing import TokenTimer

    timer = TokenTimer().start()
    out = fn(ids, streamer=timer, **kw)
    return out, timer.ttft_s, timer.total_s


def run_workflow(model, tok, doc: str, rounds: int, max_new_tokens: int, rep: int, rows: list, save) -> None:
    from hf_kvreuse import ReuseSession

    session = ReuseSession(model)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    transcript = ""
    for rnd in range(rounds):
        for a, (role, task) in enumerate(ROLES):
            text = (f"Document:\n{doc}\n\nDiscussion so far:{transcript}\n\n"
                    f"You are the {role}. {task}\n{role.capitalize()}:")
            ids = tok(text, return_tensors="pt").input_ids
            ref, ref_ttft, ref_total = _timed(model.generate, ids, attention_mask=torch.ones_like(ids), **kw)
            out, ttft, total = _timed(session.generate, ids, agent=role, **kw)
            st = session.last_stats
            same = bool(torch.equal(out.sequences, ref.sequences))
            diff = max(float((x - y).abs().max()) for x, y in zip(out.logits, ref.logits)) if same else None
            rows.append(dict(rep=rep, round=rnd, agent=role, prompt_tokens=int(ids.shape[1]),
                             plain_ttft_s=ref_ttft, ttft_s=ttft, ttft_ratio=ttft / ref_ttft,
                             plain_total_s=ref_total, total_s=total, e2e_ratio=total / ref_total,
                             same_tokens=same, max_logit_diff=diff, method=st.method,
                             exact_prefix_tokens=st.exact_prefix_tokens, new_tokens=st.new_tokens,
                             exact_output=bool(st.exact_output), held_mib=st.held_bytes / 2**20))
            save()
            print(f"rep {rep} round {rnd} {role:16s} {ids.shape[1]:5d} tok  plain {ref_ttft:6.3f}s  session "
                  f"{ttft:6.3f}s  ({ttft / ref_ttft:4.2f}x)  {st.method:6s} prefix {st.exact_prefix_tokens:5d}  "
                  f"same={same}", flush=True)
            answer = tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()
            transcript += f"\n{role.capitalize()}: {answer}"


def summary(rows: list[dict]) -> dict:
    r = [x["ttft_ratio"] for x in rows]
    return dict(calls=len(rows), ttft_ratio_median=statistics.median(r), ttft_ratio_max=max(r),
                ttft_speedup_median=1 / statistics.median(r),
                e2e_ratio_median=statistics.median(x["e2e_ratio"] for x in rows),
                same_tokens_share=sum(x["same_tokens"] for x in rows) / len(rows),
                max_logit_diff=max((x["max_logit_diff"] or 0.0) for x in rows),
                first_calls_ttft_ratio_max=max(x["ttft_ratio"] for x in rows if x["round"] == 0
                                               and x["agent"] == ROLES[0][0]),
                methods={m: sum(x["method"] == m for x in rows) for m in sorted({x["method"] for x in rows})})


def table(doc: dict) -> str:
    s = doc["summary"]
    lines = ["| calls | first token / plain (median, worst call) | median speedup | end to end / plain (median) "
             "| answers = plain generate | max logit diff | methods |", "|---|---|---|---|---|---|---|",
             f"| {s['calls']} | {s['ttft_ratio_median']:.2f}x, {s['ttft_ratio_max']:.2f}x | "
             f"{s['ttft_speedup_median']:.1f}x | {s['e2e_ratio_median']:.2f}x | {s['same_tokens_share']:.0%} | "
             f"{s['max_logit_diff']:.1e} | " + ", ".join(f"{m} {n}" for m, n in s["methods"].items()) + " |"]
    lines += ["", "| round | agent | prompt tokens | plain first token | session first token | ratio | method "
              "| reused prefix |", "|---|---|---|---|---|---|---|---|"]
    for x in doc["rows"]:
        if x["rep"] == 0:
            lines.append(f"| {x['round'] + 1} | {x['agent']} | {x['prompt_tokens']} | {x['plain_ttft_s']:.3f} s | "
                         f"{x['ttft_s']:.3f} s | {x['ttft_ratio']:.2f}x | {x['method']} | {x['exact_prefix_tokens']} |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["plain_ttft_s"] for r in rows], 0.4, label="plain generate")
    ax.bar([i + 0.2 for i in x], [r["ttft_s"] for r in rows], 0.4, label="ReuseSession (default)")
    ax.set_xticks(list(x), [f"{r['rep']}.{r['round'] + 1}\n{r['agent'][:6]}" for r in rows], fontsize=6)
    ax.set_ylabel("first token (s)")
    ax.set_title("Gemma 3 270M, 3 agents x 2 rounds, document of ~3 windows", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="documents (a fresh session each)")
    p.add_argument("--windows", type=float, default=3.0, help="document length in sliding windows")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gemma_workflow.json"))
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.table:
        print(table(json.loads(out.read_text())))
        return 0
    from hf_kvreuse.models import load_offline

    torch.set_num_threads(args.threads)
    model, tok = load_offline("gemma3-270m")
    window = int(model.config.sliding_window)
    doc = dict(config=dict(vars(args), model="gemma3-270m", sliding_window=window,
                           torch=torch.__version__, transformers=__import__("transformers").__version__),
               commit=git_commit(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
               command="PYTHONPATH=. python benchmarks/gemma_workflow.py " + " ".join(argv or sys.argv[1:]),
               rows=[], complete=False)

    def save():
        doc["summary"] = summary(doc["rows"])
        write_json(out, doc)

    with torch.inference_mode():
        model.generate(tok("warm up", return_tensors="pt").input_ids, max_new_tokens=2, do_sample=False)
        for rep in range(args.reps):
            text = document(tok, int(args.windows * window), start=40 * rep)
            run_workflow(model, tok, text, args.rounds, args.max_new_tokens, rep, doc["rows"], save)
    doc["complete"] = True
    save()
    plot(doc, out.with_suffix(".png"))
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
