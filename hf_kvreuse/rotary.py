"""RoPE primitives: the rotation math of post-RoPE keys, for a rotary module and a layout given explicitly.

A leaf module (it imports nothing else of the library): :mod:`hf_kvreuse.model_check` probes a model's layout with
it, and :class:`hf_kvreuse.rope.RopeShifter` (what users call) takes the layout from that check. The re-positioning
is RebaseKV's / CacheBlend's RoPE rebase of reused keys (METHODS.md §1.2): ``R(delta) k_p`` moves a key from ``p`` to
``p + delta``, with the model's own ``inv_freq`` in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import HFKVReuseError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
ROPE_LAYOUTS = ("half", "interleaved")


class UnsupportedRopeError(HFKVReuseError, ValueError):
    """The model's RoPE variant cannot be re-positioned exactly."""


class _LayerTypeRotary:
    """The frequencies of one layer type of a rotary module that keeps one ``{type}_inv_freq`` buffer per type
    (Gemma3, OLMo3, ...): used when every decoder layer of the model has that type."""

    def __init__(self, module: nn.Module, layer_type: str):
        self.inv_freq = getattr(module, f"{layer_type}_inv_freq")
        rope_type = getattr(module, "rope_type", "default")
        self.rope_type = rope_type.get(layer_type, "default") if isinstance(rope_type, dict) else rope_type
        scaling = getattr(module, f"{layer_type}_attention_scaling", getattr(module, "attention_scaling", 1.0))
        self.attention_scaling = scaling


def find_rotary_embedding(model: nn.Module):
    """The model's shared rotary-embedding module (the first module with an ``inv_freq`` buffer), or the
    frequencies of the single layer type all its layers use when the module keeps one buffer per layer type."""
    for name, module in model.named_modules():
        if hasattr(module, "inv_freq") and name.endswith("rotary_emb"):
            return module
    for _, module in model.named_modules():
        if hasattr(module, "inv_freq"):
            return module
    layer_types = set(getattr(getattr(model, "config", None), "layer_types", None) or ())
    for _, module in model.named_modules():
        per_type = [t for t in layer_types if hasattr(module, f"{t}_inv_freq")]
        if per_type:
            if len(layer_types) != 1:
                raise UnsupportedRopeError(f"{type(model).__name__} mixes layer types {sorted(layer_types)} with "
                                           "their own RoPE frequencies; one layer type only")
            return _LayerTypeRotary(module, per_type[0])
    raise UnsupportedRopeError(f"{type(model).__name__} has no rotary embedding (inv_freq); RoPE models only")


def layer_rotaries(model: nn.Module) -> list | None:
    """Per decoder layer, the frequencies of its layer type, for a model that mixes layer types whose rotary module
    keeps one ``{type}_inv_freq`` buffer per type (Gemma 3: local and global RoPE bases, OLMo 3); None for a model
    whose layers share one rotary embedding."""
    layer_types = list(getattr(getattr(model, "config", None), "layer_types", None) or ())
    if len(set(layer_types)) <= 1:
        return None
    modules = dict(model.named_modules())
    local = [m for name, m in modules.items() if name.endswith("rotary_emb_local") and hasattr(m, "inv_freq")]
    glob = [m for name, m in modules.items() if name.endswith("rotary_emb") and hasattr(m, "inv_freq")]
    if len(local) == 1 and len(glob) == 1:  # transformers 4.x Gemma 3: a second module for the local layers
        return [local[0] if t == "sliding_attention" else glob[0] for t in layer_types]
    if any(hasattr(m, "inv_freq") for m in modules.values()):
        return None
    for _, module in model.named_modules():
        if all(hasattr(module, f"{t}_inv_freq") for t in set(layer_types)):
            by_type = {t: _LayerTypeRotary(module, t) for t in set(layer_types)}
            return [by_type[t] for t in layer_types]
    return None


def rope_type_of(model_or_rotary: nn.Module) -> str:
    if not hasattr(model_or_rotary, "inv_freq"):
        per = layer_rotaries(model_or_rotary)
        if per is not None:  # the first unsupported type, else the first
            types = [getattr(r, "rope_type", "default") for r in per]
            return next((t for t in types if t not in SUPPORTED_ROPE_TYPES), types[0])
    rot = model_or_rotary if hasattr(model_or_rotary, "inv_freq") else find_rotary_embedding(model_or_rotary)
    return getattr(rot, "rope_type", "default")


def _rope_types(spec) -> list[str]:
    """The rope types named in a rotary module's ``rope_type`` or a config's ``rope_parameters`` / ``rope_scaling``
    (a string, one dict, or one dict per layer type)."""
    if isinstance(spec, str):
        return [spec]
    if not isinstance(spec, dict):
        return []
    if "rope_type" in spec or "type" in spec:
        return [str(spec.get("rope_type", spec.get("type")))]
    return [t for v in spec.values() for t in _rope_types(v)]


def length_dependent_rope(model: nn.Module) -> str | None:
    """Why ``model``'s RoPE frequencies depend on the sequence length (None when they do not, or when it has no
    rotary embedding): the one place that says which rope kinds are length dependent. Every type outside the
    static ones (:data:`SUPPORTED_ROPE_TYPES`) counts: ``dynamic`` (NTK: transformers recomputes ``inv_freq`` when
    a forward reaches past the longest length seen, and resets it below ``max_position_embeddings``), ``longrope``
    (short or long factors by the longest position of each forward) and any type not known to be static. K/V of
    such a model depend on the longest position of the forward that computed them (and on the module's history),
    so rows held from another call are never exact, and cannot be re-positioned."""
    types = []
    for _, module in model.named_modules():
        if hasattr(module, "rope_type"):
            types += _rope_types(getattr(module, "rope_type"))
    config = getattr(model, "config", None)
    for name in ("rope_parameters", "rope_scaling"):
        types += _rope_types(getattr(config, name, None))
    dependent = sorted({t for t in types if t not in SUPPORTED_ROPE_TYPES})
    if not dependent:
        return None
    return (f"rope_type={dependent[0]!r}: its frequencies depend on the sequence length (the longest position of "
            "each forward), so K/V computed in another call are not what a plain prefill of this prompt computes, and "
            "cannot be re-positioned")


