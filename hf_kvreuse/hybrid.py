"""Layers whose cache is a recurrent state, not per-token K/V (linear-attention / state-space hybrids).

Qwen3.5, Qwen3-Next, Jamba, Bamba, Falcon-H1, Zamba, Nemotron-H, OLMo hybrid and others mix attention layers with
layers (gated delta rule, Mamba, linear attention) whose cache is a convolution and a recurrent state summing the
whole prefix. Such a state cannot be sliced at a shorter prefix, re-positioned or recomputed for a span: none of
hf_kvreuse's reuse methods applies, and a held copy of it reproduces plain ``generate`` only for exactly the tokens
it was taken at. This module finds those layers from the model's own cache layers and config, without trusting the
architecture's name.
"""

from __future__ import annotations

from transformers import DynamicCache

#: ``config.layer_types`` entries whose cache is per-token K/V
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
#: layer types holding no cache at all (Nemotron-H's MLP / MoE blocks)
NO_CACHE_TYPES = ("mlp", "moe", "dense")


def state_layer_ids(config) -> list[int]:
    """Indices of the layers of ``config`` whose cache is not per-token K/V (:func:`state_layers`)."""
    return [int(x.split(":", 1)[0]) for x in state_layers(config)]


def state_layers(config) -> list[str]:
    """``["<index>: <what>", ...]`` for every layer of ``config`` whose cache is not per-token K/V ([] if none).

    Two probes, either suffices: transformers' own ``DynamicCache(config=...)`` building a layer without a
    ``keys`` / ``values`` pair (``LinearAttentionLayer`` and its mixed forms in transformers 5.x), and
    ``config.layer_types`` naming a layer type that is not attention (releases whose DynamicCache builds K/V
    layers for every layer and leaves the states to the model's own cache class).
    """
    config = getattr(config, "get_text_config", lambda: config)()
    found: dict[int, str] = {}
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot size: the layer_types probe below decides
        layers = []
    for i, layer in enumerate(layers):
        name = type(layer).__name__
        if "LinearAttention" in name or hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states"):
            found[i] = name
    for i, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if isinstance(kind, str) and kind not in KV_LAYER_TYPES + NO_CACHE_TYPES and i not in found:
            found[i] = kind
    for attr in ("layers_block_type", "hybrid_override_pattern"):  # Jamba / Bamba style names of the same thing
        pattern = getattr(config, attr, None)
        if isinstance(pattern, (list, tuple)):
            for i, kind in enumerate(pattern):
                if isinstance(kind, str) and kind not in KV_LAYER_TYPES + NO_CACHE_TYPES and i not in found:
                    found[i] = kind
    return [f"{i}: {found[i]}" for i in sorted(found)]


def state_reason(config) -> str | None:
    """A one-line reason naming the recurrent-state layers of ``config``, or None if every layer holds K/V."""
    layers = state_layers(config)
    if not layers:
        return None
    shown = ", ".join(layers[:4]) + (f", ... ({len(layers)} in all)" if len(layers) > 4 else "")
    return (f"linear-attention / recurrent-state layers ({shown}) hold a state summing the whole prefix, not "
            "per-token K/V: it cannot be cut, re-positioned or partly recomputed")


def state_cache(model):
    """An empty cache of ``model``'s own layer kinds that ``generate`` fills in place (transformers' own
    ``DynamicCache(config=...)``, where it builds the recurrent-state layers), or None where this release leaves
    the states to the model's own cache class (``generate`` then makes one itself)."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot size
        return None
    stateful = [type(layer).__name__ for layer in cache.layers
                if "LinearAttention" in type(layer).__name__ or hasattr(layer, "recurrent_states")
                or hasattr(layer, "conv_states")]
    return cache if stateful else None


def state_at(cache, b: int, snap: dict):
    """A new cache standing for the first ``b`` tokens of ``cache``: its K/V layers' first ``b`` rows and, for each
    recurrent-state layer ``i``, a copy of ``snap[i]`` (that layer after exactly ``b`` tokens)."""
    import copy

    new_cache = copy.copy(cache)
    layers = []
    for i, layer in enumerate(cache.layers):
        if i in snap:
            layers.append(copy.deepcopy(snap[i]))
        elif getattr(layer, "keys", None) is None:  # a layer that holds nothing (Nemotron-H's MLP blocks)
            layers.append(copy.deepcopy(layer))
        else:
            new = copy.copy(layer)
            new.keys, new.values = layer.keys[..., :b, :].clone(), layer.values[..., :b, :].clone()
            layers.append(new)
    new_cache.layers = layers
    return new_cache


def tensor_bytes(obj, _seen=None) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj`` (a cache, its layers, lists, dicts)."""
    import torch

    seen = _seen if _seen is not None else set()
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        if ("obj", id(obj)) in seen:
            return 0
        seen.add(("obj", id(obj)))
        return sum(tensor_bytes(x, seen) for x in vars(obj).values()
                   if isinstance(x, (torch.Tensor, list, tuple, dict)) or type(x).__module__.startswith("transformers"))
    return 0


