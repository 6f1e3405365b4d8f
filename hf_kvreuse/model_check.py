"""Trust by construction: probe a model's own code once before any cache relies on it.

Every cache of the library rests on three assumptions about the model, none of which an attribute name can
guarantee:

* **RoPE re-positioning** (:class:`~hf_kvreuse.rope.RopeShifter`): a key cached at position ``p`` and rotated by
  ``R(d)`` equals the key the model itself computes at ``p + d``, in the model's rotation layout (half-split as
  in Llama, interleaved pairs as in Cohere / GLM) and over its rotary dimensions (partial rotary);
* **position invariance**: hidden states, values and the RoPE-free part of keys do not depend on absolute
  positions (no learned absolute embeddings, no position-dependent scaling), so a shifted block is the block;
* **the partial-recompute engine** (:func:`~hf_kvreuse.generation.partial.partial_forward`): recomputing rows
  through the model's forward with position-causal attention (the path that runs: a 4D mask, or the
  selected-row attention of :mod:`~hf_kvreuse.generation.selected`) reproduces a plain forward, and its layer-range
  mode (which drives the decoder layers itself) reproduces what the model's own ``forward`` does around them
  (embedding scaling, norms, multipliers).

:func:`check_model` verifies each of them on a short probe sequence by running the model's **own** forward
twice (at positions ``0..T-1`` and ``d..d+T-1``) and comparing, layer by layer, with what the library derives.
The result is cached per model object (and dtype / attention backend); the first cache built on a model pays
one probe: the two positions in one batched forward plus one partial recompute, about two reads of the weights
(the layer-range probe runs only when a layer-wise cache asks for it). Measured in the research notes. Caches call
:func:`require` and refuse at construction, with an error naming the model type and the failed check.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from .rotary import (ROPE_LAYOUTS, RotaryShifter, UnsupportedRopeError, check_rope_supported, find_rotary_embedding,
                     layer_rotaries)
from .errors import HFKVReuseError

PROBE_TOKENS = 8
PROBE_SHIFT = 37


class UnsupportedModelError(HFKVReuseError, ValueError):
    """The model's own code does not behave as a library mechanism requires (the check says which)."""


def rows_coupled(model) -> str | None:
    """Why a row's K/V in ``model``'s forward depend on the other rows of that forward (None: no known reason):
    dynamically quantized layers (``torch.ao`` ``quantize_dynamic`` and its kind) scale each forward's
    activations by the whole forward's range, so a row held from a forward of other rows is not what a prefill of
    this prompt computes. Such K/V are never exact for another call, at any position."""
    for name, module in model.named_modules():
        kind = f"{type(module).__module__}.{type(module).__name__}"
        if ".quantized.dynamic" in kind:
            return (f"{name or 'the model'} is a dynamically quantized {type(module).__name__}: it scales each "
                    "forward's activations by that forward's range, so K/V rows depend on the other rows of their "
                    "forward and rows held from another call are not exact")
    return None


@dataclass
class ModelCheck:
    """What the probe of one model found (relative errors are ``max|a - b| / max|b|`` over every layer)."""

    model_type: str
    dtype: str
    rope_layout: str | None = None         # "half" | "interleaved" (None: re-positioning refused)
    rotary_dim: int | None = None          # leading dimensions of each head that rotate
    rope_error: float | None = None        # layer-0 keys: shift vs the model's keys at the shifted positions
    invariance_error: float | None = None  # every layer: shifted keys / values vs the model's at p + d
    rope_reason: str | None = None
    engine_error: float | None = None      # partial_forward (all rows, then a subset) vs the model's forward
    engine_reason: str | None = None
    layers_error: float | None = None      # partial_forward(layers=...) in two ranges vs the model's forward
    layers_reason: str | None = None
    probe_s: float = 0.0
    kv_heads: int | None = None            # K/V heads and head size as the model's own cache stores them
    head_dim: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def rope_ok(self) -> bool:
        return self.rope_reason is None

    @property
    def engine_ok(self) -> bool:
        return self.engine_reason is None

    @property
    def layers_ok(self) -> bool:
        self.probe_layers()
        return self.layers_reason is None

    def probe_layers(self) -> None:
        """Run the layer-range probe now if it has not run (only layer-wise caches need it: it is lazy)."""
        pending = self.extra.pop("_layers_pending", None)
        if pending is None:
            return
        model_ref, ids, kv0, tol = pending
        model = model_ref()
        if model is None:
            self.layers_reason = f"{self.model_type}: the model is gone; probe it again"
            return
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
            _probe_layers(model, self, ids, kv0, tol)
        self.probe_s += time.perf_counter() - t0