def check_rope_supported(model: nn.Module) -> str:
    """Return the model's rope type, or raise :class:`UnsupportedRopeError` naming it."""
    rope_type = rope_type_of(model)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(
            f"rope_type={rope_type!r} cannot be re-positioned exactly: its frequencies depend on the sequence "
            f"length. Supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    return rope_type


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Interleaved counterpart of :func:`rotate_half`: ``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RotaryShifter:
    """Re-positions post-RoPE keys with a rotary module's frequencies and a given layout (RebaseKV's RoPE rebase).

    Parameters
    ----------
    model : nn.Module
        A rotary module (``layout`` is trusted as given), or a transformers causal LM with ``layout`` given.
    layout : {"half", "interleaved"}, optional
        Rotation layout; default "half" for a bare rotary module, required for a model.

    Examples
    --------
    >>> shifter = RotaryShifter(rotary_module, layout="half")
    >>> keys_at_new_positions = shifter.shift(keys, delta)      # keys [B, H, T, D], delta int or [T] / [B, T]
    """

    def __init__(self, model: nn.Module, layout: str | None = None):
        self._layers = None  # per decoder layer, its type's shifter (models with per-type frequencies)
        if hasattr(model, "inv_freq"):  # a rotary module (or one layer type's frequencies)
            rot = model
        else:
            if layout is None:
                raise ValueError("RotaryShifter does not guess a model's RoPE layout: pass layout=, or use "
                                 "hf_kvreuse.rope.RopeShifter, which takes it from the model check")
            per = layer_rotaries(model)
            if per is not None:
                by_rot = {}
                self._layers = [by_rot.setdefault(id(r.inv_freq), RotaryShifter(r, layout)) for r in per]
                rot = per[0]
            else:
                rot = find_rotary_embedding(model)
        layout = layout or "half"
        if layout not in ROPE_LAYOUTS:
            raise ValueError(f"layout={layout!r}: choose one of {ROPE_LAYOUTS}")
        rope_type = getattr(rot, "rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            check_rope_supported(rot)
        # A frozen float32 copy: the module's buffer may be in bf16 or mutated by dynamic variants.
        self.inv_freq = rot.inv_freq.detach().float().clone()
        self.rope_type = rope_type
        self.layout = layout
        self.rotary_dim = 2 * self.inv_freq.numel()

    def for_layer(self, layer_idx: int) -> "RotaryShifter":
        """The shifter of decoder layer ``layer_idx``: this one, or its layer type's where the model's layer types
        have their own RoPE frequencies (then :meth:`shift` refuses to guess which)."""
        return self if self._layers is None else self._layers[layer_idx]

    def cos_sin(self, delta: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of ``delta * inv_freq`` in float32, shape ``[..., rot_dim]``."""
        inv = self.inv_freq.to(device)
        ang = delta.to(device=device, dtype=torch.float32)[..., None] * inv
        ang = torch.cat((ang, ang), dim=-1) if self.layout == "half" else ang.repeat_interleave(2, dim=-1)
        return ang.cos(), ang.sin()

    def shift(self, keys: torch.Tensor, delta: int | torch.Tensor,
              cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Move post-RoPE ``keys`` ``[B, H, T, D]`` by ``delta`` positions (int, ``[T]`` or ``[B, T]``).

        Pass ``cos_sin`` from :meth:`cos_sin` to reuse it across layers.
        """
        if self._layers is not None:
            raise ValueError("this model's layer types have their own RoPE frequencies: shift with "
                             "for_layer(layer_idx).shift(...)")
        B, H, T, D = keys.shape
        if cos_sin is None:
            if isinstance(delta, int):
                if delta == 0:
                    return keys
                delta = torch.full((T,), delta, dtype=torch.long)
            cos_sin = self.cos_sin(delta, keys.device)
        cos, sin = cos_sin
        if cos.dim() == 2:  # [T, rot] -> [1, 1, T, rot]
            cos, sin = cos[None, None], sin[None, None]
        else:  # [B, T, rot] -> [B, 1, T, rot]
            cos, sin = cos[:, None], sin[:, None]
        rot_dim = cos.shape[-1]
        k = keys.float()
        k_rot, k_pass = k[..., :rot_dim], k[..., rot_dim:]  # partial rotary: only the first rot_dim dims turn
        k_rot = k_rot * cos + (rotate_half(k_rot) if self.layout == "half" else rotate_pairs(k_rot)) * sin
        return torch.cat((k_rot, k_pass), dim=-1).to(keys.dtype) if rot_dim < D else k_rot.to(keys.dtype)


    def shift_into(self, dst: torch.Tensor, src: torch.Tensor, delta: int, chunk: int = 512) -> None:
        """``dst[:] = shift(src, delta)`` for one scalar ``delta``, ``chunk`` tokens at a time (bounded temporaries)."""
        if delta == 0:
            dst.copy_(src)
            return
        cos_sin = self.cos_sin(torch.tensor([delta]), src.device)  # [1, rot]: broadcast over the tokens
        for c0 in range(0, src.shape[-2], chunk):
            dst[..., c0:c0 + chunk, :].copy_(self.shift(src[..., c0:c0 + chunk, :], None, cos_sin))
