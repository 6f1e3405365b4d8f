"""Cost of the model identity (:mod:`hf_kvreuse.fingerprint`) per model: the first
:func:`~hf_kvreuse.fingerprint.model_fingerprint` (hashes every byte of every parameter and buffer), a cached one
(nothing written since) and :func:`~hf_kvreuse.fingerprint.weights_state`, the check a session runs on every call
(storage, version and sampled elements of every tensor, adapter state, config digest). Models: tiny random-init
llama, and SmolLM2-135M where it is on disk (skipped, with the reason in the JSON, otherwise). ``--compare-ref``
names a commit whose ``fingerprint.py`` is timed alongside on the same model. Writes a JSON (config, commit,
figures per model).

    python benchmarks/fingerprint_cost.py --out benchmarks/results/fingerprint_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def _best(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), times


def _module_at(ref: str):
    """``hf_kvreuse/fingerprint.py`` of ``ref`` as a standalone module."""
    import importlib.util
    import tempfile

    src = subprocess.run(["git", "show", f"{ref}:hf_kvreuse/fingerprint.py"], capture_output=True, text=True,
                         check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("old_fingerprint", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(model, repeats: int, old=None) -> dict:
    from hf_kvreuse import fingerprint

    tensors, packed = fingerprint._tensors(model)
    nbytes = sum(t.numel() * t.element_size() for *_, t in tensors)

    def first():
        fingerprint.forget(model)
        fingerprint.model_fingerprint(model)

    first_s, first_all = _best(first, repeats)
    fingerprint.model_fingerprint(model)
    cached_s, cached_all = _best(lambda: fingerprint.model_fingerprint(model), repeats * 10)
    state_s, state_all = _best(lambda: fingerprint.weights_state(model), repeats * 10)
    out = dict(tensors=len(tensors), packed=len(packed), tensor_bytes=nbytes, first_call_s=first_s,
               first_call_all_s=first_all, cached_call_s=cached_s, cached_call_all_s=cached_all,
               per_call_check_s=state_s, per_call_check_all_s=state_all, hash_rate_gb_s=nbytes / first_s / 1e9)
    if old is not None:  # the same figures with another commit's fingerprint.py
        def old_first():
            old._DIGESTS.clear()
            old.model_fingerprint(model)

        o_first, _ = _best(old_first, repeats)
        old.model_fingerprint(model)
        o_cached, _ = _best(lambda: old.model_fingerprint(model), repeats * 10)
        o_state, _ = _best(lambda: old.weights_state(model), repeats * 10)
        out["compared"] = dict(first_call_s=o_first, cached_call_s=o_cached, per_call_check_s=o_state)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/fingerprint_cost.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compare-ref", default="", help="git ref whose hf_kvreuse/fingerprint.py is timed alongside")
    args = ap.parse_args()
    from hf_kvreuse.models import tiny_model

    old = _module_at(args.compare_ref) if args.compare_ref else None
    dtype = getattr(torch, args.dtype)
    models = dict(tiny_llama=measure(tiny_model("llama").to(dtype), args.repeats, old))
    try:
        from hf_kvreuse.models import load_by_key

        model, _ = load_by_key("smollm2", dtype)
        models["SmolLM2-135M"] = measure(model, args.repeats, old)
    except Exception as e:  # noqa: BLE001 - a model not on disk is reported, the tiny figures still written
        models["SmolLM2-135M"] = dict(skipped=f"{type(e).__name__}: {e}"[:300])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "hf_kvreuse/fingerprint.py"], capture_output=True,
                                text=True).stdout.strip())
    out = dict(config=dict(dtype=args.dtype, repeats=args.repeats, threads=torch.get_num_threads(),
                           machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                           load_average=os.getloadavg(), samples=_samples()),
               commit=commit, fingerprint_py_uncommitted=dirty, compared_ref=args.compare_ref or None,
               models=models)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def _samples() -> int:
    from hf_kvreuse import fingerprint

    return fingerprint.SAMPLES


if __name__ == "__main__":
    main()
