"""Cache classes: one file per method."""

from .base import KVReuseCache
from .base_lr import BaseLRCache, BaseLRStats, TurnStats
from .blend import BlendCache
from .block_reuse import BlockReuseCache, BlockReuseStats, find_blocks
from .direct import DirectReuseCache
from .epic import EPICCache
from .focus import FocusRecomputeCache, FocusRecomputeStats
from .latent_remedy import LatentRemedyCache, LatentRemedyStats
from .offset import OffsetCache
from .optimistic import OptimisticCache, OptimisticStats
from .tail import TailRecomputeCache
from .translated import TranslatedCache, TranslatedStats

__all__ = ["KVReuseCache", "OptimisticCache", "OptimisticStats", "BlockReuseCache", "BlockReuseStats", "find_blocks",
           "DirectReuseCache", "BlendCache", "EPICCache", "TailRecomputeCache", "FocusRecomputeCache",
           "FocusRecomputeStats", "OffsetCache",
           "BaseLRCache", "BaseLRStats", "TurnStats", "TranslatedCache", "TranslatedStats",
           "LatentRemedyCache", "LatentRemedyStats"]
