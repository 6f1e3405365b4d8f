"""Cross-model KV translation (RaReCache's mapper and position scorers); the cache is
:class:`hf_kvreuse.TranslatedCache`."""

from .mapper import KVMapper, MapperConfig, MapperMismatchError, MapperStats, PairGeometry, model_identity
from .scorers import (SCORERS, FirstLayerDeviationScorer, OracleScorer, RandomScorer, RankDisagreementScorer, Scorer,
                      make_scorer)

__all__ = ["KVMapper", "MapperConfig", "MapperMismatchError", "MapperStats", "PairGeometry", "model_identity",
           "SCORERS", "Scorer", "RankDisagreementScorer", "RandomScorer", "OracleScorer", "FirstLayerDeviationScorer",
           "make_scorer"]
