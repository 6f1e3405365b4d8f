"""Every Triton kernel of :mod:`hf_kvreuse.triton` against its eager torch reference, side by side in one run.

Sizes are a serving model's cache (32 layers x 8 KV heads x 128 dims, bf16) at several lengths (4k-32k tokens by
default). Per kernel and length: median time of each path (CUDA events), speed-up of Triton over torch, the bytes
the operation has to move at least, and the achieved bandwidth as a fraction of ``--peak-tbps`` (the H200's
~4.8 TB/s). Targets (issue 11): each kernel >= 3x its eager reference, >= 60 % of peak for the memory-bound ones.
Also records the largest |triton - torch| difference per case. Writes JSON after every row (``complete`` turns true
after the last: a run cut by a time limit keeps its rows) and a PNG when matplotlib is there.

    python benchmarks/triton_kernels.py                                        # on a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/triton_kernels.py --device cpu --tokens 40 --reps 1   # smoke run anywhere

Cases live in ``benchmarks/kernel_cases/`` (one module per kernel). The script is not called ``kernels.py``: a
top-level module of that name on ``sys.path`` is taken by transformers for the Hugging Face ``kernels`` package.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import markdown_table, write_json  # noqa: E402
from kernel_cases import all_cases  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tbps", type=float, default=4.8, help="the device's peak memory bandwidth, TB/s")
    ap.add_argument("--only", nargs="*", help="case names to run (default: all)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kernels.json")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --device cpu with TRITON_INTERPRET=1 for a smoke run")
    result = dict(command=" ".join(["python"] + sys.argv), device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  dtype=args.dtype, peak_tbps=args.peak_tbps, torch=torch.__version__, complete=False, rows=[])
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    rows = result["rows"]
    write_json(args.out, result)  # a run cut by a time limit keeps every row measured before (checkpoints)
    cases = [c for c in all_cases() if not args.only or c.name in args.only]
    for tokens in args.tokens:  # every kernel at the shorter lengths first: a cut run still covers each kernel
        for case in cases:
            row = dict(kernel=case.name, tokens=tokens)
            try:
                prep = case.make(device, dtype, tokens)
                row["max_abs_diff"] = prep.check() if prep.check else None
                row["torch_s"] = timed(prep.torch_fn, device, args.reps, args.warmup)
                row["triton_s"] = timed(prep.triton_fn, device, args.reps, args.warmup)
                row["speedup"] = row["torch_s"] / row["triton_s"]
                row["bytes"] = prep.bytes_moved
                row["memory_bound"] = prep.memory_bound
                row["triton_tbps"] = prep.bytes_moved / row["triton_s"] / 1e12
                row["peak_fraction"] = row["triton_tbps"] / args.peak_tbps
                row["meets_speedup"] = row["speedup"] >= 3.0
                row["meets_bandwidth"] = (row["peak_fraction"] >= 0.6) if prep.memory_bound else None
            except Exception as e:  # one failing case must not hide the others' numbers
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                prep = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            write_json(args.out, result)
            print(json.dumps(row), flush=True)
    result["complete"] = True
    write_json(args.out, result)
    ok = [r for r in rows if "error" not in r]
    print(markdown_table(ok, [
        ("kernel", lambda r: r["kernel"]), ("tokens", lambda r: str(r["tokens"])),
        ("torch", lambda r: f"{r['torch_s'] * 1e3:.3f} ms"), ("triton", lambda r: f"{r['triton_s'] * 1e3:.3f} ms"),
        ("speed-up", lambda r: f"{r['speedup']:.1f}x"),
        ("TB/s", lambda r: f"{r['triton_tbps']:.2f}"),
        ("% of peak", lambda r: f"{100 * r['peak_fraction']:.0f}%" if r["memory_bound"] else "(compute)"),
        ("max |diff|", lambda r: f"{r['max_abs_diff']:.2g}" if r["max_abs_diff"] is not None else "-")]))
    for r in rows:
        if "error" in r:
            print(f"FAILED {r['kernel']} @ {r['tokens']}: {r['error']}")
    print(f"wrote {args.out}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in sorted({r["kernel"] for r in ok}):
            rs = [r for r in ok if r["kernel"] == name]
            ax.plot([r["tokens"] for r in rs], [r["speedup"] for r in rs], marker="o", label=name)
        ax.axhline(3.0, ls="--", c="gray")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached tokens")
        ax.set_ylabel("Triton speed-up over eager torch")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    return result


if __name__ == "__main__":
    main()