_CONTINUES: "weakref.WeakKeyDictionary" = None  # model -> (config digest, whether a held state continues exactly)


def state_continues(model) -> tuple[bool, str]:
    """(whether ``model`` continues a held cache of this release's own kind exactly, reason): a probe of the
    model's own code, once per model and config. A 12-token prompt is prefilled at once, as 8 tokens then 4 more
    over a copy of the cache taken after the 8, and as 4 more over that cache cut back to 8 tokens
    (:func:`state_at`, with the state layers copied after 8); the last logits must agree (some releases restart
    the recurrent state on any prefill of several tokens, which would silently change every later answer). A
    model whose forward raises on such a cache (its own cache class only, or a state of another shape) does not
    continue one either: the reason names the error."""
    import weakref

    from .fingerprint import config_digest

    global _CONTINUES
    if _CONTINUES is None:
        _CONTINUES = weakref.WeakKeyDictionary()
    key = config_digest(model.config)
    hit = _CONTINUES.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    result = (False, "this transformers release builds no generic cache for the recurrent-state layers")
    try:
        if state_cache(model) is not None:
            result = _continues_probe(model)
    except Exception as e:  # noqa: BLE001 - a model whose own code will not run on this cache: no held states
        result = (False, f"its forward does not run on a held cache of its own layer kinds ({type(e).__name__}: "
                         f"{str(e)[:160]})")
    _CONTINUES[model] = (key, result)
    return result


def _continues_probe(model) -> tuple[bool, str]:
    """:func:`state_continues`' probe itself (12 tokens at once, 8 + 4 over a copy, 8 + 4 over a cut cache)."""
    import copy

    import torch

    from .compat import cache_kwargs
    from .devices import input_device

    vocab = int(getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "vocab_size", 32))
    ids = (torch.arange(12) * 7 % max(vocab - 3, 1) + 3)[None].to(input_device(model))
    with torch.no_grad():
        whole = state_cache(model)
        a = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(whole)).logits[0, -1].float()
        part = state_cache(model)
        model(input_ids=ids[:, :8], use_cache=True, logits_to_keep=1, **cache_kwargs(part))
        idx = [i for i, layer in enumerate(part.layers) if not hasattr(layer, "keys")]
        snap = {i: copy.deepcopy(part.layers[i]) for i in idx}
        cont = copy.deepcopy(part)
        b = model(input_ids=ids[:, 8:], use_cache=True, logits_to_keep=1, **cache_kwargs(cont)).logits[0, -1].float()
        # the block path: a cache past the block end cut back to it (K/V rows) with the block's state copies
        cut = state_at(cont, 8, snap)
        c = model(input_ids=ids[:, 8:], use_cache=True, logits_to_keep=1, **cache_kwargs(cut)).logits[0, -1].float()
    err = max(float((a - x).abs().max() / a.abs().max().clamp_min(1e-6)) for x in (b, c))
    tol = 1e-3 if a.dtype == torch.float32 and model.dtype == torch.float32 else 3e-2
    return (err <= tol, f"a held state continued over 4 tokens differs from one prefill by {err:.2g} "
                        f"relative" if err > tol else "")


