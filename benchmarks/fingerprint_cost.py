"""Cost of :func:`hf_kvreuse.fingerprint.model_fingerprint` on SmolLM2-135M: the first call (hashes every
parameter's bytes) and a cached call (no parameter written since), plus the old row/column-sum checksum's first
call for comparison when ``--compare-ref`` names a commit. Writes a JSON (config, commit, figures).

    python benchmarks/fingerprint_cost.py --compare-ref 382d810 --out benchmarks/results/fingerprint_cost.json
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
    ap.add_argument("--compare-ref", default="", help="git ref whose hf_kvreuse/fingerprint.py is timed alongside")
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
    old = {}
    if args.compare_ref:  # the fingerprint of another commit (a standalone module), timed on the same model
        import importlib.util
        import tempfile

        src = subprocess.run(["git", "show", f"{args.compare_ref}:hf_kvreuse/fingerprint.py"], capture_output=True,
                             text=True, check=True).stdout
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location("old_fingerprint", f.name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        times = []
        for _ in range(args.repeats):
            mod._DIGESTS.clear()
            t = time.perf_counter()
            mod.model_fingerprint(model)
            times.append(time.perf_counter() - t)
        old = dict(ref=args.compare_ref, first_call_s=min(times), first_call_all_s=times)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = dict(config=dict(model="SmolLM2-135M", dtype=args.dtype, repeats=args.repeats,
                           threads=torch.get_num_threads(), machine=platform.processor() or platform.machine()),
               commit=commit, parameter_bytes=nbytes, first_call_s=min(first), first_call_all_s=first,
               cached_call_s=min(cached), cached_call_all_s=cached,
               hash_rate_gb_s=nbytes / min(first) / 1e9, compared=old)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
