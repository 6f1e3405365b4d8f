"""Helpers shared by the benchmark scripts: the TTFT floor, per-setting summaries, markdown tables."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.kv import dynamic_cache_from_kv, slice_kv
from hf_kvreuse.timing import now


def floor_seconds(model, ids: torch.Tensor, exact_cache, new_tokens: int) -> float:
    """prefill(new_tokens) on an exact cache of the tokens before them, plus one decode step (synchronised)."""
    covered = ids.shape[1] - 1
    start = covered - new_tokens
    cache = dynamic_cache_from_kv([(k.clone(), v.clone()) for k, v in slice_kv(exact_cache, slice(0, start))],
                                  model.config)
    dev = ids.device
    with torch.no_grad():
        t0 = now(dev)
        if new_tokens:
            model(ids[:, start:covered], position_ids=torch.arange(start, covered, device=dev)[None],
                  logits_to_keep=1, **cache_kwargs(cache))
        model(ids[:, covered:], position_ids=torch.tensor([[covered]], device=dev), logits_to_keep=1,
              **cache_kwargs(cache))
        return now(dev) - t0


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


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion k / n."""
    import math

    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)
