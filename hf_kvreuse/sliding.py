"""Sliding-window layers at prompt boundaries: the rows a cache of the prompt keeps, after generation moved on.

transformers' sliding-window cache layers (``DynamicSlidingWindowLayer``) keep only the last ``window - 1`` rows.
A cache held after ``generate`` stands for the prompt and the answer; its sliding layers hold the answer's last
rows, not those a cache of the prompt alone keeps, so the next turn of the same agent, which repeats the prompt
but not (all of) the answer, could reuse nothing. :class:`WindowSnapshot` is a streamer that copies the sliding
layers' rows when ``generate`` emits its first new token, the moment the cache holds exactly the prompt (the
first forward has run, the second has not), so the held entry can also serve the prompt as an exact prefix:
full-attention layers from the held rows (views), sliding layers from the copy. The copied rows are what plain
prefill of the prompt leaves in those layers, bit for bit (the same forward wrote them).
"""

from __future__ import annotations

import torch

from .kv import kv_of

__all__ = ["WindowSnapshot", "boundary_kv"]


class WindowSnapshot:
    """A streamer copying the sliding-window layers' rows of ``cache`` at the end of the prompt.

    ``put`` is called by ``generate`` with the prompt first, then with each new token right after the forward
    that produced it: at the second call the cache holds exactly the prompt's rows.

    Parameters
    ----------
    cache : Cache
        The cache ``generate`` runs with.
    windows : list of int or None
        Each layer's sliding window (None: full attention).
    prompt_tokens : int
        Tokens of the prompt; the copy is kept only if the cache then holds exactly that many.
    """

    def __init__(self, cache, windows: list, prompt_tokens: int):
        self.cache, self.windows, self.n = cache, windows, prompt_tokens
        self.calls = 0
        self.rows: list | None = None  # per layer: (k, v) copies for sliding layers, None for full ones

    def put(self, value) -> None:
        self.calls += 1
        if self.calls != 2 or self.cache is None:
            return
        if int(self.cache.get_seq_length()) != self.n:
            return
        rows = []
        for (k, v), w in zip(kv_of(self.cache), self.windows):
            if w is None:
                rows.append(None)
                continue
            if k.shape[-2] != min(self.n, w - 1) or k.shape[0] != 1:
                return  # not the layout a sliding layer keeps: no snapshot
            rows.append((k.detach().clone(), v.detach().clone()))
        self.rows = rows

    def end(self) -> None:
        self.cache = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for r in self.rows or [] if r is not None for t in r)


def boundary_kv(kv, marks: dict, p: int, windows: list):
    """The longest exact prefix ``m <= p`` a held entry can serve from its prompt-boundary copies.

    Parameters
    ----------
    kv : list of (K, V)
        The entry's held rows (full-attention layers from token 0).
    marks : dict
        ``{m: rows}``: at ``m`` tokens, the sliding layers' copied rows (:attr:`WindowSnapshot.rows`).
    p : int
        The longest prefix wanted.
    windows : list of int or None
        Each layer's sliding window.

    Returns
    -------
    (int, list of (K, V)) or None
        ``m`` and the K/V a cache of the first ``m`` tokens holds.
    """
    for m in sorted((m for m in marks if 0 < m <= p), reverse=True):
        out = []
        for (k, v), w, snap in zip(kv, windows, marks[m]):
            if w is None:
                if k.shape[-2] < m:
                    break
                out.append((k[..., :m, :], v[..., :m, :]))
            else:
                out.append(snap)
        else:
            return m, out
    return None