_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def _target(model):
    from .generation.mixin import _generation_target

    return _generation_target(model)


def _tolerance(dtype: torch.dtype) -> float:
    # fp32 numerics agree to ~1e-6 relative; half precision rounds every op. A wrong layout, a missing scale or
    # an absolute-position term gives errors of order 1, far above either bound.
    return 1e-3 if dtype in (torch.float32, torch.float64) else 6e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _max_rel(pairs) -> tuple[float, int]:
    worst, where = 0.0, -1
    for i, (a, b) in enumerate(pairs):
        e = _rel(a, b)
        if e > worst or e != e:  # NaN counts as the worst
            worst, where = e, i
    return worst, where


def _probe_ids(model, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    hi = max(4, min(vocab, 32000))
    return torch.randint(3 if hi > 8 else 0, hi, (1, _probe_tokens(model)), generator=g).to(device)


def _probe_tokens(model) -> int:
    """:data:`PROBE_TOKENS`; on a model with sliding-window layers, enough to pass a window of up to 64 tokens
    (the probes then check the window's mask too; a wider window's rule is the same)."""
    from .sliding import layer_windows

    windows = [w for w in layer_windows(model.config) if w is not None]
    return max(PROBE_TOKENS, min(min(windows) + 4, 68)) if windows else PROBE_TOKENS


def _forward_kv(model, ids, starts: tuple[int, ...]):
    """The model's own K/V and logits of ``ids`` at positions ``start..`` for each start, in ONE batched forward
    (the probe's cost is reading the weights: one pass serves every start)."""
    from transformers import DynamicCache

    from .compat import cache_kwargs
    from .hybrid import state_indices
    from .kv import kv_of
    from .sliding import keep_history, layer_windows, take_history

    cache = DynamicCache(config=model.config)
    windows = layer_windows(model.config)
    if any(windows):  # sliding-window layers: every row they computed, as a full-attention layer holds them
        keep_history(cache, windows)
    batch = ids.expand(len(starts), -1)
    pos = torch.stack([torch.arange(s, s + ids.shape[1], device=ids.device) for s in starts])
    out = model(input_ids=batch, position_ids=pos, use_cache=True, logits_to_keep=0, **cache_kwargs(cache))
    kv = take_history(cache, windows, ids.shape[1], batch=len(starts)) if any(windows) else None
    states = state_indices(cache)
    if kv is None and states:  # a linear-attention hybrid: its attention layers' K/V (the states are not K/V)
        kv = [(layer.keys, layer.values) for i, layer in enumerate(cache.layers) if i not in states]
    kv = kv if kv is not None else kv_of(cache)
    return [([(k[i:i + 1].clone(), v[i:i + 1].clone()) for k, v in kv], out.logits[i:i + 1])
            for i in range(len(starts))]


def _probe_rope(model, report: ModelCheck, kv0, kv1, tol: float) -> None:
    try:
        check_rope_supported(model)
        # one rotary module, or per layer its type's frequencies (Gemma 3's local and global bases)
        rots = layer_rotaries(model)
        kv_layers = report.extra.get("kv_layers")  # a hybrid: the attention layers' indices
        rots = ([rots[i] for i in kv_layers] if kv_layers and rots else rots) or [find_rotary_embedding(model)] * len(kv0)
    except UnsupportedRopeError as e:
        report.rope_reason = f"{report.model_type}: {e}"
        return
    errors = {}
    for layout in ROPE_LAYOUTS:
        shifter = RotaryShifter(rots[0], layout=layout)
        errors[layout] = _rel(shifter.shift(kv0[0][0], PROBE_SHIFT), kv1[0][0])
    layout = min(errors, key=errors.get)
    report.extra["layout_errors"] = errors
    report.rope_error = errors[layout]
    if not errors[layout] <= tol:
        report.rope_reason = (f"{report.model_type}: re-rotating cached keys matches neither the half-split nor the "
                              f"interleaved RoPE layout of the model's own forward (layer-0 key error "
                              + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()) + ")")
        return
    shifter = RotaryShifter(rots[0], layout=layout)
    pairs = []
    for (k0, v0), (k1, v1), rot in zip(kv0, kv1, rots):
        pairs += [(RotaryShifter(rot, layout=layout).shift(k0, PROBE_SHIFT), k1), (v0, v1)]
    err, where = _max_rel(pairs)
    report.invariance_error = err
    # moving a whole context re-rounds every layer in half precision (SmolLM2-135M bf16: 0.03 over 30 layers);
    # an absolute-position term changes the states by order 1
    if not err <= (tol if tol < 1e-2 else 0.25):
        what = "keys" if where % 2 == 0 else "values"
        report.rope_reason = (f"{report.model_type}: the model's {what} of layer {where // 2} depend on absolute "
                              f"positions beyond RoPE (a block moved by {PROBE_SHIFT} positions differs from the "
                              f"model's own by {err:.3g} relative), so re-positioned K/V would be wrong")
        return
    report.rope_layout, report.rotary_dim = layout, shifter.rotary_dim


