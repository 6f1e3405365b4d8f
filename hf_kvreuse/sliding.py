"""Sliding-window layers at prompt boundaries: the rows a cache of the prompt keeps, after generation moved on.

transformers' sliding-window cache layers (``DynamicSlidingWindowLayer``) keep only the last ``window - 1`` rows.
A cache held after ``generate`` stands for the prompt and the answer; its sliding layers hold the answer's last
rows, not those a cache of the prompt alone keeps, so the next turn of the same agent, which repeats the prompt
but not (all of) the answer, could reuse nothing. :class:`WindowSnapshot` is a streamer that copies the sliding
layers' rows when ``generate`` emits its first new token, the moment the cache holds exactly the prompt (the
first forward has run, the second has not), so the held entry can also serve the prompt as an exact prefix:
full-attention layers from the held rows (views), sliding layers from the copy. The copied rows are what plain
prefill of the prompt leaves in those layers, bit for bit (the same forward wrote them).

:func:`keep_history` goes further (the session's default): the sliding layers of the cache a call runs with also
append every row they are given to a history, while what they return to attention, keep, and report for the
mask stays transformers' own (so the forward is plain ``generate``'s). :func:`take_history` then gives the held
entry every row of every layer, as a full-attention model's would be, and any later prompt sharing any prefix
with it (another agent's prompt over the same document, not only this prompt) reuses that prefix exactly: a cache
of the first ``p`` tokens keeps, in a sliding layer, rows ``p - window + 1 .. p - 1``, all of them held. The cost
is memory: those layers are held in full.
"""

from __future__ import annotations

import torch

from .kv import kv_of

__all__ = ["WindowSnapshot", "boundary_kv", "crop_rows", "keep_history", "keep_rows", "layer_windows",
           "take_history"]


def layer_windows(config) -> list:
    """Each layer's sliding window (None: full attention), as transformers' own ``DynamicCache`` builds the layers
    for ``config``."""
    from transformers import DynamicCache

    return [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            for layer in DynamicCache(config=config).layers]


_HISTORY_CLASSES: dict[type, type] = {}  # base layer class -> its history-keeping subclass


def _history_class(base: type) -> type:
    """``base`` (a sliding-window cache layer class, whichever transformers has) whose ``update`` also appends the
    new rows to ``history``, so that the layer can later give every row, while what it returns to attention, what
    it keeps, its mask sizes and token count stay the base class's (the forward is plain generate's, bit for bit).
    Any operation that rewrites the rows (crop, beam reordering, batch changes, reset) drops the history. A plain
    subclass, so that an instance's ``__class__`` can be switched to it and back."""
    cls = _HISTORY_CLASSES.get(base)
    if cls is not None:
        return cls

    class History(base):
        _history_base = base

        def update(self, key_states, value_states, *args, **kwargs):
            out = super().update(key_states, value_states, *args, **kwargs)
            if self.history is not None:
                self.history.append((key_states, value_states))
            return out

    def dropping(name):
        def method(self, *args, **kwargs):
            self.history = None  # the rows are rewritten: the history no longer matches them
            return getattr(base, name)(self, *args, **kwargs)
        return method

    for name in ("crop", "reorder_cache", "batch_repeat_interleave", "batch_select_indices", "reset"):
        if hasattr(base, name):
            setattr(History, name, dropping(name))
    History.__name__ = History.__qualname__ = f"History{base.__name__}"
    _HISTORY_CLASSES[base] = History
    return History


def keep_history(cache, windows: list, prefix_kv=None) -> bool:
    """Make the sliding-window layers of ``cache`` also keep every row they are given (see :func:`take_history`).

    ``prefix_kv``: every row of the tokens ``cache`` already stands for (per layer, all of them, as a full-attention
    layer holds them), or None if the cache is empty. Returns False (and changes nothing) where a sliding layer
    already holds rows and no ``prefix_kv`` gives their history."""
    n = int(cache.get_seq_length()) if cache.layers else 0
    if n and (prefix_kv is None or any(k.shape[-2] != n for k, _ in prefix_kv)):
        return False
    for i, (layer, w) in enumerate(zip(cache.layers, windows)):
        if w is None:
            continue
        layer.__class__ = _history_class(type(layer))
        layer.history = [prefix_kv[i]] if n else []
        layer.history_start = 0
    return True


def take_history(cache, windows: list, tokens: int, batch: int = 1):
    """The K/V of ``cache`` with every row of every layer (``tokens`` rows each): the sliding layers' rows from
    the history :func:`keep_history` started; the layers go back to their own classes. None where a history was
    dropped or does not cover ``tokens`` (the cache's own rows are then all there is)."""
    kv, ok = list(kv_of(cache)), True
    for i, (layer, w) in enumerate(zip(cache.layers, windows)):
        if w is None or not hasattr(type(layer), "_history_base"):
            ok = ok and (w is None)
            continue
        hist = layer.history
        layer.__class__ = type(layer)._history_base
        del layer.history
        layer.__dict__.pop("history_start", None)
        if not hist or not ok:
            ok = False
            continue
        k, v = torch.cat([h[0] for h in hist], -2), torch.cat([h[1] for h in hist], -2)
        if k.shape[-2] != tokens or k.shape[0] != batch:
            ok = False
            continue
        kv[i] = (k, v)
    return kv if ok else None


def keep_rows(cache, windows: list) -> None:
    """From now on the sliding-window layers of ``cache`` also keep every row they are given, after the rows they
    hold, so that :func:`crop_rows` can cut them back to fewer tokens (transformers' own sliding layer cannot, once
    its window has moved: the rows it dropped are gone)."""
    for layer, w in zip(cache.layers, windows):
        if w is None:
            continue
        held = layer.keys.shape[-2]
        layer.__class__ = _history_class(type(layer))
        layer.history = [(layer.keys, layer.values)]
        layer.history_start = int(layer.cumulative_length) - held  # the token of the first kept row


def crop_rows(cache, windows: list, length: int, keep: bool = False) -> None:
    """Cut every layer of ``cache`` back to its first ``length`` tokens: full-attention layers by their own
    ``crop``, sliding-window layers (after :func:`keep_rows` or :func:`keep_history`) to the last ``window - 1`` rows
    of those tokens, what a prefill of ``length`` tokens leaves there. The layers go back to their own classes, or
    with ``keep`` go on keeping their rows (cut to the same tokens)."""
    for layer, w in zip(cache.layers, windows):
        if w is None:
            extra = layer.keys.shape[-2] - length
            if extra > 0:
                layer.crop(-extra)  # a negative count: tokens to remove (what every transformers release takes)
            continue
        base = getattr(type(layer), "_history_base", None)
        hist, start = getattr(layer, "history", None), getattr(layer, "history_start", None)
        if base is None or hist is None or start is None:
            raise RuntimeError("crop_rows needs the rows keep_rows started to keep (a crop or reset dropped them)")
        k, v = torch.cat([h[0] for h in hist], -2), torch.cat([h[1] for h in hist], -2)
        if not start <= length - min(length, w - 1) or start + k.shape[-2] < length:
            raise RuntimeError(f"crop_rows: the kept rows (tokens {start}..{start + k.shape[-2] - 1}) do not hold "
                               f"the window of the first {length} tokens")
        lo = max(0, length - (w - 1)) - start
        if keep:
            layer.history = [(k[..., :length - start, :], v[..., :length - start, :])]
        else:
            layer.__class__ = base
            del layer.history, layer.history_start
        layer.keys, layer.values = k[..., lo:length - start, :], v[..., lo:length - start, :]
        layer.cumulative_length = length


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
