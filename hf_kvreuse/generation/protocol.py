"""What the generation mixin needs to know about a cache, without importing the cache classes.

:class:`ReuseCacheHooks` is the marker base class the mixin checks with ``isinstance``: every hf_kvreuse cache
(:class:`hf_kvreuse.KVReuseCache` and its subclasses) derives from it, so ``generation/`` never imports
``cache_classes/`` (the cache classes import ``generation/``, not the other way round). It holds no state and
defines no methods; the hooks listed below are implemented by ``KVReuseCache``.

The mixin reads ``phase`` (``"new"``, ``"active"``, ``"continuing"``, ``"done"`` or ``"failed"``) and
``multi_turn`` and calls ``prepare``, ``before_forward``, ``forward``, ``after_forward``, ``finish``,
``end_generate``, ``begin_continuation`` and ``end_continuation``.
"""

from __future__ import annotations


class ReuseCacheHooks:
    """Marker base class of the caches whose hooks :class:`~hf_kvreuse.generation.mixin.KVReuseGenerationMixin`
    runs inside ``generate`` (see the module docstring for the hooks)."""

    __slots__ = ()
