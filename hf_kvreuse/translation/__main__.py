"""``python -m hf_kvreuse.translation fit [--refit] [--inputs KIND] [--ridge L] [--calibration N] [--prompts FILE]
[--max-tokens T] [--stride S] [--dtype bf16|fp32] [--out DIR]``: fit (or load) the offline Qwen2.5-Coder 0.5B -> 1.5B KV map and print what it found, with the fit
time, the size on disk and the process's peak memory."""

from __future__ import annotations

import argparse
import resource
import time

import torch


def main(argv=None) -> None:
    from .mapper import INPUT_KINDS
    from .pairs import DEFAULT_RIDGE, FIT_DEFAULT_INPUTS

    p = argparse.ArgumentParser(prog="python -m hf_kvreuse.translation", description=__doc__)
    p.add_argument("command", choices=["fit"])
    p.add_argument("--refit", action="store_true", help="fit again even if a saved map exists")
    p.add_argument("--inputs", choices=INPUT_KINDS, default=FIT_DEFAULT_INPUTS,
                   help=f"what each target layer's map reads (default {FIT_DEFAULT_INPUTS!r}, the best measured; "
                        "'kv' is the kind that works from a source cache alone)")
    p.add_argument("--ridge", type=float, default=None,
                   help=f"relative ridge penalty (default per kind: {DEFAULT_RIDGE})")
    p.add_argument("--hidden-band", type=int, default=1, help="hidden kinds: source layers around matched depth")
    p.add_argument("--calibration", type=int, default=None,
                   help="how many calibration prompts (default: 64 DROP prompts, or every one of --prompts)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='calibrate on your own prompts: one {"text": ...} or {"messages": [...]} object per line '
                        "(prompts of the task's own domain fit this pair's maps best; default: DROP)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="the models' dtype for the fit (the map serves both; fp32 is several times faster on a CPU "
                        "without native bf16)")
    p.add_argument("--out", default=None, help="folder of the map (default: $HF_KVREUSE_CACHE/maps/...)")
    a = p.parse_args(argv)
    from pathlib import Path

    from .pairs import default_map_path, qwen_pair_mapper

    t0 = time.perf_counter()
    mapper = qwen_pair_mapper(path=a.out, n_calibration=a.calibration, max_tokens=a.max_tokens, stride=a.stride,
                              refit=a.refit, inputs=a.inputs, hidden_band=a.hidden_band,
                              ridge_lambda=a.ridge, prompts=a.prompts,
                              dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype])
    where = Path(a.out) if a.out else default_map_path(inputs=a.inputs)
    disk = sum(f.stat().st_size for f in where.iterdir()) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    print(mapper)
    print(f"kind {mapper.kind}: fit_s={mapper.info.get('fit_s', 0):.1f} (this call {time.perf_counter() - t0:.1f} s), "
          f"calibration tokens={mapper.info.get('calibration_tokens')}, {disk:.0f} MB on disk at {where}, "
          f"peak memory {peak:.1f} GiB (models included)")
    print("source layers per target layer:", [lm.sources for lm in mapper.layers])


if __name__ == "__main__":
    main()
