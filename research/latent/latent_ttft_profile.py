"""What in FocusRecomputeCache's and Tail-k's first token grows with the reused block, against direct reuse.

The conflicting-task prompt of ``benchmarks/latent_ttft.py`` (``[own prefix][registry block of ~N tokens]
[question]``, the block's K/V computed after the other agent's prefix) at each block size. For ``direct``,
``tail16`` and ``focus16`` (own prefix computed, as the harness runs them): the rows each one computes in its first
forward (``stats.recomputed_tokens`` plus the last prompt token), the median first-token time over ``--reps``
interleaved repetitions, and profiled calls (``--reps`` per method, interleaved, median) split into the time of
the model's linear layers, of attention (``scaled_dot_product_attention``) and of everything else (``cProfile``
own times; the profiler's overhead sits in "other").

The cost model it checks: every method runs the same fused forward over its computed rows ``q`` against all
``N`` keys, so both the linear layers (``~ q``) and attention (``~ q * N``) scale with ``q``, and the ratio of
two methods tends to ``q_method / q_direct`` as the block grows (the per-call costs that do not depend on ``q``,
block lookup and re-positioning, weigh less at larger ``N``). With ``k`` recomputed rows on top of a question and
own prefix of ``q`` rows, the ratio to direct reuse tends to ``(q + k) / q`` from below: it cannot fall with the
block. ``--focus-k 4 8`` adds FocusRecompute with fewer rows; ``--bridges NAME=PATH`` adds LatentRemedyCache with those bridges (their own rows: focus rows for a
bridge trained with them), timed beside the others. JSON per size under ``--out`` (rewritten after each)::

    python research/latent/latent_ttft_profile.py --sizes 1024 4096 8192 16384 --reps 3 --threads 1
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
METHODS = ("direct", "tail16", "focus16")


def split(profile: cProfile.Profile) -> dict:
    """Own seconds of the linear layers, of attention and the rest of one profiled call."""
    st = pstats.Stats(profile)
    lin = att = total = 0.0
    for (file, _, name), (_, _, tt, _, _) in st.stats.items():
        total += tt
        if name == "<built-in method torch._C._nn.linear>":
            lin += tt
        elif name == "<built-in method torch._C._nn.scaled_dot_product_attention>":
            att += tt
    return {"linear_s": lin, "attention_s": att, "other_s": total - lin - att}


def main(argv=None) -> None:
    from latent_ttft import long_record, ttft

    from hf_kvreuse import (ChunkStore, DirectReuseCache, FocusRecomputeCache, LatentBridge, LatentRemedyCache,
                            TailRecomputeCache, enable)
    from hf_kvreuse.models import load_offline
    from hf_kvreuse.workflows.conflicting import prompt_parts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--focus-k", type=int, nargs="*", default=[],
                   help="FocusRecompute with these row counts too (focusK), timed beside focus16")
    p.add_argument("--bridges", nargs="*", default=[], help="NAME=PATH: LatentRemedy bridges timed beside them")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "latent_ttft_profile_qwen2.5-0.5b.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_offline(a.model, dtype=torch.float32)
    enable(model)
    from common import git_commit

    bridges = {k: LatentBridge.load(v, model) for k, v in (x.split("=", 1) for x in a.bridges)}
    methods = METHODS + tuple(f"focus{k}" for k in a.focus_k if k != 16) + tuple(bridges)

    commit = git_commit(ROOT)
    res = {"command": "python research/latent/latent_ttft_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "args": vars(a), "git_commit": commit, "date": time.strftime("%F %T"), "sizes": {}}
    for n in a.sizes:
        rec = long_record(tok, n)
        donor, (ds, _) = prompt_parts(tok, rec, "a")
        ids_l, (s, e) = prompt_parts(tok, rec, "b")
        ids = torch.tensor([ids_l])
        store = ChunkStore(max_bytes=8 << 30)
        store.get_or_compute(model, ids[0, s:e], torch.tensor(donor[:ds]))  # the other agent's block K/V
        kw = dict(store=store, block_prefix_ids=torch.tensor(donor[:ds]))
        make = {"direct": lambda: DirectReuseCache(model, ids, [(s, e)], **kw),
                "tail16": lambda: TailRecomputeCache(model, ids, [(s, e)], **kw),
                "focus16": lambda: FocusRecomputeCache(model, ids, [(s, e)], tok, **kw),
                **{f"focus{k}": (lambda k=k: FocusRecomputeCache(model, ids, [(s, e)], tok, recompute_tokens=k, **kw))
                   for k in a.focus_k if k != 16},
                **{k: (lambda b=b: LatentRemedyCache(model, ids, [(s, e)], bridge=b,
                                                     focus=tok if b.rows == "focus" else None, **kw))
                   for k, b in bridges.items()}}
        rows = {}
        for m in methods:  # warm-up; the rows each computes in its first forward
            c = make[m]()
            ttft(model, ids, c)
            rows[m] = int(c.stats.recomputed_tokens) + 1
        k = len(methods)
        times = {m: [] for m in methods}
        for r in range(a.reps):
            for m in methods[r % k:] + methods[: r % k]:
                times[m].append(ttft(model, ids, make[m]())[0])
        parts = {m: [] for m in methods}  # one profiled call per method and repetition, interleaved
        for r in range(a.reps):
            for m in methods[r % k:] + methods[: r % k]:
                pr = cProfile.Profile()
                pr.enable()
                ttft(model, ids, make[m]())
                pr.disable()
                parts[m].append(split(pr))
        prof = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in parts.items()}
        row = {"block_tokens": e - s, "prompt_tokens": ids.shape[1], "rows": rows,
               "ttft_s": {m: statistics.median(v) for m, v in times.items()}, "raw_s": times,
               "ratio_to_direct": {m: statistics.median(x / y for x, y in zip(times[m], times["direct"]))
                                   for m in methods},
               "rows_ratio_to_direct": {m: rows[m] / rows["direct"] for m in methods},
               "profile_s": prof,
               "profile_ratio_to_direct": {m: {k: prof[m][k] / max(prof["direct"][k], 1e-9) for k in prof[m]}
                                           for m in methods}}
        res["sizes"][str(n)] = row
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(n, json.dumps({k: row[k] for k in ("block_tokens", "rows", "ttft_s", "ratio_to_direct",
                                                 "profile_ratio_to_direct")}), flush=True)


def table(doc: dict) -> str:
    """Markdown rows of a profile JSON: rows computed, TTFT ratio to direct reuse, and the profiled split."""
    lines = ["| block tokens | rows direct / tail16 / focus16 | rows ratio (focus16) | TTFT direct | TTFT tail16 / direct "
             "| TTFT focus16 / direct | focus16 / direct: linear layers | attention | other |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, r in sorted(doc["sizes"].items(), key=lambda x: int(x[0])):
        rows, rt, pr = r["rows"], r["ratio_to_direct"], r["profile_ratio_to_direct"]["focus16"]
        lines.append(f"| {r['block_tokens']} | {rows['direct']} / {rows['tail16']} / {rows['focus16']} | "
                     f"{r['rows_ratio_to_direct']['focus16']:.2f}x | {1000 * r['ttft_s']['direct']:.0f} ms | "
                     f"{rt['tail16']:.2f}x | {rt['focus16']:.2f}x | {pr['linear_s']:.2f}x | {pr['attention_s']:.2f}x | "
                     f"{pr['other_s']:.2f}x |")
    extra = [m for m in next(iter(doc["sizes"].values()))["ttft_s"] if m not in METHODS]
    if extra:  # LatentRemedy bridges timed beside them
        lines += ["", "| block tokens | " + " | ".join(f"TTFT {m} / direct | {m} / focus16" for m in extra) + " |",
                  "|---|" + "---|---|" * len(extra)]
        for _, r in sorted(doc["sizes"].items(), key=lambda x: int(x[0])):
            rt = r["ratio_to_direct"]
            lines.append(f"| {r['block_tokens']} | " + " | ".join(
                f"{rt[m]:.2f}x | {statistics.median(x / y for x, y in zip(r['raw_s'][m], r['raw_s']['focus16'])):.2f}x"
                for m in extra) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    from common import run_or_table

    run_or_table(main, table)
