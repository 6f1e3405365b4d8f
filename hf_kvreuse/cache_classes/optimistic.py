"""OptimisticCache: RebaseKV's optimistic cache alignment as a drop-in transformers cache.

Based on "RebaseKV: Hiding Prefill Latency in Multi-Agent LLMs via Optimistic Cache Alignment" (seed abstract;
algorithm of METHODS.md §2.1, whose details are our reading of the abstract). Algorithm, per ``generate`` call:

1. Align the target prompt with the donors' tokens (previous agents' prompts + answers): common prefix and
   matching non-prefix spans, from one donor or several (:mod:`hf_kvreuse.alignment`).
2. Optimistic cache: matched spans copied from the donor cache and RoPE-re-positioned to their target
   positions (:mod:`hf_kvreuse.rope`); only the unmatched target tokens are computed, in place, attending
   causally to the stale cache (:func:`hf_kvreuse.generation.partial.partial_forward`).
   First token ≈ prefill(unmatched tokens) + one decode step.
3. Foreground decoding starts at once from that cache, while the exact prefill of the prompt runs in the
   background (:class:`hf_kvreuse.generation.background.BackgroundPrefill`); when a donor is known to be an
   exact cache (``donor_exact``), the exact prefill starts after the common prefix with it.
4. Rebase: at the first step boundary where the exact cache is ready (or when ``max_optimistic_tokens`` is
   reached, waiting for it), the exact cache is swapped in and the tokens generated so far are replayed on it
   in the same forward that produces the next token. From then on every token is the one full prefill would
   give after the same earlier tokens. Optionally the replay's logits count how many optimistic tokens the
   exact model would not have chosen greedily (``divergent_tokens``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from transformers import Cache

from ..alignment import Alignment, align_multi
from ..compat import cache_kwargs
from ..devices import offloaded
from ..generation.background import BackgroundPrefill, ThreadBudget
from ..generation.partial import partial_forward
from ..model_check import check_donor
from ..kv import alloc_layer, copy_shifted_, kv_length, kv_of, load_kv, release_kv, release_layer
from ..rope import RopeShifter
from ..timing import now
from .base import KVReuseCache, as_batch1


@dataclass
class OptimisticStats:
    """What happened during one ``generate`` with an :class:`OptimisticCache` (times in seconds)."""

    ttft_s: float | None = None             # generate() entry -> first token's logits
    assemble_s: float | None = None         # alignment + re-positioning + prefill of unmatched tokens
    swap_step: int | None = None            # tokens generated before the exact cache took over (None: never)
    optimistic_tokens: int = 0              # tokens emitted from the optimistic cache
    divergent_tokens: int | None = None     # of those, how many exact greedy decoding would not have chosen
    first_divergence: int | None = None     # index of the first such token
    background_prefill_s: float | None = None
    wait_s: float = 0.0                     # foreground time spent waiting for the exact cache
    reused_tokens: int = 0                  # prompt tokens taken from the donor
    prefix_tokens: int = 0                  # of those, the common prefix (delta 0)
    background_tokens: int = 0              # prompt tokens the exact prefill computes (all but an exact prefix)
    donors: int = 1                         # donor caches aligned against
    new_tokens: int = 0                     # prompt tokens prefilled in the foreground
    generated_tokens: int = 0
    exact: bool = False                     # the cache now holds exact K/V for every token
    kernels: str = "torch"                 # backend of the hot paths: "torch" or "triton" (HF_KVREUSE_KERNELS)

    def as_dict(self) -> dict:
        return asdict(self)


class OptimisticCache(KVReuseCache):
    """Start decoding from a previous agent's re-positioned cache; swap in the exact one when it is ready.

    Based on RebaseKV (Optimistic Cache Alignment). Usage::

        cache = OptimisticCache(model, input_ids=ids_b, donor_cache=out_a.cache, donor_ids=out_a.sequences)
        out_b = model.generate(ids_b, past_key_values=cache, max_new_tokens=64)   # or cache=cache
        print(cache.stats)

    Parameters
    ----------
    model : PreTrainedModel
        Causal LM with RoPE of a type that can be re-positioned (default, linear, llama3, yarn). It is passed to
        :func:`hf_kvreuse.enable` (in place, idempotent).
    input_ids : LongTensor ``[1, N]``, optional
        The target prompt; ``generate`` must be called with exactly these ids. ``None``: the prompt is taken from
        the ``generate`` call.
    donor_cache : transformers Cache, or a list of them
        A cache of the same model over ``donor_ids`` (e.g. ``out.cache`` of the previous ``generate`` with
        ``return_dict_in_generate=True``). Read, never modified. A list: spans are taken from any of them (e.g.
        the agent's own last prompt for its role text and the previous agent's for the shared context).
    donor_ids : LongTensor ``[1, L]``, or a list of them (one per donor cache)
        The donor's tokens (e.g. ``out.sequences``); only the first ``donor_cache`` length of them have K/V.
    max_optimistic_tokens : int or None, default=16
        At most this many tokens come from the optimistic cache: at that step the foreground waits for the exact
        cache. 0 waits before the first token (plain prefill); None never waits.
    record_divergence : bool, default=True
        Keep the replay's logits to count ``stats.divergent_tokens``.
    min_span : int, default=4
        Shortest non-prefix match reused from the donor.
    background_start : {"auto", "immediate", "after_first_token"}, default="auto"
        When the exact prefill starts. "auto": immediately on GPU (side stream), after the first token on CPU,
        where both compete for the same cores and starting early would delay the first token.
    background_chunk_tokens : int, optional
        Prefill the exact cache in chunks of this size; between chunks the job checks for cancellation and, on
        CPU, takes all cores once the foreground waits for it. Default: one forward (chunked prefill is 10-30%
        slower on CPU: later chunks cannot use the causal fast path of SDPA).
    background_threads : int, optional
        CPU only: intra-op threads of the background worker while the foreground decodes (default: all of the
        caller's threads; the foreground then decodes with one). Decoding a small model on CPU is bound by
        per-step overhead, so a decode thread beside a full-width prefill costs little, while halving the
        prefill's threads nearly doubles it (measured on the 2-core CPU: end-to-end 0.92x of full prefill vs
        1.05-1.2x with one thread each).
    on_early_finish : {"swap", "cancel"}, default="swap"
        If generation ends before the swap: "swap" waits and replays so the returned cache is exact;
        "cancel" stops the background job and leaves the optimistic cache (``stats.exact`` is False).
    release_donor : bool, default=False
        The donor is not needed after this call: its K/V are freed layer by layer while the optimistic cache is
        assembled (so the optimistic copy takes the donor's place in memory), and in any case when ``generate``
        returns. ``donor_cache`` is left empty and cannot serve again. Default: the donor is read, never
        modified.
    donor_exact : bool or list of bool, default=False
        The donor cache is the model's exact cache of its ids (true of a cache returned by a finished plain
        ``generate``, or by an OptimisticCache with ``stats.exact``), per donor for a list. The longest common
        prefix with an exact donor is then exact K/V for this prompt as well: the background prefill starts
        after it instead of at 0 (prefix caching, without its risk). Default: no donor is trusted, the exact
        prefill covers the whole prompt.
    verify_donor : bool, default=True
        Check that each donor was computed by ``model`` (:func:`hf_kvreuse.model_check.check_donor`): a cache this
        model's ``generate`` returned with its present weights is recognised by its tag; any other is probed (its
        layer-0 keys at a few positions against the model's own) and refused if another model made it. False: trust
        the donors (e.g. another peft adapter of this model on purpose).
    """

    def __init__(self, model, input_ids: torch.Tensor | None, donor_cache: Cache | list, donor_ids, *,
                 max_optimistic_tokens: int | None = 16, record_divergence: bool = True, min_span: int = 4,
                 background_start: Literal["auto", "immediate", "after_first_token"] = "auto",
                 background_chunk_tokens: int | None = None, background_threads: int | None = None,
                 on_early_finish: Literal["swap", "cancel"] = "swap", release_donor: bool = False,
                 donor_exact: bool | list = False, verify_donor: bool = True):
        from ..generation.mixin import enable

        super().__init__(model)
        enable(model)
        self._shifter = RopeShifter(model, layout=self.model_check.rope_layout)  # layout probed on this model
        if input_ids is not None:
            self.set_target(input_ids)
        many = isinstance(donor_cache, (list, tuple)) and not (donor_cache and isinstance(donor_cache[0], tuple))
        caches = list(donor_cache) if many else [donor_cache]
        ids = list(donor_ids) if many else [donor_ids]
        if not caches or len(ids) != len(caches):
            raise ValueError(f"{len(caches)} donor caches and {len(ids)} donor_ids: give one ids tensor per cache")
        exact = list(donor_exact) if isinstance(donor_exact, (list, tuple)) else [bool(donor_exact)] * len(caches)
        if len(exact) != len(caches):
            raise ValueError(f"donor_exact has {len(exact)} flags for {len(caches)} donors")
        self.donor_caches = caches
        self.donor_ids_list = [as_batch1(d, "donor_ids") for d in ids]
        self.donor_exact = exact
        if max_optimistic_tokens is not None and max_optimistic_tokens < 0:
            raise ValueError("max_optimistic_tokens must be >= 0 or None")
        if max_optimistic_tokens != 0 and offloaded(model):
            raise ValueError(f"{type(model).__name__} has offloaded weights (accelerate moves them in for every "
                             "forward, and its hooks are not thread-safe): OptimisticCache cannot prefill in the "
                             "background next to decoding. Load the model without offload, or pass "
                             "max_optimistic_tokens=0 (exact prefill before the first token)")
        if background_start not in ("auto", "immediate", "after_first_token"):
            raise ValueError(f"background_start={background_start!r}")
        if on_early_finish not in ("swap", "cancel"):
            raise ValueError(f"on_early_finish={on_early_finish!r}")
        self.max_optimistic_tokens = max_optimistic_tokens
        self.record_divergence = record_divergence
        self.min_span = min_span
        self.background_start = background_start
        self.background_chunk_tokens = background_chunk_tokens
        self.background_threads = background_threads
        self.on_early_finish = on_early_finish
        self.release_donor = release_donor
        self.stats = OptimisticStats()
        self.alignment: Alignment | None = None
        self.job: BackgroundPrefill | None = None
        self._budget = None
        self._threads_lowered = False
        self.verify_donor = verify_donor
        self._donor_lens = [self._check_donor(c, d) for c, d in zip(self.donor_caches, self.donor_ids_list)]
        self.stats.donors = len(caches)

    @property
    def donor_cache(self):
        """The donor cache (the first one, when several were given)."""
        return self.donor_caches[0] if self.donor_caches else None

    @property
    def donor_ids(self) -> torch.Tensor:
        return self.donor_ids_list[0]

    # -- generate entry --------------------------------------------------------------------------------------
    def prepare(self, model, input_ids, generate_kwargs) -> None:
        self.begin_generate(model, input_ids, generate_kwargs)
        self._t0 = now(self.input_ids.device)
        self._forwards = 0
        self._swapped = False
        self._replay = None
        self._threads_lowered = False
        n = self.input_ids.shape[1]
        on_cuda = self.input_ids.device.type == "cuda"
        synchronous = self.max_optimistic_tokens == 0
        self._budget = None
        if not on_cuda and not synchronous:
            # the worker's thread count changes the process default too: ThreadBudget puts it back at finish
            self._budget = ThreadBudget.acquire()
        baseline, running = self._budget or (torch.get_num_threads(), 1)
        self._fg_threads = baseline
        al = self.alignment = self._align()
        prefix_kv = None
        if al.prefix_len and self.donor_exact[al.prefix_donor]:
            prefix_kv = [(k[..., :al.prefix_len, :], v[..., :al.prefix_len, :])
                         for k, v in kv_of(self.donor_caches[al.prefix_donor])]
        self.stats.background_tokens = n - 1 - (al.prefix_len if prefix_kv else 0)
        self.job = BackgroundPrefill(
            model, self.input_ids[:, : n - 1], chunk_tokens=self.background_chunk_tokens,
            cpu_threads=self.background_threads or max(1, baseline // running), max_threads=baseline,
            synchronous=synchronous, prefix_kv=prefix_kv)
        if self.max_optimistic_tokens == 0:
            return  # the exact cache is built in before_forward, before the first token: plain prefill
        if self.background_start == "immediate" or (self.background_start == "auto" and on_cuda):
            self._start_background()
        t = now(self.input_ids.device)
        self._assemble()
        self.stats.assemble_s = now(self.input_ids.device) - t

    def _start_background(self) -> None:
        if self.job.started:
            return
        if self.input_ids.device.type == "cpu" and not self.job.synchronous:
            torch.set_num_threads(max(1, self._fg_threads - self.job.cpu_threads))
            self._threads_lowered = True
        self.job.start()

    def _restore_threads(self) -> None:
        if self._threads_lowered:
            torch.set_num_threads(self._fg_threads)
            self._threads_lowered = False

    def _check_donor(self, donor_cache, donor_ids: torch.Tensor) -> int:
        """Validate a donor against the model; return how many donor tokens have K/V."""
        donor_kv = kv_of(donor_cache)
        if getattr(donor_cache, "logical_offset", 0):
            raise ValueError("donor_cache holds fewer K/V entries than tokens (compressed); it cannot be a donor")
        if len(donor_kv) != len(self.layers):
            raise ValueError(f"donor_cache has {len(donor_kv)} layers, the model {len(self.layers)}: "
                             "was it made by another model?")
        kv_heads, head_dim = self.model_check.kv_heads, self.model_check.head_dim  # from the model's own cache
        k0 = donor_kv[0][0]
        if k0.shape[0] != 1 or k0.shape[1] != kv_heads or k0.shape[-1] != head_dim:
            raise ValueError(f"donor_cache K/V shape {tuple(k0.shape)} does not fit this model "
                             f"(batch 1, {kv_heads} KV heads of size {head_dim})")
        donor_len = kv_length(donor_kv)
        if donor_ids.shape[1] < donor_len:
            raise ValueError(f"donor_ids has {donor_ids.shape[1]} tokens but donor_cache covers {donor_len}")
        if self.verify_donor:
            check_donor(self.model, donor_cache, donor_ids, donor_len, who=type(self).__name__)
        return donor_len

    def _align(self) -> Alignment:
        return align_multi(self.donor_ids_list, self.input_ids, min_span=self.min_span, donor_limits=self._donor_lens,
                           target_limit=self.input_ids.shape[1] - 1)

    @torch.no_grad()
    def _assemble(self) -> None:
        donors = [list(kv_of(c)) for c in self.donor_caches]
        covered = self.input_ids.shape[1] - 1
        al = self.alignment
        device = donors[0][0][0].device
        # Layer by layer, span by span, straight into uninitialised storage: every row is written before it
        # is read (matched rows here, unmatched ones by partial_forward before their layer attends), so no
        # zero fill, no full-length index_select or rotated temporaries. With release_donor each donor layer
        # is dropped as soon as it is copied: the optimistic cache then takes the donors' place in memory.
        kv = []
        for i in range(len(donors[0])):
            like_k, like_v = donors[0][i]
            dk, dv = alloc_layer(like_k, covered), alloc_layer(like_v, covered)
            for sp in al.spans:
                k, v = donors[sp.donor][i]
                t, d, n = sp.target_start, sp.donor_start, sp.length
                copy_shifted_(dk[..., t:t + n, :], k[..., d:d + n, :], self._shifter, sp.delta)
                dv[..., t:t + n, :].copy_(v[..., d:d + n, :])
            kv.append((dk, dv))
            del like_k, like_v
            if self.release_donor:
                for j, cache in enumerate(self.donor_caches):
                    donors[j][i] = None
                    release_layer(cache, i)
        del donors
        unmatched = al.unmatched().to(device)
        if unmatched.numel():
            partial_forward(self.model, self.input_ids[:, :covered].to(device), unmatched, kv)
        load_kv(self, kv)
        self.logical_offset = 0
        self.stats.reused_tokens = al.matched
        self.stats.prefix_tokens = al.prefix_len
        self.stats.new_tokens = int(unmatched.numel())

    # -- per step ----------------------------------------------------------------------------------------------
    def before_forward(self, input_ids, next_sequence_length):
        if self._swapped:
            return next_sequence_length, {}
        generated = input_ids.shape[1] - self.input_ids.shape[1]
        self.job.raise_if_failed()
        if generated >= 1 and not self.job.started:
            self._start_background()
        limit = self.max_optimistic_tokens
        if not (self.job.ready() or (limit is not None and generated >= limit)):
            return next_sequence_length, {}
        feed = self._swap_in(input_ids)
        keep = feed if (self.record_divergence and generated > 0) else 1
        return feed, {"logits_to_keep": keep}

    def _swap_in(self, input_ids: torch.Tensor) -> int:
        """Load the exact prefix K/V; return how many trailing tokens must be fed to replay the rest."""
        t = now(self.input_ids.device)
        if not self.job.started:
            self._start_background()
        kv = self.job.result()
        self.job._cache = None  # the exact K/V now live in this cache only: freed as decoding moves on
        self.stats.wait_s += now(self.input_ids.device) - t
        self._restore_threads()
        load_kv(self, kv)
        self.logical_offset = 0
        n = self.input_ids.shape[1]
        generated = input_ids.shape[1] - n
        self._swapped = True
        self.stats.swap_step = generated
        self.stats.optimistic_tokens = generated
        self.stats.exact = True
        self._replay = input_ids if self.record_divergence and generated > 0 else None
        return input_ids.shape[1] - (n - 1)

    def after_forward(self, outputs) -> None:
        self._forwards += 1
        if self._forwards == 1:
            self.stats.ttft_s = now(self.input_ids.device) - self._t0
        if self._replay is not None:
            self._count_divergence(outputs.logits[0, :-1], self._replay)
            self._replay = None

    def _count_divergence(self, logits: torch.Tensor, sequence: torch.Tensor) -> None:
        """``logits`` ``[g, V]``: the exact model's raw logits of the ``g`` generated tokens of ``sequence``
        ``[1, n + g]``; a token diverges where the call's processed scores (repetition penalty, bad words, ...)
        would make exact greedy decoding choose another."""
        n = self.input_ids.shape[1]
        tokens = sequence[0, n:n + logits.shape[0]].to(logits.device)
        scores = self.process_logits(sequence.to(logits.device), logits, n)
        diff = (scores.argmax(-1) != tokens).nonzero()
        self.stats.divergent_tokens = int(diff.numel())
        self.stats.first_divergence = int(diff[0, 0]) if diff.numel() else None

    # -- generate exit -------------------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, sequences, error) -> None:
        job = self.job
        try:
            if error is not None or job is None:
                return
            n = self.input_ids.shape[1]
            self.stats.generated_tokens = int(sequences.shape[1] - n) if sequences is not None else 0
            if self._swapped:
                return
            self.stats.optimistic_tokens = self.stats.generated_tokens
            if self.on_early_finish == "cancel" or sequences is None:
                job.raise_if_failed()
                return
            # make the returned cache exact: exact prefix + replay of every fed token
            fed = sequences[:, : sequences.shape[1] - 1]
            feed = self._swap_in(fed)
            replay = fed[:, -feed:].to(self.input_ids.device)
            pos = torch.arange(n - 1, fed.shape[1], device=replay.device)[None]
            out = self.model(input_ids=replay, position_ids=pos, use_cache=True,
                             logits_to_keep=0 if self.record_divergence else 1, **cache_kwargs(self))
            # every generated token was optimistic, the last one (never fed) included
            self.stats.swap_step = self.stats.optimistic_tokens = self.stats.generated_tokens
            if self.record_divergence:
                self._count_divergence(out.logits[0], sequences)
            self._replay = None
        finally:
            if self.release_donor:
                for cache in self.donor_caches:
                    release_kv(cache)
            self.donor_caches = []  # the donor is not needed any more; do not keep its memory alive
            if job is not None:
                if job.ready():
                    job.join()
                else:
                    job.cancel()
                self.stats.background_prefill_s = job.elapsed_s
                job._cache = None  # the cache took its tensors (or has moved on): no second copy of the prompt
            self._restore_threads()
            if self._budget is not None:
                self._budget = None
                ThreadBudget.release()
