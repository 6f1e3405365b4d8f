"""BlendCache: CacheBlend, "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion"
(Yao et al., EuroSys 2025; METHODS.md §3.3, from the YaoJiayi/CacheBlend research code and LMCache's blender).

Blocks are reused as in direct reuse, then repaired:

1. every row runs through layers ``0 .. check_layer`` (the first layers are fully recomputed);
2. at ``check_layer`` the fresh K or V of each reused row is compared with the reused one,
   ``d_j = sum_{heads, dims} (X_fresh[j] - X_reused[j])^2``;
3. the ``recompute_ratio`` fraction of reused rows with the largest deviation, plus every row outside the
   blocks (system text, question), continue through the remaining layers; their fresh K/V replace the reused
   ones there. Reused rows that were not selected keep their reused K/V at every layer above 0.

Unlike the research code, selected rows attend with a mask causal by their original positions (no future
leak), and the deviation can be measured on keys (LMCache, after RoPE) or values (research code).
"""

from __future__ import annotations

from typing import Literal

import torch

from .. import kernels
from ..generation.partial import partial_forward
from ..kv import KV
from .block_reuse import BlockReuseCache


class BlendCache(BlockReuseCache):
    """CacheBlend selective recompute over reused blocks.

    Parameters
    ----------
    recompute_ratio : float, default=0.15
        Fraction of the reused rows recomputed through the layers after ``check_layer`` (LMCache's default).
    check_layer : int, default=1
        Layers ``0..check_layer`` run for every row; the deviation is measured at this layer.
    deviation : {"values", "keys"}, default="values"
        What is compared at the check layer: values (CacheBlend research code) or post-RoPE keys (LMCache).
    Other parameters are those of :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`.
    """

    requires = {"rope": True, "engine": True, "layers": True}  # layer-wise: drives the decoder layers itself

    def __init__(self, model, input_ids, blocks, store=None, block_prefix_ids=None, recompute_ratio: float = 0.15,
                 check_layer: int = 1, deviation: Literal["values", "keys"] = "values"):
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError("recompute_ratio must be in [0, 1]")
        if not 0 <= check_layer < model.config.num_hidden_layers:
            raise ValueError(f"check_layer must be in [0, {model.config.num_hidden_layers})")
        if deviation not in ("values", "keys"):
            raise ValueError(f"deviation={deviation!r}: choose 'values' or 'keys'")
        self.recompute_ratio, self.check_layer, self.deviation = recompute_ratio, check_layer, deviation
        super().__init__(model, input_ids, blocks, store, block_prefix_ids)

    def recompute(self, kv: KV, fresh: torch.Tensor) -> torch.Tensor:
        covered = kv[0][0].shape[-2]
        device = kv[0][0].device
        ids = self.input_ids[:, :covered]
        reused = torch.ones(covered, dtype=torch.bool, device=device)
        reused[fresh] = False
        c = self.check_layer
        # keep the reused K/V of layers 1..c: rows that are not selected go back to them
        saved = [(k.clone(), v.clone()) for k, v in kv[1: c + 1]]
        old = kv[c][1 if self.deviation == "values" else 0].clone()
        everything = torch.arange(covered, device=device)
        hidden = self._layer_pass(ids, everything, kv, range(0, c + 1))
        new = kv[c][1 if self.deviation == "values" else 0]
        candidates = torch.nonzero(reused).flatten()
        n_pick = int(candidates.numel() * self.recompute_ratio)
        # top-n_pick of sum_{b,h,d} (new - old)^2 among the reused rows (layer c may sit on another device; the
        # Triton backend reads new and old once, no difference temporary)
        picked = kernels.deviation_topk(new, old, candidates, n_pick)
        rows = torch.sort(torch.cat([fresh.to(device), picked])).values
        keep_old = torch.ones(covered, dtype=torch.bool, device=device)
        keep_old[rows] = False
        for (k, v), (ok, ov) in zip(kv[1: c + 1], saved):
            keep = keep_old.to(k.device)
            k[..., keep, :] = ok[..., keep, :]
            v[..., keep, :] = ov[..., keep, :]
        del saved, old, new
        if rows.numel() and c + 1 < len(kv):
            selected = hidden[:, rows]
            del hidden  # every row's hidden states: not needed past the check layer
            self._layer_pass(ids, rows, kv, range(c + 1, len(kv)), selected)
        self.selected_rows = picked.sort().values
        return rows

    def _layer_pass(self, ids: torch.Tensor, rows: torch.Tensor, kv: KV, layers: range,
                    hidden: torch.Tensor | None = None) -> torch.Tensor:
        # partial_forward keeps the mask small under sdpa (none for all rows, boolean for a subset)
        return partial_forward(self.model, ids, rows, kv, layers=layers, hidden_states=hidden)
