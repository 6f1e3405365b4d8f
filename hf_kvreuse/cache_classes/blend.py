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
        rows, picked = blend_recompute(self.model, self.input_ids[:, : kv[0][0].shape[-2]], kv, fresh,
                                       self.recompute_ratio, self.check_layer, self.deviation)
        self.selected_rows = picked
        return rows


def blend_recompute(model, ids: torch.Tensor, kv: KV, fresh: torch.Tensor, recompute_ratio: float,
                    check_layer: int = 1, deviation: str = "values", start: int = 0) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """CacheBlend's repair of ``kv`` (every row ``>= start`` not in ``fresh`` holds reused K/V), in place.

    Rows ``start..`` run through layers ``0..check_layer``; the ``recompute_ratio`` fraction of the reused rows whose
    K or V deviates most there, plus ``fresh``, continue through the later layers; the other reused rows go back
    to their reused K/V at layers ``1..check_layer``. Rows before ``start`` (an exact prefix) are left alone.
    Returns ``(all recomputed rows, the selected reused rows)``, both sorted.
    """
    covered = kv[0][0].shape[-2]
    device = kv[0][0].device
    reused = torch.zeros(covered, dtype=torch.bool, device=device)
    reused[start:] = True
    reused[fresh] = False
    c = check_layer
    # keep the reused K/V of layers 1..c: rows that are not selected go back to them
    saved = [(k.clone(), v.clone()) for k, v in kv[1: c + 1]]
    old = kv[c][1 if deviation == "values" else 0].clone()
    everything = torch.arange(start, covered, device=device)
    hidden = partial_forward(model, ids, everything, kv, layers=range(0, c + 1))
    new = kv[c][1 if deviation == "values" else 0]
    candidates = torch.nonzero(reused).flatten()
    n_pick = int(candidates.numel() * recompute_ratio)
    # top-n_pick of sum_{b,h,d} (new - old)^2 among the reused rows (layer c may sit on another device; the
    # Triton backend reads new and old once, no difference temporary)
    picked = kernels.deviation_topk(new, old, candidates, n_pick)
    rows = torch.sort(torch.cat([fresh.to(device), picked])).values
    keep_old = torch.ones(covered, dtype=torch.bool, device=device)
    keep_old[rows] = False
    keep_old[:start] = False
    for (k, v), (ok, ov) in zip(kv[1: c + 1], saved):
        keep = keep_old.to(k.device)
        k[..., keep, :] = ok[..., keep, :]
        v[..., keep, :] = ov[..., keep, :]
    del saved, old, new
    if rows.numel() and c + 1 < len(kv):
        # partial_forward keeps the mask small under sdpa (none for all rows, boolean for a subset)
        selected = hidden[:, (rows - start).to(hidden.device)]
        del hidden  # every row's hidden states: not needed past the check layer
        partial_forward(model, ids, rows, kv, layers=range(c + 1, len(kv)), hidden_states=selected)
    return rows, picked.sort().values
