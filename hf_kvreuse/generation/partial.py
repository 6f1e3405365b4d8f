"""Partial recompute: run the model over a subset of token rows and scatter their fresh K/V into a full cache.

Rows ``S`` of a sequence are recomputed through every layer while all other rows keep the K/V already in the
cache (reused, possibly stale). Each recomputed row attends to every present column whose *original*
position is not after its own: ``mask[j, i] = pos[i] <= pos[S[j]]`` (METHODS.md §3.3: the CacheBlend research
code lets recomputed rows see future tokens; this engine does not). One engine serves every selective method:
OptimisticCache computes its unmatched rows with it; the selective-recompute caches choose other rows.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..compat import cache_kwargs
from ..kv import KV


class _ScatterCache(DynamicCache):
    """Write-through cache for one partial forward: ``update`` scatters the new rows and returns all rows."""

    def __init__(self, config, kv: KV, rows: torch.Tensor):
        super().__init__(config=config)
        self._kv, self._rows = kv, rows
        if len(kv) != len(self.layers):
            raise ValueError(f"KV has {len(kv)} layers, the model {len(self.layers)}")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self._kv[layer_idx]
        k.index_copy_(-2, self._rows, key_states.to(k.dtype))
        v.index_copy_(-2, self._rows, value_states.to(v.dtype))
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv[layer_idx][0].shape[-2]


def position_causal_mask(row_pos: torch.Tensor, col_pos: torch.Tensor, dtype: torch.dtype,
                         col_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask ``[1, 1, |rows|, |cols|]``: 0 where ``col_pos <= row_pos`` (and the column is valid)."""
    allowed = col_pos[None, :] <= row_pos[:, None]
    if col_valid is not None:
        allowed = allowed & col_valid[None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=row_pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def partial_forward(model, input_ids: torch.Tensor, rows: torch.Tensor, kv: KV,
                    positions: torch.Tensor | None = None, col_valid: torch.Tensor | None = None,
                    logits_to_keep: int = 1):
    """Recompute rows ``rows`` of ``input_ids`` in place of their entries in ``kv``.

    Parameters
    ----------
    model : PreTrainedModel
        Causal LM whose layers call ``cache.update`` (Llama, Qwen2/3, Mistral, ...).
    input_ids : LongTensor ``[1, N]``
        Token of every row of ``kv`` (only ``input_ids[:, rows]`` is fed).
    rows : LongTensor ``[R]``
        Row indices to recompute, increasing.
    kv : list of (K, V) ``[1, H, N, D]``
        Full-length K/V, written in place at ``rows``. Rows not recomputed must already hold valid K/V (or be
        excluded with ``col_valid``).
    positions : LongTensor ``[N]``, optional
        Original position of each row (default ``arange(N)``): RoPE positions and the causal order.
    col_valid : BoolTensor ``[N]``, optional
        Columns that may be attended to at all (default: all).
    logits_to_keep : int, default=1
        Passed to the model; 0 keeps the logits of every recomputed row.

    Returns
    -------
    The model output (``logits`` of the kept recomputed rows).
    """
    if input_ids.shape[0] != 1:
        raise ValueError("partial_forward runs one sequence at a time (batch size 1)")
    n = kv[0][0].shape[-2]
    device = kv[0][0].device
    rows = rows.to(device=device, dtype=torch.long)
    if positions is None:
        positions = torch.arange(n, device=device)
    row_pos = positions[rows]
    mask = position_causal_mask(row_pos, positions, kv[0][0].dtype, col_valid)
    cache = _ScatterCache(model.config, kv, rows)
    return model(input_ids=input_ids[:, rows.to(input_ids.device)], position_ids=row_pos[None], attention_mask=mask,
                 use_cache=True, logits_to_keep=logits_to_keep, **cache_kwargs(cache))
