"""Base class of every hf_kvreuse cache: a ``DynamicCache`` with logical-vs-physical length bookkeeping.

``generate`` reads two different lengths from a cache (HF_API.md §1.2, §2.3 F2):

* the **logical** length, ``get_seq_length()``: how many real prompt tokens are already covered; ``generate``
  feeds ``input_ids[:, logical:]`` and positions keep counting real tokens;
* the **physical** length, ``get_query_offset()`` and each layer's ``get_mask_sizes``: how many K/V entries the
  attention actually sees, i.e. the geometry of the causal mask.

They differ only for caches that physically hold fewer entries than the tokens they stand for (compressed or
partially materialised layouts): ``logical_offset`` counts the real tokens that have no physical entry.
Subclasses implement :meth:`prepare` (assemble the state right before ``generate`` runs, so that its cost is
inside time-to-first-token) and may implement the per-step hooks used by the generation mixin.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


class KVReuseCache(DynamicCache):
    """A DynamicCache that ``generate`` on an :func:`hf_kvreuse.enable`-d model prepares and steps.

    Parameters
    ----------
    model : PreTrainedModel
        The model this cache is built for; its config sizes the layers from the start (HF_API.md F5).
    """

    def __init__(self, model, **kwargs):
        super().__init__(config=model.config, **kwargs)
        self.model = model
        self.logical_offset = 0
        self.stats: dict[str, Any] = {}

    # -- lengths -------------------------------------------------------------------------------------------
    def physical_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.physical_length(layer_idx) + self.logical_offset

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.physical_length(layer_idx)

    # -- hooks called by hf_kvreuse.generation.KVReuseGenerationMixin ---------------------------------------
    def prepare(self, model, input_ids: torch.Tensor, generate_kwargs: dict) -> None:
        """Called once right before ``generate`` starts; assemble the cache here."""

    def before_forward(self, input_ids: torch.Tensor, next_sequence_length: int | None) -> tuple[int | None, dict]:
        """Called before every forward of ``generate`` (prefill included).

        Returns the number of trailing tokens of ``input_ids`` to feed (``next_sequence_length``, possibly
        changed) and extra model inputs to override (e.g. ``logits_to_keep``).
        """
        return next_sequence_length, {}

    def after_forward(self, outputs) -> None:
        """Called after every forward of ``generate`` with the model outputs."""

    def finish(self, input_ids: torch.Tensor | None, error: BaseException | None) -> None:
        """Called once when ``generate`` returns or raises (``input_ids``: final sequences, if known)."""