def _probe_engine(model, report: ModelCheck, ids, kv0, logits0, tol: float) -> None:
    from .generation.partial import partial_forward

    n = ids.shape[1]
    try:
        # rows of the second half only, the first half already exact: the position mask must let them see the
        # cached columns and nothing after themselves (all rows at once is the same path with an empty cache)
        pairs = []
        kv2 = [(k.clone(), v.clone()) for k, v in kv0]
        for k, v in kv2:
            k[..., n // 2:, :] = 0
            v[..., n // 2:, :] = 0
        out2 = partial_forward(model, ids, torch.arange(n // 2, n), kv2, logits_to_keep=0)
        pairs += [t for (k, v), (rk, rv) in zip(kv2, kv0) for t in ((k, rk), (v, rv))]
        pairs.append((out2.logits, logits0[:, n // 2:]))
    except Exception as e:  # noqa: BLE001 - any failure of the engine on this model is a refusal reason
        report.engine_reason = f"{report.model_type}: partial recompute fails on this model ({type(e).__name__}: {e})"
        return
    err, where = _max_rel(pairs)
    report.engine_error = err
    if not err <= tol:
        report.engine_reason = (f"{report.model_type}: recomputing rows through the model's forward with a "
                                f"position-causal mask (attention path: {report.extra.get('attention_path')}) "
                                f"does not reproduce a plain forward (relative error "
                                f"{err:.3g}, check #{where})")


def _probe_layers(model, report: ModelCheck, ids, kv0, tol: float) -> None:
    from .generation.partial import partial_forward

    n = ids.shape[1]
    n_layers = len(kv0)
    cut = max(1, n_layers // 2)
    try:
        pairs = []
        # every row in order, then the second half after exact first-half rows (two mask forms under sdpa)
        for rows in (torch.arange(n), torch.arange(n // 2, n)):
            kv = [(k.clone(), v.clone()) for k, v in kv0]
            for k, v in kv:
                k[..., rows, :] = 0
                v[..., rows, :] = 0
            h = partial_forward(model, ids, rows, kv, layers=range(0, cut))
            if cut < n_layers:
                partial_forward(model, ids, rows, kv, layers=range(cut, n_layers), hidden_states=h)
            pairs += [t for (k, v), (rk, rv) in zip(kv, kv0) for t in ((k, rk), (v, rv))]
    except Exception as e:  # noqa: BLE001
        report.layers_reason = (f"{report.model_type}: layer-range recompute is not available for this model "
                                f"({type(e).__name__}: {e})")
        return
    err, where = _max_rel(pairs)
    where %= 2 * n_layers
    report.layers_error = err
    if not err <= tol:
        report.layers_reason = (f"{report.model_type}: running its decoder layers directly does not reproduce the "
                                f"model's own forward (layer {where // 2} {'keys' if where % 2 == 0 else 'values'} "
                                f"differ by {err:.3g} relative): its forward does more around the layers than "
                                f"the Llama layout (e.g. an embedding multiplier); layer-wise methods are refused")


@torch.no_grad()
def check_model(model, refresh: bool = False) -> ModelCheck:
    """Probe ``model`` (once per model object, dtype, attention implementation and the partial engine's
    attention path, :func:`~hf_kvreuse.generation.selected.selected_path`; cached) and return what it found.

    Parameters
    ----------
    model : PreTrainedModel or peft PeftModel
        A causal LM.
    refresh : bool, default=False
        Probe again even if a cached result exists.
    """
    target = _target(model)
    from .devices import input_device
    from .generation.selected import base_attn, selected_path

    # an offloaded model keeps its parameters on ``meta`` between forwards: probe where it computes
    device = input_device(target)
    dtype = next(target.parameters()).dtype
    like = torch.empty(0, dtype=dtype, device=device)
    attn = base_attn(target.config)
    try:  # the engine's attention path depends on HF_KVREUSE_KERNELS: probe the one that runs
        path = selected_path(target, like)
    except (RuntimeError, ValueError) as e:  # a backend that cannot run here: the probe records its failure
        path = f"unavailable: {e}"
    key = (dtype, device, attn, path)
    with _LOCK:
        seen = _CACHE.setdefault(target, {})
        if key in seen and not refresh:
            return seen[key]
        t0 = time.perf_counter()
        model_type = f"{type(target).__name__} (model_type={getattr(target.config, 'model_type', '?')!r})"
        report = ModelCheck(model_type=model_type, dtype=str(dtype).replace("torch.", ""))
        report.extra["attention_path"] = path
        tol = _tolerance(dtype)
        ids = _probe_ids(target, device)
        from .hybrid import state_layer_ids, state_reason

        states = state_reason(target.config)
        # the probe checks the model's layout, not the caller's numerics: no autocast
        with torch.autocast(device.type, enabled=False):
            try:
                (kv0, logits0), (kv1, _) = _forward_kv(target, ids, (0, PROBE_SHIFT))
            except Exception as e:  # noqa: BLE001
                reason = f"{model_type}: its forward cannot be probed ({type(e).__name__}: {e})"
                report.rope_reason = report.engine_reason = report.layers_reason = reason
            else:
                report.kv_heads, report.head_dim = kv0[0][0].shape[1], kv0[0][0].shape[-1]
                if len({k.shape[-2] for k, _ in kv0}) != 1:
                    reason = f"{model_type}: its layers cache different numbers of tokens (sliding or shared layers)"
                    report.rope_reason = report.engine_reason = report.layers_reason = reason
                elif states:  # re-positioning applies to the attention layers; nothing recomputes rows here
                    skip = state_layer_ids(target.config)
                    report.extra["kv_layers"] = [i for i in range(len(kv0) + len(skip)) if i not in skip]
                    _probe_rope(target, report, kv0, kv1, tol)
                    report.engine_reason = report.layers_reason = f"{model_type}: its {states}"
                else:
                    _probe_rope(target, report, kv0, kv1, tol)
                    _probe_engine(target, report, ids, kv0, logits0, tol)
                    report.extra["_layers_pending"] = (weakref.ref(target), ids, kv0, tol)
        if target.training and not (report.rope_ok and report.engine_ok):
            report.extra["note"] = "the model is in training mode (dropout makes forwards differ): call model.eval()"
        report.probe_s = time.perf_counter() - t0
        seen[key] = report
        return report


def require(model, *, rope: bool = False, engine: bool = False, layers: bool = False, who: str = "this cache"
            ) -> ModelCheck:
    """:func:`check_model`, raising :class:`UnsupportedModelError` (or :class:`UnsupportedRopeError`) when a
    needed mechanism does not reproduce the model's own computation."""
    report = check_model(model)
    note = f" ({report.extra['note']})" if "note" in report.extra else ""
    if rope and not report.rope_ok:
        raise UnsupportedRopeError(f"{who} cannot re-position K/V of {report.rope_reason}{note}")
    if engine and not report.engine_ok:
        raise UnsupportedModelError(f"{who} refuses {report.engine_reason}{note}")
    if layers:
        with _LOCK:
            report.probe_layers()
    if layers and not report.layers_ok:
        raise UnsupportedModelError(f"{who} refuses {report.layers_reason}{note}")
    return report


class _StopAfterLayer0(Exception):
    pass


@torch.no_grad()
def check_donor(model, kv, ids: torch.Tensor, length: int, who: str, what: str = "donor_cache",
                samples: int = 8) -> None:
    """Refuse (``ValueError``) K/V that ``model`` did not compute: layer-0 keys depend only on the token and its
    position (embedding, norm, projection, RoPE), so the cached layer-0 keys of a few of ``ids``' first ``length``
    positions must equal what ``model`` itself computes there; another model of the same shape differs by order 1.

    Caches a model returned from its own ``generate`` with its present weights skip the probe
    (:func:`hf_kvreuse.fingerprint.made_by`). The probe runs layer 0 only (a forward hook stops the rest), on
    ``samples`` positions spread over the donor, as independent one-token sequences at their positions.
    """
    from transformers import DynamicCache

    from .compat import cache_kwargs
    from .devices import decoder_layers, input_device
    from .fingerprint import made_by
    from .local_hooks import local_hooks

    target = _target(model)
    if made_by(kv, target) or made_by(kv, model) or length == 0:
        return
    from .kv import kv_of

    k0 = kv_of(kv)[0][0]
    pos = torch.linspace(0, length - 1, min(samples, length)).round().long().unique()
    device = input_device(target)
    tokens = ids.reshape(-1)[pos.to(ids.device)].to(device)[:, None]
    cache = DynamicCache(config=target.config)
    layers = decoder_layers(target)

    def stop(*_):
        raise _StopAfterLayer0()

    try:
        with local_hooks() as hooks, torch.autocast(device.type, enabled=False):
            if layers is not None:
                hooks.forward(layers[0], stop)  # this call only: another thread's forward runs every layer
            target(input_ids=tokens, position_ids=pos.to(device)[:, None], use_cache=True, logits_to_keep=1,
                   **cache_kwargs(cache))
    except _StopAfterLayer0:
        pass
    mine = cache.layers[0].keys  # [samples, H, 1, D]
    theirs = k0[0, :, pos.to(k0.device), :].transpose(0, 1)[:, :, None, :]  # [samples, H, 1, D]
    if mine.shape != theirs.shape:
        raise ValueError(f"{who}: {what} layer-0 keys have shape {tuple(k0.shape)}, which {_describe_model(target)} "
                         "does not produce: was it made by another model?")
    err = _rel(theirs.to(mine.device), mine)
    tol = max(_tolerance(mine.dtype), _tolerance(theirs.dtype))
    if not err <= tol:
        raise ValueError(
            f"{who}: {what} was not computed by this model ({_describe_model(target)}): its layer-0 keys differ from "
            f"the model's own for the same tokens and positions by {err:.3g} relative (tolerance {tol:g}). It comes "
            "from another model, another checkpoint, another adapter on k_proj, or other token ids. Pass the cache "
            "this model's generate returned, or verify_donor=False if it is another adapter of this model on purpose")


def _describe_model(model) -> str:
    return f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', '?')!r})"


@torch.no_grad()
def check_exact_donor(model, cache, ids: torch.Tensor, length: int, who: str, probe: bool = True,
                      probe_tokens: int = 16) -> None:
    """Refuse (``ValueError``) a donor passed as ``model``'s *exact* cache of ``ids`` (``donor_exact``) whose K/V
    the model does not compute now. A cache whose producer tag names this model object with another weights
    state is refused on the tag (:func:`stale_producer`), always; one it made with its present state passes on
    the tag; any other, where ``probe`` (``verify_donor``), is probed: the model's own forward over the donor's first ``probe_tokens`` ids must give the keys
    *and values* the donor holds there in *every* attention layer (an adapter on ``q_proj`` / ``v_proj`` leaves
    layer 0's keys unchanged, not its values nor the later layers). The probe compares within the float
    tolerance of the dtype: weights whose K/V differ by less than that rounding on the probed rows pass it; the
    tag has no such gap."""
    from .compat import cache_kwargs
    from .devices import input_device
    from .fingerprint import made_by, stale_producer
    from .kv import kv_of

    target = _target(model)
    reason = stale_producer(cache, model, target)
    if reason:
        raise ValueError(
            f"{who}: donor_exact=True for a donor cache that this {type(target).__name__} made with {reason} than it "
            "has now: its K/V are not this model's exact prefix. Pass donor_exact=False (the donor then serves "
            "re-positioned drafts, which verify checks), or a cache made with the present weights and adapters")
    if not probe or length == 0 or made_by(cache, target) or made_by(cache, model):
        return
    from .hybrid import state_cache

    m = min(probe_tokens, length)
    mine = state_cache(target)
    if mine is None:
        from transformers import DynamicCache

        mine = DynamicCache(config=target.config)
    device = input_device(target)
    with torch.autocast(device.type, enabled=False):
        model(input_ids=ids.reshape(1, -1)[:, :m].to(device), use_cache=True, logits_to_keep=1,
              **cache_kwargs(mine))
    if hasattr(cache, "layers"):
        theirs = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers]
    else:
        theirs = list(kv_of(cache))
    worst, where = 0.0, -1
    for i, (layer, (tk, tv)) in enumerate(zip(mine.layers, theirs)):
        mk, mv = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not torch.is_tensor(mk) or not torch.is_tensor(tk) or mk.numel() == 0:
            continue  # a recurrent-state layer: no rows to compare
        rows = mk.shape[-2]  # a sliding-window layer of the probe may keep fewer than m rows: its last ones
        tk, tv = tk[..., m - rows:m, :], tv[..., m - rows:m, :]
        if tk.shape != mk.shape or tv.shape != mv.shape:
            raise ValueError(f"{who}: donor_exact=True for a donor whose layer-{i} K/V have shape {tuple(tk.shape)}, "
                             f"which this {type(target).__name__} does not produce ({tuple(mk.shape)})")
        tol = max(_tolerance(mk.dtype), _tolerance(tk.dtype))
        for a, b in ((tk, mk), (tv, mv)):
            err = _rel(a.to(b.device), b) / tol
            if err > worst or err != err:
                worst, where = err, i
    if not worst <= 1.0:
        raise ValueError(
            f"{who}: donor_exact=True for a donor cache that this {type(target).__name__} does not compute with its "
            f"present weights and adapters: its layer-{where} keys or values over its first {m} tokens differ from "
            f"the model's own by {worst:.3g} times the tolerance. It comes from another adapter, other weights or "
            "another model. Pass donor_exact=False (verified drafts), or the cache this model's generate returned")
