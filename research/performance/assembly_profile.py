"""Issue 23 diagnosis: where a round-1-like ``OptimisticCache`` call spends its time to the first token.

    python research/performance/assembly_profile.py --out benchmarks/results/assembly_profile.json

Qwen2.5-Coder-0.5B-Instruct (float32, one thread): a donor cache over a 1,090-token prompt plus its 40-token reply; a
target that shares the 1,090-token prefix, adds 15 new tokens, repeats the donor's reply at another position and
ends with 10 new tokens (the shape of a round-1 call in the 3 x 3 workflow: a long exact prefix, a reused reply, a
few unmatched rows). Reports, medians of ``--reps``, for RebaseKV's two forwards (``fuse_first_step=False``: the
unmatched rows' forward in the assembly, then a one-token decode step) and the fused first step (the default: one
partial forward over the unmatched rows and the last prompt token), alternating call by call: the assembly
(``stats.assemble_s``), the time spent in ``partial_forward``, TTFT; and plain forwards of 1, 25 and 66 new rows over
the 1,090-row prefix (a decode step, the unmatched rows alone, what ``prefix`` computes in such a call).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/assembly_profile.json")
    p.add_argument("--model", choices=("qwen2.5-0.5b", "tiny"), default="qwen2.5-0.5b",
                   help="tiny: a random-init Qwen2 of hf_kvreuse.models (the script's test)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import hf_kvreuse.cache_classes.optimistic as optimistic
    import hf_kvreuse.generation.fused as fused
    from hf_kvreuse import OptimisticCache
    from hf_kvreuse.cli import _git_commit
    from hf_kvreuse.compat import cache_kwargs, output_cache
    from hf_kvreuse.models import load_qwen, tiny_model

    model = load_qwen("0.5b", dtype=torch.float32)[0] if a.model == "qwen2.5-0.5b" else tiny_model("qwen2")
    hi = min(20000, model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, hi, (1, 1090), generator=g)
    donor_ids = torch.cat([base, torch.randint(3, hi, (1, 40), generator=g)], 1)
    target = torch.cat([base, torch.randint(3, hi, (1, 15), generator=g), donor_ids[:, 1090:],
                        torch.randint(3, hi, (1, 10), generator=g)], 1)
    with torch.no_grad():
        donor = output_cache(model(donor_ids, use_cache=True))
        prefix_cache = output_cache(model(base, use_cache=True))
    spent = []
    original = optimistic.partial_forward
    assert fused.partial_forward is original  # the two-forward path's and the fused path's forward, timed alike

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = original(*args, **kwargs)
        spent.append(time.perf_counter() - t)
        return out

    optimistic.partial_forward = fused.partial_forward = timed
    modes = {"two_forwards": False, "fused": True}
    calls = {m: [] for m in modes}
    try:
        for _ in range(a.reps):
            for mode, fuse in modes.items():  # alternating: drift of the machine hits both alike
                cache = OptimisticCache(model, target, copy.deepcopy(donor), donor_ids, rebase="commit",
                                        max_optimistic_tokens=1, fuse_first_step=fuse)
                spent.clear()
                model.generate(target, cache=cache, max_new_tokens=1, do_sample=False)
                s = cache.stats
                assert s.fused_first_step == fuse
                calls[mode].append(dict(assemble_s=s.assemble_s, partial_forward_s=sum(spent), ttft_s=s.ttft_s,
                                        new_tokens=s.new_tokens, prefix_tokens=s.prefix_tokens,
                                        reused_tokens=s.reused_tokens))
    finally:
        optimistic.partial_forward = fused.partial_forward = original
    forwards = {}
    with torch.no_grad():
        for n in (1, 25, 66):
            ts = []
            for _ in range(a.reps):
                c = copy.deepcopy(prefix_cache)
                t = time.perf_counter()
                model(target[:, 1090:1090 + n], use_cache=True, **cache_kwargs(c))
                ts.append(time.perf_counter() - t)
            forwards[str(n)] = statistics.median(ts)
    keys = ("assemble_s", "partial_forward_s", "ttft_s")
    med = {m: {k: statistics.median(c[k] for c in cs) for k in keys} for m, cs in calls.items()}
    med["fused_over_two_forwards_ttft"] = med["fused"]["ttft_s"] / med["two_forwards"]["ttft_s"]
    result = dict(config=dict(command="research/performance/assembly_profile.py", reps=a.reps, threads=a.threads,
                              model=a.model, dtype="float32", prefix_tokens=1090),
                  calls=calls, median=med, forward_over_prefix_s=forwards)
    result["config"]["git_commit"] = _git_commit()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for mode in modes:
        m = med[mode]
        print(f"{mode}: optimistic call ({calls[mode][0]['new_tokens']} new rows): TTFT {m['ttft_s']:.3f} s, assembly "
              f"{m['assemble_s']:.3f} s, partial forward {m['partial_forward_s']:.3f} s")
    print(f"fused / two forwards, median TTFT: {med['fused_over_two_forwards_ttft']:.2f}")
    print("plain forward over the 1,090-row prefix: " + ", ".join(f"{n} rows {t:.3f} s" for n, t in forwards.items()))


if __name__ == "__main__":
    main()
