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

from ..devices import input_device
from ..generation.options import STEPWISE_MODES, call_options
from ..generation.protocol import ReuseCacheHooks
from ..generation.selected import base_attn
from ..hybrid import state_reason


class KVReuseCache(DynamicCache, ReuseCacheHooks):
    """A DynamicCache that ``generate`` on an :func:`hf_kvreuse.enable`-d model prepares and steps.

    Parameters
    ----------
    model : PreTrainedModel
        The model this cache is built for; its config sizes the layers from the start (HF_API.md F5).
        It is probed once (:func:`hf_kvreuse.model_check.check_model`) for the mechanisms the cache class
        relies on (:attr:`requires`); a model whose own code disagrees with them is refused here.
    """

    #: which probes of :func:`hf_kvreuse.model_check.require` this cache class relies on
    requires: dict = {"rope": True, "engine": True}
    #: every generate runs this cache's hooks (True for caches that manage whole trajectories themselves)
    multi_turn: bool = False
    #: serves models with sliding-window attention layers (their K/V kept as transformers' own layers keep them)
    sliding_ok: bool = False
    #: serves linear-attention hybrids (recurrent-state layers beside attention layers; :mod:`hf_kvreuse.hybrid`)
    states_ok: bool = False

    def __init__(self, model, **kwargs):
        from ..model_check import require

        super().__init__(config=model.config, **kwargs)
        if any(self.is_sliding) and not self.sliding_ok:
            raise ValueError(f"{type(self).__name__} does not support {type(model).__name__}: it has sliding-window "
                             "attention layers (OptimisticCache and ReuseSession serve such models)")
        states = state_reason(model.config)
        requires = self.requires
        if states and not self.states_ok:
            raise ValueError(f"{type(self).__name__} cannot serve {type(model).__name__}: its {states}")
        if states:
            from ..hybrid import draft_refusal

            why = draft_refusal(model)
            if why:
                raise ValueError(f"{type(self).__name__} cannot serve {type(model).__name__} (a linear-attention "
                                 f"hybrid): {why}")
            requires = {"rope": True} if self.requires.get("rope") else {}  # nothing recomputes rows in place
        attn = base_attn(model.config) or "eager"  # not a partial forward's swap in another thread
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={attn!r} is not supported by {type(self).__name__}: partial "
                             "recompute needs a 4D position mask; load the model with 'sdpa' or 'eager'")
        if requires:
            self.model_check = require(model, who=type(self).__name__, **requires)
        self.model = model
        self.logical_offset = 0
        self.stats: Any = {}
        self.input_ids: torch.Tensor | None = None
        # "new": not used yet; "active": inside its first generate; "done": a plain exact-from-here DynamicCache
        # whose K/V stand for ``token_ids``; "failed": its first generate raised (build a new one)
        self.phase = "new"
        self.token_ids = torch.empty(1, 0, dtype=torch.long)

    def set_target(self, input_ids: torch.Tensor) -> None:
        """Record the prompt this cache is built for (``generate`` must be called with exactly these ids)."""
        input_ids = as_batch1(input_ids, "input_ids")
        if input_ids.shape[1] < 2:
            raise ValueError(f"{type(self).__name__} needs a prompt of at least 2 tokens")
        self.input_ids = input_ids.to(input_device(self.model))

    def begin_generate(self, model, input_ids, generate_kwargs: dict) -> None:
        """Refuse ``generate`` calls whose result would silently be wrong; mark the cache active."""
        name = type(self).__name__
        if self.phase == "failed":
            raise RuntimeError(f"the first generate with this {name} failed; build a new cache")
        if self.phase == "active":
            raise RuntimeError(f"this {name} is already in use by a running generate call")
        self.check_call(model, input_ids, generate_kwargs)
        self._check_pad_tokens(model, input_ids, generate_kwargs)
        self.note_kernels(input_ids)
        if self.input_ids is None:
            self.set_target(input_ids)
        elif not torch.equal(input_ids.to(self.input_ids.device), self.input_ids):
            raise ValueError(f"generate was called with different input_ids than the {name} was built for "
                             "(pass the full prompt, not only a suffix)")
        self.phase = "active"

    def note_kernels(self, input_ids: torch.Tensor) -> None:
        """Record in ``stats.kernels`` which backend (torch or triton, see :mod:`hf_kvreuse.kernels`) this call's
        hot paths run on; a forced backend that cannot run raises here, before any work."""
        from ..kernels import describe

        self._kernels_device = input_ids.device
        if hasattr(self.stats, "kernels"):
            self.stats.kernels = describe(input_ids.device)

    def refresh_kernels(self) -> None:
        """After a call: under measured ``auto``, ``stats.kernels`` names the backend each kernel ran on
        (``"auto(rope_rebase=triton, ...)"``, see :func:`hf_kvreuse.kernels.describe`)."""
        from ..kernels import describe

        device = getattr(self, "_kernels_device", None)
        if device is not None and hasattr(self.stats, "kernels") and self.stats.kernels.startswith("auto"):
            self.stats.kernels = describe(device)

    def _check_pad_tokens(self, model, input_ids, generate_kwargs: dict) -> None:
        """Without a mask, generate treats pad tokens in the prompt as padding (unless the pad id is also an eos
        id): it masks them and shifts the positions after them, while this cache assembles (or, continuing, holds)
        them as real tokens: refused (:func:`hf_kvreuse.inputs.refuse_inferred_padding`)."""
        from ..inputs import refuse_inferred_padding

        refuse_inferred_padding(model, input_ids, generate_kwargs, type(self).__name__)

    def check_call(self, model, input_ids, generate_kwargs: dict) -> None:
        """The checks every ``generate`` with this cache passes (first call and continuations alike)."""
        name = type(self).__name__
        from ..generation.mixin import _generation_target

        if _generation_target(model) is not _generation_target(self.model):
            raise ValueError("this cache was built for another model object; build it with the model you "
                             "generate with")
        if input_ids is None:
            raise ValueError("call generate with the prompt ids the cache was built for (input_ids=...)")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"{name} supports batch size 1, got input_ids of shape {tuple(input_ids.shape)}")
        mask = generate_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError(f"padded attention_mask: {name} does not support padded batches")
        opts = call_options(model, generate_kwargs)
        cfg = opts.config
        if not opts.use_cache:
            raise ValueError(f"use_cache=False with a {name}: the cache would be ignored or decoded from stale "
                             "rows; drop use_cache=False (or the cache)")
        for key in ("num_beams", "num_return_sequences"):
            val = getattr(cfg, key, 1) or 1
            if val > 1:
                raise ValueError(f"{key}={val} is not supported with {name} (batch size 1 only)")
        if opts.mode not in STEPWISE_MODES:
            raise ValueError(f"generation mode {opts.mode!r} is not supported with {name}: greedy or sampling only "
                             "(no assisted, prompt-lookup or speculative decoding)")
        if getattr(cfg, "prefill_chunk_size", None):
            raise ValueError(f"prefill_chunk_size is not supported with {name}")

    # -- after the first generate: an ordinary DynamicCache that continues the conversation -------------------
    def end_generate(self, sequences: torch.Tensor | None, error: BaseException | None) -> None:
        """Called by the mixin after :meth:`finish`: record which tokens the cache now holds."""
        self._pending = None  # a generate that ended before its first forward: do not keep the storage alive
        self.refresh_kernels()
        if error is not None or sequences is None:
            self.phase = "failed" if self.phase == "active" else self.phase
            return
        self.phase = "done"
        self.token_ids = sequences[:, : self.physical_length()].detach().to("cpu")

    def begin_continuation(self, model, input_ids, generate_kwargs: dict) -> None:
        """A later ``generate`` on this cache (the next turn of a chat): plain exact decoding from the cached K/V.

        ``input_ids`` must repeat the conversation so far; the cache is cropped to the longest common prefix of
        its tokens and ``input_ids`` (at most all but the last token, which generate must feed), so edited
        histories stay exact instead of silently reusing K/V of other tokens.
        """
        self.check_call(model, input_ids, generate_kwargs)
        self._check_pad_tokens(model, input_ids, generate_kwargs)  # the held rows read pad tokens as text
        cached = self.token_ids.to(input_ids.device)
        m = min(cached.shape[1], input_ids.shape[1] - 1)
        same = (cached[0, :m] == input_ids[0, :m]).long()
        lcp = int(same.cumprod(0).sum()) if m else 0
        if lcp < self.physical_length():
            DynamicCache.crop(self, lcp - self.physical_length())
        self.token_ids = self.token_ids[:, :lcp]
        self._continuation_start = lcp
        self.phase = "continuing"

    def end_continuation(self, sequences: torch.Tensor | None, error: BaseException | None) -> None:
        if error is not None or sequences is None:  # leave the cache as it was before the failed call
            extra = self.physical_length() - self._continuation_start
            if extra > 0:
                DynamicCache.crop(self, -extra)
        else:
            self.token_ids = sequences[:, : self.physical_length()].detach().to("cpu")
        self.phase = "done"

    # -- the DynamicCache contract ----------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """``DynamicCache.update``, refused while the cache was never prepared by an hf_kvreuse ``generate``.

        A cache whose hooks never ran holds nothing yet: a forward (or a ``generate`` of a model class whose own
        ``generate`` bypasses :mod:`hf_kvreuse.generation.mixin`) would silently run plain prefill with it.
        (Multi-turn caches run their hooks on every forward of an enabled model, which their constructor enables.)"""
        if self.phase == "new" and not self.multi_turn:
            raise RuntimeError(
                f"this {type(self).__name__} was used by a forward before any hf_kvreuse generate prepared it, so "
                f"it would silently act as an empty cache (no reuse). Call model.generate(ids, cache=cache) on the "
                f"model it was built for ({type(self.model).__name__}: hf_kvreuse.enable(model) routes it); a model "
                f"class that overrides generate itself is not supported")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def crop(self, max_length: int) -> None:
        """As ``DynamicCache.crop`` (transformers' own semantics of ``max_length``); keeps ``token_ids`` in step."""
        if self.phase == "active":
            raise RuntimeError(f"{type(self).__name__} cannot be cropped while its first generate assembles and "
                               "swaps it (assisted decoding and rollback are not supported)")
        super().crop(max_length)
        self.token_ids = self.token_ids[:, : self.physical_length()]

    def _batch1_only(self, what: str, n: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}.{what}: hf_kvreuse caches hold one sequence (batch size "
                                  f"1); beam search, num_return_sequences and batch selection are not supported "
                                  f"(got {n})")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if beam_idx.numel() != 1 or int(beam_idx.reshape(-1)[0]) != 0:
            self._batch1_only("reorder_cache", beam_idx.numel())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._batch1_only("batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.numel() != 1 or int(indices.reshape(-1)[0]) != 0:
            self._batch1_only("batch_select_indices", indices.numel())

    def reset(self) -> None:
        super().reset()
        self.token_ids = self.token_ids[:, :0]

    # objects that a copy of a cache shares instead of copying (the model, stores, background jobs)
    _shared_attrs = ("model", "model_check", "donor_cache", "store", "job", "split", "_shifter")

    def __deepcopy__(self, memo):
        if self.phase in ("active", "continuing"):
            raise RuntimeError(f"cannot copy a {type(self).__name__} while generate is using it")
        for name in self._shared_attrs:
            obj = getattr(self, name, None)
            if obj is not None:
                memo[id(obj)] = obj
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(f"{type(self).__name__} holds its model; it is not pickled. Save its K/V "
                        "(hf_kvreuse.kv.kv_of(cache)) with safetensors instead")

    # -- lengths -------------------------------------------------------------------------------------------
    def physical_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.physical_length(layer_idx) + self.logical_offset

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.physical_length(layer_idx)

    # -- hooks called by hf_kvreuse.generation.KVReuseGenerationMixin ---------------------------------------
    def prepare(self, model, input_ids: torch.Tensor, generate_kwargs: dict) -> None:
        """Called once right before ``generate`` starts; assemble the cache here (subclasses call
        :meth:`begin_generate` first, as this default does)."""
        self.begin_generate(model, input_ids, generate_kwargs)

    def set_logits_processor(self, processors, generation_config) -> None:
        """Called by the mixin once per ``generate`` with the logits processors (warpers included) it applies to
        every step's logits, and its generation config."""
        self.logits_processor, self.generation_config = processors, generation_config

    def set_stopping_criteria(self, criteria) -> None:
        """Called by the mixin with the stopping criteria ``generate`` built for this call."""
        self._stopping_criteria = criteria

    def continuing_parts(self):
        """``(logits processors, stopping criteria)`` a continuing ``generate`` of the same call must reuse
        instead of building its own (a cache that drives several generates), or None."""
        return None

    def drive(self, model, generate_kwargs: dict):
        """Run the call's ``generate`` after :meth:`prepare` (default: transformers' own, once)."""
        return model._stock_generate(**generate_kwargs)

    def process_logits(self, history: torch.Tensor, logits: torch.Tensor, start: int) -> torch.Tensor:
        """The scores ``generate`` chooses from: row ``i`` of ``logits`` ``[T, V]`` (raw, the token at position
        ``start + i``) through this call's processors, given the tokens ``history[:, :start + i]`` before it."""
        processors = getattr(self, "logits_processor", None)
        if not processors:
            return logits.float()
        history = history.to(logits.device)  # processors index the logits with the ids (repetition penalty)
        rows = [processors(history[:, :start + i], logits[i:i + 1].float()) for i in range(logits.shape[0])]
        return torch.cat(rows, 0)

    def before_forward(self, input_ids: torch.Tensor, next_sequence_length: int | None) -> tuple[int | None, dict]:
        """Called before every forward of ``generate`` (prefill included).

        Returns the number of trailing tokens of ``input_ids`` to feed (``next_sequence_length``, possibly
        changed) and extra model inputs to override (e.g. ``logits_to_keep``).
        """
        return next_sequence_length, {}

    #: rows left for the first forward of generate (:mod:`hf_kvreuse.generation.fused`), set by ``prepare``
    _pending = None

    def forward(self, forward_fn, **kwargs):
        """Runs every model forward that carries this cache (``forward_fn`` is the model's own forward); the first
        one runs the pending rows of a fused first step with the last prompt token instead."""
        pending = self._pending
        if pending is None:
            return forward_fn(**kwargs)
        self._pending = None
        return pending.run(self.model, self, kwargs.get("input_ids"))

    def after_forward(self, outputs) -> None:
        """Called after every forward of ``generate`` with the model outputs."""

    def finish(self, input_ids: torch.Tensor | None, error: BaseException | None) -> None:
        """Called once when ``generate`` returns or raises (``input_ids``: final sequences, if known)."""

    def __repr__(self) -> str:
        """Method, phase, tokens held, prompt length, layers, K/V bytes and the headline stats, on one line."""
        from ..reprs import cache_repr

        return cache_repr(self)


def as_batch1(ids, name: str) -> torch.Tensor:
    """``ids`` as a ``[1, T]`` LongTensor, or a clear error for batched / padded input (a tokenizer's
    ``BatchEncoding`` is accepted: :func:`hf_kvreuse.inputs.prompt_ids`)."""
    from ..inputs import prompt_ids

    return prompt_ids(ids, name)
