"""Cross-model KV translation (RaReCache's mapper and position scorers); the cache is
:class:`hf_kvreuse.TranslatedCache`."""

from .mapper import (INPUT_KINDS, KVMapper, MapperConfig, MapperMismatchError, MapperStats, PairGeometry, model_identity,
                     run_source)
from .moments import BlockLayout, BlockMoments
from .question import QuestionAttentionScorer, QuestionWordScorer, attention_probe
from .residual import ResidualConfig, apply_residual, fit_residuals, train_residual
from .scorers import (CombinedScorer, FirstLayerDeviationScorer, OracleScorer, RandomScorer, RankDisagreementScorer,
                      Scorer)
from .selection import SCORERS, make_scorer

__all__ = ["KVMapper", "MapperConfig", "MapperMismatchError", "MapperStats", "PairGeometry", "model_identity",
           "run_source", "INPUT_KINDS", "ResidualConfig", "fit_residuals", "train_residual", "apply_residual",
           "BlockLayout", "BlockMoments", "SCORERS", "Scorer", "CombinedScorer", "RankDisagreementScorer",
           "RandomScorer", "OracleScorer", "FirstLayerDeviationScorer", "QuestionAttentionScorer",
           "QuestionWordScorer", "attention_probe", "make_scorer"]
