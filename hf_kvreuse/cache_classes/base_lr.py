"""BaseLRCache: multi-LoRA agents sharing one base cache plus per-agent low-rank caches (PReCache).

Jeon et al., "PReCache: training-free KV cache sharing for multi-LoRA agents" (2026; METHODS.md §2.3; its
predecessor is LRAgent, arXiv 2602.01053). Agents are LoRA adapters of one base model that extend one shared
trajectory (a ReAct scratchpad). The text is an exact prefix of every next prompt; what differs between agents
is the weights that produced each token's K/V. With LoRA on ``v_proj`` (and optionally ``k_proj``), a value
splits into ``X W_V`` plus ``s (X A_a) B_a`` (see :mod:`hf_kvreuse.lora`), so agents can share the first part.

Methods, per ``generate`` call (one *turn* of the active adapter ``a``):

``nonshared``
    The baseline: every agent keeps its own full cache and prefills every token added since its last turn.
``prelrshared``
    One shared base cache. Every forward, whoever runs it, also writes the LR cache ``X A_j`` of *every*
    adapter ``j``; the next agent therefore prefills only the genuinely new tokens. The base and LR caches
    carry the writer's adapted hidden states (the error ReBaseShared removes).
``rebaseshared``
    The turn writes only ``L_a``. The base cache over the turn's tokens is then rebuilt from adapter-free
    hidden states, which also write ``L_j = X_neutral A_j`` for every ``j != a``:

    * ``schedule="after_turn"`` (PReCache's "LP", single stream): when the turn ends, crop the base cache to
      the turn start and prefill the turn's tokens again with adapters disabled (outside time-to-first-token);
    * ``schedule="alongside"`` (PReCache's "DB", concurrent serving): every forward of the turn runs a second,
      adapter-free batch row over the same shared prefix; at the end of the turn that row becomes the base.

    Both schedules give the same caches up to float rounding.

Usage::

    pm = PeftModel.from_pretrained(model, "adapters/plan", adapter_name="plan")   # + load_adapter(...) ...
    cache = BaseLRCache(pm, method="prelrshared")        # one cache object for the whole trajectory
    pm.set_adapter("plan")                                # the active peft adapter is the agent of the turn
    out = pm.generate(ids, cache=cache, max_new_tokens=32)
    pm.set_adapter("act")
    out = pm.generate(torch.cat([out, new_ids], 1), cache=cache, max_new_tokens=8)   # prefills new_ids only
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..compat import cache_kwargs
from ..devices import input_device
from ..generation.mixin import enable
from ..generation.selected import base_attn
from ..lora import ACTIVE, LoraSplit, LRState, LRStore, Row, is_peft_model, mixed_adapter_hooks, register_attention
from .base import KVReuseCache

METHODS = ("nonshared", "prelrshared", "rebaseshared")
SCHEDULES = ("after_turn", "alongside")
BASE = "__base__"


@dataclass
class TurnStats:
    agent: str | None
    cached_tokens: int  # tokens of the prompt already in the agent's cache when the turn started
    prefill_tokens: int  # tokens the turn's prefill had to compute
    generated_tokens: int = 0
    rebase_tokens: int = 0  # tokens re-prefilled adapter-free after the turn (rebaseshared, after_turn)
    rebase_s: float = 0.0
    kv_bytes: int = 0  # all K/V this cache holds after the turn (base + LR, or every agent's full cache)


@dataclass
class BaseLRStats:
    turns: list[TurnStats] = field(default_factory=list)
    kernels: str = "torch"                 # backend of the hot paths: "torch" or "triton" (HF_KVREUSE_KERNELS)

    @property
    def last(self) -> TurnStats | None:
        return self.turns[-1] if self.turns else None


class BaseLRCache(KVReuseCache):
    """One cache for a whole multi-LoRA agent trajectory (PReCache's NonShared / PreLRShared / ReBaseShared).

    Parameters
    ----------
    model : peft.PeftModel
        The base model with every agent's LoRA adapter loaded under its name. Attention must be "sdpa" or
        "eager". For the shared methods, adapters may target q/k/v/o and the MLP; ``k_proj``/``v_proj`` LoRAs
        are split into base + low-rank caches (``k_proj`` not on models with a key norm, e.g. Qwen3).
    method : {"nonshared", "prelrshared", "rebaseshared"}
        See the module docstring. Default ``"prelrshared"``.
    schedule : {"after_turn", "alongside"}
        When ``rebaseshared`` rebuilds the base cache. Default ``"after_turn"``.
    agent : str, optional
        Fix the agent for every turn; by default each ``generate`` call uses the model's active peft adapter
        (``pm.set_adapter(name)``), or no adapter inside ``with pm.disable_adapter():``.
    lowrank_max_queries : int or None
        Forwards with at most this many new tokens (decode steps, short prefills) attend in the low-rank form
        ``P·V_base + s·(P·L_a)·B_a``. Longer prefills add a transient ``s·L_a·B_a`` (one layer at a time, never
        cached) to the values so the fused sdpa kernel runs: on CPU the low-rank form, whose value width
        ``D + r`` differs from the key width, falls back to a 3-5x slower attention. ``None``: always
        low-rank; ``0``: always the transient sum. Both are exact.

    Notes
    -----
    Each ``generate`` call must extend the trajectory: its ids start with the tokens already cached (the
    previous output). If they do not, the cache is cropped to the common prefix, which stays exact.
    ``stats.turns`` records per turn what was cached, prefilled and rebuilt; :meth:`kv_bytes` the memory.
    """

    requires: dict = {}     # no re-positioning, no partial recompute: every token is computed by the model
    multi_turn = True       # each generate is a turn; prepare() crops to the common prefix itself

    def __init__(self, model, method: str = "prelrshared", schedule: str = "after_turn", agent: str | None = None,
                 lowrank_max_queries: int | None = 16):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if not is_peft_model(model):
            raise TypeError("BaseLRCache needs a peft PeftModel with the agents' LoRA adapters "
                            f"(peft.get_peft_model / PeftModel.from_pretrained), got {type(model).__name__}")
        super().__init__(model)
        enable(model)
        self.method, self.schedule = method, schedule
        self.lowrank_max_queries = lowrank_max_queries
        self.adapters: tuple[str, ...] = tuple(model.peft_config)
        if agent is not None:
            self._check_agent(agent)
        self.agent = agent
        self.split = LoraSplit(model) if method != "nonshared" else None
        self.store = LRStore()
        self.stats = BaseLRStats()
        self.token_ids = torch.empty(1, 0, dtype=torch.long)
        self._agent_layers: dict[str | None, list] = {}  # nonshared: every agent's own full cache
        self._agent_tokens: dict[str | None, torch.Tensor] = {}
        self._state: LRState | None = None
        self._turn: TurnStats | None = None
        self._turn_agent: str | None = None
        self._turn_start = 0
        self._saved_attn: str | None = None
        self._hooks: list = []

    # -- helpers ---------------------------------------------------------------------------------------------
    def _check_agent(self, agent: str) -> None:
        if agent not in self.adapters:
            raise ValueError(f"unknown adapter {agent!r}: the model has {list(self.adapters)}")

    def _current_agent(self) -> str | None:
        if self.agent is not None:
            return self.agent
        from ..lora import _is_lora_layer

        layers = [m for m in self.model.get_base_model().modules() if _is_lora_layer(m)]
        if layers and all(getattr(m, "disable_adapters", False) for m in layers):
            return None
        active = self.model.active_adapters
        if len(active) != 1:
            raise ValueError(f"BaseLRCache needs exactly one active adapter per turn, got {active}")
        self._check_agent(active[0])
        return active[0]

    @property
    def shared(self) -> bool:
        return self.method != "nonshared"

    def _fresh_layers(self) -> list:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config).layers

    def kv_bytes(self) -> int:
        """Bytes of every K/V tensor this cache holds (all agents' caches for ``nonshared``)."""
        def layer_bytes(layers):
            return sum(t.numel() * t.element_size() for layer in layers
                       for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                       if isinstance(t, torch.Tensor))
        if self.shared:
            return layer_bytes(self.layers) + self.store.nbytes()
        return sum(layer_bytes(layers) for layers in self._agent_layers.values())

    def lr_bytes(self, adapter: str | None = None) -> int:
        """Bytes of the LR caches (of one adapter, or of all)."""
        return self.store.nbytes(adapter)

    def _crop_base(self, length: int) -> None:
        for layer in self.layers:
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    # -- generate entry --------------------------------------------------------------------------------------
    def begin_generate(self, model, input_ids, generate_kwargs: dict) -> None:
        # one cache object serves every turn of the trajectory: no target ids, no single-use phase
        if self.phase == "active":
            raise RuntimeError("this BaseLRCache is already in use by a running generate call")
        self.check_call(model, input_ids, generate_kwargs)
        self.note_kernels(input_ids)
        self.phase = "active"

    def end_generate(self, sequences, error) -> None:
        self.phase = "done"  # finish() recorded the tokens (or restored the cache after a failed turn)

    def crop(self, max_length: int) -> None:
        """``DynamicCache.crop`` that keeps the low-rank store and the token record consistent with the K/V."""
        if self.phase == "active":
            raise RuntimeError("BaseLRCache cannot be cropped during generate")
        DynamicCache.crop(self, max_length)
        n = self.physical_length()
        if self.shared:
            self.store.crop(n)
            self.token_ids = self.token_ids[:, :n]
        elif self._turn_agent in self._agent_tokens:  # nonshared: self.layers are the last turn's agent's cache
            self._agent_tokens[self._turn_agent] = self._agent_tokens[self._turn_agent][:, :n]

    def prepare(self, model, input_ids, generate_kwargs) -> None:
        self.begin_generate(model, input_ids, generate_kwargs)
        agent = self._current_agent()
        device = input_ids.device
        self._prompt_ids = input_ids
        if self.shared:
            tokens = self.token_ids.to(device)
        else:
            self.layers = self._agent_layers.setdefault(agent, self._fresh_layers())
            tokens = self._agent_tokens.get(agent, self.token_ids).to(device)
        n = input_ids.shape[1]
        m = min(tokens.shape[1], n - 1)  # generate needs at least one uncached token
        same = (tokens[0, :m] == input_ids[0, :m]).long()
        lcp = int(same.cumprod(0).sum()) if m else 0
        if lcp < tokens.shape[1]:
            self._crop_base(lcp)
            if self.shared:
                self.store.crop(lcp)
        self._turn_agent, self._turn_start = agent, lcp
        self._turn = TurnStats(agent, cached_tokens=lcp, prefill_tokens=n - lcp)
        if not self.shared:
            return
        others = tuple(a for a in self.adapters if a != agent)
        if self.method == "prelrshared":
            rows = [Row(agent, self.adapters)]
        elif self.schedule == "after_turn":
            rows = [Row(agent, (agent,) if agent else ())]
        else:
            rows = [Row(agent, (agent,) if agent else ()), Row(None, others)]
            for layer in self.layers:  # both rows attend over the same neutral prefix
                if getattr(layer, "is_initialized", False) and layer.keys is not None:
                    layer.keys = layer.keys.expand(2, -1, -1, -1)
                    layer.values = layer.values.expand(2, -1, -1, -1)
        self._install(rows)

    def _install(self, rows: list[Row]) -> None:
        self._state = LRState(rows=rows, store=self.store, split=self.split,
                              lowrank_max_queries=self.lowrank_max_queries)
        self.split.install()
        cfg = self.model.config
        if self._saved_attn is None:
            self._saved_attn = base_attn(cfg) or "eager"  # not a partial forward's swap in another thread
            cfg._attn_implementation = register_attention(self._saved_attn)

    def _uninstall(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.split is not None:
            self.split.uninstall()
        if self._saved_attn is not None:
            self.model.config._attn_implementation = self._saved_attn
            self._saved_attn = None
        self._state = None

    # -- every forward (called by the generation mixin) ------------------------------------------------------
    def forward(self, forward_fn, **kwargs):
        if self._state is None:
            if self.shared:
                raise RuntimeError("a shared BaseLRCache is filled through model.generate (it must split every "
                                   "forward into base and low-rank caches); do not pass it to a plain forward")
            return forward_fn(**kwargs)
        rows = len(self._state.rows)
        if rows > 1:
            kwargs = {k: (v.expand(rows, *v.shape[1:]) if k in ("input_ids", "attention_mask", "position_ids",
                                                                   "inputs_embeds") and isinstance(v, torch.Tensor)
                          and v.shape[0] == 1 else v) for k, v in kwargs.items()}
            names = [r.reader or BASE for r in self._state.rows]
            skip = [m for kinds in self.split.modules.values() for m in kinds.values()]
            self._hooks = mixed_adapter_hooks(self.model, names, skip)
        token = ACTIVE.set(self._state)
        try:
            out = forward_fn(**kwargs)
        finally:
            ACTIVE.reset(token)
            for h in self._hooks:
                h.remove()
            self._hooks = []
        if rows > 1:  # the adapted row drives generation; the adapter-free row only writes the cache
            out.logits = out.logits[:1]
            for name in ("hidden_states", "attentions"):
                if getattr(out, name, None) is not None:
                    setattr(out, name, tuple(t[:1] for t in getattr(out, name)))
        return out

    # -- generate exit ---------------------------------------------------------------------------------------
    def finish(self, input_ids, error) -> None:
        turn = self._turn
        try:
            if self.shared and self.schedule == "alongside" and self.method == "rebaseshared":
                for layer in self.layers:  # keep the adapter-free row as the new base
                    if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.shape[0] > 1:
                        layer.keys, layer.values = layer.keys[1:].clone(), layer.values[1:].clone()
            if error is not None or input_ids is None:
                self._crop_base(self._turn_start)  # leave the cache as it was before the failed turn
                if self.shared:
                    self.store.crop(self._turn_start)
                cached = self._turn_start
                input_ids = input_ids if input_ids is not None else self._prompt_ids
            else:
                cached = self.physical_length()
                turn.generated_tokens = input_ids.shape[1] - turn.cached_tokens - turn.prefill_tokens
                if self.method == "rebaseshared" and self.schedule == "after_turn" and cached > self._turn_start:
                    self._rebase(input_ids[:, self._turn_start: cached])
            tokens = input_ids[:, :cached].detach().cpu() if input_ids is not None else self.token_ids[:, :cached]
            if self.shared:
                self.token_ids = tokens
            else:
                self._agent_tokens[self._turn_agent] = tokens
            if error is None and turn is not None:
                turn.kv_bytes = self.kv_bytes()
                self.stats.turns.append(turn)
        finally:
            self._uninstall()

    def _rebase(self, turn_ids: torch.Tensor) -> None:
        """ReBaseShared, after the turn: rebuild base K/V (and the other adapters' LR) adapter-free."""
        start = self._turn_start
        t0 = time.perf_counter()
        self._crop_base(start)
        others = tuple(a for a in self.adapters if a != self._turn_agent)
        self.store.crop(start, adapters=list(others))
        self._state = LRState(rows=[Row(None, others)], store=self.store, split=self.split,
                              lowrank_max_queries=self.lowrank_max_queries)
        from ..generation.mixin import _generation_target

        target = _generation_target(self.model)
        positions = torch.arange(start, start + turn_ids.shape[1], device=turn_ids.device)[None]
        with torch.no_grad(), self.model.disable_adapter():
            target(input_ids=turn_ids, position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kwargs(self))
        if self.device_type() == "cuda":
            torch.cuda.current_stream().synchronize()
        self._turn.rebase_tokens = turn_ids.shape[1]
        self._turn.rebase_s = time.perf_counter() - t0

    def device_type(self) -> str:
        return input_device(self.model).type
