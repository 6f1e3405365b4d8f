"""TTFT of LatentRemedy beside direct reuse at growing block sizes, side by side in one run (issue 25, item 5).

A conflicting-task prompt ``[own prefix][shared block of ~N tokens][question]`` whose block K/V another agent
computed under its prefix (in the chunk store beforehand, as in the harness). Methods, timed interleaved (the
order rotates every repetition, so load changes hit all of them alike):

* ``direct``: DirectReuseCache, the agent's prefix computed (the harness's direct reuse);
* ``direct_pc``: DirectReuseCache with the agent's prefix as a leading block from the store too (its own,
  standalone at position 0: exact), so only the question is computed;
* ``tail16``: TailRecomputeCache (prefix computed);
* ``latent``: LatentRemedyCache, prefix computed (a prefix pass, then latents + question);
* ``latent_pc``: LatentRemedyCache with the prefix as a leading block; its read-out for the bridge is kept with
  the chunk after the first call, so a call runs one pass over latents + question;
* ``latent_tail16``: LatentRemedyCache plus Tail-16, prefix computed (the shipped checkpoint's default set-up
  in the harness);
* ``latent_tail16_pc``: the same with the prefix as a leading block (one pass over latents + 16 block rows +
  question);
* ``focus16`` / ``focus16_pc``: FocusRecomputeCache (16 block rows: those mentioning what the two prefixes disagree
  on, then the tail), prefix computed / as a leading block;
* ``latent_focus16_pc``: LatentRemedyCache with ``focus=`` (latents + those 16 rows), prefix as a leading block.

Reported per size: median TTFT (streamer, first token) of each method and its median ratio to ``direct`` and to
``direct_pc`` over the repetitions, and the latents' absolute cost ``latent_pc - direct_pc`` (flat in N if the
latents do not depend on the block).

    python benchmarks/latent_ttft.py --model qwen2.5-0.5b --sizes 1024 4096 8192 --reps 7 --threads 1

``--two-forwards`` adds ``direct_pc-2fwd`` and ``latent_pc-2fwd``: the same caches with ``fuse_first_step=False``
(their rows in a forward of their own, then ``generate``'s one-token step), in the same rotation, so that what the
fused first step saves each method is measured side by side (``fused_over_two_forwards`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_kvreuse import (ChunkStore, DirectReuseCache, FocusRecomputeCache, LatentBridge, LatentRemedyCache,
                        TailRecomputeCache, enable)
from hf_kvreuse.models import load_offline
from hf_kvreuse.timing import TokenTimer
from hf_kvreuse.workflows.conflicting import _WORDS, QUESTION, ConflictRecord, prompt_parts

HERE = Path(__file__).resolve().parent
METHODS = ("direct", "direct_pc", "tail16", "latent", "latent_pc", "latent_tail16", "latent_tail16_pc", "focus16",
           "focus16_pc", "latent_focus16_pc")
#: ``--two-forwards``: the fused methods above with fuse_first_step=False
TWO_FORWARDS = ("direct_pc-2fwd", "latent_pc-2fwd")


def long_record(tok, n_tokens: int, seed: int = 0) -> ConflictRecord:
    """A registry of ~``n_tokens`` tokens; the two agents ask for two different entries."""
    rng = random.Random(seed)
    lines, keys = [], []
    while True:
        key = f"{rng.choice(_WORDS)}-{len(keys)}"
        keys.append(key)
        lines.append(f"{key}: {rng.randint(100, 999)}")
        if len(lines) % 20 == 0 and len(tok("Registry:\n" + "\n".join(lines))["input_ids"]) >= n_tokens:
            break
    a, b = keys[len(keys) // 3], keys[2 * len(keys) // 3]
    vals = {k: v.split(": ")[1] for k, v in zip(keys, lines)}
    tmpl = "You are in charge of the entry '{}'. Report the number stored for your entry."
    return ConflictRecord("registry", tmpl.format(a), tmpl.format(b), "Registry:\n" + "\n".join(lines), QUESTION,
                          vals[a], vals[b])


def ttft(model, ids: torch.Tensor, cache) -> tuple[float, float]:
    """Wall TTFT (streamer) and this process's CPU seconds for the call (one new token: prefill + first token;
    on a shared machine the CPU time is the steadier of the two)."""
    timer = TokenTimer().start()
    c0 = time.process_time()
    model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False, streamer=timer)
    return timer.ttft_s, time.process_time() - c0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--bridge", default=None, help="LatentBridge folder (default: the shipped checkpoint)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(HERE / "results" / "latent_ttft_qwen2.5-0.5b.json"))
    p.add_argument("--two-forwards", action="store_true",
                   help="also time direct_pc and latent_pc with fuse_first_step=False (-2fwd)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="the methods to time (direct and direct_pc always are: the ratios' references)")
    a = p.parse_args(argv)
    methods = tuple(dict.fromkeys(["direct", "direct_pc", *a.methods])) + (TWO_FORWARDS if a.two_forwards else ())
    torch.set_num_threads(a.threads)
    from hf_kvreuse.cli import _git_commit

    model, tok = load_offline(a.model, dtype=getattr(torch, a.dtype))
    enable(model)
    bridge = LatentBridge.from_pretrained(model, a.bridge)
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    res["meta"] = {"command": "python benchmarks/latent_ttft.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   "args": vars(a), "bridge": {"n_latent": bridge.n_latent, "layers": list(bridge.layers),
                                               "read": bridge.read, **bridge.info},
                   "date": time.strftime("%F %T"), "git_commit": _git_commit()}
    res.setdefault("sizes", {})
    for n in a.sizes:
        if str(n) in res["sizes"]:
            continue  # resumable: a finished size is kept
        rec = long_record(tok, n)
        donor, (ds, de) = prompt_parts(tok, rec, "a")
        ids_l, (s, e) = prompt_parts(tok, rec, "b")
        ids = torch.tensor([ids_l])
        dprefix = torch.tensor(donor[:ds])
        store = ChunkStore(max_bytes=8 << 30)
        t0 = time.perf_counter()
        store.get_or_compute(model, ids[0, s:e], dprefix)   # the donor's block K/V (the other agent's prefill)
        store.get_or_compute(model, ids[0, :s], None)        # the agent's own prefix, standalone at 0: exact
        prep_s = time.perf_counter() - t0
        lead = dict(store=store, block_prefix_ids=[None, dprefix])
        harness = dict(store=store, block_prefix_ids=dprefix)
        make = {
            "direct": lambda: DirectReuseCache(model, ids, [(s, e)], **harness),
            "direct_pc": lambda: DirectReuseCache(model, ids, [(0, s), (s, e)], **lead),
            "tail16": lambda: TailRecomputeCache(model, ids, [(s, e)], **harness),
            "latent": lambda: LatentRemedyCache(model, ids, [(s, e)], bridge=bridge, tail_tokens=0, **harness),
            "latent_pc": lambda: LatentRemedyCache(model, ids, [(0, s), (s, e)], bridge=bridge, tail_tokens=0,
                                                   **lead),
            "latent_tail16": lambda: LatentRemedyCache(model, ids, [(s, e)], bridge=bridge, tail_tokens=16,
                                                       **harness),
            "latent_tail16_pc": lambda: LatentRemedyCache(model, ids, [(0, s), (s, e)], bridge=bridge,
                                                          tail_tokens=16, **lead),
            "focus16": lambda: FocusRecomputeCache(model, ids, [(s, e)], tok, **harness),
            "focus16_pc": lambda: FocusRecomputeCache(model, ids, [(0, s), (s, e)], tok, **lead),
            "latent_focus16_pc": lambda: LatentRemedyCache(model, ids, [(0, s), (s, e)], bridge=bridge, tail_tokens=16,
                                                           focus=tok, **lead),
            "direct_pc-2fwd": lambda: DirectReuseCache(model, ids, [(0, s), (s, e)], **lead, fuse_first_step=False),
            "latent_pc-2fwd": lambda: LatentRemedyCache(model, ids, [(0, s), (s, e)], bridge=bridge, tail_tokens=0,
                                                        **lead, fuse_first_step=False),
        }
        for m in methods:  # warm-up (and the first latent_pc call stores the prefix read-out with its chunk)
            ttft(model, ids, make[m]())
        times = {m: [] for m in methods}
        cpu = {m: [] for m in methods}
        bridge_s = {}
        for r in range(a.reps):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                cache = make[m]()
                wall, c = ttft(model, ids, cache)
                times[m].append(wall)
                cpu[m].append(c)
                if m.startswith("latent"):  # the pass over the latents (fused: the whole first forward)
                    bridge_s.setdefault(m, []).append(cache.stats.bridge_s)
        row = {"block_tokens": e - s, "prompt_tokens": ids.shape[1], "prefix_tokens": s, "prep_s": prep_s,
               "ttft_s": {m: statistics.median(v) for m, v in times.items()}, "raw_s": times,
               "ratio_to_direct": {m: statistics.median(x / y for x, y in zip(times[m], times["direct"]))
                                   for m in methods},
               "ratio_to_direct_pc": {m: statistics.median(x / y for x, y in zip(times[m], times["direct_pc"]))
                                      for m in methods},
               "bridge_s": {m: statistics.median(v) for m, v in bridge_s.items()},
               "latent_cost_s": (statistics.median(x - y for x, y in zip(times["latent_pc"], times["direct_pc"]))
                                 if "latent_pc" in times else None),
               "cpu_s": {m: statistics.median(v) for m, v in cpu.items()}, "raw_cpu_s": cpu,
               "cpu_ratio_to_direct": {m: statistics.median(x / y for x, y in zip(cpu[m], cpu["direct"]))
                                       for m in methods},
               "cpu_ratio_to_direct_pc": {m: statistics.median(x / y for x, y in zip(cpu[m], cpu["direct_pc"]))
                                          for m in methods}}
        if a.two_forwards:  # median per repetition of fused TTFT / two-forward TTFT
            row["fused_over_two_forwards"] = {
                m: statistics.median(x / y for x, y in zip(times[m], times[m + "-2fwd"])) for m in ("direct_pc",
                                                                                                   "latent_pc")}
        res["sizes"][str(n)] = row
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        print(n, json.dumps({k: row[k] for k in ("block_tokens", "ttft_s", "ratio_to_direct", "ratio_to_direct_pc",
                                                 "latent_cost_s", "fused_over_two_forwards") if k in row}), flush=True)
        del store


def markdown(path: str) -> str:
    """README table: ``python benchmarks/latent_ttft.py --table results.json`` (methods a run did not time: -)."""
    d = json.load(open(path))
    timed = {m for r in d["sizes"].values() for m in r["ttft_s"]}
    methods = [m for m in METHODS if m in timed]  # the methods this run timed
    ratios = [(m, b) for m, b in (("latent", "direct"), ("latent_pc", "direct"), ("latent_pc", "direct_pc"),
                                  ("latent_tail16", "direct"), ("latent_tail16_pc", "direct"),
                                  ("latent_tail16_pc", "direct_pc"), ("focus16", "direct"),
                                  ("focus16_pc", "direct_pc"), ("latent_focus16_pc", "direct_pc")) if m in timed]
    head = ("| block tokens | clock | " + " | ".join(methods) + " | "
            + " | ".join(f"{m} / {b}" for m, b in ratios) + " |")
    lines = [head, "|" + "---|" * (len(methods) + len(ratios) + 2)]
    for n, r in sorted(d["sizes"].items(), key=lambda x: int(x[0])):
        for clock, key, rk in (("wall", "ttft_s", ""), ("CPU", "cpu_s", "cpu_")):
            cells = [f"{1000 * r[key][m]:.0f} ms" if m in r[key] else "-" for m in methods]
            cells += [f"{r[rk + 'ratio_to_' + b][m]:.2f}x" if m in r[rk + "ratio_to_" + b] else "-" for m, b in ratios]
            lines.append(f"| {r['block_tokens']} | {clock} | " + " | ".join(cells) + " |")
    for n, r in sorted(d["sizes"].items(), key=lambda x: int(x[0])):
        if "fused_over_two_forwards" in r:
            lines.append(f"\n{r['block_tokens']} block tokens, fused / two forwards (median per repetition): "
                         + ", ".join(f"{m} {v:.2f}x" for m, v in r["fused_over_two_forwards"].items())
                         + "; the latents' pass (stats.bridge_s, median): "
                         + ", ".join(f"{m} {1000 * v:.0f} ms" for m, v in r.get("bridge_s", {}).items()))
    return "\n".join(lines)

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(markdown(sys.argv[2]))
    else:
        main()
