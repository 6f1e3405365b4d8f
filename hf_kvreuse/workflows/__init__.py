"""Workloads: multi-agent records and prompts (conflicting tasks for LatentRemedy)."""

from .conflicting import (FAMILIES, HELDOUT_FAMILIES, TRAIN_FAMILIES, ConflictRecord, conflict_records, is_correct,
                          prompt_parts)

__all__ = ["FAMILIES", "HELDOUT_FAMILIES", "TRAIN_FAMILIES", "ConflictRecord", "conflict_records", "is_correct",
           "prompt_parts"]
