"""TranslatedCache: RaReCache, a small source model prefills for a larger target of the same family
(seed 004, "RaReCache"; METHODS.md §2.4; the linear mapper of Heo et al., arXiv 2608.03893).

For a prompt of ``T`` covered tokens (all but the last, which ``generate`` feeds):

1. **source prefill**: the source model runs the prompt (``T`` rows, its own cache);
2. **map**: every target layer's K/V from the source's RoPE-stripped K/V of its ``top_k`` source layers
   (:class:`~hf_kvreuse.translation.mapper.KVMapper`); the target's RoPE is re-applied;
3. **select**: a scorer ranks the positions (``selector="auto"``: the attention the source model's last prompt row
   pays to each position over its upper-middle layers, CacheClip-style);
   the top ``recompute_ratio * T`` are chosen, always including the first ``sink_tokens`` (attention sinks)
   and the last ``suffix_tokens`` (the new query);
4. **recompute**: the target runs the selected rows through all of its layers with the partial-recompute
   engine (each row attends to the mapped and fresh K/V at positions not after its own); their K/V overwrite
   the mapped ones;
5. ``generate`` decodes with the target from the assembled cache.

``recompute_ratio=1.0`` recomputes every row in order: the target's full prefill. ``0.0`` recomputes nothing
(not even sinks and suffix): pure translation, the KV-Prediction-style baseline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..devices import input_device
from ..generation.fused import PendingForward, returns_internals
from ..generation.partial import head_logits, partial_forward, plain_head
from ..kv import kv_of, load_kv
from ..model_check import check_donor
from ..reprs import stats_repr
from ..rope import RopeShifter
from ..timing import now
from ..translation.mapper import KVMapper, run_source
from ..translation.scorers import Scorer, scorer_parts
from ..translation.selection import make_scorer
from .base import KVReuseCache


@dataclass
class TranslatedStats:
    """What happened during one ``generate`` with a :class:`TranslatedCache` (times in seconds).

    Attributes
    ----------
    prompt_tokens : int
        Covered prompt rows: all but the last prompt token (which ``generate`` feeds to the target).
    recomputed_tokens : int
        Rows the target recomputed through every layer.
    forced_tokens : int
        Sinks and suffix among them (always recomputed when ``recompute_ratio > 0``).
    recompute_ratio : float
        The ratio asked for.
    selector : str
        The scorer that chose the rows.
    selector_note : str
        Why ``selector="auto"`` did not use its first choice (empty when it did, or when a selector was named).
    exact_layers : int
        Leading target layers computed for every row (the first-layer scorer).
    source_prefill_s, map_s, select_s, recompute_s : float
        Source prefill; RoPE strip, linear maps and RoPE re-apply (and the scorer's observation); row selection;
        the target's recompute.
    assemble_s : float
        Everything before the target's first decoding forward.
    fused_first_step : bool
        The selected rows were recomputed in the forward that gives the first token, with the last prompt token
        (``fuse_first_step``): one pass over the target's weights less before the first token; ``recompute_s`` is
        then that whole forward, after ``assemble_s``.
    kernels : str
        Backend of the hot paths: ``"torch"`` or ``"triton"`` (``HF_KVREUSE_KERNELS``).
    """

    __repr__ = stats_repr

    prompt_tokens: int = 0          # covered prompt rows (all but the last prompt token)
    recomputed_tokens: int = 0      # rows the target recomputed through every layer
    forced_tokens: int = 0          # sinks + suffix among them
    recompute_ratio: float = 0.0
    selector: str = ""
    selector_note: str = ""         # why "auto" fell back from source attention ("" when it did not)
    exact_layers: int = 0           # leading target layers computed for every row (first-layer scorer)
    source_prefill_s: float = 0.0
    map_s: float = 0.0              # RoPE strip, linear maps, RoPE re-apply (and the scorer's observation)
    select_s: float = 0.0
    recompute_s: float = 0.0
    assemble_s: float = 0.0         # everything before the target's first decoding forward
    fused_first_step: bool = False  # the recompute ran in the first token's forward (recompute_s is in it)
    kernels: str = "torch"                 # backend of the hot paths: "torch" or "triton" (HF_KVREUSE_KERNELS)

    def as_dict(self) -> dict:
        return asdict(self)


def _auto_selector(source_model, source_cache, source_hidden, input_ids, tokenizer):
    """``selector="auto"``: source attention over the source's upper-middle layers (measured best, research notes);
    when a given source cache comes without those layers' hidden states, question-words (with a tokenizer) or
    first-layer deviation, and the reason."""
    from ..translation.source_attention import SourceAttentionScorer, depth_layers, unsupported

    need = depth_layers(source_model.config.num_hidden_layers)
    fallback = "question-words" if tokenizer is not None else "first-layer"
    reason = unsupported(source_model, need)
    if reason:
        return fallback, f"auto chose {fallback}: source attention cannot read this source model ({reason})"
    if source_cache is None:  # the cache's own source prefill captures what the scorer reads
        return SourceAttentionScorer(), ""
    rows = input_ids.shape[-1] - 1
    missing = [s for s in need if source_hidden is None or s not in source_hidden
               or source_hidden[s].shape[-2] < rows]
    if not missing:
        return SourceAttentionScorer(), ""
    return fallback, (f"auto chose {fallback}: source_hidden lacks the source layers {missing} that source attention "
                      "reads (pass source_hidden= from the same prefill, run_source, to get it)")


class TranslatedCache(KVReuseCache):
    """Target-model cache translated from a source model's prefill, with selective recompute.

    Parameters
    ----------
    model : PreTrainedModel
        The target (larger) model; ``generate`` runs on it.
    source_model : PreTrainedModel
        The source (smaller) model, same tokenizer.
    mapper : KVMapper
        Fitted for exactly this (source, target) pair (checked).
    input_ids : LongTensor ``[1, N]``
        The prompt; ``generate`` must be called with it.
    recompute_ratio : float, default=0.3
        Fraction of the covered prompt rows the target recomputes (RaReCache's default on a 23x gap).
    selector : str or Scorer, default="auto"
        How positions are chosen (:mod:`hf_kvreuse.translation.source_attention`,
        :mod:`hf_kvreuse.translation.scorers`, :mod:`hf_kvreuse.translation.question`): ``"source-attention"``,
        ``"question-words"`` (needs ``tokenizer``), ``"first-layer"``, ``"rank"``, ``"first-layer+rank"``,
        ``"random"``, ``"question-attention"``, or a Scorer (``"oracle"`` needs an
        :class:`~hf_kvreuse.translation.scorers.OracleScorer` built with the target's true K/V). ``"auto"``:
        ``"source-attention"`` (the attention of the source's last covered row, summed over the source layers at
        60-85% of its depth, then first-layer deviation for ties); it needs no marked question and no shared
        words. With a ``source_cache`` whose ``source_hidden`` lacks those layers it falls back to
        ``"question-words"`` (with ``tokenizer``) or ``"first-layer"`` and says why in ``stats.selector_note``.
        Chosen by measurement (research notes, TranslatedCache selection) on the Qwen2.5-Coder 0.5B -> 1.5B pair
        at ratio 0.3, fp32, n = 100 per dataset: retention 97% [88, 108] on SQuAD and 103% [95, 112] on CoQA
        first turns, against question-words 78% / 80%, first-layer deviation 52% / 64% and the source model alone
        78% / 76%. Every scorer here but ``"random"``, ``"rank"`` and ``"oracle"`` runs the target's layers 0-1
        for every row, only when ``0 < recompute_ratio < 1``.
    sink_tokens : int, default=4
        Leading rows always recomputed when ``recompute_ratio > 0``.
    suffix_tokens : int, default=16
        Trailing rows (the query) always recomputed when ``recompute_ratio > 0``.
    seed : int, default=0
        Seed of the random selector.
    source_cache : Cache or KV list, optional
        The source model's own K/V of (at least) the prompt's first ``N - 1`` tokens, e.g. from the turn the
        source served before the switch: step 1 is skipped (``stats.source_prefill_s == 0``). Its first
        ``N - 1`` positions must be this prompt's tokens at positions ``0..N-2`` (the caller's promise).
    source_hidden : dict, optional
        With ``source_cache`` and a map that reads the source's hidden states (``mapper.hidden_layers``): the
        normalised hidden states ``{layer: [T >= N-1, hidden]}`` of the same prefill
        (:func:`~hf_kvreuse.translation.mapper.run_source` returns them). Without ``source_cache`` the source
        prefill captures them itself.
    prefix_layers : int, default=0
        Leading target layers run for *every* row (exact K/V there; costs ``prefix_layers / L`` of a prefill);
        the selected rows then recompute only the layers after them, from the prefix's hidden states. A scorer
        that runs leading layers itself (``"first-layer"``, and the first-layer base of the question and
        source-attention scorers) measures its deviation at the first layer after them (layer
        ``max(1, prefix_layers)``), which becomes exact too. Spending a fixed budget on more exact leading layers and
        fewer selected rows was measured against the default (research notes, TranslatedCache selection).
    fuse_first_step : bool, default=True
        Keyword-only. The selected rows are recomputed in the forward that gives the first token, together with the
        last prompt token (:mod:`hf_kvreuse.generation.fused`): the same K/V and logits up to float rounding, one
        pass over the target's weights less before the first token. Not when ``generate`` returns attentions or
        hidden states, nor with exact leading layers on a model whose forward computes its logits otherwise than
        its output embedding (and soft-capping) would (probed once per model: a logit scale, another head).
        False: the recompute runs in the assembly, then ``generate``'s one-token step.
    tokenizer : optional
        The pair's tokenizer: ``"question-words"``
        (:class:`~hf_kvreuse.translation.question.QuestionWordScorer`: the context rows near several of the
        question's rarer words first, then first-layer deviation) needs it and is refused without it; ``"auto"``
        falls back to it when it cannot read the source's attention.
    """

    requires = {"rope": True, "engine": True, "layers": True}

    def __init__(self, model, source_model, mapper: KVMapper, input_ids: torch.Tensor, recompute_ratio: float = 0.3,
                 selector: str | Scorer = "auto", sink_tokens: int = 4, suffix_tokens: int = 16, seed: int = 0,
                 source_cache=None, source_hidden: dict | None = None, prefix_layers: int = 0, tokenizer=None, *,
                 fuse_first_step: bool = True):
        from ..generation.mixin import enable
        from ..model_check import require

        if not isinstance(mapper, KVMapper):
            raise TypeError(f"mapper must be a KVMapper, got {type(mapper).__name__}")
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
        if sink_tokens < 0 or suffix_tokens < 0:
            raise ValueError("sink_tokens and suffix_tokens must be >= 0")
        if not 0 <= prefix_layers <= model.config.num_hidden_layers:
            raise ValueError(f"prefix_layers must be in 0..{model.config.num_hidden_layers}, got {prefix_layers}")
        if not isinstance(fuse_first_step, bool):
            raise TypeError(f"fuse_first_step must be True or False, got {fuse_first_step!r}")
        if source_model is model:
            raise ValueError("source_model is the target model itself: use a plain prefill (or OptimisticCache)")
        super().__init__(model)
        src_check = require(source_model, rope=True, who="TranslatedCache (source model)")
        mapper.check_pair(source_model, model)
        g = mapper.geometry
        if (src_check.kv_heads, src_check.head_dim) != (g.source_heads, g.source_dim) or \
                (self.model_check.kv_heads, self.model_check.head_dim) != (g.target_heads, g.target_dim):
            raise ValueError(f"the models' K/V geometry does not match the mapper's {g}")
        enable(model)
        self.source_model, self.mapper = source_model, mapper
        self.recompute_ratio, self.sink_tokens, self.suffix_tokens = recompute_ratio, sink_tokens, suffix_tokens
        note = ""
        if isinstance(selector, str) and selector == "auto":
            selector, note = _auto_selector(source_model, source_cache, source_hidden, input_ids, tokenizer)
        self.scorer = make_scorer(selector, mapper, seed=seed, tokenizer=tokenizer)
        for part in scorer_parts(self.scorer):  # a deviation checked inside the exact prefix: refused now
            if hasattr(part, "layer_for"):
                part.layer_for(prefix_layers, model.config.num_hidden_layers)
        self._src_shifter = RopeShifter(source_model, layout=src_check.rope_layout)
        self._shifter = RopeShifter(model, layout=self.model_check.rope_layout)
        self.set_target(input_ids)
        vocab = min(source_model.config.vocab_size, model.config.vocab_size)
        if int(self.input_ids.max()) >= vocab:
            raise ValueError(f"token id {int(self.input_ids.max())} is outside the smaller vocabulary ({vocab}); "
                             "source and target must share a tokenizer")
        if tokenizer is not None and hasattr(tokenizer, "__len__") and int(self.input_ids.max()) >= len(tokenizer):
            raise ValueError(f"token id {int(self.input_ids.max())} is outside the tokenizer's {len(tokenizer)} "
                             "tokens: pass the pair's own tokenizer")
        if source_cache is not None:
            src_kv = kv_of(source_cache)
            have = src_kv[0][0].shape[-2]
            if len(src_kv) != g.source_layers or have < self.input_ids.shape[1] - 1:
                raise ValueError(f"source_cache holds {len(src_kv)} layers x {have} tokens; the source model has "
                                 f"{g.source_layers} layers and the prompt needs {self.input_ids.shape[1] - 1}")
            check_donor(source_model, source_cache, self.input_ids, self.input_ids.shape[1] - 1,
                        who=type(self).__name__, what="source_cache (of the source model)")
        need = self.source_hidden_layers()
        if source_cache is not None and need:
            missing = [s for s in need if source_hidden is None or s not in source_hidden]
            if missing:
                raise ValueError(f"this KVMapper ({mapper.kind}) or selector ({self.scorer.name}) reads the source's "
                                 f"hidden states of layers {missing}, "
                                 "which a source cache does not hold: pass source_hidden= from the same prefill "
                                 "(run_source), or no source_cache (the source prefill then runs)")
            short = [s for s in need if source_hidden[s].shape[-2] < self.input_ids.shape[1] - 1]
            if short:
                raise ValueError(f"source_hidden of layers {short} covers fewer than the prompt's "
                                 f"{self.input_ids.shape[1] - 1} tokens")
        self.source_cache, self.source_hidden = source_cache, source_hidden
        self.prefix_layers, self.fuse_first_step = prefix_layers, fuse_first_step
        self._prefix_hidden = None
        self.exact_layers = 0
        self.selected_rows = torch.zeros(0, dtype=torch.long)
        self.stats = TranslatedStats(recompute_ratio=recompute_ratio, selector=self.scorer.name, selector_note=note)

    _shared_attrs = KVReuseCache._shared_attrs + ("source_model", "mapper", "scorer", "_src_shifter", "source_cache",
                                                  "source_hidden")

    def source_hidden_layers(self) -> list[int]:
        """The source layers whose normalised hidden states the map or the selector reads."""
        need = set(self.mapper.hidden_layers)
        if hasattr(self.scorer, "source_layers"):
            need |= set(self.scorer.source_layers(self.source_model))
        return sorted(need)

    def run_prefix(self, kv, n: int, layers: int) -> None:
        """Run every row through target layers ``exact_layers .. layers - 1`` (their K/V become exact); keep the
        rows' hidden states after them for the selected rows' recompute."""
        if layers <= self.exact_layers:
            return
        rows = torch.arange(n, device=kv[0][0].device)
        h = None if self.exact_layers == 0 else self._prefix_hidden
        self._prefix_hidden = partial_forward(self.model, self.input_ids[:, :n], rows, kv,
                                              layers=range(self.exact_layers, layers), hidden_states=h)
        self.exact_layers = layers

    def forced_rows(self, n: int) -> tuple[torch.Tensor, int]:
        """The rows always recomputed at a partial ratio (``[n]`` bool: sinks and suffix) and how many rows the
        budget ``round(recompute_ratio * n)`` leaves beyond them (the question scorers plan on it)."""
        forced = torch.zeros(n, dtype=torch.bool)
        forced[: self.sink_tokens] = True
        if self.suffix_tokens:
            forced[max(0, n - self.suffix_tokens):] = True
        return forced, max(0, int(round(self.recompute_ratio * n)) - int(forced.sum()))

    def select(self, scores: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
        """Rows to recompute: forced sinks and suffix, then the highest ``scores`` up to the budget."""
        if self.recompute_ratio >= 1.0:
            return torch.arange(n), 0
        if self.recompute_ratio <= 0.0:
            return torch.zeros(0, dtype=torch.long), 0
        forced, free = self.forced_rows(n)
        candidates = torch.nonzero(~forced).flatten()
        extra = min(free, candidates.numel())
        picked = candidates[torch.topk(scores.float().cpu()[candidates], extra).indices] if extra else candidates[:0]
        return torch.sort(torch.cat([torch.nonzero(forced).flatten(), picked])).values, int(forced.sum())

    @torch.no_grad()
    def prepare(self, model, input_ids, generate_kwargs) -> None:
        from transformers import DynamicCache

        from ..compat import cache_kwargs

        self.begin_generate(model, input_ids, generate_kwargs)
        st = self.stats
        device = self.input_ids.device
        n = self.input_ids.shape[1] - 1
        ids = self.input_ids[:, :n]
        t0 = now(device)
        # 1. source prefill (unless the source's own cache of the prompt was given)
        src_dev = input_device(self.source_model)
        hidden = None
        need = self.source_hidden_layers()
        if self.source_cache is not None:
            src_kv = [(k[..., :n, :], v[..., :n, :]) for k, v in kv_of(self.source_cache)]
            src_dev = src_kv[0][0].device
            if need:
                hidden = {s: self.source_hidden[s].reshape(-1, self.source_hidden[s].shape[-1])[:n] for s in need}
        else:
            src_cache = DynamicCache(config=self.source_model.config)
            if need:
                hidden = run_source(self.source_model, ids.to(src_dev), src_cache, need)
            else:
                self.source_model(input_ids=ids.to(src_dev), use_cache=True, logits_to_keep=1,
                                  **cache_kwargs(src_cache))
            src_kv = kv_of(src_cache)
        t1 = now(device)
        # 2. map (the scorer observes each target layer's mapped K/V on the way)
        dtype = next(model.parameters()).dtype
        self.scorer.reset(n, device)
        if hasattr(self.scorer, "observe_source"):  # the source's own attention (source-attention selector)
            self.scorer.observe_source(self, src_kv, hidden, n)
        # a fused first step writes the last prompt token's row after the n mapped ones: storage for it too, and
        # views of the n rows for everything before it
        fuse = self.fuse_first_step and not returns_internals(model, generate_kwargs)
        full = self.mapper.translate(src_kv, torch.arange(n, device=src_dev), self._src_shifter, self._shifter,
                                     dtype, device, observe=self.scorer.observe, hidden=hidden,
                                     extra_rows=1 if fuse else 0)
        kv = [(k[..., :n, :], v[..., :n, :]) for k, v in full] if fuse else full
        del src_kv, hidden
        self.source_cache = self.source_hidden = None  # not held past the assembly
        t2 = now(device)
        # 3. select (leading layers exact for every row first, when asked: a scorer may read them)
        self.exact_layers, self._prefix_hidden = 0, None
        partial = 0.0 < self.recompute_ratio < 1.0
        if partial:
            self.run_prefix(kv, n, self.prefix_layers)
        scores = self.scorer.scores(self, kv) if partial else None
        self.last_scores = scores
        rows, forced = self.select(scores, n)
        t3 = now(device)
        # 4. recompute the selected rows through the target layers after the exact prefix (all rows in order
        # through every layer: the full prefill); fused: in the first forward, with the last prompt token
        e, hidden = self.exact_layers, self._prefix_hidden
        self._prefix_hidden = None
        rows_d = rows.to(device)
        # fused with exact leading layers: the last token's logits come from the output head (probed to be the
        # model's own); a model whose forward does more keeps generate's one-token step
        fuse = fuse and (e == 0 or plain_head(model))
        st.fused_first_step = fuse
        if fuse:  # generate sees the n rows (views) until the first forward writes the last token's row
            sel = hidden[:, rows_d] if e and hidden is not None else None
            self._pending = PendingForward(int(self.input_ids[0, -1]),
                                           _FusedRecompute(self, full, rows_d, e, sel, st))
        elif rows.numel():
            if e and hidden is not None:
                if e < len(kv):
                    partial_forward(model, ids, rows_d, kv, layers=range(e, len(kv)), hidden_states=hidden[:, rows_d])
            else:
                partial_forward(model, ids, rows_d, kv, layers=range(len(kv)))
        del hidden
        t4 = now(device)
        del full
        load_kv(self, kv)
        self.selected_rows = rows
        st.prompt_tokens, st.recomputed_tokens, st.forced_tokens = n, int(rows.numel()), forced
        st.exact_layers = self.exact_layers
        st.source_prefill_s, st.map_s, st.select_s = t1 - t0, t2 - t1, t3 - t2
        st.recompute_s = 0.0 if fuse else t4 - t3
        st.assemble_s = t4 - t0


class _FusedRecompute:
    """The first forward of a fused :class:`TranslatedCache`: the last prompt token through the exact leading
    layers (the selected rows already have their hidden states there), then the selected rows and the last token
    together through the layers after them, each row attending to the columns at positions not after its own (as
    the recompute and then ``generate``'s one-token step would); the logits of the last token."""

    def __init__(self, cache, kv, rows, exact_layers: int, hidden, stats):
        self.kv, self.rows, self.e, self.hidden, self.stats = kv, rows, exact_layers, hidden, stats
        self.input_ids = cache.input_ids

    @torch.no_grad()
    def __call__(self, model, cache):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        t0 = now(self.input_ids.device)
        kv, e, ids = self.kv, self.e, self.input_ids
        n = ids.shape[1] - 1
        last = torch.tensor([n], device=self.rows.device, dtype=torch.long)
        rows = torch.cat([self.rows, last])
        if e == 0:  # every row from its token embedding: the model's own forward gives the logits
            out = partial_forward(model, ids, rows, kv)
        else:
            h = partial_forward(model, ids, last, kv, layers=range(e))
            if e < len(kv):  # (every layer exact: the selected rows have nothing left to recompute)
                h = h if self.hidden is None else torch.cat([self.hidden, h], 1)
                h = partial_forward(model, ids, rows, kv, layers=range(e, len(kv)), hidden_states=h)
            out = CausalLMOutputWithPast(logits=head_logits(model, h[:, -1:]))
        self.hidden = None
        load_kv(cache, kv)  # the prompt's rows, the last token's included, as a decode step leaves them
        self.stats.recompute_s = now(ids.device) - t0
        return out
