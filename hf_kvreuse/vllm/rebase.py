"""RoPE re-positioning of stored spans where no transformers model of full size is at hand (vLLM's worker).

The connector moves a stored span's keys with the library's own :class:`~hf_kvreuse.rope.RopeShifter`. Its
frequencies and rotation layout must be the model's, and neither is assumed: a two-layer model of the folder's
architecture and RoPE configuration (same head size, ``rope_theta`` / ``rope_scaling``; fewer layers, a small
vocabulary and MLP, random weights) is built with transformers, and :func:`hf_kvreuse.model_check.check_model`
probes its own forward at two positions to find the layout (or refuse the model: dynamic / LongRoPE variants,
absolute position terms). The rotary frequencies come from that model's rotary module, which computes them from
the same configuration as the full model's. That vLLM's implementation of the architecture rotates the same way as
transformers' is what ``tests_vllm`` checks end to end (a re-positioned span equals DirectReuseCache's K/V).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..rope import RopeShifter

_SHIFTERS: dict[str, RopeShifter] = {}


def shifter_for_folder(folder: str | os.PathLike) -> RopeShifter:
    """A :class:`RopeShifter` for the model in ``folder`` (its ``config.json``), checked on a small model of its
    architecture. Cached per folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    key = str(Path(folder).resolve())
    if key not in _SHIFTERS:
        config = AutoConfig.from_pretrained(folder)
        small = AutoConfig.from_pretrained(folder)
        small.num_hidden_layers = min(2, config.num_hidden_layers)
        if hasattr(small, "layer_types") and small.layer_types:
            small.layer_types = list(small.layer_types)[:small.num_hidden_layers]
        small.vocab_size = min(int(config.vocab_size), 512)
        if hasattr(small, "intermediate_size"):
            small.intermediate_size = 64
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tok = getattr(small, attr, None)
            if isinstance(tok, int) and tok >= small.vocab_size:
                setattr(small, attr, None)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(small, dtype=torch.float32, attn_implementation="sdpa").eval()
        if getattr(model.config, "head_dim", None) != getattr(config, "head_dim", None) and hasattr(config, "head_dim"):
            raise ValueError(f"{folder}: the probe model's head_dim differs from the model's")
        _SHIFTERS[key] = RopeShifter(model)  # check_model: layout and RoPE support, or UnsupportedRopeError
    return _SHIFTERS[key]


def shift_span(shifter: RopeShifter, k: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys ``[layers, kv_heads, T, head_dim]`` (every layer at once: layers act as the batch) moved by ``delta``."""
    if delta == 0:
        return k
    return shifter.shift(k, delta)
