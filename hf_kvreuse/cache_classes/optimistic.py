"""OptimisticCache: RebaseKV's optimistic cache alignment as a drop-in transformers cache.

Based on "RebaseKV: Hiding Prefill Latency in Multi-Agent LLMs via Optimistic Cache Alignment" (seed abstract;
algorithm of METHODS.md §2.1, whose details are our reading of the abstract). Algorithm, per ``generate`` call:

1. Align the target prompt with the donors' tokens (previous agents' prompts + answers): common prefix and
   matching non-prefix spans, from one donor or several (:mod:`hf_kvreuse.alignment`).
2. Optimistic cache: matched spans copied from the donor cache and RoPE-re-positioned to their target
   positions (:mod:`hf_kvreuse.rope`); only the unmatched target tokens are computed, in place, attending
   causally to the stale cache (:func:`hf_kvreuse.generation.partial.partial_forward`). By default
   (``fuse_first_step``) they are computed in the same forward as the first decode step, with the last prompt
   token as one more row: first token ≈ one forward over the unmatched tokens (a separate decode step costs a
   whole pass over the weights: ~0.17 s of ~0.78 s on Qwen2.5-0.5B fp32 on this CPU, research notes).
3. Foreground decoding starts at once from that cache, while the exact prefill of the prompt runs in the
   background (:class:`hf_kvreuse.generation.background.BackgroundPrefill`); when a donor is known to be an
   exact cache (``donor_exact``), the exact prefill starts after the common prefix with it.
4. Rebase: at the first step boundary where the exact cache is ready (or when ``max_optimistic_tokens`` is
   reached, waiting for it), the exact cache is swapped in and the tokens generated so far are replayed on it.
   Two ways to treat the tokens emitted before (``rebase=``):

   * ``"commit"`` (RebaseKV as published): they stay; the replay runs in the same forward that produces the next
     token, and from then on every token is the one full prefill would give after the same earlier tokens. The
     replay's logits count how many optimistic tokens exact greedy decoding would not have chosen
     (``divergent_tokens``). Two options bring commit closer to full prefill: a confidence gate (``gate=``, stop
     emitting optimistic tokens at the first uncertain step: that step's token already comes from the exact
     cache; ``gate_tokens=``, the same before a token the caller marks as decisive) and a repair of the
     optimistic cache before the first token (``repair=``).
   * ``"verify"``: they are drafts, verified by the replay's exact logits as speculative decoding verifies a
     draft model's tokens (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
     Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"). Greedy: the
     longest run of drafts that equal the exact argmax is kept, the first other token is replaced by the exact
     choice and decoding continues from the exact cache cropped there: the output is plain ``generate``'s.
     Sampling: draft ``t`` drawn from ``q`` is kept with probability ``min(1, p(t) / q(t))``; at the first
     rejection a token is drawn from ``max(0, p - q)`` normalised; if every draft is kept, the next token is drawn
     from ``p``: the output follows the exact distribution. Streamers receive verified tokens only.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from transformers import Cache, StoppingCriteria, StoppingCriteriaList

from ..alignment import Alignment, align_multi
from ..compat import cache_kwargs, init_layer
from ..devices import offloaded
from ..generation.background import BackgroundPrefill, ThreadBudget
from ..generation.fused import PendingRows, returns_internals
from ..generation.partial import partial_forward
from ..hybrid import attention_rows, check_state_donor, copy_states, plan_draft, rewind, state_at, state_cache, \
    state_indices
from ..model_check import check_exact_donor
from ..model_check import check_donor
from ..kv import alloc_layer, copy_shifted_, kv_length, kv_of, load_kv, release_kv, release_layer
from ..rope import RopeShifter
from ..sliding import crop_rows, keep_history, keep_rows, layer_windows
from ..timing import now
from ..reprs import stats_repr
from .base import KVReuseCache, as_batch1


@dataclass
class OptimisticStats:
    """What happened during one ``generate`` with an :class:`OptimisticCache` (times in seconds).

    Attributes
    ----------
    ttft_s : float or None
        ``generate`` entry to the first token the caller receives: under ``"commit"`` the first (optimistic)
        token's logits, under ``"verify"`` the first verified token (drafts are never handed out).
    draft_ttft_s : float or None
        ``generate`` entry to the first forward's logits (under ``"verify"``: the first draft, which the caller
        does not see; equal to ``ttft_s`` under ``"commit"``).
    exact_output : bool
        The returned tokens are guaranteed equal to plain ``generate``'s (greedy, or sampling with the same seed):
        True under ``"verify"`` and whenever no optimistic token was emitted; never True for tokens ``"commit"``
        emitted from the optimistic cache.
    drafted_tokens : int or None
        ``"verify"``: drafts the optimistic cache produced before verification; None under ``"commit"``.
    assemble_s : float or None
        Alignment, re-positioning of the donor rows and prefill of the unmatched rows (with ``fuse_first_step``
        the unmatched rows are computed in the first token's forward instead, and are not counted here).
    swap_step : int or None
        Tokens generated before the exact cache took over (0: before the first token; None: never swapped).
    optimistic_tokens : int
        Tokens emitted from the optimistic (re-positioned) cache.
    divergent_tokens : int or None
        Of those, how many exact greedy decoding would not have chosen (None: not recorded).
    first_divergence : int or None
        Index of the first such token.
    background_prefill_s : float or None
        Wall time of the exact background prefill.
    wait_s : float
        Foreground time spent waiting for the exact cache.
    reused_tokens : int
        Prompt tokens whose K/V were taken from the donors and kept (with ``max_optimistic_tokens=0``: the exact
        prefix); rows ``repair=`` recomputed are not counted.
    prefix_tokens : int
        Of those, the common prefix with a donor (moved by 0 positions).
    background_tokens : int
        Prompt tokens the exact prefill computes (all but the last and an exact donor prefix).
    donors : int
        Donor caches aligned against.
    new_tokens : int
        The prompt tokens whose K/V this call computed before the first token, the last prompt token included
        (``generate`` always feeds it) and the rows ``repair=`` recomputed: ``reused_tokens + new_tokens`` is the
        prompt length. The same count as :attr:`hf_kvreuse.SessionStats.new_tokens`.
    generated_tokens : int
        Tokens generated by the call.
    exact : bool
        The cache now holds the model's exact K/V for every token.
    kernels : str
        Backend of the hot paths: ``"torch"`` or ``"triton"`` (``HF_KVREUSE_KERNELS``).
    rebase : str
        ``"commit"`` (the optimistic tokens are kept) or ``"verify"`` (they are drafts the exact cache verifies).
    accepted_tokens : int or None
        ``"verify"``: drafts kept (each equals what full prefill gives); None under ``"commit"``.
    rejected_tokens : int or None
        ``"verify"``: drafts withdrawn (the first one replaced by the exact choice); None under ``"commit"``.
    gated_step : int or None
        ``"commit"`` with ``gate=`` or ``gate_tokens=``: the step whose logits triggered the swap (None: no gate
        fired).
    gate_reason : str or None
        Why that step was gated: ``"margin"`` (below ``gate``) or ``"token"`` (a decisive token was due).
    repaired_tokens : int
        Donor rows recomputed before the first token (``repair="blend"`` / ``"epic"``); counted in ``new_tokens``.
    fused_first_step : bool
        The unmatched (and ``repair="epic"``) rows were computed in the first token's forward
        (``fuse_first_step``), not before it.
    rerun_tokens : int
        Linear-attention hybrids under ``"verify"``: tokens fed again after the verification withdrew a draft (a
        recurrent state cannot be cut back; it is restored from its copy at the prompt and the kept tokens rerun).
    background_start : str or None
        When this call's exact prefill started, ``background_start="auto"`` resolved: ``"immediate"`` or
        ``"after_first_token"`` (None: no background job, ``max_optimistic_tokens=0``).
    draft_margins : list of float
        Top-1 minus top-2 probability of the call's processed scores at every step decided from the optimistic
        cache (drafts under ``"verify"``), in order. With ``first_divergence`` / ``accepted_tokens`` it tells
        offline what any ``gate=`` threshold would have done to this call (the gate curve in the research notes). Recorded with
        ``record_divergence=True`` (the default) or a gate.
    """

    __repr__ = stats_repr

    ttft_s: float | None = None             # generate() entry -> the first token the caller receives
    draft_ttft_s: float | None = None       # generate() entry -> the first forward's logits (a draft under verify)
    exact_output: bool = False              # the returned tokens equal plain generate's (greedy or same seed)
    drafted_tokens: int | None = None       # verify: drafts made before verification
    assemble_s: float | None = None         # alignment + re-positioning (+ prefill of unmatched tokens unfused)
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
    rebase: str = "commit"                  # "commit" or "verify"
    accepted_tokens: int | None = None      # verify: drafts kept (they equal what full prefill gives)
    rejected_tokens: int | None = None      # verify: drafts withdrawn (the first one replaced by the exact choice)
    gated_step: int | None = None           # commit + gate: the step whose uncertain logits triggered the swap
    gate_reason: str | None = None          # "margin" (below gate) or "token" (a decisive token was due)
    repaired_tokens: int = 0                # reused rows recomputed before the first token (repair=)
    rerun_tokens: int = 0                   # hybrids, verify: kept tokens fed again after a withdrawn draft
    background_start: str | None = None     # "immediate" or "after_first_token" ("auto" resolved)
    fused_first_step: bool = False          # the unmatched rows were computed in the first token's forward
    draft_margins: list[float] = field(default_factory=list, repr=False)  # p1 - p2 at every optimistic step

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
        When the exact prefill starts. "auto": immediately on GPU (side stream) and under ``rebase="verify"``;
        after the first token under ``"commit"`` on CPU, where both compete for the same cores and starting early
        would delay the first token. Under ``"verify"`` a streamer sees only verified tokens, so the first one that
        counts is the first verified token, which an early start brings forward (2-core CPU, Qwen2.5-0.5B, 54
        calls: 0.78x in the median optimistic call; research notes).
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
        prefill covers the whole prompt. A donor passed as exact whose producer tag shows this model with other
        weights, another adapter state (LoRA scaling included) or config is refused (``ValueError``), also with
        ``verify_donor=False``; with ``verify_donor`` an untagged one must match the model's own keys and values
        in every layer over its first tokens (:func:`hf_kvreuse.model_check.check_exact_donor`).
    rebase : {"verify", "commit"}, default="verify"
        What happens to the tokens emitted before the swap (module docstring). "verify" (the default everywhere in
        hf_kvreuse): they are drafts checked by the exact logits; the output equals plain ``generate``'s token for
        token, greedy or sampled with the same seed (each verified position is sampled from the exact
        distribution with the global generator, in plain ``generate``'s order; a draft is kept only while it
        equals that sample), and streamers receive verified tokens only (``stats.ttft_s`` is the first verified
        token). "commit" (opt-in, approximate): they stay (RebaseKV as published): the lowest time to the first
        streamed token, but answers may differ from full prefill's (``stats.divergent_tokens``,
        ``stats.exact_output`` False).
    gate : float, optional
        ``rebase="commit"`` only: stop emitting optimistic tokens at the first step whose top-1 probability margin
        (``p1 - p2`` of the call's processed distribution) is below ``gate``; that step's token then comes from the
        exact cache (the foreground waits for it). None: no gate.
    gate_tokens : iterable of int, optional
        ``rebase="commit"`` only: token ids the caller marks as decisive (the first token of "Yes" / "No", of a
        number, of a function name, ...): no optimistic step emits one; the step that would is gated like an
        uncertain one and its token comes from the exact cache. Greedy: a step is gated when its greedy choice is
        one of them. Sampling: when the call's processed distribution gives any of them a nonzero probability
        (with ``top_k`` / ``top_p`` that is the steps where one could be drawn; without them, every step: the
        first token then already waits for the exact cache). The answers' tokens that decide a task then always
        equal full prefill's choice after the same earlier tokens. None: no token gate.
    repair : {"blend", "epic"}, optional
        Recompute a few reused rows of the optimistic cache before the first token: "blend" (CacheBlend's
        deviation-based selection of ``repair_ratio`` of the reused rows after the exact prefix) or "epic" (the
        first ``repair_tokens`` rows of every reused span, EPIC's LegoLink). None: no repair.
    repair_ratio : float, default=0.15
    repair_tokens : int, default=16
    fuse_first_step : bool, default=True
        Compute the unmatched rows (and ``repair="epic"``'s) in the first token's forward, the last prompt token as
        one more row of the same partial forward (the same causal position mask, so the same K/V and logits up to
        float rounding), instead of a forward over them followed by a one-token decode step: one pass over the
        weights less before the first token. Not with ``repair="blend"`` (its selection needs the rows first) nor
        when ``generate`` returns attentions or hidden states (they would cover the fused rows). False: the two
        forwards of RebaseKV as published.
    sliding_history : bool, default=False
        Models with sliding-window layers: the exact cache's sliding layers also keep every row on the side
        (:func:`hf_kvreuse.sliding.keep_history`; what they hand to attention stays transformers' own), so that
        :func:`~hf_kvreuse.sliding.take_history` gives every row of the returned cache: a donor for a later
        call. ReuseSession sets it for the caches it holds. More memory: those layers are kept in full.
    verify_donor : bool, default=True
        Check that each donor was computed by ``model`` (:func:`hf_kvreuse.model_check.check_donor`): a cache this
        model's ``generate`` returned with its present weights is recognised by its tag; any other is probed (its
        layer-0 keys at a few positions against the model's own) and refused if another model made it. False: trust
        the donors (e.g. another peft adapter of this model on purpose).
    donor_states : dict or list of dict, optional
        Linear-attention hybrids (Notes): per donor, ``{token count: {layer index: copy of that recurrent-state
        layer after that many tokens}}``, the points where a draft may cut the donor's span (the donor cache's own
        state counts for its last token). ReuseSession passes the copies it holds.
    state_every : int, default=256
        Linear-attention hybrids: the exact background prefill copies its states at multiples of this many tokens
        (``state_snapshots``), for later calls. 0: none.
    state_copies : int or None, default=2
        How many of those multiples get a copy: the last ones (each copy splits the prefill into one more forward).
        None: every one.

    Notes
    -----
    Models with sliding-window layers (Gemma 2/3, Mistral or Qwen2 with a window, ...): the optimistic cache is
    assembled over every row and its unmatched rows are computed with each layer type's own mask (the window
    added); the sliding layers then keep what transformers' own layers keep after a prefill (the last
    ``window - 1`` rows), as does the exact cache. A donor must hold every row of every layer (a cache longer than
    the window keeps only the window there: refused; ReuseSession's held caches and
    :func:`hf_kvreuse.sliding.take_history` give every row). The first step is not fused on these models.

    Linear-attention hybrids (Qwen3.5, Qwen3-Next: recurrent-state layers beside attention layers,
    :mod:`hf_kvreuse.hybrid`): a recurrent state sums its whole prefix and stands for exactly the tokens it was
    taken after, so a draft reuses one donor span, cut where a copy of that donor's state exists (``donor_states``;
    the donor cache's own state counts for its last token): the prompt's start comes from an exact donor's state
    where one is a prefix of it (else it is computed), the tokens up to the span are computed, the span's attention
    rows are the donor's re-positioned and every state layer takes the donor's state at the span's end, and the
    prompt after it is computed over that cache. Where no span saves ``min_span`` tokens and half of what the exact
    start leaves to compute, there is no draft: the exact cache is built before the first token (exact start + the
    rest). The exact prefill runs in the background from the exact start, copying its
    states at the last ``state_copies`` multiples of ``state_every`` tokens (``state_snapshots``: later calls
    draft or start from them). Under
    ``"verify"`` a rejected draft costs one more forward over the kept tokens (a state cannot be cut back: it is
    restored from a copy taken before the replay and the kept tokens are fed again; ``stats.rerun_tokens``).
    ``repair`` does not apply.
    """

    sliding_ok = True
    states_ok = True

    def __init__(self, model, input_ids: torch.Tensor | None, donor_cache: Cache | list, donor_ids, *,
                 max_optimistic_tokens: int | None = 16, record_divergence: bool = True, min_span: int = 4,
                 background_start: Literal["auto", "immediate", "after_first_token"] = "auto",
                 background_chunk_tokens: int | None = None, background_threads: int | None = None,
                 on_early_finish: Literal["swap", "cancel"] = "swap", release_donor: bool = False,
                 donor_exact: bool | list = False, verify_donor: bool = True,
                 rebase: Literal["verify", "commit"] = "verify", gate: float | None = None,
                 gate_tokens=None, repair: Literal["blend", "epic"] | None = None, repair_ratio: float = 0.15,
                 repair_tokens: int = 16, fuse_first_step: bool = True, sliding_history: bool = False,
                 donor_states=None, state_every: int = 256, state_copies: int | None = 2):
        from ..generation.mixin import enable

        super().__init__(model)
        enable(model)
        # recurrent-state layers of a linear-attention hybrid ([] for attention-only models)
        self._states = state_indices(self) or []
        if state_every < 0:
            raise ValueError(f"state_every must be >= 0, got {state_every}")
        if state_copies is not None and state_copies < 0:
            raise ValueError(f"state_copies must be >= 0 or None, got {state_copies}")
        self.state_every, self.state_copies = int(state_every), state_copies
        self.state_snapshots: dict = {}
        self._shifter = RopeShifter(model, layout=self.model_check.rope_layout)  # layout probed on this model
        # sliding-window layers (None: full attention): assembled over every row, kept as transformers keeps them
        self._windows = layer_windows(model.config)
        self.sliding_history = bool(sliding_history) and any(self._windows)
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
        if rebase not in ("verify", "commit"):
            raise ValueError(f"rebase={rebase!r}: choose 'verify' (exact output) or 'commit' (RebaseKV)")
        if gate is not None and rebase != "commit":
            raise ValueError("gate= applies to rebase='commit' (verify already withdraws every wrong draft)")
        if gate is not None and not 0.0 <= gate <= 1.0:
            raise ValueError("gate must be a probability margin in [0, 1]")
        self._gate_tokens = self._decisive_ids(model, gate_tokens, rebase)
        self._gate_ids = frozenset(self._gate_tokens.tolist()) if self._gate_tokens is not None else frozenset()
        if repair not in (None, "blend", "epic"):
            raise ValueError(f"repair={repair!r}: choose None, 'blend' or 'epic'")
        if not 0.0 <= repair_ratio <= 1.0 or repair_tokens < 0:
            raise ValueError("repair_ratio must be in [0, 1] and repair_tokens >= 0")
        if repair is not None and self._states:
            raise ValueError(f"repair={repair!r} does not apply to {type(model).__name__}: its recurrent-state layers "
                             "cannot recompute rows in place (drafts there reuse one span and compute the rest)")
        if repair == "blend" and any(self._windows):
            raise ValueError(f"repair='blend' does not support {type(model).__name__}: it has sliding-window "
                             "layers (repair='epic' or None do)")
        if repair == "blend":  # CacheBlend drives the decoder layers itself: the layer-range probe must pass
            from ..model_check import require

            require(model, layers=True, who=f"{type(self).__name__}(repair='blend')")
        if not isinstance(fuse_first_step, bool):
            raise TypeError(f"fuse_first_step must be True or False, got {fuse_first_step!r}")
        self.rebase, self.gate = rebase, gate
        self.fuse_first_step = fuse_first_step
        self.repair, self.repair_ratio, self.repair_tokens = repair, repair_ratio, repair_tokens
        self.max_optimistic_tokens = max_optimistic_tokens
        self.record_divergence = record_divergence
        self.min_span = min_span
        self.background_start = background_start
        self.background_chunk_tokens = background_chunk_tokens
        self.background_threads = background_threads
        self.on_early_finish = on_early_finish
        self.release_donor = release_donor
        self.stats = OptimisticStats(rebase=rebase)
        self.alignment: Alignment | None = None
        self.job: BackgroundPrefill | None = None
        self._budget = None
        self._threads_lowered = False
        self.verify_donor = verify_donor
        self._donor_lens = [self._check_donor(c, d, e)
                            for c, d, e in zip(self.donor_caches, self.donor_ids_list, self.donor_exact)]
        self._points = self._check_donor_states(donor_states) if self._states else None
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
        self._last_input_ids = None
        self._threads_lowered = False
        self._pending = None
        # the fused first step's masks know no sliding window: such models compute their rows before it
        self._fuse = (self.fuse_first_step and self.repair != "blend" and not any(self._windows)
                      and not self._states and not returns_internals(model, generate_kwargs))
        self._no_draft = False
        n = self.input_ids.shape[1]
        on_cuda = self.input_ids.device.type == "cuda"
        synchronous = self.max_optimistic_tokens == 0
        self._budget = None
        if not on_cuda and not synchronous:
            # the worker's thread count changes the process default too: ThreadBudget puts it back at finish
            self._budget = ThreadBudget.acquire()
        baseline, running = self._budget or (torch.get_num_threads(), 1)
        self._fg_threads = baseline
        if self._states:
            return self._prepare_states(baseline, running, synchronous, on_cuda)
        al = self.alignment = self._align()
        prefix_kv = None
        if al.prefix_len and self.donor_exact[al.prefix_donor]:
            prefix_kv = [(k[..., :al.prefix_len, :], v[..., :al.prefix_len, :])
                         for k, v in kv_of(self.donor_caches[al.prefix_donor])]
        self.stats.background_tokens = n - 1 - (al.prefix_len if prefix_kv else 0)
        self.job = BackgroundPrefill(
            model, self.input_ids[:, : n - 1], chunk_tokens=self.background_chunk_tokens,
            cpu_threads=self.background_threads or max(1, baseline // running), max_threads=baseline,
            synchronous=synchronous, prefix_kv=prefix_kv, windows=self._windows if self.sliding_history else None)
        if self.max_optimistic_tokens == 0:
            # the exact cache is built in before_forward, before the first token: plain prefill after the prefix
            self.stats.new_tokens = self.stats.background_tokens + 1
            self.stats.reused_tokens = self.stats.prefix_tokens = n - 1 - self.stats.background_tokens
            return
        self._start_and_assemble(on_cuda, self._assemble)

    def _start_and_assemble(self, on_cuda: bool, assemble) -> None:
        """Start the exact prefill now where ``background_start`` says so, then build the optimistic cache."""
        at_once = self.background_start == "immediate" or (
            self.background_start == "auto" and (on_cuda or self.rebase == "verify"))
        self.stats.background_start = "immediate" if at_once else "after_first_token"
        if at_once:
            self._start_background()
        t = now(self.input_ids.device)
        assemble()
        self.stats.assemble_s = now(self.input_ids.device) - t

    @torch.no_grad()
    def _prepare_states(self, baseline: int, running: int, synchronous: bool, on_cuda: bool) -> None:
        """A linear-attention hybrid (class Notes): plan the draft, start the exact prefill from the exact start,
        assemble the draft."""
        n = self.input_ids.shape[1]
        covered = n - 1
        self.alignment = self._align()
        # one span per draft, cut at a state copy: every donor's own matches are candidates (the joint alignment
        # would keep one donor per region, perhaps one without a copy inside it)
        spans = [dataclasses.replace(sp, donor=d) for d, ids in enumerate(self.donor_ids_list)
                 for sp in align_multi([ids], self.input_ids, min_span=self.min_span,
                                       donor_limits=[self._donor_lens[d]], target_limit=covered).spans]
        plan = self.plan = plan_draft(spans, self.input_ids[0], [d[0] for d in self.donor_ids_list], self._points,
                                      self.donor_exact, covered, self.min_span)
        self._no_draft = plan.span_donor < 0  # nothing saves min_span tokens: the draft would be the exact cache
        self.stats.prefix_tokens = plan.exact_len
        self.stats.background_tokens = covered - plan.exact_len
        self.job = BackgroundPrefill(
            self.model, self.input_ids[:, :covered], chunk_tokens=self.background_chunk_tokens,
            cpu_threads=self.background_threads or max(1, baseline // running), max_threads=baseline,
            synchronous=synchronous or self._no_draft, start_cache=self._state_at(plan.exact_donor, plan.exact_len),
            snapshot_every=self.state_every, snapshot_last=self.state_copies)
        if synchronous or self._no_draft:
            self.stats.new_tokens = self.stats.background_tokens + 1
            self.stats.reused_tokens = plan.exact_len
            return
        self._start_and_assemble(on_cuda, lambda: self._assemble_states(plan, covered))

    def _assemble_states(self, plan, covered: int) -> None:
        """The draft of a hybrid's prompt (``plan``: :class:`hf_kvreuse.hybrid.DraftPlan`) loaded into this cache."""
        ids = self.input_ids
        cache = self._state_at(plan.exact_donor, plan.exact_len)

        def run(a: int, b: int) -> None:
            if b > a:
                pos = torch.arange(a, b, device=ids.device)[None]
                self.model(input_ids=ids[:, a:b], position_ids=pos, use_cache=True, logits_to_keep=1,
                           **cache_kwargs(cache))

        run(plan.exact_len, plan.span_target)
        donor = self.donor_caches[plan.span_donor]
        snap = (self._donor_states[plan.span_donor].get(plan.state_at)
                if plan.state_at != self._donor_lens[plan.span_donor] else None)
        a, b = plan.span_donor_start, plan.state_at
        for i, layer in enumerate(cache.layers):
            if i in self._states:  # the donor's state after the span's last reused token
                cache.layers[i] = copy.deepcopy(snap[i] if snap is not None else donor.layers[i])
                continue
            if getattr(donor.layers[i], "keys", None) is None:  # a layer that holds nothing (an MLP block)
                continue
            dk, dv = donor.layers[i].keys[..., a:b, :], donor.layers[i].values[..., a:b, :]
            k = alloc_layer(dk, b - a)
            copy_shifted_(k, dk, self._shifter.for_layer(i), plan.delta)
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                init_layer(layer, k, dv)
                layer.keys, layer.values = k, dv.clone()
            else:
                layer.keys, layer.values = torch.cat([layer.keys, k], -2), torch.cat([layer.values, dv], -2)
        run(plan.resume, covered)
        self.layers[:] = cache.layers
        self.logical_offset = 0
        self.stats.fused_first_step = False
        self.stats.reused_tokens = plan.exact_len + plan.reused
        self.stats.new_tokens = plan.computed(covered) + 1

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

    def _check_donor(self, donor_cache, donor_ids: torch.Tensor, exact: bool = False) -> int:
        """Validate a donor against the model; return how many donor tokens have K/V. ``exact`` (its
        ``donor_exact`` flag): a producer tag showing this model with other weights, adapters or config refuses
        it, and with ``verify_donor`` an untagged one is probed on every layer's keys and values
        (:func:`~hf_kvreuse.model_check.check_exact_donor`)."""
        if self._states:
            return self._check_state_donor(donor_cache, donor_ids, exact)
        donor_kv = kv_of(donor_cache)
        rows = {k.shape[-2] for k, _ in donor_kv}
        # a transformers sliding layer that has seen more tokens than it holds: its first rows are gone
        cut = [int(layer.get_seq_length()) for layer in getattr(donor_cache, "layers", ())
               if getattr(layer, "is_sliding", False) and int(layer.get_seq_length()) > layer.keys.shape[-2]]
        if any(self._windows) and (len(rows) > 1 or cut):
            raise ValueError(
                f"donor_cache of {type(self.model).__name__}: its sliding-window layers hold {min(rows)} rows of "
                f"{max(cut + list(rows))} tokens (a cache of more tokens than the window keeps only the window's rows "
                "there). A donor needs every row of every layer: pass ReuseSession's held caches (they keep them), "
                "the K/V list hf_kvreuse.sliding.take_history gives, or a donor shorter than the window")
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
        if exact:
            check_exact_donor(self.model, donor_cache, donor_ids, donor_len, type(self).__name__, self.verify_donor)
        return donor_len

    def _check_state_donor(self, donor_cache, donor_ids: torch.Tensor, exact: bool = False) -> int:
        """A hybrid's donor: a cache of this model's own layer kinds (the same recurrent-state layers); return how
        many tokens its attention layers hold (its states stand for as many)."""
        name = type(self.model).__name__
        states = state_indices(donor_cache)
        if states != self._states or len(donor_cache.layers) != len(self.layers):
            raise ValueError(f"donor_cache is not a cache of {name}: its recurrent-state layers are {states}, the "
                             f"model's {self._states} ({len(getattr(donor_cache, 'layers', []))} layers, the model "
                             f"{len(self.layers)}). Pass the cache this model's generate returned")
        donor_len = attention_rows(donor_cache, states)
        first = next((i for i, layer in enumerate(donor_cache.layers)
                      if i not in states and getattr(layer, "keys", None) is not None), None)
        if first is None:
            raise ValueError(f"donor_cache holds no attention rows of {name}: nothing to re-position")
        k0 = donor_cache.layers[first].keys
        kv_heads, head_dim = self.model_check.kv_heads, self.model_check.head_dim
        if donor_len and (k0.shape[0] != 1 or k0.shape[1] != kv_heads or k0.shape[-1] != head_dim):
            raise ValueError(f"donor_cache K/V shape {tuple(k0.shape)} does not fit this model "
                             f"(batch 1, {kv_heads} KV heads of size {head_dim})")
        if donor_ids.shape[1] < donor_len:
            raise ValueError(f"donor_ids has {donor_ids.shape[1]} tokens but donor_cache covers {donor_len}")
        if self.verify_donor:
            check_state_donor(self.model, donor_cache, donor_ids, donor_len, states, type(self).__name__)
        if exact:
            check_exact_donor(self.model, donor_cache, donor_ids, donor_len, type(self).__name__, self.verify_donor)
        return donor_len

    def _check_donor_states(self, donor_states) -> list[list[int]]:
        """Each donor's state points: token counts where a copy of its recurrent-state layers exists (its own last
        token, and the keys of ``donor_states[d]``: ``{tokens: {layer index: layer copy}}``)."""
        k = len(self.donor_caches)
        given = [None] * k if donor_states is None else (
            list(donor_states) if isinstance(donor_states, (list, tuple)) else [donor_states])
        if len(given) != k:
            raise ValueError(f"donor_states has {len(given)} entries for {k} donors (one dict or None per donor)")
        self._donor_states = []
        points = []
        for d, snaps in enumerate(given):
            snaps = dict(snaps or {})
            for b, snap in snaps.items():
                if not isinstance(b, int) or not 0 < b <= self._donor_lens[d]:
                    raise ValueError(f"donor_states[{d}] has a state at {b!r} tokens; donor {d} holds "
                                     f"{self._donor_lens[d]} (a positive token count at most that)")
                if not isinstance(snap, dict) or sorted(snap) != self._states:
                    raise ValueError(f"donor_states[{d}][{b}] must map each recurrent-state layer {self._states} to "
                                     "a copy of that layer")
            self._donor_states.append(snaps)
            points.append(sorted(set(snaps) | ({self._donor_lens[d]} if self._donor_lens[d] else set())))
        return points

    def _state_at(self, donor: int, tokens: int):
        """A new cache of this model standing for the first ``tokens`` tokens of donor ``donor`` (-1 or 0 tokens:
        an empty one)."""
        if donor < 0 or tokens == 0:
            return state_cache(self.model)
        cache = self.donor_caches[donor]
        snap = (self._donor_states[donor].get(tokens) if tokens != self._donor_lens[donor] else None)
        new = state_cache(self.model)
        new.layers = state_at(cache, tokens, snap if snap is not None else
                              {i: cache.layers[i] for i in self._states}).layers
        return new

    def _align(self) -> Alignment:
        return align_multi(self.donor_ids_list, self.input_ids, min_span=self.min_span, donor_limits=self._donor_lens,
                           target_limit=self.input_ids.shape[1] - 1)

    @torch.no_grad()
    def _assemble(self) -> None:
        donors = [list(kv_of(c)) for c in self.donor_caches]
        covered = self.input_ids.shape[1] - 1
        al = self.alignment
        device = donors[0][0][0].device
        unmatched = al.unmatched().to(device)
        # rows of an exact donor's common prefix are exact: never "repaired"
        exact_prefix = al.prefix_len if al.prefix_len and self.donor_exact[al.prefix_donor] else 0
        rows, repaired = unmatched, 0
        if self.repair == "epic":
            heads = [torch.arange(sp.target_start, sp.target_start + min(self.repair_tokens, sp.length))
                     for sp in al.spans if sp.target_start >= exact_prefix]
            if heads:
                rows = torch.unique(torch.cat([unmatched, torch.cat(heads).to(device)]))
                repaired = int(rows.numel() - unmatched.numel())
        # fused: one more row, the last prompt token's, which the first forward computes with the rows
        fuse = self._fuse and self.repair != "blend" and rows.numel() > 0
        length = covered + 1 if fuse else covered
        # Layer by layer, span by span, straight into uninitialised storage: every row is written before it
        # is read (matched rows here, unmatched ones by partial_forward before their layer attends), so no
        # zero fill, no full-length index_select or rotated temporaries. With release_donor each donor layer
        # is dropped as soon as it is copied: the optimistic cache then takes the donors' place in memory.
        kv = []
        for i in range(len(donors[0])):
            like_k, like_v = donors[0][i]
            dk, dv = alloc_layer(like_k, length), alloc_layer(like_v, length)
            for sp in al.spans:
                k, v = donors[sp.donor][i]
                t, d, n = sp.target_start, sp.donor_start, sp.length
                copy_shifted_(dk[..., t:t + n, :], k[..., d:d + n, :], self._shifter.for_layer(i), sp.delta)
                dv[..., t:t + n, :].copy_(v[..., d:d + n, :])
            kv.append((dk, dv))
            del like_k, like_v
            if self.release_donor:
                for j, cache in enumerate(self.donor_caches):
                    donors[j][i] = None
                    release_layer(cache, i)
        del donors
        ids = self.input_ids[:, :covered].to(device)
        if self.repair == "blend":
            from .blend import blend_recompute

            rows, picked = blend_recompute(self.model, ids, kv, unmatched, self.repair_ratio, start=exact_prefix)
            repaired = int(picked.numel())
        elif fuse:  # the first forward computes these rows with the last token's (generation.fused)
            self._pending = PendingRows(kv, rows, self.input_ids)
            kv = self._pending.visible()
        elif rows.numel():
            partial_forward(self.model, ids, rows, kv)
        load_kv(self, kv)
        self.logical_offset = 0
        self.stats.fused_first_step = fuse
        self.stats.reused_tokens = al.matched - repaired
        self.stats.prefix_tokens = al.prefix_len
        # + the last prompt token, which generate feeds; repaired rows are computed too (and no longer reused)
        self.stats.new_tokens = int(unmatched.numel()) + repaired + 1
        self.stats.repaired_tokens = repaired

    # -- per step ----------------------------------------------------------------------------------------------
    def before_forward(self, input_ids, next_sequence_length):
        if self._swapped:
            return next_sequence_length, {}
        generated = input_ids.shape[1] - self.input_ids.shape[1]
        self.job.raise_if_failed()
        if generated >= 1 and not self.job.started:
            self._start_background()
        self._last_input_ids = input_ids
        limit = self.max_optimistic_tokens
        if self.rebase == "verify":
            # drafts are verified after the drafting generate ends (drive); only an exact cache that is ready
            # before the first token is swapped in here (then there is nothing to verify)
            if generated == 0 and (self.job.ready() or limit == 0 or self._no_draft):
                return self._swap_in(input_ids), {"logits_to_keep": 1}
            return next_sequence_length, {}
        if not (self.job.ready() or self._no_draft or (limit is not None and generated >= limit)):
            return next_sequence_length, {}
        feed = self._swap_in(input_ids)
        keep = feed if (self.record_divergence and generated > 0) else 1
        return feed, {"logits_to_keep": keep}

    def _take_exact(self) -> None:
        """Wait for the background job and load its exact prefix K/V into this cache (prompt minus its last
        token); the caller then feeds the rest."""
        t = now(self.input_ids.device)
        if not self.job.started:
            self._start_background()
        kv = self.job.result()
        self.job._cache = None  # the exact K/V now live in this cache only: freed as decoding moves on
        self._pending = None    # an exact cache before the first token: no optimistic rows to compute
        self.stats.wait_s += now(self.input_ids.device) - t
        self._restore_threads()
        if self._states:  # a hybrid: the job's whole cache (its states are not K/V)
            self.layers[:] = kv.layers
            self.state_snapshots = dict(self.job.snapshots)
        else:
            load_kv(self, kv, seq_length=self.input_ids.shape[1] - 1)  # every row given: sliding layers keep theirs
            if self.sliding_history:  # and keep every row on the side from here on
                keep_history(self, self._windows, kv)
        self.logical_offset = 0
        self._swapped = True
        self.stats.exact = True

    def _swap_in(self, input_ids: torch.Tensor) -> int:
        """Load the exact prefix K/V; return how many trailing tokens must be fed to replay the rest."""
        self._take_exact()
        n = self.input_ids.shape[1]
        generated = input_ids.shape[1] - n
        self.stats.swap_step = generated
        self.stats.optimistic_tokens = generated
        self._replay = input_ids if self.record_divergence and generated > 0 else None
        return input_ids.shape[1] - (n - 1)

    def after_forward(self, outputs) -> None:
        self._forwards += 1
        if self._forwards == 1:
            self.stats.draft_ttft_s = now(self.input_ids.device) - self._t0
            if self.rebase == "commit" or self._swapped:  # under verify the caller sees verified tokens only
                self.stats.ttft_s = self.stats.draft_ttft_s
        if self._replay is not None:
            self._count_divergence(outputs.logits[0, :-1], self._replay)
            self._replay = None
        # diagnostics off and no gate: no per-step softmax and host sync on the hot path
        if not self._swapped and self._last_input_ids is not None and (
                self.record_divergence or self.gate is not None or self._gate_tokens is not None):
            probs = self._step_probs(outputs)
            top = probs.topk(2, dim=-1)
            margin = float(top.values[0] - top.values[1])
            self.stats.draft_margins.append(margin)
            if self.gate is not None and margin < self.gate:
                self._gate(outputs, "margin")
            elif self._gate_tokens is not None and self._decisive_due(probs, int(top.indices[0])):
                self._gate(outputs, "token")

    def _step_probs(self, outputs) -> torch.Tensor:
        """``[V]``: the probabilities of this optimistic step's processed scores (what generate chooses from)."""
        ids = self._last_input_ids
        return self.process_logits(ids, outputs.logits[0, -1:], ids.shape[1]).softmax(-1)[0]

    @staticmethod
    def _decisive_ids(model, gate_tokens, rebase: str) -> torch.Tensor | None:
        """``gate_tokens`` checked: token ids of this model's vocabulary, under ``rebase="commit"``."""
        if gate_tokens is None:
            return None
        if rebase != "commit":
            raise ValueError("gate_tokens= applies to rebase='commit' (verify already withdraws every wrong draft)")
        if isinstance(gate_tokens, (str, bytes)) or not hasattr(gate_tokens, "__iter__"):
            raise TypeError(f"gate_tokens must be an iterable of token ids, got {type(gate_tokens).__name__} "
                            "(e.g. tok.encode(' Yes', add_special_tokens=False)[:1] + ...)")
        ids = [int(t) for t in (gate_tokens.flatten().tolist() if torch.is_tensor(gate_tokens) else gate_tokens)]
        vocab = getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
                        "vocab_size", None)
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"gate_tokens {bad[:5]} are not token ids of {type(model).__name__} "
                             f"(vocabulary of {vocab})")
        return torch.tensor(sorted(set(ids)), dtype=torch.long) if ids else None

    def _decisive_due(self, probs: torch.Tensor, greedy_choice: int) -> bool:
        """Could this step emit a decisive token? Greedy: it is the greedy choice; sampling: it can be drawn."""
        if self._gate_tokens.device != probs.device:  # moved once, not every step
            self._gate_tokens = self._gate_tokens.to(probs.device)
        if getattr(self.generation_config, "do_sample", False):
            return bool(probs[self._gate_tokens].sum() > 0)
        return greedy_choice in self._gate_ids

    def _gate(self, outputs, reason: str) -> None:
        """commit + gate: this optimistic step is uncertain (or due to emit a decisive token): swap now and let
        generate choose this step's token from the exact logits instead (its own selection reads
        ``outputs.logits`` after this hook)."""
        ids = self._last_input_ids
        n = self.input_ids.shape[1]
        generated = ids.shape[1] - n
        self._take_exact()
        self.stats.swap_step = self.stats.optimistic_tokens = self.stats.gated_step = generated
        self.stats.gate_reason = reason
        # replay every fed token on the exact cache; its last row is this step's exact logits
        pos = torch.arange(n - 1, ids.shape[1], device=ids.device)[None]
        keep = 0 if (self.record_divergence and generated > 0) else 1
        out = self.model(input_ids=ids[:, n - 1:], position_ids=pos, use_cache=True, logits_to_keep=keep,
                         **cache_kwargs(self))
        if keep == 0:
            self._count_divergence(out.logits[0, :-1], ids)
        outputs["logits"] = out.logits[:, -1:].to(outputs.logits.dtype)

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

    # -- rebase="verify": drafts, verification, continuation ------------------------------------------------
    def drive(self, model, kwargs: dict):
        """Run ``generate`` (called by the mixin after :meth:`prepare`). With ``rebase="verify"``: a drafting
        ``generate`` on the optimistic cache that stops when the exact cache is ready (or at
        ``max_optimistic_tokens``), the verification of its drafts on the exact logits, then a continuing
        ``generate`` on the exact cache from the first withdrawn draft (module docstring)."""
        if self.rebase != "verify" or self.max_optimistic_tokens == 0:
            return model._stock_generate(**kwargs)
        for key in ("output_attentions", "output_hidden_states"):
            if kwargs.get(key) or getattr(kwargs.get("generation_config") or model.generation_config, key, False):
                raise ValueError(f"{key}=True is not supported with rebase='verify' (drafts are withdrawn); "
                                 "run plain generate for them")
        cfg = kwargs.get("generation_config") or model.generation_config
        want = {k: kwargs.get(k, getattr(cfg, k, False)) for k in ("return_dict_in_generate", "output_scores",
                                                                  "output_logits")}
        user_streamer = kwargs.get("streamer")
        draft_stop = _DraftStop(self)
        first = dict(kwargs, return_dict_in_generate=True, output_scores=True, output_logits=True,
                     streamer=_VerifiedOnly(user_streamer, self) if user_streamer is not None else None,
                     stopping_criteria=StoppingCriteriaList(list(kwargs.get("stopping_criteria") or []) +
                                                            [draft_stop]))
        # sampled drafts draw from the global generator; verification draws again from the state before them,
        # so the output is a function of the caller's seed alone (not of when the exact cache was ready)
        rng = _RngState(self.input_ids.device)
        out = model._stock_generate(**first)
        criteria = StoppingCriteriaList([c for c in self._stopping_criteria if c is not draft_stop])
        if self._swapped:  # the exact cache was ready before the first token: plain generate ran
            self.stats.accepted_tokens = self.stats.rejected_tokens = self.stats.drafted_tokens = 0
            if user_streamer is not None:
                user_streamer.end()
            return self._as_requested(out, want)
        rng.restore()
        seq, exact_scores, exact_logits, done = self._verify(out, criteria)
        if user_streamer is not None:
            for tok in seq[0, self.input_ids.shape[1]:].cpu():  # one copy to the host, not one per token
                user_streamer.put(tok.reshape(1))
        if not done:  # continue from the exact cache (it holds every row but the last token's)
            self._continuing_parts = (self.logits_processor, criteria)
            rest = dict(kwargs, inputs=seq, input_ids=None, attention_mask=torch.ones_like(seq),
                        max_new_tokens=int(criteria.max_length - seq.shape[1]) if criteria.max_length else None,
                        min_new_tokens=None, return_dict_in_generate=True, output_scores=True, output_logits=True,
                        streamer=_AfterPrompt(user_streamer) if user_streamer is not None else None)
            rest.pop("input_ids")
            if rest["max_new_tokens"] is None:
                rest.pop("max_new_tokens")
            rest.pop("min_new_tokens")
            try:
                out2 = model._stock_generate(**rest)
            finally:
                self._continuing_parts = None
            seq = out2.sequences
            exact_scores += list(out2.scores)
            exact_logits += list(out2.logits)
        elif user_streamer is not None:
            user_streamer.end()
        out["sequences"] = seq
        out["scores"] = tuple(exact_scores)
        out["logits"] = tuple(exact_logits)
        return self._as_requested(out, want)

    @torch.no_grad()
    def _verify(self, out, criteria: StoppingCriteriaList):
        """Swap in the exact cache, replay the drafts, keep the verified ones and choose the next token.

        Every verified position's token is chosen as plain ``generate`` chooses it from the exact scores: the argmax
        (greedy) or one ``torch.multinomial`` draw from the global generator, in order (sampling; the generator
        was put back to its state before the drafts). A draft is kept while it equals that choice; the first
        other choice is the next token. The output is then plain ``generate``'s with the same seed, token for token,
        whatever the number of drafts.

        Returns ``(sequence, scores, logits, done)``: the verified sequence (drafts kept plus the exact model's next
        token, unless the kept drafts already end the generation), the processed scores and raw logits of its
        generated tokens as plain ``generate`` records them, and whether a stopping rule ends the generation."""
        n = self.input_ids.shape[1]
        seq = out.sequences
        g = seq.shape[1] - n
        self._take_exact()
        self.stats.swap_step = self.stats.optimistic_tokens = self.stats.drafted_tokens = g
        pos = torch.arange(n - 1, n + g, device=seq.device)[None]
        sliding = any(self._windows)
        if sliding and not self.sliding_history:  # a sliding layer drops rows as the replay passes its window:
            keep_rows(self, self._windows)     # keep them to cut back to
        saved = copy_states(self, self._states) if self._states else None  # a state cannot be cut back: a copy
        could_end, fed = None, n + g
        if saved is not None:  # drafts that would end the generation if all kept: their last token is not fed, so
            could_end = bool(criteria(seq, out.scores[-1]).all())  # that the state stands for what generate leaves
            fed -= int(could_end)
            pos = pos[:, : fed - n + 1]
        logits = self.model(input_ids=seq[:, n - 1:fed], position_ids=pos, use_cache=True, logits_to_keep=0,
                            **cache_kwargs(self)).logits[0].float()      # [g + 1, V]: row i scores token n + i
        scores = self.process_logits(seq, logits, n)
        drafts = seq[0, n:].to(scores.device)
        self._count_divergence(logits[:g], seq)
        sample = bool(getattr(self.generation_config, "do_sample", False))
        if sample:
            j, nxt = sample_accept(scores, drafts)
        else:
            choice = scores.argmax(-1)
            j = int((choice[:g] == drafts).long().cumprod(0).sum())  # the one host sync of the verification
            nxt = choice[min(j, choice.shape[0] - 1)]  # no row g when the drafts could end it: unused if they do
        self.stats.accepted_tokens, self.stats.rejected_tokens = j, g - j
        ends = j == g and (could_end if could_end is not None else bool(criteria(seq, scores[g - 1: g]).all()))
        # every layer back to the exact rows of the prompt and the kept drafts; when the drafts end the generation
        # (EOS, length, stop string), every token but the last (never fed), as after plain generate
        rows_kept = n + j - (1 if ends else 0)
        if saved is not None:
            self._rewind_states(saved, seq, rows_kept, fed)
        else:
            crop_rows(self, self._windows, rows_kept, keep=self.sliding_history)
        kept = seq[:, : n + j]
        rows = list(scores[: j].unsqueeze(1)), list(logits[: j].unsqueeze(1))
        if ends:
            self.stats.ttft_s = now(self.input_ids.device) - self._t0
            return seq, rows[0], rows[1], True
        if sample and j == g:  # every draft kept and the generation goes on: plain generate draws the next one
            nxt = _draw(scores[g: g + 1])
        seq = torch.cat([kept, nxt.reshape(1, 1).to(seq.device)], 1)
        rows[0].append(scores[j: j + 1])
        rows[1].append(logits[j: j + 1])
        self.stats.ttft_s = now(self.input_ids.device) - self._t0
        return seq, rows[0], rows[1], bool(criteria(seq, scores[j: j + 1]).all())

    def _rewind_states(self, saved: dict, seq: torch.Tensor, rows: int, replayed: int) -> None:
        """A hybrid after the replay of its drafts (``replayed`` tokens): back to the first ``rows`` tokens; the
        states from their copy at the prompt, then the kept tokens fed again."""
        if rows == replayed:
            return
        n = self.input_ids.shape[1]
        rewind(self, saved, n - 1)
        if rows > n - 1:
            pos = torch.arange(n - 1, rows, device=seq.device)[None]
            self.model(input_ids=seq[:, n - 1:rows], position_ids=pos, use_cache=True, logits_to_keep=1,
                       **cache_kwargs(self))
        self.stats.rerun_tokens = rows - (n - 1)

    @staticmethod
    def _as_requested(out, want: dict):
        if not want["return_dict_in_generate"]:
            return out.sequences
        if not want["output_scores"]:
            out["scores"] = None
        if not want["output_logits"]:
            out["logits"] = None
        return out

    def set_stopping_criteria(self, criteria) -> None:
        """Called by the mixin with the stopping criteria generate built (the drafting call's, kept for the
        verification and the continuation: max length counted from the original prompt)."""
        if getattr(self, "_continuing_parts", None) is None:
            if self._replays_drafts():
                self._refuse_stateful([c for c in criteria if not isinstance(c, _DraftStop)], "stopping criteria")
            self._stopping_criteria = criteria

    def set_logits_processor(self, processors, generation_config) -> None:
        """The call's logits processors: under ``"verify"`` (or a gate) they are applied again to replayed rows, so
        each must be a pure function of its inputs (:func:`hf_kvreuse.generation.options.stateful_steps`);
        otherwise the call is refused before its first token. Under ``"commit"`` without a gate only the divergence
        count replays them: it is skipped (``divergent_tokens`` None)."""
        from ..generation.options import stateful_steps

        super().set_logits_processor(processors, generation_config)
        if self._replays_drafts() or self.gate is not None or self._gate_tokens is not None:
            self._refuse_stateful(processors, "logits processors")
        elif stateful_steps(processors):
            self.record_divergence = False

    def _replays_drafts(self) -> bool:
        return self.rebase == "verify" and self.max_optimistic_tokens != 0

    def _refuse_stateful(self, steps, what: str) -> None:
        from ..generation.options import stateful_steps

        names = stateful_steps(steps)
        if names:
            mode = "rebase='verify'" if self._replays_drafts() else "a gate"
            raise ValueError(
                f"OptimisticCache({mode}) runs the call's {what} again on replayed draft rows, and {', '.join(names)} "
                "keep(s) state across calls (classifier-free guidance with guidance_scale, for one, runs its own model "
                "and cache): the answer would differ from plain generate's. Use ReuseSession (policy 'auto' or "
                "'prefix': exact prefix reuse), or max_optimistic_tokens=0; a processor of your own that is a pure "
                "function of (input_ids, scores) may declare hf_kvreuse_stateless = True")

    def continuing_parts(self):
        """(logits processors, stopping criteria) the continuing generate must reuse, or None."""
        return getattr(self, "_continuing_parts", None)

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
            # the answer is plain generate's: verified drafts, or no token emitted from the optimistic cache
            self.stats.exact_output = error is None and (self.rebase == "verify" or not self.stats.optimistic_tokens)
            if self.release_donor:
                for cache in self.donor_caches:
                    if self._states:
                        cache.layers.clear()  # a hybrid's states are not K/V: the layers go
                    else:
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


def _draw(scores: torch.Tensor) -> torch.Tensor:
    """One token from ``scores`` ``[1, V]`` exactly as transformers' sampling step draws it (softmax, then
    ``torch.multinomial(probs, 1)`` from the global generator)."""
    return torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1)[0, 0]


