"""Helpers shared by the benchmark scripts: per-setting summaries, markdown tables (the TTFT floor and the Wilson
interval live in the package and are re-exported here)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Callable, Sequence


from hf_kvreuse.cli import paired_difference, wilson  # noqa: F401  (one implementation, shared with hf-kvreuse bench)
from hf_kvreuse.timing import floor_seconds  # noqa: F401


def summarize(samples: list[dict]) -> dict:
    """Medians over transitions; ratios are taken per transition first (machines drift between runs)."""
    med = lambda f: statistics.median(f(s) for s in samples)  # noqa: E731
    return dict(n=len(samples), prompt_tokens=med(lambda s: s["prompt_tokens"]),
                new_tokens=med(lambda s: s["new_tokens"]),
                full_ttft_s=med(lambda s: s["full_ttft"]), opt_ttft_s=med(lambda s: s["opt_ttft"]),
                floor_s=med(lambda s: s["floor"]), full_e2e_s=med(lambda s: s["full_e2e"]),
                opt_e2e_s=med(lambda s: s["opt_e2e"]),
                ttft_speedup=med(lambda s: s["full_ttft"] / s["opt_ttft"]),
                ttft_over_floor=med(lambda s: s["opt_ttft"] / s["floor"]),
                e2e_ratio=med(lambda s: s["opt_e2e"] / s["full_e2e"]),
                swap_step=med(lambda s: s["swap_step"] if s["swap_step"] is not None else s["generated_tokens"]),
                divergent_tokens=med(lambda s: s["divergent_tokens"] or 0),
                identical_rate=sum(s["identical"] for s in samples) / len(samples),
                **memory_summary(samples, "full_mem_mib", "opt_mem_mib"))


def memory_summary(samples: list[dict], ref_key: str, key: str, prefix: str = "") -> dict:
    """Medians of the peak memory growth (MiB) of a method and of full prefill, and of their per-sample ratio."""
    if not samples or key not in samples[0] or ref_key not in samples[0]:
        return {}
    med = lambda f: statistics.median(f(s) for s in samples)  # noqa: E731
    return {f"{prefix}{ref_key}": med(lambda s: s[ref_key]), f"{prefix}{key}": med(lambda s: s[key]),
            f"{prefix}mem_ratio": med(lambda s: s[key] / max(s[ref_key], 1e-9))}


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, Callable[[dict], str]]]) -> str:
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in rows]
    return "\n".join(lines)


def seconds(key: str, scale: float = 1.0, unit: str = "s", digits: int = 3) -> Callable[[dict], str]:
    return lambda r: f"{r[key] * scale:.{digits}f} {unit}"


TIMING_COLUMNS = [
    ("prompt", lambda r: f"{r['prompt_tokens']:.0f}"),
    ("new tok", lambda r: f"{r['new_tokens']:.0f}"),
    ("TTFT full", seconds("full_ttft_s")), ("TTFT opt", seconds("opt_ttft_s")), ("floor", seconds("floor_s")),
    ("TTFT speed-up", lambda r: f"{r['ttft_speedup']:.1f}x"),
    ("TTFT/floor", lambda r: f"{r['ttft_over_floor']:.2f}"),
    ("E2E full", seconds("full_e2e_s", digits=2)), ("E2E opt", seconds("opt_e2e_s", digits=2)),
    ("E2E ratio", lambda r: f"{r['e2e_ratio']:.2f}"),
    ("swap step", lambda r: f"{r['swap_step']:.0f}"),
]
# peak memory growth during generate (hf_kvreuse.timing.PeakMemory), full prefill and the method side by side
MEMORY_COLUMNS = [
    ("mem full", lambda r: f"{r['full_mem_mib']:.0f} MiB" if "full_mem_mib" in r else "-"),
    ("mem opt", lambda r: f"{r['opt_mem_mib']:.0f} MiB" if "opt_mem_mib" in r else "-"),
    ("mem ratio", lambda r: f"{r['mem_ratio']:.2f}" if "mem_ratio" in r else "-"),
]




def write_json(path: Path | str, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (a temporary file renamed over it): a run killed at any moment leaves
    the previous complete checkpoint, never a truncated file. Benchmarks call it after every row, with
    ``complete: False`` until the last one, so a step cut by its time limit keeps what it measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def git_commit(root: Path | str | None = None) -> str | None:
    """The commit ``HEAD`` of the repository at ``root`` (default: this one), or None outside a git checkout."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root or Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_or_table(main: Callable[[], None], table: Callable[[dict], str]) -> None:
    """A results script's entry point: ``python SCRIPT --table RESULTS.json`` prints ``table`` of that JSON (what
    the docs' generated tables show); any other command line runs ``main``."""
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(table(json.loads(Path(sys.argv[2]).read_text())))
    else:
        main()
