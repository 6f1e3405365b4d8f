"""EPICCache: LegoLink from EPIC, "Efficient Position-Independent Context Caching for Serving LLMs"
(Hu et al., arXiv 2410.15332; METHODS.md §3.4).

A block encoded on its own turns its first tokens into spurious attention sinks; LegoLink recomputes the first
``k`` tokens of every block (k ≤ 32, 16 in the headline configuration) plus the query, against the assembled
cache. Cost O(k · #blocks).
"""

from .block_reuse import EdgeRecomputeCache


class EPICCache(EdgeRecomputeCache):
    """Recompute the first ``recompute_tokens`` tokens of every reused block.

    Parameters
    ----------
    recompute_tokens : int, default=16
        Tokens recomputed at the start of each block (EPIC's LegoLink-16).
    Other parameters are those of :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`.
    """

    edge = "head"
