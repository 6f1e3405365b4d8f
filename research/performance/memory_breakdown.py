"""Where the bytes go: peak memory growth of full prefill vs OptimisticCache and the block caches, by phase.

Runs one prompt of about ``--ctx`` tokens on SmolLM2-135M (fp32) and measures, with the one helper every
benchmark uses (:class:`hf_kvreuse.timing.PeakMemory`: resident memory on CPU, ``max_memory_allocated`` on
CUDA, growth above the level right before the call):

* plain ``generate`` (full prefill), the reference;
* ``generate`` with an :class:`OptimisticCache` whose donor is the previous agent's ``generate`` output, with the
  resident level traced over time and cut at the cache's phases: assembly (copy + re-position of the matched
  K/V, prefill of the unmatched rows), the background exact prefill, the swap (+ replay) and the finish;
* the parts on their own: the K/V of the prompt (bytes, computed), assembly alone, the exact prefill alone
  (one forward into a fresh DynamicCache), and a block cache (DirectReuseCache, BlendCache) assembly.

    python research/performance/memory_breakdown.py [--ctx 2048] [--new-tokens 24] [--device cpu] [--parts] [--variants ...]

On glibc the resident figures include what malloc keeps mapped after tensors are freed (fragmentation of its
heaps, one arena per thread); run with ``MALLOC_MMAP_THRESHOLD_=131072`` to see close to the live tensor bytes
(every tensor above 128 KiB is then its own mapping, returned to the OS when freed).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

import hf_kvreuse
from hf_kvreuse import BlendCache, ChunkStore, DirectReuseCache, OptimisticCache
from hf_kvreuse.compat import output_cache
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.kv import dynamic_cache_from_kv, kv_of
from hf_kvreuse.models import load_smollm2
from hf_kvreuse.timing import PeakMemory
from hf_kvreuse.workflows.agents import DEFAULT_AGENTS, agent_prompt
from hf_kvreuse.workflows.datasets import context_for, squad

MiB = 2**20
VARIANTS = {  # OptimisticCache keyword arguments
    "optimistic": {},
    "optimistic_release": dict(release_donor=True),
    "optimistic_chunk512": dict(background_chunk_tokens=512),
    "optimistic_release_chunk512": dict(release_donor=True, background_chunk_tokens=512),
}


class Phases:
    """Time stamps of (phase, start, end), taken by wrapping methods (per class: the thread does not matter)."""

    def __init__(self):
        self.stamps: list[tuple[str, float, float]] = []
        self._undo = []

    def wrap(self, cls, name, label=None):
        orig = getattr(cls, name)

        @functools.wraps(orig)
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.stamps.append((label or name, t0, time.perf_counter()))

        setattr(cls, name, wrapped)
        self._undo.append((cls, name, orig))

    def restore(self):
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)
        self._undo = []


def phase_table(mem: PeakMemory, phases: Phases) -> list[dict]:
    """Per phase: growth at its start and end, and its peak (from the traced timeline)."""
    tl = mem.timeline
    rows = []
    for name, t0, t1 in sorted(phases.stamps, key=lambda s: s[1]):
        inside = [g for t, g in tl if t0 <= t <= t1]
        before = [g for t, g in tl if t <= t0]
        after = [g for t, g in tl if t >= t1]
        end = after[0] if after else (inside[-1] if inside else (before[-1] if before else 0))
        rows.append(dict(phase=name, start_mib=(before[-1] if before else 0) / MiB,
                         peak_mib=max(inside + [end], default=0) / MiB, end_mib=end / MiB,
                         seconds=t1 - t0))
    return rows


def kv_bytes(model, n: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p = next(model.parameters())
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * n * p.element_size()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=2, help="repeat every measurement; the table keeps the largest")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--parts", action="store_true", help="also the exact prefill alone and the assembly alone")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    model, tok = load_smollm2(device=dev)
    model = hf_kvreuse.enable(model)
    items = squad()
    item = items[5]
    doc = context_for(items, item, tok, args.ctx)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    ids_a = agent_prompt(tok, DEFAULT_AGENTS[0], doc, item.question, [], 32).to(dev)
    donor = model.generate(ids_a, return_dict_in_generate=True, **gen)
    answer = tok.decode(donor.sequences[0, ids_a.shape[1]:], skip_special_tokens=True)
    ids = agent_prompt(tok, DEFAULT_AGENTS[1], doc, item.question, [(DEFAULT_AGENTS[0].name, answer)], 32).to(dev)
    n = ids.shape[1]
    kvb = kv_bytes(model, n - 1)
    res = dict(prompt_tokens=n, kv_mib=kvb / MiB, device=str(dev))
    print(f"prompt {n} tokens; the K/V of the prompt: {kvb / MiB:.1f} MiB", flush=True)

    def peak(fn, trace=False):
        best = None
        for _ in range(args.reps):
            with PeakMemory(dev, trace=trace) as mem:
                out = fn()
            del out
            if best is None or mem.peak_bytes > best[0].peak_bytes:
                best = (mem,)
        return best[0]

    # 1. plain generate
    full = peak(lambda: model.generate(ids, **gen))
    res["full_generate_mib"] = full.peak_mib
    print(f"  full prefill generate: {full.peak_mib:.1f} MiB", flush=True)
    # 2. the exact prefill alone: one forward into a fresh DynamicCache (what the background job does)
    if args.parts:
        def prefill_alone():
            job = BackgroundPrefill(model, ids[:, : n - 1], synchronous=True)
            job.start()
            return job._cache
        res["exact_prefill_alone_mib"] = peak(prefill_alone).peak_mib

    # 3. OptimisticCache, traced by phase
    phases = Phases()
    phases.wrap(OptimisticCache, "_assemble", "assemble")
    phases.wrap(BackgroundPrefill, "_prefill", "background prefill")
    phases.wrap(OptimisticCache, "_swap_in", "swap (wait + load)")
    phases.wrap(OptimisticCache, "finish", "finish")
    donor_cache = output_cache(donor)

    def optimistic(donor_cache, **kw):
        phases.stamps.clear()
        cache = OptimisticCache(model, input_ids=ids, donor_cache=donor_cache, donor_ids=donor.sequences,
                                **{"rebase": "commit", **kw})
        out = model.generate(ids, cache=cache, **gen)
        res["optimistic_stats"] = cache.stats.as_dict()
        return out

    try:
        for key in args.variants:
            kw = VARIANTS[key]
            release = kw.get("release_donor", False)
            opt = None
            for _ in range(args.reps):
                # release_donor frees the donor it is given: hand it a private copy, made before measuring
                dc = dynamic_cache_from_kv([(k.clone(), v.clone()) for k, v in kv_of(donor_cache)], model.config) \
                    if release else donor_cache
                with PeakMemory(dev, trace=True) as mem:
                    out = optimistic(dc, **kw)
                del out, dc
                table = phase_table(mem, phases) if dev.type == "cpu" else []
                if opt is None or mem.peak_bytes > opt[0].peak_bytes:
                    opt = (mem, table)
            res[f"{key}_generate_mib"] = opt[0].peak_mib
            print(f"  {key} generate: {opt[0].peak_mib:.1f} MiB", flush=True)
            res[f"{key}_phases"] = opt[1]
    finally:
        phases.restore()

    # 4. assembly alone (no generate, no background job)
    if args.parts:
        def assemble_only():
            cache = OptimisticCache(model, input_ids=ids, donor_cache=donor_cache, donor_ids=donor.sequences,
                                    rebase="commit")
            cache._assemble()
            return cache
        res["optimistic_assemble_alone_mib"] = peak(assemble_only).peak_mib

    # 5. block caches: the prompt cut into 6 blocks, precomputed standalone (not measured)
    store = ChunkStore()
    cut = torch.linspace(0, n - 1, 8).long().tolist()[1:-1]
    spans = [(a, b) for a, b in zip(cut[:-1], cut[1:])]
    for s, e in spans:
        store.get_or_compute(model, ids[0, s:e])
    for name, make in (("direct", lambda: DirectReuseCache(model, ids, spans, store=store)),
                       ("blend-0.15", lambda: BlendCache(model, ids, spans, store=store))):
        res[f"{name}_generate_mib"] = peak(lambda: model.generate(ids, cache=make(), **gen)).peak_mib
        print(f"  {name} generate: {res[f'{name}_generate_mib']:.1f} MiB", flush=True)

    f = res["full_generate_mib"]
    print(f"\nK/V of the prompt (one copy)            {res['kv_mib']:8.1f} MiB")
    print(f"full prefill generate                   {f:8.1f} MiB   1.00x")
    if args.parts:
        print(f"exact prefill alone (background job)    {res['exact_prefill_alone_mib']:8.1f} MiB")
        print(f"OptimisticCache assembly alone          {res['optimistic_assemble_alone_mib']:8.1f} MiB")
    for key in args.variants:
        print(f"{key:39s} {res[key + '_generate_mib']:8.1f} MiB   {res[key + '_generate_mib'] / f:.2f}x")
    for name in ("direct", "blend-0.15"):
        print(f"{name:10s} generate                     {res[name + '_generate_mib']:8.1f} MiB   "
              f"{res[name + '_generate_mib'] / f:.2f}x")
    for key in args.variants:
        if res[f"{key}_phases"]:
            print(f"\n{key} phases (resident growth over the level before generate, MiB):")
            print(f"{'phase':22s} {'start':>8s} {'peak':>8s} {'end':>8s} {'s':>7s}")
            for r in res[f"{key}_phases"]:
                print(f"{r['phase']:22s} {r['start_mib']:8.1f} {r['peak_mib']:8.1f} {r['end_mib']:8.1f} "
                      f"{r['seconds']:7.2f}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
