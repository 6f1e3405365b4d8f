"""hf_kvreuse: KV-cache reuse beyond exact prefix caching, as drop-in transformers caches."""

from .alignment import Alignment, Span, align_token_ids, block_token_span, segment_prompt
from .cache_classes import (BaseLRCache, BaseLRStats, BlendCache, BlockReuseCache, DirectReuseCache, EPICCache,
                            KVReuseCache, LatentRemedyCache, LatentRemedyStats, OffsetCache,
                            OptimisticCache, OptimisticStats, TailRecomputeCache, TranslatedCache,
                            TranslatedStats, find_blocks)
from .chunk_store import ChunkStore, KVChunk
from .compat import output_cache
from .generation import BackgroundPrefill, disable, enable, is_enabled, partial_forward
from .latent import LatentBridge, LatentBridgeMismatchError
from .lora import LoraSplit, UnsupportedAdapterError
from .kv import cat_kv, dynamic_cache_from_kv, kv_length, kv_of, load_kv, scatter_kv, slice_kv
from .models import load_offline, load_qwen, load_smollm2, smollm2_path, tiny_model
from .translation import (FirstLayerDeviationScorer, KVMapper, MapperMismatchError, OracleScorer, RandomScorer,
                          RankDisagreementScorer, Scorer)
from .rope import RopeShifter, UnsupportedRopeError, check_rope_supported, rope_shift
from .timing import TokenTimer, now, synchronize

from .pipeline import KVReuseTextGenerationPipeline, register as _register_pipeline

_register_pipeline()

__version__ = "0.1.0"

__all__ = [
    "Alignment", "Span", "align_token_ids", "block_token_span", "segment_prompt",
    "KVReuseCache", "OptimisticCache", "OptimisticStats", "output_cache",
    "BlockReuseCache", "DirectReuseCache", "BlendCache", "EPICCache", "TailRecomputeCache", "OffsetCache",
    "find_blocks", "LatentRemedyCache", "LatentRemedyStats", "LatentBridge", "LatentBridgeMismatchError",
    "BaseLRCache", "BaseLRStats", "LoraSplit", "UnsupportedAdapterError",
    "ChunkStore", "KVChunk",
    "BackgroundPrefill", "enable", "disable", "is_enabled", "partial_forward",
    "cat_kv", "dynamic_cache_from_kv", "kv_length", "kv_of", "load_kv", "scatter_kv", "slice_kv",
    "load_offline", "load_qwen", "load_smollm2", "smollm2_path", "tiny_model",
    "TranslatedCache", "TranslatedStats", "KVMapper", "MapperMismatchError", "Scorer", "RankDisagreementScorer",
    "RandomScorer", "OracleScorer", "FirstLayerDeviationScorer",
    "RopeShifter", "UnsupportedRopeError", "check_rope_supported", "rope_shift",
    "TokenTimer", "now", "synchronize", "KVReuseTextGenerationPipeline",
]
