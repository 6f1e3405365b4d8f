"""Cache classes: one file per method."""

from .base import KVReuseCache
from .optimistic import OptimisticCache, OptimisticStats

__all__ = ["KVReuseCache", "OptimisticCache", "OptimisticStats"]
