"""DirectReuseCache: RoPE-shifted reuse of precomputed blocks, no repair (METHODS.md §3.2).

The baseline every non-prefix method improves on: block K/V computed elsewhere (standalone or under another
prefix) are moved to their positions; only the rows outside blocks are computed.
"""

from .block_reuse import BlockReuseCache


class DirectReuseCache(BlockReuseCache):
    """Direct (naive position-independent) reuse: blocks are re-positioned and used as they are.

    Parameters are those of :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`.
    """
