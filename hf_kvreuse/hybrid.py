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
    the recurrent state on any prefill of several tokens, which would silently change every later answer)."""
    import copy
    import weakref

    import torch

    from .compat import cache_kwargs
    from .devices import input_device
    from .fingerprint import config_digest

    global _CONTINUES
    if _CONTINUES is None:
        _CONTINUES = weakref.WeakKeyDictionary()
    key = config_digest(model.config)
    hit = _CONTINUES.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    result = (False, "this transformers release builds no generic cache for the recurrent-state layers")
    if state_cache(model) is not None:
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
        result = (err <= tol, f"a held state continued over 4 tokens differs from one prefill by {err:.2g} "
                              f"relative" if err > tol else "")
    _CONTINUES[model] = (key, result)
    return result
