"""hf_kvreuse: KV-cache reuse beyond exact prefix caching, as drop-in transformers caches.

The top level holds the public API: the caches and their stats, :class:`ReuseSession` (one object that reuses every
earlier call's cache), :func:`enable` / :func:`disable`, the chunk store
and what the caches are built from (mappers, scorers, bridges, LoRA splits, block finders) with the errors they
raise. Lower-level helpers live in their modules: :mod:`hf_kvreuse.kv` (K/V helpers), :mod:`hf_kvreuse.rope`,
:mod:`hf_kvreuse.alignment`, :mod:`hf_kvreuse.timing`, :mod:`hf_kvreuse.generation` (background prefill, partial
recompute), :mod:`hf_kvreuse.models` (offline and tiny model loaders) and :mod:`hf_kvreuse.workflows` (workloads).
"""

from .cache_classes import (BaseLRCache, BaseLRStats, BlendCache, BlockReuseCache, BlockReuseStats, DirectReuseCache,
                            EPICCache, FocusRecomputeCache, FocusRecomputeStats, KVReuseCache, LatentRemedyCache,
                            LatentRemedyStats, OffsetCache,
                            OptimisticCache, OptimisticStats, TailRecomputeCache, TranslatedCache, TranslatedStats,
                            TurnStats, find_blocks)
from .chunk_store import ChunkStore, KVChunk
from .compat import output_cache
from .generation import disable, enable, install_routing, is_enabled
from .latent import LatentBridge, LatentBridgeMismatchError
from .lora import LoraSplit, UnsupportedAdapterError
from .model_check import UnsupportedModelError
from .persist import DiskTier, PersistedKVError
from .translation import (FirstLayerDeviationScorer, KVMapper, MapperMismatchError, OracleScorer,
                          QuestionAttentionScorer, QuestionWordScorer, RandomScorer, RankDisagreementScorer, Scorer)
from .rope import UnsupportedRopeError
from .session import ReuseSession, SessionStats
from .guard import DivergenceGuard, GuardConfig
from .errors import HFKVReuseError

from .pipeline import KVReuseTextGenerationPipeline, register as _register_pipeline

_register_pipeline()
# model.generate(ids, cache=SomeCache(model, ...)) on a model that was never enabled: see generation/mixin.py
install_routing()

from .version import __version__  # noqa: E402

__all__ = [
    "KVReuseCache", "OptimisticCache", "OptimisticStats",
    "BlockReuseCache", "BlockReuseStats", "DirectReuseCache", "BlendCache", "EPICCache", "TailRecomputeCache",
    "FocusRecomputeCache", "FocusRecomputeStats", "OffsetCache", "find_blocks",
    "LatentRemedyCache", "LatentRemedyStats", "LatentBridge", "LatentBridgeMismatchError",
    "BaseLRCache", "BaseLRStats", "TurnStats", "LoraSplit", "UnsupportedAdapterError",
    "TranslatedCache", "TranslatedStats", "KVMapper", "MapperMismatchError", "Scorer", "RankDisagreementScorer",
    "RandomScorer", "OracleScorer", "FirstLayerDeviationScorer", "QuestionAttentionScorer", "QuestionWordScorer",
    "ChunkStore", "KVChunk", "DiskTier", "PersistedKVError", "output_cache",
    "enable", "disable", "is_enabled",
    "HFKVReuseError", "UnsupportedRopeError", "UnsupportedModelError",
    "KVReuseTextGenerationPipeline", "ReuseSession", "SessionStats", "DivergenceGuard", "GuardConfig",
]
