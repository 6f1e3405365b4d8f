"""KV slicing and splicing across all layers of a transformers cache.

A "KV list" is ``list[tuple[K, V]]`` with one entry per layer, tensors ``[B, H_kv, T, D]``. Every cache in the
library reads donors and writes its assembled state through these helpers, so layer iteration, dtype/device
handling and the HF layer API (``cache.layers[i].keys``) live in one place.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import Cache, DynamicCache

from . import kernels
from .compat import init_layer

KV = list[tuple[torch.Tensor, torch.Tensor]]
Index = slice | torch.Tensor | Sequence[int]


def _physical_len(layer) -> int:
    keys = getattr(layer, "keys", None)
    return 0 if keys is None or keys.numel() == 0 else keys.shape[-2]


def kv_of(cache: Cache | KV) -> KV:
    """The per-layer ``(K, V)`` tensors of a cache (or a KV list, returned as is)."""
    if isinstance(cache, list):
        return cache
    if not isinstance(cache, Cache):
        raise TypeError(f"expected a transformers Cache or a list of (K, V), got {type(cache).__name__}")
    out = []
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is None or not getattr(layer, "is_initialized", True):
            raise ValueError(f"cache layer {i} is empty or not a key/value layer ({type(layer).__name__})")
        out.append((layer.keys, layer.values))
    return out


def kv_length(cache: Cache | KV) -> int:
    """Physical number of cached tokens (checked equal across layers)."""
    lens = {k.shape[-2] for k, _ in kv_of(cache)}
    if len(lens) != 1:
        raise ValueError(f"layers hold different numbers of tokens: {sorted(lens)} (sliding-window cache?)")
    return lens.pop()


def _index(idx: Index, device: torch.device) -> slice | torch.Tensor:
    if isinstance(idx, slice):
        return idx
    return torch.as_tensor(idx, dtype=torch.long, device=device)


def slice_kv(cache: Cache | KV, idx: Index) -> KV:
    """Tokens ``idx`` (a slice or positions) of every layer."""
    out = []
    for k, v in kv_of(cache):
        i = _index(idx, k.device)
        if isinstance(i, slice):
            out.append((k[..., i, :], v[..., i, :]))
        else:
            out.append(kernels.gather_kv_rows(k, v, i))  # torch: index_select of each
    return out


def cat_kv(*parts: KV) -> KV:
    """Concatenate KV lists along the token axis."""
    parts = [p for p in parts if p]
    return [(torch.cat([p[l][0] for p in parts], -2), torch.cat([p[l][1] for p in parts], -2))
            for l in range(len(parts[0]))]


def scatter_kv(dst: KV, idx: Index, src: KV) -> None:
    """In place: ``dst[l][..., idx, :] = src[l]`` for every layer."""
    for (dk, dv), (sk, sv) in zip(dst, src):
        i = _index(idx, dk.device)
        if isinstance(i, slice):
            dk[..., i, :], dv[..., i, :] = sk, sv
        else:
            kernels.scatter_kv_rows(dk, dv, i, sk, sv)  # torch: index_copy_ of each


def empty_kv(like: KV, length: int) -> KV:
    """Zero KV of ``length`` tokens with the shapes, dtype and device of ``like``."""
    return [(k.new_zeros(*k.shape[:-2], length, k.shape[-1]), v.new_zeros(*v.shape[:-2], length, v.shape[-1]))
            for k, v in like]


def alloc_layer(like: torch.Tensor, length: int) -> torch.Tensor:
    """An *uninitialised* ``[B, H, length, D]`` tensor like ``like`` (callers write every row before reading)."""
    return like.new_empty(*like.shape[:-2], length, like.shape[-1])


def kv_nbytes(kv: Cache | KV) -> int:
    """Bytes held by the K and V tensors of every layer."""
    return sum(t.numel() * t.element_size() for k, v in kv_of(kv) for t in (k, v))


def release_layer(cache: Cache | KV, layer_idx: int) -> None:
    """Drop one layer's K/V from ``cache`` (their memory is freed unless someone else holds the tensors).

    The layer is left holding empty tensors: the cache cannot serve any more, only be discarded.
    """
    if isinstance(cache, list):
        k, v = cache[layer_idx]
        cache[layer_idx] = (k.new_empty(0), v.new_empty(0))
        return
    layer = cache.layers[layer_idx]
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor):
        layer.keys, layer.values = keys.new_empty(0), layer.values.new_empty(0)


def release_kv(cache: Cache | KV) -> None:
    """Drop every layer's K/V from ``cache`` (see :func:`release_layer`)."""
    for i in range(len(cache) if isinstance(cache, list) else len(cache.layers)):
        release_layer(cache, i)


def copy_shifted_(dst: torch.Tensor, src: torch.Tensor, shifter=None, delta: int = 0, chunk: int = 512) -> None:
    """``dst[:] = src`` re-positioned by ``delta`` tokens (keys; values pass ``delta=0``), in place, through
    :meth:`hf_kvreuse.rope.RopeShifter.shift_into` (the one RoPE rotation of the library, any layout), with
    temporaries of at most ``chunk`` tokens: no full-size index_select or rotated copy per layer.

    When :func:`hf_kvreuse.kernels.backend` picks Triton for ``src`` (``HF_KVREUSE_KERNELS``), the rotation runs
    as one :func:`hf_kvreuse.kernels.rope_rebase` launch instead (same result up to float32 rounding)."""
    if delta == 0 or shifter is None:
        dst.copy_(src)
    elif kernels.backend(src) == "triton":
        kernels.rope_rebase(dst, src, delta, shifter)
    else:
        shifter.shift_into(dst, src, delta, chunk)


def load_kv(cache: Cache, kv: KV, seq_length: int | None = None) -> Cache:
    """Replace the contents of ``cache``'s layers with ``kv`` (lazily initialising empty layers).

    ``seq_length``: how many tokens the K/V stand for (default: the most rows any layer holds). A sliding-window
    layer (transformers' ``DynamicSlidingWindowLayer``) keeps only its last ``window - 1`` rows, so its token count
    is recorded separately (``cumulative_length``): it sizes the mask and decides what the next update drops.
    Given every row of such a layer (``seq_length`` of them, as a full-attention layer holds them), it keeps the
    last ``window - 1``: what plain prefill leaves there.
    """
    if len(kv) != len(cache.layers):
        raise ValueError(f"KV has {len(kv)} layers, the cache {len(cache.layers)}")
    if seq_length is None:
        seq_length = max((k.shape[-2] for k, _ in kv), default=0)
    for layer, (k, v) in zip(cache.layers, kv):
        init_layer(layer, k, v)
        window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
        if window is not None and k.shape[-2] == seq_length > window - 1:  # every row given: keep the window's
            k, v = k[..., seq_length - window + 1:, :], v[..., seq_length - window + 1:, :]
        if window is not None and k.shape[-2] != min(seq_length, window - 1):
            raise ValueError(f"a sliding-window layer (window {window}) of a cache of {seq_length} tokens holds "
                             f"{min(seq_length, window - 1)} rows, got {k.shape[-2]}")
        layer.keys, layer.values = k, v
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = seq_length
    return cache


def dynamic_cache_from_kv(kv: KV, config) -> DynamicCache:
    """A ``DynamicCache(config=config)`` holding ``kv``."""
    return load_kv(DynamicCache(config=config), kv)
