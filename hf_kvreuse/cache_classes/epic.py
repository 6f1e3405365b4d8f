"""EPICCache: LegoLink from EPIC, "Efficient Position-Independent Context Caching for Serving LLMs"
(Hu et al., arXiv 2410.15332; METHODS.md §3.4).

A block encoded on its own turns its first tokens into spurious attention sinks; LegoLink recomputes the first
``k`` tokens of every block (k ≤ 32, 16 in the headline configuration) plus the query, against the assembled
cache. Cost O(k · #blocks).
"""

from __future__ import annotations

import torch

from .block_reuse import BlockReuseCache, block_edge_rows


class EPICCache(BlockReuseCache):
    """Recompute the first ``recompute_tokens`` tokens of every reused block.

    Parameters
    ----------
    recompute_tokens : int, default=16
        Tokens recomputed at the start of each block (EPIC's LegoLink-16).
    Other parameters are those of :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`.
    """

    def __init__(self, model, input_ids, blocks, store=None, block_prefix_ids=None, recompute_tokens: int = 16):
        if recompute_tokens < 0:
            raise ValueError("recompute_tokens must be >= 0")
        self.recompute_tokens = recompute_tokens
        super().__init__(model, input_ids, blocks, store, block_prefix_ids)

    def extra_rows(self) -> torch.Tensor:
        return block_edge_rows(self.blocks, self.recompute_tokens, "head")
