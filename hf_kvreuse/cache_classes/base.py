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

import copy
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
        if any(self.is_sliding):
            raise ValueError(f"models with sliding-window attention layers are not supported by "
                             f"{type(self).__name__} yet")
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={attn!r} is not supported by {type(self).__name__}: partial "
                             "recompute needs a 4D position mask; load the model with 'sdpa' or 'eager'")
        self.model = model
        self.logical_offset = 0
        self.stats: Any = {}
        self.input_ids: torch.Tensor | None = None
        self._used = False

    def set_target(self, input_ids: torch.Tensor) -> None:
        """Record the prompt this cache is built for (``generate`` must be called with exactly these ids)."""
        input_ids = as_batch1(input_ids, "input_ids")
        if input_ids.shape[1] < 2:
            raise ValueError(f"{type(self).__name__} needs a prompt of at least 2 tokens")
        self.input_ids = input_ids.to(next(self.model.parameters()).device)

    def begin_generate(self, model, input_ids, generate_kwargs: dict) -> None:
        """Refuse ``generate`` calls whose result would silently be wrong; mark the cache used."""
        name = type(self).__name__
        if self._used:
            raise RuntimeError(f"a {name} serves one generate call; build a new one for the next prompt")
        from ..generation.mixin import _generation_target

        if _generation_target(model) is not _generation_target(self.model):
            raise ValueError("this cache was built for another model object; build it with the model you "
                             "generate with")
        if input_ids is None:
            raise ValueError("call generate with the prompt ids the cache was built for (input_ids=...)")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"{name} supports batch size 1, got input_ids of shape {tuple(input_ids.shape)}")
        if self.input_ids is not None and not torch.equal(input_ids.to(self.input_ids.device), self.input_ids):
            raise ValueError(f"generate was called with different input_ids than the {name} was built for "
                             "(pass the full prompt, not only a suffix)")
        mask = generate_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError(f"padded attention_mask: {name} does not support padded batches")
        cfg = copy.deepcopy(generate_kwargs.get("generation_config") or model.generation_config)
        cfg.update(**{k: v for k, v in generate_kwargs.items() if hasattr(cfg, k)})
        for key in ("num_beams", "num_return_sequences"):
            val = getattr(cfg, key, 1) or 1
            if val > 1:
                raise ValueError(f"{key}={val} is not supported with {name} (batch size 1 only)")
        mode = str(getattr(cfg.get_generation_mode(generate_kwargs.get("assistant_model")), "value", ""))
        if mode not in ("greedy_search", "sample"):
            raise ValueError(f"generation mode {mode!r} is not supported with {name}: greedy or sampling only "
                             "(no assisted, prompt-lookup or speculative decoding)")
        if getattr(cfg, "prefill_chunk_size", None):
            raise ValueError(f"prefill_chunk_size is not supported with {name}")
        self._used = True

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

    def forward(self, forward_fn, **kwargs):
        """Runs every model forward that carries this cache (``forward_fn`` is the model's own forward)."""
        return forward_fn(**kwargs)

    def after_forward(self, outputs) -> None:
        """Called after every forward of ``generate`` with the model outputs."""

    def finish(self, input_ids: torch.Tensor | None, error: BaseException | None) -> None:
        """Called once when ``generate`` returns or raises (``input_ids``: final sequences, if known)."""


def as_batch1(ids, name: str) -> torch.Tensor:
    """``ids`` as a ``[1, T]`` LongTensor, or a clear error for batched / padded input."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"{name} must be one sequence ([1, T]); batched or padded inputs are not supported "
                         f"yet (got shape {tuple(ids.shape)})")
    return ids
