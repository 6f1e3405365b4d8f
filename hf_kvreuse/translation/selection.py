"""Scorers by name: the ``selector=`` of :class:`~hf_kvreuse.TranslatedCache` (RaReCache's position selection:
which target rows to recompute after the KV maps). It sits above :mod:`~hf_kvreuse.translation.scorers` (the
mapper-based scorers) and :mod:`~hf_kvreuse.translation.question` (the question-aware ones), which import neither
it nor each other's names in a circle.
"""

from __future__ import annotations

from .question import QuestionAttentionScorer, QuestionWordScorer
from .scorers import (CombinedScorer, FirstLayerDeviationScorer, OracleScorer, RandomScorer, RankDisagreementScorer,
                      Scorer)

SCORERS = ("rank", "random", "oracle", "first-layer", "first-layer+rank", "question-attention", "question-words",
           "source-attention")


def make_scorer(selector, mapper, target_kv=None, seed: int = 0, tokenizer=None) -> Scorer:
    """A scorer from a name (``"rank"``, ``"random"``, ``"oracle"`` (needs ``target_kv``), ``"first-layer"``,
    ``"question-attention"``, ``"question-words"`` (needs ``tokenizer``)) or an instance (returned as is)."""
    if isinstance(selector, Scorer):
        return selector
    if selector == "rank":
        return RankDisagreementScorer(mapper)
    if isinstance(selector, str) and selector.startswith("rank-"):  # rank-{energy,whitened}[-{cov,svd}]
        parts = selector.split("-")[1:]
        if len(parts) in (1, 2) and parts[0] in ("energy", "whitened") and (len(parts) == 1 or parts[1] in ("cov", "svd")):
            return RankDisagreementScorer(mapper, variant=parts[0], basis=parts[1] if len(parts) == 2 else "cov")
    if selector == "random":
        return RandomScorer(seed)
    if selector == "oracle":
        if target_kv is None:
            raise ValueError("selector='oracle' needs the target's true K/V: pass OracleScorer(target_kv)")
        return OracleScorer(target_kv)
    if selector == "first-layer":
        return FirstLayerDeviationScorer()
    if selector == "first-layer+rank":
        return CombinedScorer([FirstLayerDeviationScorer(), RankDisagreementScorer(mapper)])
    if selector == "question-attention":
        return QuestionAttentionScorer()
    if selector == "source-attention":
        from .source_attention import SourceAttentionScorer

        return SourceAttentionScorer()
    if selector == "question-words":
        if tokenizer is None:
            raise ValueError("selector='question-words' reads the prompt's words: pass tokenizer= (the pair's "
                             "tokenizer), or QuestionWordScorer(tokenizer)")
        return QuestionWordScorer(tokenizer)
    raise ValueError(f"unknown selector {selector!r}: choose one of {SCORERS} (or rank-{{energy,whitened}}[-{{cov,svd}}]) "
                     "or pass a Scorer")
