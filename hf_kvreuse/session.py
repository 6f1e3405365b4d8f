"""ReuseSession: one object that keeps every finished cache and reuses all of it for the next prompt.

Multi-agent workflows re-send most of every prompt: the question, the document, the earlier answers, each
agent's own role text. A session holds the caches of its earlier calls (LRU, under a byte budget) and, for
each new prompt,

1. finds the longest **exact** prefix among the held caches that are exact (token level, as SGLang's radix
   tree does; a linear scan, since a session holds tens of caches, not millions): those rows are reused as
   they are, with no risk;
2. aligns the rest of the prompt against **all** held caches (:func:`hf_kvreuse.alignment.align_multi`):
   spans may come from several earlier calls, e.g. the agent's role text from its own last turn and the
   shared context from the previous agent;
3. runs the policy's cache over them. ``"auto"`` (the default) is exact and picks, per call, between the exact
   prefix plus a prefill of the rest and verified drafts (:class:`~hf_kvreuse.OptimisticCache` with
   ``rebase="verify"`` over the donor spans, its exact prefill starting after the exact prefix), from what the
   session measured on its own calls on this device and thread count (:class:`AutoChooser`); it steps down, never
   raises, where the model or the call rules drafts out, and ``last_stats.reason`` says why.

Policies: ``"full"`` (plain prefill), ``"prefix"`` (exact prefix only: the vLLM / SGLang baseline),
``"optimistic"``, ``"auto"``, ``"fast"`` (approximate: ``"auto"``'s choice with drafts committed under a confidence
gate while an online guard of each agent's divergence allows it, :mod:`hf_kvreuse.guard`), and the block baselines ``"direct"``, ``"blend"``, ``"epic"``, ``"tail"``, ``"focus"``
(needs ``method_kwargs=dict(tokenizer=...)``) and ``"latent"`` over the session's own caches as blocks
(RelayCaching-style reuse of earlier agents' K/V, each span taken with the K/V it had in its earlier call),
``"translated"`` (a smaller model prefills; it needs ``method_kwargs=dict(source_model=..., mapper=...)``) and
``"base_lr"`` (multi-LoRA agents over one trajectory: the session holds one :class:`~hf_kvreuse.BaseLRCache`, the
active peft adapter is the agent of each call).
Caches of approximate methods are kept as donors but never as an exact prefix.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from .alignment import Alignment, align_multi
from .auto import AutoChooser
from .compat import CACHE_KW, CACHE_NAMES
from .devices import input_device, layer_devices, offloaded, place_kv
from .generation.options import STEPWISE_MODES, call_options, plain_only_call
from .guard import DivergenceGuard, GuardConfig
from .inputs import inferred_padding, prompt_ids, refuse_inferred_padding
from .kv import KV, kv_of, load_kv
from .model_check import UnsupportedModelError, rows_coupled
from .rope import UnsupportedRopeError
from .rotary import length_dependent_rope
from .session_entry import _Entry, _storage_bytes
from .hybrid import state_at, state_cache, state_continues, state_indices, state_reason, tensor_bytes
from .sliding import WindowSnapshot, boundary_kv, keep_history, take_history
from .timing import TokenTimer, synchronize

POLICIES = ("auto", "fast", "full", "prefix", "optimistic", "direct", "blend", "epic", "tail", "focus", "latent", "translated",
            "base_lr")
BLOCK_POLICIES = ("direct", "blend", "epic", "tail", "focus", "latent")

#: named reuse modes (the pipeline's and ``hf-kvreuse bench``'s ``method=`` names): every policy by its own name,
#: plus the OptimisticCache variants of ``"auto"`` (the measured comparison, research notes "Verified drafts, the confidence
#: gate and repair on Qwen", n = 50: verify kept 100% of final answers, gate 0.5 92% at 0.11x full TTFT, repair
#: (blend 15%) 78% at 0.08x, plain commit 62% at 0.04x)
MODES: dict[str, dict] = {
    **{p: dict(policy=p) for p in POLICIES},
    "auto-verify": dict(policy="auto", rebase="verify"),
    "auto-commit": dict(policy="auto", rebase="commit"),
    "auto-commit-gate": dict(policy="auto", rebase="commit", method_kwargs=dict(gate=0.5)),
    "auto-commit-repair": dict(policy="auto", rebase="commit", method_kwargs=dict(repair="blend",
                                                                                   repair_ratio=0.15)),
}


def _cache_options() -> set[str]:
    """Keyword parameters of the cache classes a session builds."""
    import inspect

    from . import cache_classes

    classes = [getattr(cache_classes, n) for n in ("OptimisticCache", "DirectReuseCache", "BlendCache", "EPICCache",
                                                   "TailRecomputeCache", "FocusRecomputeCache", "OffsetCache",
                                                   "LatentRemedyCache",
                                                   "BaseLRCache", "TranslatedCache")]
    return {p for c in classes for p in inspect.signature(c.__init__).parameters if p not in ("self", "model")}


def _check_focus(policy: str, method_kwargs: dict | None) -> None:
    """Policy "focus" (:class:`~hf_kvreuse.cache_classes.focus.FocusRecomputeCache`) finds its rows with the model's
    tokenizer: refused at once without one."""
    if policy == "focus" and not callable(getattr((method_kwargs or {}).get("tokenizer"), "batch_decode", None)):
        raise ValueError("policy='focus' needs the model's tokenizer: method_kwargs={'tokenizer': tokenizer} (it "
                         "finds the block rows that mention what two prompts' prefixes disagree on)")


def resolve_mode(spec: str) -> dict:
    """The :class:`ReuseSession` arguments of a named mode, optionally with options for its cache class appended
    as ``:key=value`` (``"auto-verify:max_optimistic_tokens=4"``; values are Python literals, so ``4``, ``0.5``,
    ``None`` or ``'blend'``); they update the mode's ``method_kwargs``. The ablation syntax of ``hf-kvreuse bench
    --methods``, where the whole spec names the method's records."""
    import ast

    name, *options = spec.split(":")
    if name not in MODES:
        raise ValueError(f"method={spec!r}: choose one of {sorted(MODES)}, optionally with ':key=value' options")
    mode = dict(MODES[name])
    mk = dict(mode.pop("method_kwargs", {}))
    known = _cache_options() if options else set()
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"method={spec!r}: option {option!r} is not key=value")
        if key not in known:  # a typo fails here, not at the first call of a long run
            raise ValueError(f"method={spec!r}: {key!r} is not an option of any hf_kvreuse cache class")
        try:
            mk[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            mk[key] = value  # a bare word: a string (repair=blend)
    return dict(mode, method_kwargs=mk)


@dataclass
class SessionStats:
    """One :meth:`ReuseSession.generate` call (times in seconds, token counts of the prompt unless named).

    Attributes
    ----------
    policy : str
        The policy asked for.
    method : str
        What ran: ``full``, ``prefix``, ``optimistic``, ``direct``, ``blend``, ... (``auto`` picks one).
    agent : str or None
        The ``agent=`` of the call.
    prompt_tokens : int
        Tokens of the prompt.
    exact_prefix_tokens : int
        Prompt rows reused as they are from an exact held cache of the same weights.
    donor_tokens : int
        Prompt rows taken from held caches at other positions (re-positioned with RoPE) and kept; rows that
        ``repair=`` recomputed count in ``new_tokens`` instead.
    donor_calls : int
        Held caches those rows came from.
    new_tokens : int
        Prompt tokens whose K/V the call computed before the first token, the last prompt token included
        (``generate`` always feeds it), so ``exact_prefix_tokens + donor_tokens + new_tokens == prompt_tokens``.
        One exception: ``optimistic`` with ``max_optimistic_tokens=0`` runs the exact prefill before the first
        token, and ``new_tokens`` counts those rows, while ``donor_tokens`` still counts what the held caches
        offered. The same count as ``OptimisticStats.new_tokens`` and ``TurnStats.prefill_tokens``; block methods
        also recompute repaired rows (``cache_stats["recomputed_tokens"]``).
    background_tokens : int
        Rows the exact background prefill computed (``optimistic``), after the first token.
    generated_tokens : int
        Tokens generated.
    ttft_s, total_s : float or None
        Time to the first and to the last token the caller receives (drafts are not received).
    draft_ttft_s : float or None
        ``optimistic``: time to the first draft's logits (under ``rebase="verify"`` the caller never sees it).
    exact_output : bool
        The answer is guaranteed equal to plain ``generate``'s (greedy, or sampling with the same seed): ``full``,
        ``prefix`` and verified drafts; never the approximate methods or ``rebase="commit"`` tokens.
    drafted_tokens, accepted_tokens : int or None
        ``optimistic`` with ``rebase="verify"``: drafts made, and of those kept after verification.
    divergent_tokens : int or None
        ``optimistic``: tokens of the optimistic cache that exact greedy decoding would not have chosen (under
        ``"commit"`` they stay in the answer; under ``"verify"`` they were withdrawn).
    reason : str or None
        Why ``method`` ran (``"auto"`` and every step down from the policy asked for).
    exact : bool
        Every prompt row of the kept cache is the model's exact K/V (the cache may then serve as an exact prefix);
        about the cache, not the answer (:attr:`exact_output`).
    stored : bool
        The call's cache is now held by the session.
    evicted : int
        Held caches evicted after this call (LRU, to stay under ``max_bytes``).
    held_bytes : int
        ``session.nbytes`` after the call.
    cache_stats : dict or None
        The method cache's own stats (``cache.stats.as_dict()``).
    guard_mode : str or None
        Policy ``"fast"``: what the session's divergence guard allowed this call (``"commit"``: gated committed
        drafts, approximate; ``"verify"``: verified drafts, exact), None otherwise.
    """

    policy: str                      # the policy asked for
    method: str                      # what ran: full | prefix | optimistic | direct | blend | ...
    agent: str | None = None
    prompt_tokens: int = 0
    exact_prefix_tokens: int = 0     # rows reused as they are from an exact held cache
    donor_tokens: int = 0            # rows taken from held caches at other positions (re-positioned)
    donor_calls: int = 0             # held caches those rows came from
    new_tokens: int = 0              # rows computed before the first token
    background_tokens: int = 0       # rows the exact background prefill computed (optimistic)
    generated_tokens: int = 0
    ttft_s: float | None = None      # the first token the caller receives
    total_s: float | None = None
    draft_ttft_s: float | None = None   # optimistic: the first draft's logits (not received under verify)
    exact_output: bool = True        # the answer equals plain generate's (greedy or same seed)
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    divergent_tokens: int | None = None
    reason: str | None = None        # why ``method`` ran
    exact: bool = True               # every prompt row of the kept cache is the model's exact K/V
    stored: bool = False             # the call's cache is now held
    evicted: int = 0                 # held caches evicted after this call
    held_bytes: int = 0              # session.nbytes after the call
    cache_stats: dict | None = None  # the method cache's own stats
    guard_mode: str | None = None    # policy "fast": what its divergence guard allowed ("commit" or "verify")

    def as_dict(self) -> dict:
        return asdict(self)

    def __repr__(self) -> str:
        from .reprs import stats_repr

        return stats_repr(self)


def _generation_config_model(model):
    """The module whose ``generation_config`` and ``config`` generate reads (a peft model's base model)."""
    from .generation.mixin import _generation_target

    return _generation_target(model)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    diff = torch.nonzero(a[:n] != b[:n])
    return int(diff[0, 0]) if diff.numel() else n


class _Tee:
    """Hands every streamer call to the timer and to the caller's own streamer."""

    def __init__(self, *streamers):
        self.streamers = [s for s in streamers if s is not None]

    def put(self, value):
        for s in self.streamers:
            s.put(value)

    def end(self):
        for s in self.streamers:
            s.end()


@dataclass
class _StateEntry:
    """A whole cache of a recurrent-state model, standing for exactly ``ids`` (never fed again: copied to use)."""

    ids: torch.Tensor
    cache: object
    agent: str | None
    producer: str
    nbytes: int
    # {b: {layer index: copy of that recurrent-state layer after the first b tokens}}; the K/V layers' first b rows
    # are those of ``cache``
    boundaries: dict = dataclasses.field(default_factory=dict)

    def at(self, b: int):
        """A new cache standing for the first ``b`` tokens (``b`` = every token or a boundary)."""
        if b == self.ids.numel():
            return copy.deepcopy(self.cache)
        return state_at(self.cache, b, self.boundaries[b])


class _FirstTokenCopy:
    """A streamer that copies ``cache`` when the first generated token comes out: it then holds the prompt's
    ``n`` tokens exactly (``copy`` stays None where the cache is None or holds another count)."""

    def __init__(self, cache, n: int):
        self.cache, self.n, self.calls, self.copy = cache, n, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.cache is not None and _state_length(self.cache) == self.n:
            self.copy = copy.deepcopy(self.cache)

    def end(self):
        pass


def _state_length(cache) -> int | None:
    """Tokens a cache holds (its attention layers'), or None."""
    try:
        return int(cache.get_seq_length()) if cache is not None else None
    except Exception:  # noqa: BLE001 - a cache that cannot tell
        return None


class ReuseSession:
    """Generate with a model while reusing the K/V of every earlier call of the session.

    Parameters
    ----------
    model : PreTrainedModel
        A causal LM; for the reuse policies it is passed to :func:`hf_kvreuse.enable` (in place, idempotent).
    max_bytes : int, default=2 GiB
        K/V bytes the session may hold between calls; least recently used caches are evicted beyond it.
        ``session.nbytes`` never exceeds it after a call returns.
    policy : str, default="auto"
        How a prompt reuses the held caches (module docstring): one of :data:`POLICIES`.
    min_span : int, default=4
        Shortest non-prefix span taken from a held cache.
    min_donor_tokens : int, default=32
        ``"auto"`` decodes optimistically only when held caches supply at least this many rows past the exact
        prefix; otherwise it runs ``"prefix"`` (an optimistic pass would cost more than it hides).
    method_kwargs : dict, optional
        Keyword arguments of the method's cache class (e.g. ``recompute_ratio`` for blend,
        ``max_optimistic_tokens`` for optimistic, ``source_model`` and ``mapper`` for translated).
    rebase : {"verify", "commit"}, default="verify"
        How ``"auto"`` / ``"optimistic"`` treat the tokens decoded before the exact cache is ready
        (:class:`~hf_kvreuse.OptimisticCache`): "verify" keeps the answers (greedy output equals plain ``generate``;
        streamers get verified tokens only); "commit" streams the optimistic tokens at once (lowest time to the
        first token; answers may differ). ``method_kwargs["rebase"]`` wins over it.
    sliding_history : bool, default=True
        Models with sliding-window layers: the held caches keep every row of those layers too (as much memory as
        full attention), so that a later prompt sharing any prefix reuses it exactly. False: they keep the window's
        rows plus a copy of them at the end of each prompt (less memory; a later prompt reuses a prefix only up
        to a held prompt's end, or while the window has not moved past it). The forward is plain ``generate``'s
        either way.
    state_block : int, default=256
        Linear-attention hybrids: the recurrent-state layers are copied at block ends (multiples of this many
        tokens) of each prompt, so that a later prompt sharing only a prefix (another agent's prompt over the same
        document and transcript, or the agent's next turn with a new cue) reuses it up to such a block end (as
        vLLM's and SGLang's hybrid prefix caches do). 0: states only at each prompt's and call's end.
    state_copies : int or None, default=2
        How many of each prompt's block ends get a copy: the last ones (where later prompts diverge: their own
        role text, cue or question). Each copy splits the prefill into one more forward; on a 2-core CPU copying
        every 256-token block end of a 2k-token prompt costs ~9% of its prefill, the last two ~2%. None: every
        block end. ``"optimistic"`` drafts from these copies too: a
        held call's span over the shared document, cut at one of its copies (:class:`OptimisticCache`, hybrids).

    guard : GuardConfig or DivergenceGuard, optional
        Policy ``"fast"``: the confidence gate and the online divergence guard (:mod:`hf_kvreuse.guard`); a
        :class:`~hf_kvreuse.guard.DivergenceGuard` passed here is shared (e.g. by the sessions of one workflow run
        over many documents). Default: ``GuardConfig()``.

    Examples
    --------
    >>> session = ReuseSession(model, max_bytes=2 << 30)
    >>> out = session.generate(ids, agent="critic", max_new_tokens=64)
    >>> session.last_stats.exact_prefix_tokens, session.last_stats.donor_tokens, session.nbytes

    Notes
    -----
    Calls whose tokens no reuse cache can produce step by step run through the exact-prefix path only: beam search
    and ``num_return_sequences > 1`` (their result, several sequences, is not held). Models with sliding-window
    attention layers: ``"auto"`` chooses between exact prefixes and verified drafts from held caches with every row
    (``sliding_history=True``, the default; with False, exact prefixes only); ``"optimistic"`` is accepted, the
    other approximate policies refuse such a model. Linear-attention hybrids: ``"auto"`` reuses exact prefixes
    through held states; ``"optimistic"`` (asked for by name) drafts from another call's state over a shared span
    and verifies the drafts (the answer is plain ``generate``'s); the other approximate policies refuse them.
    ``use_cache=False`` runs plain ``generate`` and holds nothing; so do (``"auto"`` and ``"full"``; other
    policies refuse, naming the option) the calls no reuse method honours: ``cache_implementation`` (on the call or
    in the model's ``generation_config``), ``output_hidden_states`` / ``output_attentions``, assisted generation
    (``assistant_model``, ``prompt_lookup_num_tokens``) and the other decoding modes beyond greedy, sampling and
    beam search (:func:`~hf_kvreuse.generation.options.plain_only_call`), and every call of a model whose RoPE
    frequencies depend on the length (``rope_type="dynamic"``, ``"longrope"``: no held row is exact;
    ``"prefix"`` also runs plain ``generate``), with the reason in ``last_stats.reason``.

    Thread safety: one :meth:`generate` at a time (others wait); :attr:`nbytes`, :meth:`held` and ``len()`` may be
    read from any thread meanwhile; :meth:`clear` waits for a running call, then drops everything.
    """

    def __init__(self, model, max_bytes: int = 2 << 30, policy: str = "auto", min_span: int = 4,
                 min_donor_tokens: int = 32, method_kwargs: dict | None = None, rebase: str = "verify",
                 sliding_history: bool = True, state_block: int = 256, state_copies: int | None = 2,
                 guard: GuardConfig | DivergenceGuard | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: choose one of {POLICIES}")
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        if "source_cache" in (method_kwargs or {}):
            raise ValueError("method_kwargs['source_cache'] is the source model's cache of ONE prompt; the session "
                             "would reuse it for every later prompt. Leave it out: the session prefills the source "
                             "model for each prompt")
        if rebase not in ("verify", "commit"):
            raise ValueError(f"rebase={rebase!r}: choose 'verify' (keeps the answers) or 'commit' (fastest)")
        _check_focus(policy, method_kwargs)
        self.rebase = rebase
        self.model = model
        self.max_bytes = int(max_bytes)
        self.policy = policy
        self.min_span = min_span
        self.min_donor_tokens = min_donor_tokens
        self.method_kwargs = dict(method_kwargs or {})
        self.sliding_history = bool(sliding_history)
        if state_block < 0:
            raise ValueError(f"state_block must be >= 0, got {state_block}")
        self.state_block = int(state_block)
        if state_copies is not None and state_copies < 0:
            raise ValueError(f"state_copies must be >= 0 or None, got {state_copies}")
        self.state_copies = state_copies
        if guard is not None and not isinstance(guard, (GuardConfig, DivergenceGuard)):
            raise TypeError(f"guard must be a GuardConfig or a DivergenceGuard, got {type(guard).__name__}")
        #: policy "fast": per agent, how often committed drafts left full prefill's tokens (a DivergenceGuard may
        #: be shared by several sessions of one workflow)
        self.guard = guard if isinstance(guard, DivergenceGuard) else DivergenceGuard(guard)
        self._call = threading.local()  # this thread's call: the fast guard's mode while it runs
        self.last_stats: SessionStats | None = None
        self.calls = 0
        #: what ``"auto"`` measured on this session's calls (per device and thread count)
        self.chooser = AutoChooser()
        self._no_drafts: str | None = None  # why this model cannot use verified drafts ('' if it can; None: unknown)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        # recurrent-state models: whole caches of the model's own kind, each standing for exactly its tokens
        self._states: OrderedDict[int, _StateEntry] = OrderedDict()
        self._fingerprint: tuple[str, str] | None = None  # (weights token, model_fingerprint) once computed
        self._next_key = 0
        self._trajectory = None  # the BaseLRCache of policy "base_lr"
        self._lock = threading.Lock()      # one call at a time
        self._state = threading.RLock()    # the held caches: short critical sections, readable during a call
        # each layer's sliding window (None: full attention), as transformers' own DynamicCache builds it
        self._windows = [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
                         for layer in DynamicCache(config=_generation_config_model(model).config).layers]
        if any(self._windows):
            self._check_policy_for_sliding(policy)
        # linear-attention / recurrent-state layers: no held state can be reused exactly yet (hybrid.py)
        self._state_reason = state_reason(_generation_config_model(model).config)
        if self._state_reason:
            self._check_policy_for_states(policy)

    def _producer(self, fingerprint: bool = False) -> str:
        """Which weights make this call's K/V, as held entries record it (``_Entry.producer``).

        The model's fingerprint (every parameter byte, the config, the active adapters:
        :func:`~hf_kvreuse.fingerprint.model_fingerprint`) where it is known for the present weights, or where
        ``fingerprint`` asks for it or a held entry carries one (a loaded session's). Otherwise a token of the
        present weights in this process (``"w..."``: the model object, each parameter's storage and version, the
        config, the adapters), which this session's own entries are compared by; it becomes the fingerprint when
        that is computed (:meth:`_identified_entries`). Hashing every weight takes about a second per GB the first
        time, so a session that holds only its own caches never pays it before a first token."""
        from .fingerprint import config_digest, model_fingerprint, weights_state

        state = (id(self.model), weights_state(self.model), config_digest(self.model.config))
        token = "w" + hashlib.sha256(repr(state).encode()).hexdigest()[:15]
        with self._state:
            if self._fingerprint is not None and self._fingerprint[0] == token:
                return self._fingerprint[1]
            if not fingerprint and all(e.producer.startswith("w") for e in self._entries.values()):
                return token
        fp = model_fingerprint(self.model)
        with self._state:
            self._fingerprint = (token, fp)
            for e in self._entries.values():
                if e.producer == token:
                    e.producer = fp
        return fp

    def _identified_entries(self) -> list:
        """The held entries, least recently used first, each with the fingerprint of the weights that made it
        (computed now for those made with the present weights); entries made with weights this model no longer
        has cannot be identified and are left out, with a warning."""
        self._producer(fingerprint=True)
        with self._state:
            entries = list(self._entries.values())
        lost = [e for e in entries if e.producer.startswith("w")]
        if lost:
            warnings.warn(f"{len(lost)} held cache(s) were made with weights this {type(self.model).__name__} no "
                          "longer has (written in place since): they are not saved", stacklevel=3)
        return [e for e in entries if not e.producer.startswith("w")]

    @classmethod
    def for_method(cls, model, method: str, **kwargs) -> "ReuseSession":
        """A session for one of the named :data:`MODES` (e.g. ``"auto-commit"``, or with cache options as
        :func:`resolve_mode` reads them, ``"auto-verify:max_optimistic_tokens=4"``); ``kwargs`` go to the
        constructor (``method_kwargs`` given here update the mode's)."""
        mode = resolve_mode(method)
        mk = {**mode.pop("method_kwargs"), **(kwargs.pop("method_kwargs", None) or {})}
        return cls(model, **{**mode, **kwargs}, method_kwargs=mk)

    # -- what is held ----------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """K/V bytes held now."""
        with self._state:
            held = sum(e.nbytes for e in self._entries.values()) + sum(e.nbytes for e in self._states.values())
            trajectory = self._trajectory
        return held + (trajectory.kv_bytes() if trajectory is not None else 0)

    def __len__(self) -> int:
        with self._state:
            return len(self._entries) + len(self._states)

    def clear(self) -> None:
        """Drop every held cache (after the running call, if one runs: its cache is dropped too)."""
        with self._lock, self._state:
            self._entries.clear()
            self._states.clear()
            self._trajectory = None

    def hold(self, ids, kv: KV, exact: bool, agent: str | None = None) -> None:
        """Hold K/V computed elsewhere (e.g. a vLLM engine, through :mod:`hf_kvreuse.vllm.hf`) as a cache of ``ids``.

        The caller vouches that this session's model computed them (:func:`hf_kvreuse.vllm.hf.to_session` checks
        the store's model identity first); ``exact``: rows are what a plain prefill of ``ids`` computes (exact
        prefixes), otherwise they serve as re-positioned donors only. Full-attention models only.
        """
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
        if self._state_reason:
            raise ValueError(f"hold() takes K/V; {type(self.model).__name__} has {self._state_reason}")
        if any(self._windows):
            raise ValueError("hold() takes full-attention K/V; this model has sliding-window layers")
        if len(kv) != len(self._windows) or any(k.shape[-2] != ids.numel() for k, _ in kv):
            raise ValueError(f"hold(): {len(kv)} layers of K/V for {ids.numel()} tokens do not match the model's "
                             f"{len(self._windows)} layers")
        dtype = getattr(self.model, "dtype", None)  # transformers' compute dtype (its K/V's)
        if dtype is not None and any(k.dtype != dtype or v.dtype != dtype for k, v in kv):
            raise ValueError(f"hold(): K/V of dtype {kv[0][0].dtype} for a {dtype} model "
                             f"({type(self.model).__name__}): its forwards would mix dtypes; convert them first "
                             "if that is what you mean (the rows are then no longer exact)")
        # each layer's K/V where that layer computes (a CUDA model handed CPU tensors, or a split model)
        kv = place_kv(kv, layer_devices(self.model))
        from .fingerprint import model_fingerprint

        with self._lock, self._state:
            entry = _Entry(ids=ids, kv=kv, exact=bool(exact), agent=agent, nbytes=_storage_bytes(kv),
                           producer=model_fingerprint(self.model))
            if entry.nbytes > self.max_bytes:
                raise ValueError(f"{entry.nbytes} bytes of K/V exceed the session's max_bytes={self.max_bytes}")
            self._entries[self._next_key] = entry
            self._next_key += 1
            while self.nbytes > self.max_bytes:
                self._entries.popitem(last=False)

    def held(self) -> list[dict]:
        """One row per held cache, least recently used first: tokens, exact, agent, bytes."""
        with self._state:
            return ([dict(tokens=int(e.ids.numel()), exact=e.exact, agent=e.agent, nbytes=e.nbytes)
                     for e in self._entries.values()]
                    + [dict(tokens=int(e.ids.numel()), exact=True, agent=e.agent, nbytes=e.nbytes)
                       for e in self._states.values()])

    def _drafts_on_sliding(self) -> bool:
        """A model with sliding-window layers whose held caches keep every row: verified drafts can use them."""
        return any(self._windows) and self.sliding_history

    def _check_policy_for_sliding(self, policy: str) -> None:
        allowed = ("auto", "fast", "full", "prefix") + (("optimistic",) if self.sliding_history else ())
        if policy not in allowed:
            what = ("OptimisticCache needs held caches with every row: sliding_history=True" if policy == "optimistic"
                    else "only OptimisticCache serves such models")
            also = "'optimistic', " if self.sliding_history else ""
            raise ValueError(f"policy={policy!r} cannot serve {type(self.model).__name__}: it has sliding-window "
                             f"attention layers ({what}). Use policy 'auto' or 'prefix' (exact prefix reuse), "
                             f"{also}or 'full'")

    # -- generate --------------------------------------------------------------------------------------------
    def _check_policy_for_states(self, policy: str) -> None:
        if policy == "optimistic":
            from .hybrid import draft_refusal

            why = draft_refusal(_generation_config_model(self.model))
            if why:
                raise ValueError(f"policy='optimistic' cannot draft on {type(self.model).__name__} (a "
                                 f"linear-attention hybrid): {why}. Use policy 'auto' or 'prefix', or 'full'")
            return
        if policy not in ("auto", "fast", "full", "prefix"):
            raise ValueError(f"policy={policy!r} reuses K/V that {type(self.model).__name__} does not have: its "
                             f"{self._state_reason}. Use policy 'auto' or 'prefix' (exact prefixes through held "
                             "states), 'optimistic' (verified drafts from held states), or 'full' (plain generate)")

    def generate(self, input_ids, agent: str | None = None, policy: str | None = None, **generate_kwargs):
        """``model.generate(input_ids, **generate_kwargs)`` with the session's caches reused.

        Returns what ``model.generate`` returns (plain ``generate`` keywords pass through, ``streamer`` too).
        ``agent`` names the caller for the stats; ``policy`` overrides the session's for this call. On error
        the session is left as it was.
        """
        policy = policy or self.policy
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: choose one of {POLICIES}")
        if policy == "fast":
            return self._generate_fast(input_ids, agent, generate_kwargs)
        _check_focus(policy, self.method_kwargs)
        for name in CACHE_NAMES:
            if generate_kwargs.get(name) is not None:
                raise ValueError(f"ReuseSession builds the cache itself: do not pass {name}=")
        if any(self._windows):
            self._check_policy_for_sliding(policy)
        if self._state_reason:
            self._check_policy_for_states(policy)
        if policy == "translated" and "source_cache" in generate_kwargs:
            raise ValueError("source_cache is not a generate keyword; the session prefills the source model itself")
        opts = call_options(_generation_config_model(self.model), generate_kwargs)
        padded = self._inferred_padding(input_ids, generate_kwargs, policy if opts.use_cache else "full")
        ids = self._check_ids(input_ids, generate_kwargs)
        if padded:
            with self._lock:
                return self._generate_uncached(ids, agent, policy, generate_kwargs, padded=True,
                                               timed=opts.sequences == 1)
        plain_why = self._plain_only(policy, opts, generate_kwargs)
        if plain_why:  # no held K/V can serve this call exactly: plain generate, nothing held
            with self._lock:
                return self._generate_uncached(ids, agent, policy, generate_kwargs,
                                               timed=opts.mode in STEPWISE_MODES + ("assisted_generation",)
                                               and opts.sequences == 1,
                                               reason=f"{plain_why}: plain generate, nothing held")
        if not opts.stepwise and policy not in ("auto", "full", "prefix"):
            raise ValueError(f"policy={policy!r} decodes one sequence token by token; this call asks for "
                             f"{opts.mode} with {opts.sequences} sequences: use policy 'auto' or 'prefix' (exact "
                             "prefix reuse), or 'full'")
        with self._lock:  # one call at a time: held caches and stats belong to the session
            if self._state_reason:  # whole held states, reused where they stand for a prefix of the prompt
                continues, why = state_continues(_generation_config_model(self.model))
                if policy == "prefix" and not continues:
                    raise ValueError(f"policy='prefix' cannot reuse held states of {type(self.model).__name__}: "
                                     f"{why}. Use policy 'auto' or 'full' (plain generate)")
                if policy == "full" or not opts.use_cache or not opts.stepwise or not continues:
                    reason = f"{self._state_reason}: plain generate, nothing held" + (f" ({why})" if why else "")
                    return self._generate_uncached(ids, agent, policy, generate_kwargs, timed=opts.sequences == 1,
                                                   reason=reason)
                if policy == "optimistic" and opts.sequences == 1:
                    return self._generate_state_drafts(ids, agent, policy, generate_kwargs)
                return self._generate_states(ids, agent, policy, generate_kwargs)
            if not opts.use_cache:
                return self._generate_uncached(ids, agent, policy, generate_kwargs)
            return self._generate(ids, agent, policy, generate_kwargs, opts)

    def _generate_fast(self, input_ids, agent, generate_kwargs: dict):
        """Policy ``"fast"`` (approximate): ``"auto"``'s choice, with drafts from held caches committed under the
        confidence gate while the guard allows it for this agent (:class:`~hf_kvreuse.guard.DivergenceGuard`), or
        verified (exact) once its drafts have left full prefill's tokens too often; every call's outcome (the
        divergence the swap counts, or what the verified drafts say a gated commit would have done) goes back to
        the guard. Calls ``"auto"`` serves exactly (an exact prefix, plain prefill) stay exact."""
        if self.method_kwargs.get("rebase") == "verify" or "gate" in self.method_kwargs:
            raise ValueError("policy='fast' sets rebase and the gate itself: leave them out of method_kwargs (the "
                             "gate is guard=GuardConfig(gate=...))")
        mode, why = self.guard.decide(agent)
        self._call.fast = (mode, why, agent)
        try:
            return self.generate(input_ids, agent=agent, policy="auto", **generate_kwargs)
        finally:
            self._call.fast = None

    def _fast(self):
        """``(mode, reason, agent)`` of the guard while a ``"fast"`` call runs in this thread, else None."""
        return getattr(self._call, "fast", None)

    def _rebase_for_call(self) -> str:
        fast = self._fast()
        if fast is not None:
            return fast[0]
        return self.method_kwargs.get("rebase", self.rebase)

    def _cache_kwargs_for_call(self) -> dict:
        """``method_kwargs`` of this call's OptimisticCache: policy ``"fast"`` adds its mode and gate."""
        fast = self._fast()
        if fast is None:
            return dict(self.method_kwargs)
        kw = {k: v for k, v in self.method_kwargs.items() if k not in ("rebase", "gate")}
        kw["rebase"] = fast[0]
        if fast[0] == "commit":
            kw["gate"] = self.guard.config.gate
        return kw

    def _set_last(self, stats: "SessionStats") -> None:
        """The call's stats become ``last_stats``; a ``"fast"`` call's are labelled and taught to its guard."""
        fast = self._fast()
        if fast is not None:
            mode, why, agent = fast
            stats.policy = "fast"
            if stats.method == "optimistic":
                stats.guard_mode = mode
                self.guard.record(agent, stats.cache_stats)
                stats.reason = why
            else:
                stats.reason = f"fast: {stats.reason}" if stats.reason else "fast: exact path"
        self.last_stats = stats

    def _plain_only(self, policy: str, opts, kwargs: dict) -> str | None:
        """Why this call runs as plain ``generate`` with nothing held (None: the policy runs): a generate option or
        model config no reuse method honours (:func:`~hf_kvreuse.generation.options.plain_only_call`), or RoPE
        frequencies that depend on the length (:func:`~hf_kvreuse.rotary.length_dependent_rope`), or a forward whose
        rows depend on each other (:func:`~hf_kvreuse.model_check.rows_coupled`: dynamic quantization): no held row
        is exact. ``"auto"`` and ``"full"`` step down to plain ``generate``, ``"prefix"`` too where the model is the
        reason (it reuses only exact rows, and none are); every other policy refuses, naming the option."""
        if not opts.use_cache:
            return None  # runs as plain generate already
        why = plain_only_call(opts, kwargs)
        if why is not None:
            if policy not in ("auto", "full"):
                raise ValueError(f"policy={policy!r} cannot honour {why}. Use policy 'auto' or 'full' (plain "
                                 "generate for this call)")
            return why
        model = _generation_config_model(self.model)
        why = length_dependent_rope(model)
        if why is not None and policy not in ("auto", "full", "prefix"):
            raise UnsupportedRopeError(f"policy={policy!r} cannot reuse or re-position K/V of "
                                       f"{type(self.model).__name__}: {why}. Use policy 'auto', 'prefix' or 'full' "
                                       "(plain generate, nothing held)")
        if why is None:
            why = rows_coupled(model)
            if why is not None and policy not in ("auto", "full", "prefix"):
                raise UnsupportedModelError(f"policy={policy!r} cannot reuse K/V of {type(self.model).__name__}: "
                                            f"{why}. Use policy 'auto', 'prefix' or 'full' (plain generate, nothing "
                                            "held)")
        return why

    def _inferred_padding(self, input_ids, kwargs: dict, policy: str) -> bool:
        """Whether plain ``generate`` would mask pad tokens of this prompt (no ``attention_mask``, the pad id in
        the prompt and not an eos id). Policies ``auto`` and ``full`` then run plain ``generate`` as it is (no
        reuse, nothing held: held rows read the pad tokens as text); any other policy is refused with the pad id."""
        if kwargs.get("attention_mask") is not None:
            return False
        ids = prompt_ids(input_ids, "input_ids")
        model = _generation_config_model(self.model)
        if inferred_padding(model, ids, kwargs) is None:
            return False
        if policy not in ("auto", "full"):
            refuse_inferred_padding(model, ids, kwargs, f"ReuseSession policy {policy!r}")
        return True

    def _generate_uncached(self, ids: torch.Tensor, agent, policy: str, kwargs: dict, padded: bool = False,
                           timed: bool = True, reason: str | None = None):
        """``use_cache=False``, or a prompt whose pad tokens ``generate`` masks (``padded``): plain ``generate``
        (no cache to reuse or to keep; ``padded`` calls get the mask ``generate`` infers, not an all-ones one)."""
        if padded:
            kwargs.pop("attention_mask", None)
        stats = SessionStats(policy=policy, method="full", agent=agent, prompt_tokens=ids.shape[1],
                             new_tokens=ids.shape[1], stored=False, reason=reason)
        out = self._timed_generate(ids, None, kwargs, stats, timed=timed)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        stats.generated_tokens = int(sequences.shape[1] - ids.shape[1])
        stats.held_bytes = self.nbytes
        self.calls += 1
        self._set_last(stats)
        return out

    def _generate_states(self, ids: torch.Tensor, agent, policy: str, kwargs: dict):
        """A recurrent-state model: the longest held state that stands for a prefix of the prompt (a copy of it;
        the held one is never fed), the prompt's rest prefilled in blocks of ``state_block`` tokens with the
        recurrent-state layers copied at each block's end, then plain ``generate``. Held after the call: the cache
        at the prompt's end (copied when the first token is out, so it costs no first-token time) and the cache the
        call ends with, carrying the block copies. The convolution and recurrent states sum their whole prefix, so
        a state is reused only at exactly the token it was taken at, as the hybrid prefix caches of vLLM and SGLang
        do."""
        n = ids.shape[1]
        stats = SessionStats(policy=policy, method="full", agent=agent, prompt_tokens=n, new_tokens=n)
        producer = self._producer()
        cpu_ids = ids[0].cpu()
        best = None  # (tokens, key, entry)
        with self._state:
            for key, e in self._states.items():
                if e.producer != producer:
                    continue
                for b in [e.ids.numel(), *e.boundaries]:
                    if b <= n - 1 and (best is None or b > best[0]) and torch.equal(e.ids[:b], cpu_ids[:b]):
                        best = (b, key, e)
            if best is not None:
                self._states.move_to_end(best[1])
        start, kept = 0, {}
        if best is not None:
            start, _, held = best
            cache = held.at(start)
            kept = {b: snap for b, snap in held.boundaries.items() if b <= start}
            stats.method, stats.exact_prefix_tokens, stats.new_tokens = "prefix", start, n - start
            stats.reason = "recurrent-state layers: an exact prefix through a held state taken at its last token"
        else:
            cache = state_cache(self.model)
            stats.reason = f"{self._state_reason}: no held state stands for a prefix of this prompt"
        blocks: dict = {}
        state_idx = (state_indices(cache) or None) if cache is not None and self.state_block else None

        def prefill_blocks():  # the prompt up to its copy points before the last token, a copy at each
            from .compat import cache_kwargs
            from .hybrid import copy_points

            pos = start
            with torch.no_grad():
                for b in copy_points(start, n - 1, self.state_block, self.state_copies):
                    self.model(input_ids=ids[:, pos:b], use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
                    blocks[b] = {i: copy.deepcopy(cache.layers[i]) for i in state_idx}
                    pos = b

        snap = _FirstTokenCopy(cache, n)
        out = self._timed_generate(ids, cache, kwargs, stats, also=snap,
                                   before=prefill_blocks if state_idx is not None else None)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        stats.generated_tokens = int(sequences.shape[1] - n)
        stats.exact = stats.exact_output = True
        final = cache if cache is not None else getattr(out, "past_key_values", None)
        boundaries = {**kept, **blocks}
        with self._state:
            length = _state_length(final)
            keep_final = length is not None and n < length <= sequences.shape[1]
            if snap.copy is not None:
                self._hold_state(cpu_ids, snap.copy, agent, producer, stats,
                                 boundaries=None if keep_final else boundaries)
            if keep_final:
                self._hold_state(sequences[0, :length].cpu(), copy.deepcopy(final), agent, producer, stats,
                                 boundaries=boundaries)
            stats.held_bytes = self.nbytes
        self.calls += 1
        self._set_last(stats)
        return out

    def _generate_state_drafts(self, ids: torch.Tensor, agent, policy: str, kwargs: dict):
        """A recurrent-state model, ``"optimistic"``: an :class:`OptimisticCache` over every held state of this
        producer (each with its block copies; exact donors: they are this model's own exact caches), whose verified
        drafts make the answer plain ``generate``'s. Held after the call: the exact cache it ends with, carrying the
        exact start's block copies and those its background prefill took."""
        from .cache_classes.optimistic import OptimisticCache

        n = ids.shape[1]
        producer = self._producer()
        with self._state:
            held = [(k, e) for k, e in self._states.items() if e.producer == producer]
        if not held:
            return self._generate_states(ids, agent, policy, kwargs)
        model = _generation_config_model(self.model)
        donors = []
        for _, e in held:  # a new list of the held layers: release_donor empties the wrapper, not the entry
            w = state_cache(model)
            w.layers = list(e.cache.layers)
            donors.append(w)
        cache = OptimisticCache(self.model, ids, donors, [e.ids[None] for _, e in held],
                                donor_states=[dict(e.boundaries) for _, e in held], donor_exact=[True] * len(held),
                                **{"min_span": self.min_span, "verify_donor": False, "rebase": self.rebase,
                                   "state_every": self.state_block, "state_copies": self.state_copies,
                                   **self.method_kwargs})
        stats = SessionStats(policy=policy, method="optimistic", agent=agent, prompt_tokens=n, new_tokens=n)
        out = self._timed_generate(ids, cache, kwargs, stats)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        cst, plan = cache.stats, cache.plan
        stats.generated_tokens = int(sequences.shape[1] - n)
        stats.exact, stats.exact_output = bool(cst.exact), bool(cst.exact_output)
        stats.exact_prefix_tokens, stats.donor_tokens = plan.exact_len, plan.reused
        stats.donor_calls = int(plan.span_donor >= 0)
        stats.new_tokens, stats.background_tokens = cst.new_tokens, cst.background_tokens
        stats.draft_ttft_s = cst.draft_ttft_s
        stats.drafted_tokens, stats.accepted_tokens = cst.drafted_tokens, cst.accepted_tokens
        stats.divergent_tokens = cst.divergent_tokens
        stats.cache_stats = cst.as_dict()
        if plan.span_donor < 0:
            stats.method = "prefix" if plan.exact_len else "full"
            stats.reason = ("recurrent-state layers: no held span saves min_span tokens over the exact start; "
                            "exact prefill")
        else:
            stats.reason = (f"recurrent-state layers: a draft from a held call's state after its token "
                            f"{plan.state_at} ({plan.reused} tokens reused), verified")
        kept = {}
        if plan.exact_donor >= 0:
            kept = {b: snap for b, snap in held[plan.exact_donor][1].boundaries.items() if b <= plan.exact_len}
        with self._state:
            for d in {plan.span_donor, plan.exact_donor} - {-1}:  # recently useful states are the last to go
                if held[d][0] in self._states:
                    self._states.move_to_end(held[d][0])
            length = _state_length(cache)
            if cst.exact and length is not None and n - 1 <= length <= sequences.shape[1]:
                final = state_cache(model)
                final.layers = [copy.deepcopy(layer) for layer in cache.layers]
                self._hold_state(sequences[0, :length].cpu(), final, agent, producer, stats,
                                 boundaries={**kept, **cache.state_snapshots})
            stats.held_bytes = self.nbytes
        self.calls += 1
        self._set_last(stats)
        return out

    def _hold_state(self, ids: torch.Tensor, cache, agent, producer: str, stats: SessionStats,
                    boundaries: dict | None = None) -> None:
        boundaries = {b: snap for b, snap in (boundaries or {}).items() if b < ids.numel()}
        entry = _StateEntry(ids=ids, cache=cache, agent=agent, producer=producer, boundaries=boundaries,
                            nbytes=tensor_bytes(cache) + tensor_bytes(boundaries))
        if entry.nbytes > self.max_bytes:
            return
        for key in [k for k, e in self._states.items() if torch.equal(e.ids, ids) and e.producer == producer]:
            del self._states[key]  # the same tokens: the newer copy replaces it
        self._states[self._next_key] = entry
        self._next_key += 1
        stats.stored = True
        while self.nbytes > self.max_bytes:
            self._states.popitem(last=False)
            stats.evicted += 1

    def _check_ids(self, input_ids, kwargs: dict) -> torch.Tensor:
        ids = prompt_ids(input_ids, "input_ids", kwargs.get("attention_mask"))  # a BatchEncoding too
        if ids.shape[1] < 2:
            raise ValueError("ReuseSession needs a prompt of at least 2 tokens")
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError("ReuseSession does not support padding: pass an all-ones attention_mask or none")
        device = input_device(self.model)
        # an explicit mask: generate must not mistake a pad id inside the prompt for padding
        kwargs["attention_mask"] = torch.ones_like(ids, device=device)
        return ids.to(device)

    def _generate(self, ids: torch.Tensor, agent, policy: str, kwargs: dict, opts):
        n = ids.shape[1]
        stats = SessionStats(policy=policy, method=policy, agent=agent, prompt_tokens=n)
        if policy == "base_lr":
            return self._generate_base_lr(ids, stats, kwargs)
        producer = self._producer()  # another adapter's or model's K/V are never an exact prefix
        with self._state:
            entries = list(self._entries.items())  # least recently used first
        cpu_ids = ids[0].cpu()
        trusted = [i for i, (_, e) in enumerate(entries) if e.exact and e.producer == producer]
        # the exact prefix: the longest over the exact held caches (the last prompt token is always fed) whose
        # sliding-window layers still hold the rows a cache of that prefix keeps
        prefix, prefix_key, prefix_kv = 0, None, None
        for i in trusted:
            key, e = entries[i]
            p = min(_common_prefix(e.ids, cpu_ids), n - 1)
            if p > prefix:
                kv = e.prefix_kv(p, self._windows)
                if kv is None and e.marks:  # generation moved a sliding window past p: a prompt boundary
                    p, kv = boundary_kv(e.kv, e.marks, p, self._windows) or (p, None)
                if kv is not None and p > prefix:
                    prefix, prefix_key, prefix_kv = p, key, kv
        # only an exact prefix for the calls no reuse cache can serve (beams, several sequences, sliding layers);
        # "auto" also keeps to it on an offloaded model, whose hooks cannot prefill in the background
        prefix_only = (not opts.stepwise or (any(self._windows) and not self.sliding_history)
                       or (policy == "auto" and offloaded(self.model)))
        al = None
        if policy not in ("full", "prefix", "translated") and entries and not prefix_only:
            # sliding-window layers: only held caches with every row of every layer can donate
            donors_ids = [e.ids if not any(self._windows) or e.every_row() else e.ids[:0] for _, e in entries]
            al = align_multi(donors_ids, cpu_ids, min_span=self.min_span, target_limit=n - 1,
                             prefix_donors=trusted)
            if policy == "latent" and al.spans and al.spans[0].target_start == 0:
                # LatentRemedyCache computes the agent's own prefix (the bridge reads its last hidden state): a
                # span at token 0 is not one of the blocks it remedies
                al = dataclasses.replace(al, spans=al.spans[1:], prefix_len=0)
        method, reason = policy, None
        exact_method, exact_reason = ("prefix" if prefix else "full"), None
        if policy == "auto" and prefix:  # a prefix too short to pay: plain prefill (AutoChooser.prefix_pays)
            pays, exact_reason = self.chooser.prefix_pays(ids.device, n, prefix)
            exact_method = "prefix" if pays else "full"
        if prefix_only and policy == "auto":
            method = exact_method
            reason = ("beam search / several sequences: exact prefix reuse only" if not opts.stepwise else
                      "sliding-window layers and sliding_history=False: exact prefix reuse only"
                      if any(self._windows) and not self.sliding_history else
                      "offloaded weights cannot prefill in the background: exact prefix reuse only")
        elif policy == "auto":
            method, reason = self._auto(ids, al, prefix, exact_method, opts, kwargs)
        if policy == "auto" and method == "full" and exact_reason:
            reason = reason.replace("exact prefix reuse", "plain prefill") + f" ({exact_reason})"
        elif policy in ("optimistic",) + BLOCK_POLICIES and (al is None or not al.spans):
            method = exact_method  # nothing held to reuse
            reason = "no held cache shares a span with the prompt"
        stats.method, stats.reason = method, reason

        try:
            cache, used = self._build(method, ids, entries, al, prefix, prefix_key, prefix_kv, stats,
                                      set(trusted), producer)
        except (UnsupportedModelError, UnsupportedRopeError) as e:
            if policy != "auto":
                raise  # an explicitly requested method refuses clearly
            method = stats.method = exact_method  # the default steps down, never raises
            stats.reason = f"{type(self.model).__name__} cannot use verified drafts ({e}): exact prefix reuse"
            self._no_drafts = stats.reason
            cache, used = self._build(method, ids, entries, al, prefix, prefix_key, prefix_kv, stats,
                                      set(trusted), producer)
        if opts.sequences > 1 and cache.get_seq_length():
            cache.batch_repeat_interleave(opts.sequences)  # generate expands the prompt, not a cache it is given
        snapshot, history = None, False
        if any(self._windows) and opts.sequences == 1:
            if self.sliding_history and opts.stepwise and method in ("full", "prefix"):
                # the sliding layers also keep every row, so the held entry serves any later prefix exactly
                full = dict(entries)[prefix_key].history_kv(prefix) if method == "prefix" and prefix else None
                history = keep_history(cache, self._windows, full)
            if not history and not (method == "optimistic" and self.sliding_history):
                # at least the sliding layers' rows at the end of the prompt (verified drafts keep every row)
                snapshot = WindowSnapshot(cache, self._windows, n)
                kwargs = dict(kwargs, streamer=_Tee(snapshot, kwargs.get("streamer")))
        out = self._timed_generate(ids, cache, kwargs, stats, timed=opts.sequences == 1)
        if method == "optimistic" and getattr(cache, "sliding_history", False):
            history = True  # its exact cache kept every row of the sliding layers too
        held_kv = take_history(cache, self._windows, int(cache.get_seq_length())) if history else None
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        stats.generated_tokens = int(sequences.shape[1] - n)
        cs = getattr(cache, "stats", None)
        if cs is not None and hasattr(cs, "as_dict"):
            stats.cache_stats = cs.as_dict()
        if method == "optimistic":
            cst = cache.stats
            stats.exact = bool(cst.exact)
            stats.exact_output = bool(cst.exact_output)
            stats.draft_ttft_s = cst.draft_ttft_s
            stats.drafted_tokens, stats.accepted_tokens = cst.drafted_tokens, cst.accepted_tokens
            stats.divergent_tokens = cst.divergent_tokens
            stats.background_tokens = cst.background_tokens
            stats.new_tokens = cst.new_tokens  # one count: what the cache computed before the first token
            stats.donor_tokens -= cst.repaired_tokens  # repair= recomputed those donor rows: new, not reused
            if cst.rebase == "verify" and opts.sequences == 1:
                self.chooser.record_drafts(ids.device, cst.background_tokens + 1, stats.ttft_s, stats.total_s,
                                           stats.generated_tokens)
        elif method not in ("full", "prefix"):
            stats.exact = stats.exact_output = False
        elif opts.sequences == 1:
            self.chooser.record_exact(ids.device, stats.new_tokens, stats.ttft_s, stats.total_s,
                                      stats.generated_tokens, past=stats.exact_prefix_tokens)
        with self._state:
            for key in used:  # recently useful caches are the last to go
                if key in self._entries:
                    self._entries.move_to_end(key)
            # beams / several returned sequences: nothing row-for-row to hold (a beam cache has one row per beam,
            # reordered; even its prompt rows come from a batched prefill, not the batch-1 one a later call runs)
            try:
                kv = kv_of(cache)
            except ValueError as e:  # the model keeps its own state and left this cache without K/V (RWKV)
                kv = None
                stats.stored, stats.reason = False, f"nothing held: the model does not cache per-token K/V ({e})"
            if kv is not None and sequences.shape[0] == 1 and opts.sequences == 1 and all(k.shape[0] == 1
                                                                                          for k, _ in kv):
                self._store(cache, sequences, stats, agent, producer, snapshot, held_kv)
            else:
                stats.held_bytes = self.nbytes
        self.calls += 1
        self._set_last(stats)
        return out

    def _auto(self, ids: torch.Tensor, al: Alignment | None, prefix: int, exact_method: str, opts,
              kwargs: dict) -> tuple[str, str]:
        """``"auto"``'s choice for one call: ``(method, reason)`` (module docstring, :class:`~hf_kvreuse.auto.AutoChooser`);
        ``exact_method``: the exact path it falls back to (``"prefix"`` or ``"full"``)."""
        from .generation.options import replay_unsafe_call

        n = ids.shape[1]
        donor_rows = (al.matched - al.prefix_len) if al is not None else 0
        if donor_rows < self.min_donor_tokens:
            return exact_method, (f"held caches offer {donor_rows} rows past the exact prefix of {prefix} "
                                  f"(< min_donor_tokens={self.min_donor_tokens}): exact prefix reuse")
        unsafe = replay_unsafe_call(opts, kwargs)
        if unsafe is not None:
            return exact_method, f"drafts cannot be verified by replaying {unsafe}: exact prefix reuse"
        if self._no_drafts is None:
            self._no_drafts = self._model_reason()  # probed once per session (the probe itself is cached per model)
        if self._no_drafts:
            return exact_method, self._no_drafts
        if self._fast() is not None:  # policy "fast": drafts, committed or verified as its guard allows
            return "optimistic", self._fast()[1]
        if self.rebase == "commit" or self.method_kwargs.get("rebase") == "commit":
            return "optimistic", "rebase='commit' asked for (approximate: answers may differ)"
        draft, why = self.chooser.choose(ids.device, n, n - prefix)
        return ("optimistic" if draft else exact_method), why

    def _model_reason(self) -> str:
        """Why this model cannot draft from re-positioned K/V ('' when it can): the cached model probe."""
        from .model_check import check_model

        report = check_model(self.model)
        if not report.rope_ok:
            return f"its K/V cannot be re-positioned ({report.rope_reason}): exact prefix reuse"
        if not report.engine_ok:
            return f"the partial prefill does not reproduce it ({report.engine_reason}): exact prefix reuse"
        return ""

    def _timed_generate(self, ids: torch.Tensor, cache, kwargs: dict, stats: SessionStats, timed: bool = True,
                        also=None, before=None):
        """``model.generate`` with ``cache`` (None: no cache keyword); TTFT and total time from a streamer (the
        caller's still gets every token; ``also``, another streamer, after both). ``timed=False`` (beam search
        refuses streamers): total time only."""
        kwargs = dict(kwargs)
        timer = TokenTimer(ids.device)
        if timed:
            kwargs["streamer"] = _Tee(timer, kwargs.get("streamer"), also)
        if cache is not None:
            kwargs[CACHE_KW] = cache
        timer.start()
        t0 = time.perf_counter()
        if before is not None:  # work of the call before generate (its time counts to the first token)
            before()
        out = self.model.generate(ids, **kwargs)
        if timed:
            stats.ttft_s, stats.total_s = timer.ttft_s, timer.total_s
        else:
            synchronize(ids.device)
            stats.total_s = time.perf_counter() - t0
        return out

    def _generate_base_lr(self, ids: torch.Tensor, stats: SessionStats, kwargs: dict):
        """One BaseLRCache for the session's trajectory: it crops to the common prefix and prefills the rest."""
        from .cache_classes.base_lr import BaseLRCache

        if self._trajectory is None:
            self._trajectory = BaseLRCache(self.model, **self.method_kwargs)
        cache = self._trajectory
        out = self._timed_generate(ids, cache, kwargs, stats)
        turn = cache.stats.turns[-1]
        stats.exact_prefix_tokens, stats.new_tokens = turn.cached_tokens, turn.prefill_tokens
        stats.generated_tokens = turn.generated_tokens
        stats.exact = stats.exact_output = cache.method == "nonshared"  # shared methods carry other adapters' states
        stats.cache_stats = asdict(turn)
        stats.stored = True
        if cache.kv_bytes() > self.max_bytes:  # the trajectory does not fit: start a new one next call
            self._trajectory, stats.stored, stats.evicted = None, False, 1
        stats.held_bytes = self.nbytes
        self.calls += 1
        self._set_last(stats)
        return out

    # -- one cache per method --------------------------------------------------------------------------------
    def _build(self, method: str, ids, entries, al: Alignment | None, prefix: int, prefix_key, prefix_kv, stats,
               trusted: set, producer: str):
        """The cache ``generate`` runs with, and the keys of the held caches it reads."""
        from .generation.mixin import enable

        n = ids.shape[1]
        kw = self.method_kwargs
        if method == "full":
            stats.new_tokens = n
            return DynamicCache(config=self.model.config), []
        if method == "prefix":
            cache = DynamicCache(config=self.model.config)
            if prefix:
                # views of the held rows: DynamicCache appends by concatenation, so they are never written
                load_kv(cache, prefix_kv, seq_length=prefix)
            stats.exact_prefix_tokens, stats.new_tokens = prefix, n - prefix
            return cache, [prefix_key] if prefix else []
        if method == "translated":
            from .cache_classes.translated import TranslatedCache

            missing = {"source_model", "mapper"} - set(kw)
            if missing:
                raise ValueError(f"policy 'translated' needs method_kwargs with {sorted(missing)}")
            enable(self.model)
            cache = TranslatedCache(self.model, input_ids=ids, **kw)
            stats.new_tokens = n
            return cache, []
        enable(self.model)
        donors = sorted({s.donor for s in al.spans})
        used = [entries[d][0] for d in donors]
        stats.donor_calls = len(donors)
        stats.exact_prefix_tokens = al.prefix_len if al.prefix_len and al.prefix_donor in trusted else 0
        stats.donor_tokens = al.matched - stats.exact_prefix_tokens
        stats.new_tokens = (n - 1 - al.matched) + 1
        if method == "optimistic":
            from .cache_classes.optimistic import OptimisticCache

            # new lists of the held tensors: a cache that releases its donors (``release_donor=True``) empties its
            # own lists, never the held entries' (their tensors stay alive while the session holds them)
            caches = [list(entries[d][1].kv) for d in donors]
            dids = [entries[d][1].ids[None] for d in donors]
            exact = [d in trusted for d in donors]
            # held caches were made by this model (under some adapter): no donor probe
            # sliding-window layers: the returned cache keeps every row too, a donor for later calls
            return OptimisticCache(self.model, ids, caches, dids, donor_exact=exact,
                                   **{"min_span": self.min_span, "verify_donor": False,
                                      "rebase": self._rebase_for_call(), "sliding_history": self._drafts_on_sliding(),
                                      **self._cache_kwargs_for_call()}), used
        return self._block_cache(method, ids, entries, al, kw, producer), used

    def _block_cache(self, method: str, ids, entries, al: Alignment, kw: dict, producer: str):
        """A block-reuse cache whose blocks are the aligned spans, each with the K/V of its earlier call."""
        from .cache_classes import (BlendCache, DirectReuseCache, EPICCache, FocusRecomputeCache, LatentRemedyCache,
                                    TailRecomputeCache)
        from .chunk_store import ChunkStore, KVChunk

        cls = {"direct": DirectReuseCache, "blend": BlendCache, "epic": EPICCache, "tail": TailRecomputeCache,
               "focus": FocusRecomputeCache, "latent": LatentRemedyCache}[method]
        store = ChunkStore(max_bytes=1 << 62)  # views of held rows, for this call only
        producer = self._producer(fingerprint=True)  # the cache looks its blocks up by the model's fingerprint
        blocks, prefixes = [], []
        for sp in al.spans:
            e = entries[sp.donor][1]
            d, t, m = sp.donor_start, sp.target_start, sp.length
            prefix_ids = e.ids[:d]
            chunk = KVChunk(ids[0, t:t + m].cpu(), [(k[..., d:d + m, :], v[..., d:d + m, :]) for k, v in e.kv],
                            start=d)
            store.put(self.model, chunk, prefix_ids, producer=producer)
            blocks.append((t, t + m))
            prefixes.append(prefix_ids)
        return cls(self.model, ids, blocks, store=store, block_prefix_ids=prefixes, **kw)

    # -- keeping the result ----------------------------------------------------------------------------------
    def _store(self, cache, sequences: torch.Tensor, stats: SessionStats, agent, producer: str,
               snapshot: WindowSnapshot | None = None, held_kv=None) -> None:
        """Hold the K/V of a finished call. ``held_kv``: every row of every layer (:func:`take_history`), where
        the sliding-window layers kept them; otherwise those layers give the rows they keep."""
        kv = list(held_kv) if held_kv is not None else list(kv_of(cache))
        # the tokens the cache stands for (a sliding-window layer holds fewer rows than that; layer 0 may be one)
        length = int(cache.get_seq_length())
        rows_ok = all(k.shape[-2] == length or (w is not None and k.shape[-2] == min(length, w - 1))
                      for (k, _), w in zip(kv, self._windows))
        if getattr(cache, "logical_offset", 0) or length > sequences.shape[1] or not rows_ok:
            stats.held_bytes = self.nbytes
            return  # compressed or padded layouts are not reusable row for row
        entry = _Entry(ids=sequences[0, :length].cpu(), kv=kv, exact=stats.exact, agent=agent,
                       nbytes=_storage_bytes(kv), producer=producer)
        if snapshot is not None and snapshot.rows is not None and entry.exact and snapshot.n <= length:
            entry.marks[snapshot.n] = snapshot.rows
            entry.nbytes += snapshot.nbytes
        if entry.nbytes <= self.max_bytes:
            # a held cache whose tokens this exact one extends is redundant (its prompt boundaries move over)
            if entry.exact:
                for key in [k for k, e in self._entries.items() if e.producer == producer
                            and e.ids.numel() <= length and torch.equal(e.ids, entry.ids[:e.ids.numel()])]:
                    for m, rows in self._entries[key].marks.items():
                        if m not in entry.marks:
                            entry.marks[m] = rows
                            entry.nbytes += sum(t.numel() * t.element_size() for r in rows if r for t in r)
                    del self._entries[key]
            self._entries[self._next_key] = entry
            self._next_key += 1
            stats.stored = True
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
            stats.evicted += 1
        stats.held_bytes = self.nbytes

    # -- reading, saving and loading -------------------------------------------------------------------------
    def __repr__(self) -> str:
        from .reprs import session_repr

        return session_repr(self)

    def save(self, path, **kwargs) -> dict:
        """Write the held caches to the folder ``path`` (safetensors + JSON, :func:`hf_kvreuse.persist.save_session`)
        or, for a store URL or backend (``"redis://host:6379"``; ``name=``, ``tenant=``), as one entry there
        (:func:`hf_kvreuse.stores.tiers.save_session`)."""
        from .persist import _is_store, save_session

        if _is_store(path):
            from .stores.tiers import save_session as save_to_store

            return save_to_store(self, path, **kwargs)
        return save_session(self, path, **kwargs)

    @classmethod
    def load(cls, path, model, **kwargs) -> "ReuseSession":
        """A session holding the caches saved in ``path`` (a folder, or a store URL or backend with ``name=``,
        ``tenant=``), verified against ``model``: :func:`hf_kvreuse.persist.load_session`,
        :func:`hf_kvreuse.stores.tiers.load_session`."""
        from .persist import _is_store, load_session

        if _is_store(path):
            from .stores.tiers import load_session as load_from_store

            return load_from_store(path, model, session_cls=cls, **kwargs)
        return load_session(path, model, session_cls=cls, **kwargs)
