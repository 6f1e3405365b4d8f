"""TailRecomputeCache: recompute the last ``k`` tokens of each reused block (the "Tail-k" baseline of the
LatentRemedy harness, chenzhwsysu57/kvreuse; METHODS.md §2.2), so the tokens the query attends to most
closely are computed in the new context.
"""

from __future__ import annotations

import torch

from .block_reuse import BlockReuseCache, block_edge_rows


class TailRecomputeCache(BlockReuseCache):
    """Recompute the last ``recompute_tokens`` tokens of every reused block.

    Parameters
    ----------
    recompute_tokens : int, default=16
    Other parameters are those of :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`.
    """

    def __init__(self, model, input_ids, blocks, store=None, block_prefix_ids=None, recompute_tokens: int = 16):
        if recompute_tokens < 0:
            raise ValueError("recompute_tokens must be >= 0")
        self.recompute_tokens = recompute_tokens
        super().__init__(model, input_ids, blocks, store, block_prefix_ids)

    def extra_rows(self) -> torch.Tensor:
        return block_edge_rows(self.blocks, self.recompute_tokens, "tail")
