"""Source-attention selection for :class:`~hf_kvreuse.cache_classes.translated.TranslatedCache`.

CacheClip (2025) picks the tokens a large model recomputes from the attention of a small auxiliary model. In a
translated cache the source model *is* that small model and its exact prefill runs anyway: the attention its last
rows (the question, or the prompt's tail when no question is marked) pay to each context row says which part of
the context the answer reads. No second forward runs: for the chosen source layers the queries of the last
``window`` rows are rebuilt from the normalised hidden states the source prefill captured (``q_proj``, the
optional ``q_norm``, RoPE at the rows' positions) and dotted with the source's own post-RoPE keys, which are in
the source cache; sdpa never materialises these weights, so they are computed here for those rows only
(``window x T`` per head).

The score of a context row: its attention weight, softmax over every column the query row sees, averaged over the
window rows and the query heads, summed over the layers, then max-pooled over ``pool`` neighbouring positions (a
span, as SnapKV's clustering). Rows are not required to share words with the question: a prompt whose question
comes first, or has none, still gets a ranking (the tail's attention).
"""

from __future__ import annotations

import torch

from .question import _QuestionFirst
from .scorers import Scorer


def source_queries(model, layer: int, hidden: torch.Tensor, positions: torch.Tensor, shifter) -> torch.Tensor:
    """Post-RoPE queries ``[H, R, D]`` (float32) of ``model``'s layer ``layer`` for the normalised hidden states
    ``hidden`` ``[R, hidden]`` (the input of that layer's q projection) at ``positions`` ``[R]``."""
    attn = model.model.layers[layer].self_attn
    w = attn.q_proj.weight
    q = attn.q_proj(hidden.to(device=w.device, dtype=w.dtype))
    d = getattr(attn, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    q = q.view(hidden.shape[0], -1, d).transpose(0, 1)[None]  # [1, H, R, D]
    if getattr(attn, "q_norm", None) is not None:  # Qwen3 / OLMo-style per-head query norm (before RoPE)
        q = attn.q_norm(q)
    return shifter.shift(q.float(), positions.to(q.device))[0]


def row_attention(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention ``[H_q, R, T]`` of queries ``q`` ``[H_q, R, D]`` at ``positions`` over the
    post-RoPE ``keys`` ``[H_kv, T, D]`` (grouped-query heads share their K head)."""
    hq, r, d = q.shape
    hk, t, _ = keys.shape
    if hq % hk:
        raise ValueError(f"{hq} query heads do not group over {hk} K/V heads")
    k = keys.float().to(q.device).repeat_interleave(hq // hk, dim=0)
    logits = q @ k.transpose(-1, -2) / d ** 0.5
    cols = torch.arange(t, device=q.device)
    logits = logits.masked_fill(cols[None, None, :] > positions.to(q.device)[None, :, None], float("-inf"))
    return logits.softmax(-1)


class SourceAttentionScorer(_QuestionFirst):
    """Rank the context by the source model's own attention from the prompt's last rows (CacheClip, 2025).

    Parameters
    ----------
    layers : sequence of int, optional
        Source layers whose attention counts (default: every layer of the source model). Chosen by calibration
        (``research`` notes, docs/research/translated-selection.md).
    window : int, optional
        The last ``window`` covered rows are the queries (default: the cache's ``suffix_tokens``, the marked
        question; 16 when the cache marks none).
    pool : int, default=7
        Max-pooling kernel over neighbouring positions (odd).
    share : float, default=1.0
        Share of the free budget (after sinks and suffix) chosen by attention; the rest by ``base``.
    base : Scorer, optional
        Ranks the rest (default first-layer deviation, as the question scorers).

    The source prefill of the cache captures the layers' normalised hidden states (the same capture as a
    hidden-state map, :func:`~hf_kvreuse.translation.mapper.run_source`); with a given ``source_cache`` the
    caller passes them as ``source_hidden`` (the cache refuses when they are missing).
    """

    name = "source-attention"

    def __init__(self, layers=None, window: int | None = None, pool: int = 7, share: float = 1.0,
                 base: Scorer | None = None):
        super().__init__(base, share)
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if pool < 1 or pool % 2 == 0:
            raise ValueError(f"pool must be an odd kernel size >= 1, got {pool}")
        self.layers = None if layers is None else tuple(sorted({int(s) for s in layers}))
        self.window, self.pool = window, pool
        self._attn = None

    def source_layers(self, source_model) -> tuple[int, ...]:
        """The source layers whose normalised hidden states this scorer reads (checked against the model)."""
        n = source_model.config.num_hidden_layers
        layers = tuple(range(n)) if self.layers is None else self.layers
        bad = [s for s in layers if not 0 <= s < n]
        if bad:
            raise ValueError(f"source-attention layers {bad} are outside 0..{n - 1} of {type(source_model).__name__}")
        return layers

    def rows(self, cache, n: int) -> int:
        """How many trailing covered rows are the queries."""
        w = self.window or cache.suffix_tokens or 16
        return max(0, min(w, n - 1))

    def reset(self, n_tokens, device):
        super().reset(n_tokens, device)
        self._attn = None

    @torch.no_grad()
    def observe_source(self, cache, src_kv, hidden: dict, n: int) -> None:
        """The source prefill's K/V (post-RoPE) and normalised hidden states ``{layer: [>= n, hidden]}``."""
        model = cache.source_model
        w = self.rows(cache, n)
        acc = torch.zeros(n)
        if w:
            pos = torch.arange(n - w, n)
            for s in self.source_layers(model):
                q = source_queries(model, s, hidden[s][n - w: n], pos, cache._src_shifter)
                keys = src_kv[s][0][0, :, :n]
                acc += row_attention(q, keys, pos).mean(dim=(0, 1)).cpu()
        if self.pool > 1:
            acc = torch.nn.functional.max_pool1d(acc[None, None], self.pool, stride=1, padding=self.pool // 2)[0, 0]
        self._attn = acc

    def priority(self, cache, kv, n, forced):
        if self._attn is None or self._attn.numel() != n:
            raise RuntimeError("source-attention scorer: no source attention observed (the cache must call "
                               "observe_source after its source prefill)")
        return self._attn.clone()

    def __repr__(self) -> str:
        return (f"SourceAttentionScorer(layers={self.layers}, window={self.window}, pool={self.pool}, "
                f"share={self.share}, base={self.base!r})")
