"""Readable ``repr`` of the caches, their stats and :class:`~hf_kvreuse.ReuseSession`: what a user needs at a glance
(method, phase, token counts, bytes held) in one line, numbers rounded for reading (the objects keep the exact
values: ``cache.stats.as_dict()``, ``session.held()``)."""

from __future__ import annotations

import dataclasses

import torch

#: stats fields shown in a cache's repr when its stats object has them (the rest: ``repr(cache.stats)``)
CACHE_HIGHLIGHTS = ("reused_tokens", "new_tokens", "recomputed_tokens", "background_tokens", "swap_step",
                    "divergent_tokens", "latent_tokens", "exact", "ttft_s")


def fmt_bytes(n: int | float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    if n is None:
        return "None"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def _value(name: str, v) -> str:
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and (name.endswith("bytes") or name == "nbytes"):
        return fmt_bytes(v)
    if isinstance(v, dict):
        return "{" + f"...{len(v)} fields" + "}"
    if isinstance(v, list):
        return f"[{len(v)} items]" if len(v) > 3 else "[" + ", ".join(_value("", x) for x in v) + "]"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return stats_repr(v)
    return repr(v)


def stats_repr(stats) -> str:
    """``ClassName(field=value, ...)`` of a stats dataclass: every field, times to 4 significant digits, byte counts in
    KiB / MiB, nested dicts and long lists abbreviated (the exact values stay on the object)."""
    parts = [f"{f.name}={_value(f.name, getattr(stats, f.name))}" for f in dataclasses.fields(stats) if f.repr]
    return f"{type(stats).__name__}({', '.join(parts)})"


def kv_nbytes(cache) -> int:
    """Bytes of the K/V tensors a transformers cache holds now (every layer's keys and values)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def cache_repr(cache) -> str:
    """One line for a :class:`~hf_kvreuse.KVReuseCache`: method, phase, tokens held, prompt, layers, bytes, and the
    headline stats (reused / new / recomputed tokens, swap step, exactness, TTFT)."""
    name = type(cache).__name__
    parts = []
    method = getattr(cache, "method", None)
    if isinstance(method, str):
        parts.append(f"method={method!r}")
    for knob in ("recompute_ratio", "recompute_tokens", "max_optimistic_tokens"):
        if hasattr(cache, knob):
            parts.append(f"{knob}={_value(knob, getattr(cache, knob))}")
    parts.append(f"phase={getattr(cache, 'phase', '?')!r}")
    layers = getattr(cache, "layers", [])
    try:
        held = cache.physical_length() if layers and getattr(layers[0], "keys", None) is not None else 0
    except Exception:  # noqa: BLE001 -- a repr must never raise
        held = 0
    offset = getattr(cache, "logical_offset", 0) or 0
    parts.append(f"tokens={held + offset}" + (f" ({held} physical)" if offset else ""))
    ids = getattr(cache, "input_ids", None)
    if isinstance(ids, torch.Tensor):
        parts.append(f"prompt={ids.shape[-1]}")
    parts.append(f"layers={len(layers)}")
    nbytes = cache.kv_bytes() if callable(getattr(cache, "kv_bytes", None)) else kv_nbytes(cache)
    parts.append(f"kv={fmt_bytes(nbytes)}")
    stats = getattr(cache, "stats", None)
    if dataclasses.is_dataclass(stats):
        for key in CACHE_HIGHLIGHTS:
            if hasattr(stats, key):
                parts.append(f"{key}={_value(key, getattr(stats, key))}")
        last = getattr(stats, "last", None)  # BaseLRCache: the last turn
        if last is not None:
            parts.append(f"turns={len(stats.turns)}, last={stats_repr(last)}")
    return f"{name}({', '.join(parts)})"


def store_repr(store) -> str:
    """One line for a :class:`~hf_kvreuse.ChunkStore` (and its disk tier)."""
    parts = [f"chunks={len(store)}", f"nbytes={fmt_bytes(store.nbytes)} of max_bytes={fmt_bytes(store.max_bytes)}",
             f"hits={store.hits}", f"misses={store.misses}", f"evictions={store.evictions}"]
    if store.disk is not None:
        parts.append(f"disk={store.disk!r}")  # a DiskTier (disk_repr) or a server tier
    return f"ChunkStore({', '.join(parts)})"


def disk_repr(tier) -> str:
    """One line for a :class:`~hf_kvreuse.persist.DiskTier` (counts the folder's files)."""
    return (f"DiskTier(path={str(tier.path)!r}, chunks={len(tier)}, nbytes={fmt_bytes(tier.nbytes)} of "
            f"max_bytes={fmt_bytes(tier.max_bytes)}, hits={tier.hits}, misses={tier.misses}, writes={tier.writes}, "
            f"evictions={tier.evictions})")


def session_repr(session) -> str:
    """One line for a :class:`~hf_kvreuse.ReuseSession`: policy, model, calls, held caches and bytes against the
    budget, and what the last call ran."""
    model = getattr(session, "model", None)
    entries = list(getattr(session, "_entries", {}).values())
    exact = sum(1 for e in entries if getattr(e, "exact", False))
    tokens = sum(int(e.ids.numel()) for e in entries)
    parts = [f"policy={session.policy!r}", f"model={type(model).__name__}", f"calls={session.calls}",
             f"held={len(entries)} caches ({exact} exact, {tokens} tokens)",
             f"nbytes={fmt_bytes(session.nbytes)} of max_bytes={fmt_bytes(session.max_bytes)}"]
    if getattr(session, "_trajectory", None) is not None:
        parts.append("trajectory=" + cache_repr(session._trajectory))
    last = session.last_stats
    if last is not None:
        parts.append(f"last=({last.method}, {last.prompt_tokens} prompt tokens: {last.exact_prefix_tokens} exact "
                     f"prefix, {last.donor_tokens} donor, {last.new_tokens} new)")
    return f"ReuseSession({', '.join(parts)})"