def sample_accept(scores: torch.Tensor, drafts: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Seeded verification of sampled drafts: ``scores`` ``[g + 1, V]`` are the exact processed scores of the ``g``
    draft positions and the one after, ``drafts`` ``[g]``.

    Position ``i`` is sampled from ``scores[i]`` with the global generator, in order, as plain ``generate`` samples
    it; draft ``i`` is kept while it equals that sample. Returns ``(kept, next token)``: the first sample that
    differs from its draft, or, when every draft is kept, the draw for position ``g`` is left to the caller (it
    must not be drawn when the drafts end the generation), and ``next token`` is a placeholder. The generator
    is left exactly as plain ``generate`` leaves it after ``kept + 1`` draws (``kept`` when all are kept).

    Unlike the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023), which also follows the exact
    distribution but draws other random numbers, the tokens are the same function of the seed as plain
    ``generate``'s. The samples are drawn without a host sync each; one sync finds the first mismatch, and the
    generator is then rewound and advanced by the draws actually used.
    """
    g = drafts.numel()
    state = _RngState(scores.device)
    samples = torch.stack([_draw(scores[i: i + 1]) for i in range(g)]) if g else drafts
    same = (samples == drafts).long().cumprod(0)
    j = int(same.sum())  # the one host sync
    if j == g:
        return g, drafts[-1] if g else scores.new_zeros((), dtype=torch.long)
    state.restore()  # rewind, then draw exactly the j + 1 samples plain generate draws up to the mismatch
    for i in range(j):
        _draw(scores[i: i + 1])
    return j, _draw(scores[j: j + 1])


class _RngState:
    """The global generator's state of ``device`` (and the CPU's), to draw again from the same point."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class _DraftStop(StoppingCriteria):
    """Ends the drafting generate once the exact cache is ready (or at ``max_optimistic_tokens``)."""

    def __init__(self, cache: "OptimisticCache"):
        self.cache = cache

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        c = self.cache
        stop = False
        if not c._swapped:
            limit = c.max_optimistic_tokens
            stop = c.job.ready() or (limit is not None and input_ids.shape[1] - c.input_ids.shape[1] >= limit)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class _VerifiedOnly:
    """The caller's streamer during drafting: the prompt, and tokens only once they are exact (a swap before the
    first token); drafts are held back and streamed after their verification."""

    def __init__(self, streamer, cache: "OptimisticCache"):
        self.streamer, self.cache, self.prompt_sent = streamer, cache, False

    def put(self, value):
        if not self.prompt_sent or self.cache._swapped:
            self.prompt_sent = True
            self.streamer.put(value)

    def end(self):
        pass  # the caller's streamer ends with the whole generation


class _AfterPrompt:
    """The caller's streamer during the continuation: its first put (the verified sequence, as a prompt) was
    streamed already."""

    def __init__(self, streamer):
        self.streamer, self.first = streamer, True

    def put(self, value):
        if self.first:
            self.first = False
            return
        self.streamer.put(value)

    def end(self):
        self.streamer.end()
