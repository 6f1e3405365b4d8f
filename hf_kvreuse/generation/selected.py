"""The selected-row attention of :func:`~hf_kvreuse.generation.partial.partial_forward`, plugged into the model.

A partial forward feeds ``R`` selected rows that attend to ``N`` cached columns by original position, which
transformers' attention functions only take as an explicit ``[R, N]`` mask. Here a wrapper of the model's own
attention (``sdpa`` or ``eager``) is part of the library's attention, ``kvreuse_<base>``
(:mod:`hf_kvreuse.local_hooks`); :func:`selected_rows` selects it on the model's config for the duration of one
partial forward and publishes the rows' positions in the context variable :data:`SELECTED`. While that variable is
set the wrapper computes the attention with :func:`hf_kvreuse.kernels.selected_attention` (the Triton kernel, or
on torch SDPA block by block over the columns each block can see); otherwise, and for any layer it does not
handle (softcapping, sliding windows, sinks, dropout, another shape), it calls the wrapped function with the
explicit position mask, built on that first use (the engine passes the model only a placeholder, so a forward
whose layers all take the selected-row path never builds the ``[R, N]`` mask); another thread's forward on the
same model during the swap (no rows published in its context) runs unchanged with its own mask.

Which path runs (:func:`selected_path`): the Triton kernel under the ``triton`` backend (sdpa and eager
models), the blocked SDPA formulation on torch for ``sdpa`` models on CPU, and the explicit mask (no wrapper)
for ``eager`` models on torch, for CUDA tensors on torch, and for any other attention implementation. Where
another of the library's wrappers acts in the same context (the low-rank values of
:class:`~hf_kvreuse.cache_classes.base_lr.BaseLRCache`), this one passes the call on with the explicit mask.
:func:`hf_kvreuse.model_check.check_model` probes the engine on the path that runs (its cache key holds it).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch

from ..local_hooks import ATTN_PREFIX, base_attn, library_attention, others_active, register_wrapper, wrapped_attention

__all__ = ["ATTN_PREFIX", "OBSERVER", "SELECTED", "base_attn", "register_selected_attention", "selected_attention_fn",
           "selected_path", "selected_rows", "wrapped_attention"]

#: the rows of the partial forward running in this context (a SelectedPositions), or None
SELECTED: contextvars.ContextVar = contextvars.ContextVar("hf_kvreuse_selected_rows", default=None)

#: an observer of every attention the wrapper runs in this context, or None: called as
#: ``observer(module, query, key, allowed, kwargs)`` with ``allowed`` the visible columns (a boolean
#: ``[..., R, N]`` mask) or None (every row sees every column up to its own position, rows last)
OBSERVER: contextvars.ContextVar = contextvars.ContextVar("hf_kvreuse_attention_observer", default=None)


def selected_path(model, tensor: torch.Tensor) -> str:
    """``"triton"``, ``"blocked"`` or ``"mask"``: how partial recompute attends for ``model`` with K/V like
    ``tensor`` under the current ``HF_KVREUSE_KERNELS`` (see the module docstring)."""
    from ..kernels import backend

    attn = base_attn(model.config)
    if attn not in ("sdpa", "eager"):
        return "mask"
    if backend(tensor) == "triton":
        return "triton"
    # measured on CPU only; a CUDA device under HF_KVREUSE_KERNELS=torch keeps what it ran before
    return "blocked" if attn == "sdpa" and tensor.device.type == "cpu" else "mask"


def _handles(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sel, kwargs: dict) -> bool:
    if others_active("selected"):  # another wrapper changes this attention (low-rank values): pass it the mask
        return False
    if any(kwargs.get(a) is not None for a in ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")):
        return False
    if kwargs.get("dropout", 0.0) or not getattr(module, "is_causal", True):
        return False
    if key.shape != value.shape or query.shape[-1] != key.shape[-1] or query.shape[1] % key.shape[1]:
        return False
    return query.shape[2] == sel.q_pos.numel() and key.shape[2] == sel.k_pos.numel()


def selected_attention_fn(base_fn: Callable) -> Callable:
    """Wrap an attention function (sdpa / eager) so that, while :data:`SELECTED` is set, the selected rows attend
    by position through :func:`hf_kvreuse.kernels.selected_attention`."""
    from .. import kernels

    def attention(module, query, key, value, attention_mask, **kwargs):
        sel = SELECTED.get()
        observer = OBSERVER.get()
        if observer is not None:
            observer(module, query, key, _visible(sel, attention_mask, query.device), kwargs)
        if sel is None or not _handles(module, query, key, value, sel, kwargs):
            if sel is not None and sel.has_mask:  # the engine passed a placeholder: the real mask, built now
                attention_mask = sel.fallback_mask(query.device)
            return base_fn(module, query, key, value, attention_mask, **kwargs)
        B, Hq, R, D = query.shape
        scaling = kwargs.get("scaling")
        scaling = scaling if scaling is not None else D ** -0.5
        out = query.new_empty(B, R, Hq, D)  # the layout attention functions return: no transpose copy
        kernels.selected_attention(query, key, value, sel, scaling, out=out.transpose(1, 2))
        return out, None

    return attention


def _visible(sel, attention_mask, device) -> torch.Tensor | None:
    """The columns each query row sees (boolean), from the selected positions or the mask the model passes."""
    if sel is not None:
        q_pos, k_pos, k_valid = sel.on(device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        return allowed & k_valid[None, :] if k_valid is not None else allowed
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def register_selected_attention(base_name: str) -> str:
    """Register (once) the library's attention over ``base_name`` (with the selected-row wrapper); return its
    name."""
    return library_attention(base_name)


register_wrapper("selected", selected_attention_fn, order=0,
                 active=lambda: SELECTED.get() is not None or OBSERVER.get() is not None)


@contextlib.contextmanager
def selected_rows(model, positions):
    """For the duration of the block: the model's attention is the selected-row wrapper (reference-counted
    across threads, restored by the last one out) and :data:`SELECTED` holds ``positions`` (a
    :class:`~hf_kvreuse.triton.selected_attention.SelectedPositions`) in this context.

    Code that reads the model's attention implementation meanwhile (another thread) should read it through
    :func:`base_attn`. Any interleaving with another of the library's calls (BaseLRCache's low-rank values
    included) stays correct: each wrapper acts only in its own context."""
    token = SELECTED.set(positions)
    try:
        with wrapped_attention(model):
            yield
    finally:
        SELECTED.reset(token)
