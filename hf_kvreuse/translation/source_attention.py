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

Defaults, from calibration and retention runs (research notes, TranslatedCache selection): the last covered row
alone (``window=1``) over the source layers at 60-85% of its depth (layers 15-20 of Qwen2.5-Coder-0.5B's 24). The
early layers attend to the template and the local context; summed over every layer the prompt's tail finds the
answer's rows at chance.
"""

from __future__ import annotations

import torch

from .question import _QuestionFirst
from .scorers import Scorer

DEPTH = (0.6, 0.85)
"""The share of the source model's depth whose layers' attention counts by default (layers ``s`` with
``lo <= s / L <= hi``; at least the one nearest the band's middle)."""


def depth_layers(num_layers: int, depth: tuple[float, float] = DEPTH) -> tuple[int, ...]:
    """The layers of a ``num_layers``-layer model within the depth band ``depth`` (fractions of ``num_layers``);
    the single layer nearest the band's middle when no layer falls inside (very shallow models)."""
    lo, hi = depth
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"depth must be 0 <= lo <= hi <= 1, got {depth}")
    inside = tuple(s for s in range(num_layers) if lo <= s / num_layers <= hi)
    return inside or (min(num_layers - 1, round((lo + hi) / 2 * (num_layers - 1))),)


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


def row_attention(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention ``[H_q, R, T]`` of queries ``q`` ``[H_q, R, D]`` at ``positions`` over the
    post-RoPE ``keys`` ``[H_kv, T, D]`` (grouped-query heads share their K head); logits scaled by ``scale``
    (default ``D ** -0.5``)."""
    hq, r, d = q.shape
    hk, t, _ = keys.shape
    if hq % hk:
        raise ValueError(f"{hq} query heads do not group over {hk} K/V heads")
    k = keys.float().to(q.device).repeat_interleave(hq // hk, dim=0)
    logits = q @ k.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
    cols = torch.arange(t, device=q.device)
    logits = logits.masked_fill(cols[None, None, :] > positions.to(q.device)[None, :, None], float("-inf"))
    return logits.softmax(-1)


def unsupported(model, layers) -> str:
    """Why this scorer cannot rebuild ``model``'s queries at ``layers`` ("" when it can): it needs each layer's
    ``self_attn.q_proj`` (separate query projection) and no attention-logit soft-capping."""
    inner = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    if blocks is None:
        return "no model.model.layers"
    for s in layers:
        attn = getattr(blocks[s], "self_attn", None)
        if attn is None or not hasattr(attn, "q_proj"):
            return f"layer {s} has no self_attn.q_proj (fused or non-standard attention)"
    if getattr(model.config, "attn_logit_softcapping", None):
        return "attention logits are soft-capped"
    return ""


class SourceAttentionScorer(_QuestionFirst):
    """Rank the context by the source model's own attention from the prompt's last rows (CacheClip, 2025).

    Parameters
    ----------
    layers : sequence of int or "all", optional
        Source layers whose attention counts. Default: the layers within ``depth`` of the source model's depth
        (:func:`depth_layers`); ``"all"``: every layer.
    depth : (float, float), default=(0.6, 0.85)
        The depth band of the default layers, as fractions of the source model's layer count.
    window : int or None, default=1
        The last ``window`` covered rows are the queries (the last covered row by default); ``None``: the cache's
        ``suffix_tokens`` (the marked question), 16 when the cache marks none.
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

    def __init__(self, layers=None, window: int | None = 1, pool: int = 7, share: float = 1.0,
                 base: Scorer | None = None, depth: tuple[float, float] = DEPTH):
        super().__init__(base, share)
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if pool < 1 or pool % 2 == 0:
            raise ValueError(f"pool must be an odd kernel size >= 1, got {pool}")
        depth_layers(4, depth)  # validates the band
        if layers is None or layers == "all":
            self.layers = layers
        elif isinstance(layers, str):
            raise ValueError(f"layers must be a sequence of layer indices, 'all' or None, got {layers!r}")
        else:
            self.layers = tuple(sorted({int(s) for s in layers}))
            if not self.layers:
                raise ValueError("layers is empty: pass at least one source layer (or None for the default band)")
        self.window, self.pool, self.depth = window, pool, tuple(depth)
        self._attn = None

    def source_layers(self, source_model) -> tuple[int, ...]:
        """The source layers whose normalised hidden states this scorer reads (checked against the model)."""
        n = source_model.config.num_hidden_layers
        layers = (depth_layers(n, self.depth) if self.layers is None else
                  tuple(range(n)) if self.layers == "all" else self.layers)
        bad = [s for s in layers if not 0 <= s < n]
        if bad:
            raise ValueError(f"source-attention layers {bad} are outside 0..{n - 1} of {type(source_model).__name__}")
        reason = unsupported(source_model, layers)
        if reason:
            raise ValueError(f"selector 'source-attention' cannot read {type(source_model).__name__}'s attention: "
                             f"{reason}")
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
                scale = getattr(model.model.layers[s].self_attn, "scaling", None)
                acc += row_attention(q, keys, pos, scale).mean(dim=(0, 1)).cpu()
        if self.pool > 1:
            acc = torch.nn.functional.max_pool1d(acc[None, None], self.pool, stride=1, padding=self.pool // 2)[0, 0]
        self._attn = acc

    def priority(self, cache, kv, n, forced):
        if self._attn is None or self._attn.numel() != n:
            raise RuntimeError("source-attention scorer: no source attention observed (the cache must call "
                               "observe_source after its source prefill)")
        return self._attn.clone()

    def __repr__(self) -> str:
        return (f"SourceAttentionScorer(layers={self.layers}, depth={self.depth}, window={self.window}, "
                f"pool={self.pool}, share={self.share}, base={self.base!r})")
