"""Base / low-rank split of LoRA keys and values, and the attention that reads it.

For a LoRA adapter ``a`` on ``v_proj`` the values of a layer are ``V_a = X W_V + s_a (X A_a) B_a``: a part that
depends only on the base weights and a rank-``r`` part. PReCache (Jeon et al., 2026; METHODS.md §2.3) and
its predecessor LRAgent (arXiv 2602.01053) cache them apart: one *base* cache ``X W_V`` shared by every agent,
and per adapter only the *low-rank (LR) cache* ``L_a = X A_a`` (``r`` numbers per token and layer). The active
agent attends with

    O = softmax(Q K^T / sqrt(d)) · (V_base + s_a L_a B_a) = P V_base + s_a (P L_a) B_a

which never materialises per-agent values (:func:`lowrank_attention`; with the Triton backend one fused kernel
for every query count, :mod:`hf_kvreuse.triton.lowrank_attention`).

Keys work the same way when ``k_proj`` carries a LoRA, because RoPE is linear:
``K_a = R(p) X W_K + s_a R(p) (X A^K_a) B^K_a``. The rotated key term is materialised per forward (``T x D``
per layer: exact but slower than the value path). It is refused for models with a key norm (Qwen3's
``k_norm``), where the norm sits between the projection and RoPE and the split is not exact.

Module-level state is a ``ContextVar`` holding the cache of the forward that is running; outside such a
forward (another thread's forward of the same model included) every patched module and the attention behave
exactly as peft's. The patches and the attention swap are reference-counted across threads
(:mod:`hf_kvreuse.local_hooks`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from collections.abc import Callable

import torch
from torch import nn

from . import kernels
from .local_hooks import local_hooks, patched_forward, register_wrapper
from .rope import RopeShifter, find_rotary_embedding
from .triton.lowrank_attention import lowrank_attention_torch as lowrank_attention  # noqa: F401 (public name)
from .errors import HFKVReuseError

#: the :class:`LRState` of the forward that is running (None: plain peft behaviour)
ACTIVE: contextvars.ContextVar = contextvars.ContextVar("hf_kvreuse_lora_state", default=None)

SPLIT_KINDS = {"k_proj": "k", "v_proj": "v"}
OTHER_ATTENTION_PROJECTIONS = ("q_proj", "o_proj")


class UnsupportedAdapterError(HFKVReuseError, ValueError):
    """An adapter cannot be split into a shared base cache plus a low-rank cache."""


@dataclass
class Row:
    """What one batch row of a forward does: whose LR term it reads, and whose LR caches it writes."""

    reader: str | None
    writers: tuple[str, ...] = ()


@dataclass
class LRState:
    """Per-forward instructions for the patched projections and the attention (set in :data:`ACTIVE`)."""

    rows: list[Row]
    store: LRStore
    split: LoraSplit
    #: queries above this count use a transient V_base + s·L·B with the fused kernel (None: always low-rank)
    lowrank_max_queries: int | None = 16
    positions_cache: dict = field(default_factory=dict)


class LRStore:
    """LR caches: ``lr[kind][adapter][layer]`` is ``[1, T, r]`` (``X·A`` for every cached token)."""

    def __init__(self):
        self.lr: dict[str, dict[str, dict[int, torch.Tensor]]] = {"k": {}, "v": {}}

    def append(self, kind: str, adapter: str, layer: int, value: torch.Tensor) -> None:
        per_layer = self.lr[kind].setdefault(adapter, {})
        old = per_layer.get(layer)
        per_layer[layer] = value if old is None else torch.cat([old, value], dim=1)

    def get(self, kind: str, adapter: str, layer: int) -> torch.Tensor | None:
        return self.lr[kind].get(adapter, {}).get(layer)

    def crop(self, length: int, adapters: list[str] | None = None) -> None:
        for kind in self.lr.values():
            for adapter, per_layer in kind.items():
                if adapters is None or adapter in adapters:
                    for layer, t in per_layer.items():
                        per_layer[layer] = t[:, :length]

    def nbytes(self, adapter: str | None = None) -> int:
        return sum(t.numel() * t.element_size() for kind in self.lr.values() for a, per_layer in kind.items()
                   if adapter is None or a == adapter for t in per_layer.values())


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class LoraSplit:
    """The ``k_proj`` / ``v_proj`` LoRA modules of a peft model, by layer, checked for an exact split.

    Parameters
    ----------
    peft_model : peft.PeftModel
        A model carrying one or more named LoRA adapters (``get_peft_model`` / ``PeftModel.from_pretrained``).

    Raises
    ------
    UnsupportedAdapterError
        Naming the projection: merged adapters, DoRA / other LoRA variants, LoRA bias, a LoRA on ``k_proj`` of a
        model with a key norm, or a LoRA on an attention projection other than q/k/v/o (e.g. a fused ``qkv``).
    """

    def __init__(self, peft_model):
        if not is_peft_model(peft_model):
            raise TypeError("BaseLRCache needs a peft PeftModel with named LoRA adapters (peft.get_peft_model / "
                            f"PeftModel.from_pretrained), got {type(peft_model).__name__}")
        cfgs = peft_model.peft_config
        bad = [n for n, c in cfgs.items() if str(getattr(c, "peft_type", "")).split(".")[-1] != "LORA"]
        if bad:
            raise UnsupportedAdapterError(f"adapters {bad} are not LoRA adapters; only LoRA can be split")
        self.adapters: tuple[str, ...] = tuple(cfgs)
        self.model = peft_model
        self.modules: dict[int, dict[str, nn.Module]] = {}
        for name, attn in peft_model.get_base_model().named_modules():
            if not (hasattr(attn, "layer_idx") and hasattr(attn, "v_proj")):
                continue
            for child_name, child in attn.named_children():
                if not _is_lora_layer(child):
                    continue
                where = f"{name}.{child_name}"
                if child_name in SPLIT_KINDS:
                    self._check_splittable(child, where)
                    if child_name == "k_proj" and getattr(attn, "k_norm", None) is not None:
                        raise UnsupportedAdapterError(
                            f"LoRA on k_proj ({where}) is not supported for {type(attn).__name__}: its k_norm sits "
                            "between the projection and RoPE, so keys cannot be split into base + low-rank parts. "
                            "Target v_proj (and q_proj/o_proj/MLP) instead.")
                    self.modules.setdefault(attn.layer_idx, {})[SPLIT_KINDS[child_name]] = child
                elif child_name not in OTHER_ATTENTION_PROJECTIONS:
                    raise UnsupportedAdapterError(
                        f"LoRA on {where} is not supported: only q_proj, k_proj, v_proj and o_proj of the "
                        "attention can carry adapters (a fused projection mixes keys with queries)")
        if not self.modules:
            raise UnsupportedAdapterError("no LoRA on k_proj or v_proj: nothing for a low-rank cache to hold "
                                          "(PReCache's adapters target v_proj)")
        self.rotary = find_rotary_embedding(peft_model.get_base_model())
        self.has_key_lora = any("k" in m for m in self.modules.values())
        # the model check decides the rotation layout from the model's own keys (refusing what it cannot match)
        self._shifter = RopeShifter(peft_model.get_base_model()) if self.has_key_lora else None
        self._patch: contextlib.ExitStack | None = None

    @staticmethod
    def _check_splittable(module: nn.Module, where: str) -> None:
        if getattr(module, "merged", False):
            raise UnsupportedAdapterError(f"{where}: adapters are merged into the base weight; unmerge them "
                                          "(model.unmerge_adapter()) to split base and low-rank caches")
        for a in module.lora_A:
            if getattr(module, "use_dora", {}).get(a, False) or a in getattr(module, "lora_variant", {}):
                raise UnsupportedAdapterError(f"{where}: adapter {a!r} is a LoRA variant (e.g. DoRA) whose output "
                                              "is not base + X·A·B; only plain LoRA can be split")
            if getattr(module, "lora_bias", {}).get(a, False):
                raise UnsupportedAdapterError(f"{where}: adapter {a!r} has lora_bias=True, which has no low-rank "
                                              "form; train it without LoRA bias")

    # -- factors -----------------------------------------------------------------------------------------------
    def factor(self, layer: int, kind: str, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """``(A [r, d_in], B [out, r], scaling)`` of ``adapter`` on this projection, or None if it has none."""
        module = self.modules.get(layer, {}).get(kind)
        if module is None or adapter not in module.lora_A:
            return None
        return module.lora_A[adapter].weight, module.lora_B[adapter].weight, float(module.scaling[adapter])

    # -- patching ----------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Make the k/v LoRA modules return the base projection and write LR caches while a state is active in
        the calling context (elsewhere they run peft's forward); reference-counted across threads."""
        if self._patch is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(patched_forward([(module, lambda m, layer=layer, kind=kind: _split_forward(m, layer, kind))
                                             for layer, kinds in self.modules.items()
                                             for kind, module in kinds.items()]))
        self._patch = stack

    def uninstall(self) -> None:
        if self._patch is not None:
            self._patch.close()
            self._patch = None

    def key_cos_sin(self, state: LRState, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions ``0..length-1`` with the rotary module's magnitude factor (YaRN) applied once."""
        key = (length, str(device))
        if key not in state.positions_cache:
            cos, sin = self._shifter.cos_sin(torch.arange(length), device)
            scale = float(getattr(self.rotary, "attention_scaling", 1.0))
            state.positions_cache = {key: (cos * scale, sin * scale)}
        return state.positions_cache[key]


def _split_forward(module: nn.Module, layer: int, kind: str) -> Callable:
    original = type(module).forward

    def forward(x, *args, **kwargs):
        state: LRState | None = ACTIVE.get()
        if state is None:
            return original(module, x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        out = module.base_layer(x, *args, **kwargs)
        for row_idx, row in enumerate(state.rows):
            for adapter in row.writers:
                f = state.split.factor(layer, kind, adapter)
                if f is not None:
                    A = f[0]
                    # kept in the K/V dtype: every reader casts L to it (_row_terms), so a float32 LoRA factor
                    # over a bf16 model does not double the LR cache
                    L = x[row_idx: row_idx + 1].to(A.dtype) @ A.T
                    state.store.append(kind, adapter, layer, L.to(out.dtype))
        return out

    return forward


def _row_terms(state: LRState, layer: int, kind: str, length: int, like: torch.Tensor):
    """Per-row ``L [B, T, r]``, ``B [B, out, r]`` and scaling ``[B]`` of the readers (zeros for reader None)."""
    readers = [row.reader for row in state.rows]
    factors = [state.split.factor(layer, kind, a) if a is not None else None for a in readers]
    ranks = {f[0].shape[0] for f in factors if f is not None}
    if not ranks:
        return None
    if len(ranks) > 1:
        raise ValueError("rows of one forward read adapters of different ranks")
    (r,) = ranks
    Ls, Bs, ss = [], [], []
    for a, f in zip(readers, factors):
        if f is None:
            Ls.append(like.new_zeros(1, length, r))
            Bs.append(None)
            ss.append(0.0)
            continue
        L = state.store.get(kind, a, layer)
        if L is None or L.shape[1] != length:
            got = 0 if L is None else L.shape[1]
            raise RuntimeError(f"LR cache of adapter {a!r} (layer {layer}, {kind}) covers {got} tokens but the base "
                               f"cache has {length}; this is a bug in the cache's write schedule")
        Ls.append(L.to(like.dtype))
        Bs.append(f[1].to(like.dtype))
        ss.append(f[2])
    out_dim = next(b for b in Bs if b is not None).shape[0]
    Bs = [b if b is not None else like.new_zeros(out_dim, r) for b in Bs]
    return torch.cat(Ls, 0), torch.stack(Bs, 0), like.new_tensor(ss)


def lora_attention(base_fn: Callable) -> Callable:
    """Wrap an attention function (sdpa / eager) so the active state's LR terms enter keys and values."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        state: LRState | None = ACTIVE.get()
        if state is None:
            return base_fn(module, query, key, value, attention_mask, **kwargs)
        layer = module.layer_idx
        B, Hkv, T, D = value.shape
        kterms = _row_terms(state, layer, "k", T, key) if state.split.has_key_lora else None
        if kterms is not None:
            L, Bw, s = kterms  # key delta R(p)·(s·L·B): materialised, then rotated like the cached keys
            delta = (L @ Bw.transpose(1, 2)) * s[:, None, None]
            delta = delta.view(B, T, Hkv, key.shape[-1]).transpose(1, 2)
            cos, sin = state.split.key_cos_sin(state, T, key.device)
            key = key + state.split._shifter.shift(delta, 0, cos_sin=(cos, sin))
        vterms = _row_terms(state, layer, "v", T, value)
        if vterms is None:
            return base_fn(module, query, key, value, attention_mask, **kwargs)
        L, Bw, s = vterms
        scaling = kwargs.get("scaling")
        scaling = scaling if scaling is not None else D ** -0.5
        if kernels.backend(value) == "triton":  # fused for every query count: no transient V_base + s·L·B
            return kernels.lowrank_attention(query, key, value, L, Bw, s, attention_mask, scaling), None
        limit = state.lowrank_max_queries
        if limit is not None and query.shape[2] > limit:
            # Long prefills: the fused sdpa kernels need equal key / value widths, and the low-rank form runs
            # 3-5x slower on CPU; a transient V_base + s·L·B (one layer, freed at once) keeps the fused path.
            v_agent = value + ((L @ Bw.transpose(1, 2)) * s[:, None, None]).view(B, T, Hkv, D).transpose(1, 2)
            return base_fn(module, query, key, v_agent, attention_mask, **kwargs)
        return lowrank_attention(query, key, value, L, Bw, s, attention_mask, scaling), None

    return attention


register_wrapper("lowrank", lora_attention, order=1, active=lambda: ACTIVE.get() is not None)


@contextlib.contextmanager
def mixed_adapters(peft_model, adapter_names: list[str], skip: list[nn.Module]):
    """For the block, in the calling context only: every LoRA layer except ``skip`` gets ``adapter_names`` (one
    per batch row; ``"__base__"`` = no adapter), the way peft runs mixed-adapter batches. A forward of the same
    model in another thread meanwhile runs with its own adapters."""
    skip_ids = {id(m) for m in skip}

    def hook(_module, args, kwargs):
        kwargs["adapter_names"] = adapter_names
        return args, kwargs

    with local_hooks() as hooks:
        for module in peft_model.get_base_model().modules():
            if _is_lora_layer(module) and id(module) not in skip_ids:
                hooks.pre(module, hook, with_kwargs=True)
        yield