# -- optimistic drafts on hybrids: the pieces OptimisticCache composes ------------------------------------------
def copy_points(start: int, end: int, every: int, last: int | None) -> list[int]:
    """Where a prefill of tokens ``start..end`` copies its recurrent states: the multiples of ``every`` in
    ``(start, end]``, the last ``last`` of them (None: all). Each point splits the prefill into one more forward;
    on a 2-core CPU every 256-token block end of a 2k prompt costs ~9% of the prefill, the last two ~2%, and the
    points worth keeping are near the end (where another call's prompt diverges: its own cue or role text)."""
    if every <= 0:
        return []
    points = list(range((start // every + 1) * every, end + 1, every))
    return points if last is None else points[len(points) - min(last, len(points)):]


def state_indices(cache) -> list[int] | None:
    """The recurrent-state layers of ``cache`` (a list, possibly empty) when every other layer is a plain K/V
    layer; None where a layer mixes both kinds or the cache has no ``layers`` list."""
    out = []
    for i, layer in enumerate(getattr(cache, "layers", None) or []):
        state = hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")
        kv = hasattr(layer, "keys") and hasattr(layer, "values")
        if state == kv:
            return None
        if state:
            out.append(i)
    return out if getattr(cache, "layers", None) else None


def attention_rows(cache, states: list[int]) -> int:
    """Rows every K/V layer of a hybrid ``cache`` holds (checked equal; 0 for an empty cache)."""
    rows = set()
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if i not in states and keys is not None:  # None: a layer that holds nothing (an MLP block)
            rows.add(0 if keys.numel() == 0 else int(keys.shape[-2]))
    if len(rows) > 1:
        raise ValueError(f"the attention layers of this cache hold different numbers of rows: {sorted(rows)}")
    return rows.pop() if rows else 0


def copy_states(cache, states: list[int]) -> dict:
    """``{layer index: copy}`` of the recurrent-state layers of ``cache`` (they are updated in place by the next
    forward: a copy is the only way to keep one)."""
    import copy

    return {i: copy.deepcopy(cache.layers[i]) for i in states}


def rewind(cache, snap: dict, rows: int) -> None:
    """Put ``cache`` back to the first ``rows`` tokens: its K/V layers cut to ``rows`` rows, its recurrent-state
    layers replaced by copies of ``snap`` (taken after exactly ``rows`` tokens; the states cannot be cut)."""
    import copy

    for i, layer in enumerate(cache.layers):
        if i in snap:
            cache.layers[i] = copy.deepcopy(snap[i])
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[..., :rows, :], layer.values[..., :rows, :]


def common_prefix(a, b, limit: int) -> int:
    """Length of the common prefix of the 1-D token tensors ``a`` and ``b``, at most ``limit``."""
    import torch

    m = min(a.numel(), b.numel(), limit)
    if m <= 0:
        return 0
    diff = (a[:m].cpu() != b[:m].cpu()).nonzero()
    return int(diff[0, 0]) if diff.numel() else m


class DraftPlan:
    """How an optimistic draft of a hybrid's prompt is assembled (:func:`plan_draft`).

    ``exact_donor`` / ``exact_len``: the prompt's first ``exact_len`` tokens come from that exact donor's state
    taken there (-1 / 0: from an empty cache). Tokens ``exact_len .. span_target`` are computed, then rows
    ``span_donor_start .. state_at`` of donor ``span_donor`` are reused at ``span_target ..`` (attention K/V
    re-positioned by ``delta``; every recurrent-state layer is that donor's state after ``state_at`` tokens), and
    the prompt from ``span_target + state_at - span_donor_start`` on is computed. ``span_donor`` -1: no span (the
    draft is exact: the exact prefix and the rest computed)."""

    def __init__(self, exact_donor: int, exact_len: int, span_donor: int = -1, span_donor_start: int = 0,
                 span_target: int = 0, state_at: int = 0):
        self.exact_donor, self.exact_len = exact_donor, exact_len
        self.span_donor, self.span_donor_start, self.span_target, self.state_at = (
            span_donor, span_donor_start, span_target, state_at)

    @property
    def reused(self) -> int:
        return self.state_at - self.span_donor_start if self.span_donor >= 0 else 0

    @property
    def delta(self) -> int:
        return self.span_target - self.span_donor_start

    @property
    def resume(self) -> int:
        """The first prompt position computed after the reused span."""
        return self.span_target + self.reused if self.span_donor >= 0 else self.exact_len

    def computed(self, covered: int) -> int:
        """Prompt tokens (of the first ``covered``) the draft computes."""
        return (self.span_target - self.exact_len if self.span_donor >= 0 else 0) + covered - self.resume

    def __repr__(self) -> str:
        return (f"DraftPlan(exact={self.exact_donor}:{self.exact_len}, span={self.span_donor}:"
                f"{self.span_donor_start}..{self.state_at} at {self.span_target})")


def plan_draft(spans, target, donor_ids: list, points: list, exact: list, covered: int, min_reuse: int,
               max_share: float = 0.5) -> DraftPlan:
    """The draft that computes the fewest of the prompt's first ``covered`` tokens.

    A recurrent state stands for exactly the tokens it was taken after, so a draft reuses one donor span, cut at
    one of that donor's state points (``points[d]``: token counts with a state copy), after an exact start (the
    longest state point of an exact donor that is a prefix of the prompt) and the prompt's tokens up to the span
    computed. ``spans``: the alignment's matched spans (``donor``, ``donor_start``, ``target_start``, ``length``).
    A span saving fewer than ``min_reuse`` computed tokens over the exact start alone, or leaving more than
    ``max_share`` of them to compute, is not used (the draft would hide less than it costs: the exact prefill
    computes those tokens anyway)."""
    starts = [(0, -1)]  # (exact length, donor)
    for d, (ids, ok) in enumerate(zip(donor_ids, exact)):
        if ok:
            c = common_prefix(ids.reshape(-1), target.reshape(-1), covered)
            starts += [(p, d) for p in points[d] if 0 < p <= c]
    best_exact = max(starts)
    best = DraftPlan(best_exact[1], best_exact[0])
    exact_cost = best.computed(covered)
    best_cost = limit = min(exact_cost - min_reuse, int(exact_cost * max_share))
    best_cost += 1  # a span must compute at most ``limit`` tokens

    def exact_before(s: int):
        return max(x for x in starts if x[0] <= s)

    for sp in spans:
        # an exact start inside the span trims it (exact rows rather than reused ones; the same cost)
        e, ed = exact_before(sp.target_start + sp.length - 1)
        cut = max(0, e - sp.target_start)
        d0, t0 = sp.donor_start + cut, sp.target_start + cut
        for b in points[sp.donor]:
            if not d0 < b <= sp.donor_start + sp.length:
                continue
            plan = DraftPlan(ed, e, sp.donor, d0, t0, b)
            if plan.resume > covered:
                continue
            cost = plan.computed(covered)
            if cost <= limit and (cost, -plan.exact_len) < (best_cost, -best.exact_len):
                best, best_cost = plan, cost
    return best


def draft_refusal(model) -> str | None:
    """Why optimistic drafts cannot serve the hybrid ``model`` (None: they can): this release builds no generic
    cache for its state layers, a held state does not continue exactly (:func:`state_continues`), or it also has
    sliding-window layers."""
    from .sliding import layer_windows

    config = getattr(model.config, "get_text_config", lambda: model.config)()
    if any(layer_windows(config)):
        return "it mixes recurrent-state and sliding-window layers (drafts cover one kind of each at a time)"
    if state_cache(model) is None:
        return "this transformers release builds no generic cache for its recurrent-state layers"
    ok, why = state_continues(model)
    return None if ok else why


def check_state_donor(model, cache, ids, length: int, states: list[int], who: str, probe_tokens: int = 16) -> None:
    """Refuse (``ValueError``) a hybrid donor cache that ``model`` did not compute. A cache this model's
    ``generate`` returned with its present weights passes on its tag; any other is probed: the model's own
    forward over the donor's first ``probe_tokens`` ids must give the K/V rows the donor's first attention layer
    holds there (an attention layer after recurrent layers depends on the whole prefix, so the probe runs the
    prefix, not single tokens)."""
    import torch

    from .compat import cache_kwargs
    from .devices import input_device
    from .fingerprint import made_by

    if made_by(cache, model) or length == 0:
        return
    first = next(i for i, layer in enumerate(cache.layers) if i not in states and getattr(layer, "keys", None) is not None)
    m = min(probe_tokens, length)
    mine = state_cache(model)
    device = input_device(model)
    with torch.no_grad():
        model(input_ids=ids.reshape(1, -1)[:, :m].to(device), use_cache=True, logits_to_keep=1,
              **cache_kwargs(mine))
    a, b = mine.layers[first].keys, cache.layers[first].keys[..., :m, :]
    err = float((a.float() - b.float().to(a.device)).abs().max() / a.float().abs().max().clamp_min(1e-6)) \
        if a.shape == b.shape else float("inf")
    tol = 1e-3 if a.dtype == torch.float32 else 3e-2
    if not err <= tol:
        raise ValueError(f"{who}: donor_cache was not computed by this model ({type(model).__name__}): the keys of its "
                         f"first attention layer (layer {first}) over its first {m} tokens differ from the model's own "
                         f"by {err:.3g} relative. Pass the cache this model's generate returned, or verify_donor=False")
