"""The entry a :class:`~hf_kvreuse.ReuseSession` holds per finished call, and its byte count.

A leaf module shared by :mod:`hf_kvreuse.session` (which holds entries) and :mod:`hf_kvreuse.persist` (which saves
and loads them), so that neither imports the other's module for the type. The session's reuse follows RebaseKV's
optimistic alignment over every held cache (see :class:`~hf_kvreuse.OptimisticCache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv import KV


@dataclass
class _Entry:
    ids: torch.Tensor   # [L] on the CPU: the tokens whose K/V are held
    kv: KV              # full-attention layers hold L rows; a sliding-window layer all L or the last rows only
    exact: bool
    agent: str | None
    nbytes: int
    producer: str       # identity of what made the K/V: model_fingerprint, or the session's weights_state token
    # prompt boundaries: {m: the sliding-window layers' rows a cache of the first m tokens keeps} (sliding.py)
    marks: dict = field(default_factory=dict)

    def every_row(self) -> bool:
        """Every layer holds a row for every token (a sliding-window layer's history included): a donor for
        re-positioned reuse."""
        n = self.ids.numel()
        return all(k.shape[-2] == n for k, _ in self.kv)

    def history_kv(self, p: int) -> KV | None:
        """Every row of the first ``p`` tokens in every layer (views), or None where a sliding-window layer holds
        only its window."""
        n = self.ids.numel()
        if p > n or any(k.shape[-2] != n for k, _ in self.kv):
            return None
        return [(k[..., :p, :], v[..., :p, :]) for k, v in self.kv]

    def prefix_kv(self, p: int, windows: list[int | None]) -> KV | None:
        """The K/V a cache of the first ``p`` tokens holds, from this entry's rows, or None where a sliding-window
        layer has already dropped rows that such a cache keeps (``windows``: each layer's window, None: full)."""
        n = self.ids.numel()
        out = []
        for (k, v), w in zip(self.kv, windows):
            held = k.shape[-2]
            first = n - held  # the token of this layer's first held row
            keep = p if w is None else min(p, w - 1)  # a sliding layer keeps its last window - 1 tokens
            if p > n or p - keep < first:
                return None
            a, b = p - keep - first, p - first
            out.append((k[..., a:b, :], v[..., a:b, :]))
        return out


def _storage_bytes(kv: KV) -> int:
    """Bytes of the distinct storages behind ``kv`` (a view of a larger buffer counts the whole buffer)."""
    seen, total = set(), 0
    for k, v in kv:
        for t in (k, v):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total
