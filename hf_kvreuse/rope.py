"""RoPE re-positioning of cached (post-RoPE) keys by per-token position deltas.

Cached keys are stored after RoPE: ``k_p = s * R(p) k``. Rotations compose, so a key computed at position ``p``
moves to ``p + delta`` with ``R(delta) k_p`` (METHODS.md §1.2); values carry no position and are unchanged.
The angles come from the model's own ``rotary_emb.inv_freq`` in float32 (never a hand-written theta) and the
YaRN/LongRoPE magnitude factor ``s`` is not applied twice. Two layouts exist: half-split (Llama, Qwen, Mistral:
dimension ``i`` pairs with ``i + rot/2``) and interleaved (Cohere, GLM: ``2i`` pairs with ``2i + 1``); with
partial rotary only the leading ``rot = 2 * len(inv_freq)`` dimensions turn. Given a model, the layout is not
guessed from its name: :func:`hf_kvreuse.model_check.check_model` compares both layouts with keys the model's
own forward computes at shifted positions, and refuses a model that matches neither. This is exact when ``inv_freq`` does not depend on
the sequence length: rope types default, linear, llama3, yarn, proportional. ``dynamic`` and ``longrope``
change ``inv_freq`` with the length (and mutate the module during forward), so they are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from .model_check import require
from .rotary import (ROPE_LAYOUTS, SUPPORTED_ROPE_TYPES, RotaryShifter, UnsupportedRopeError,  # noqa: F401
                     check_rope_supported, find_rotary_embedding, layer_rotaries, rope_type_of, rotate_half,
                     rotate_pairs)


class RopeShifter(RotaryShifter):
    """Re-positions post-RoPE keys of one model (the RoPE rebase of RebaseKV and CacheBlend, METHODS.md §1.2).

    Parameters
    ----------
    model : nn.Module
        A transformers causal LM (its layout is then taken from the model check, which refuses models whose
        keys the shift does not reproduce), or its rotary module (then ``layout`` is trusted as given).
    layout : {"half", "interleaved"}, optional
        Rotation layout; default: the model check's finding for a model, "half" for a bare rotary module.

    Examples
    --------
    >>> shifter = RopeShifter(model)
    >>> keys_at_new_positions = shifter.shift(keys, delta)      # keys [B, H, T, D], delta int or [T] / [B, T]
    """

    def __init__(self, model: nn.Module, layout: str | None = None):
        if layout is None and not hasattr(model, "inv_freq"):  # a model: the layout its own forward uses
            layout = require(model, rope=True, who="RopeShifter").rope_layout
        super().__init__(model, layout)


def rope_shift(keys: torch.Tensor, delta: int | torch.Tensor, model: nn.Module) -> torch.Tensor:
    """One-shot form of :meth:`RopeShifter.shift`."""
    return RopeShifter(model).shift(keys, delta)
