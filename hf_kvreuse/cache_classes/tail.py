"""TailRecomputeCache: recompute the last ``k`` tokens of each reused block (the "Tail-16" baseline of the
LatentRemedy harness, chenzhwsysu57/kvreuse ``tail16_recompute``; METHODS.md §2.2), so the block tokens nearest
to what follows are computed in the new context.
"""

from .block_reuse import EdgeRecomputeCache


class TailRecomputeCache(EdgeRecomputeCache):
    """Recompute the last ``recompute_tokens`` tokens of every reused block.

    Parameters
    ----------
    recompute_tokens : int, default=16
    Other parameters are those of :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`.
    """

    edge = "tail"
