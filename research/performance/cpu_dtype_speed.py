"""One-thread CPU speed of a Qwen2.5-0.5B-sized linear (1100 x 896 -> 4864) in float32 and bfloat16: why the loaders
warn about bf16 on CPUs without native bf16 (README, issue 23's float32 run).

    python research/performance/cpu_dtype_speed.py --out benchmarks/results/cpu_dtype_speed.json
"""

import argparse
import json
import subprocess
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/cpu_dtype_speed.json")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(1100, 896, dtype=dtype), torch.randn(4864, 896, dtype=dtype)
        torch.nn.functional.linear(x, w)
        t = time.perf_counter()
        for _ in range(a.reps):
            torch.nn.functional.linear(x, w)
        s = (time.perf_counter() - t) / a.reps
        rows.append(dict(dtype=str(dtype), seconds=s, gflops=2 * 1100 * 896 * 4864 / s / 1e9))
        print(f"{dtype}: {s:.3f} s, {rows[-1]['gflops']:.1f} GFLOP/s")
    from hf_kvreuse.models.loaders import native_cpu_bf16

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = dict(config=dict(command="research/performance/cpu_dtype_speed.py", reps=a.reps, threads=1, torch=torch.__version__,
                           cpu_capability=torch.backends.cpu.get_cpu_capability(), git_commit=commit,
                           native_cpu_bf16=native_cpu_bf16()), rows=rows)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
