"""Generation machinery: the generate mixin, background prefill, partial recompute."""

from .background import BackgroundPrefill
from .mixin import KVReuseGenerationMixin, disable, enable, install_routing, is_enabled
from .partial import partial_forward, position_causal_mask
from .protocol import ReuseCacheHooks

__all__ = ["BackgroundPrefill", "KVReuseGenerationMixin", "enable", "disable", "is_enabled", "install_routing", "partial_forward",
           "position_causal_mask", "ReuseCacheHooks"]
