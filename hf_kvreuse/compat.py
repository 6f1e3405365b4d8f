"""Differences between the transformers releases we support (5.17 to 5.2x).

transformers renamed the cache keyword of model forwards and ``prepare_inputs_for_generation`` from
``past_key_values`` to ``cache`` (5.2x; HF_API.md §0). Every forward the library issues itself goes through
:func:`cache_kwargs`, and every place that receives one reads it with :func:`pop_cache`.
"""

from __future__ import annotations

import inspect

from transformers import GenerationMixin

CACHE_KW = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"
CACHE_NAMES = ("cache", "past_key_values")


def cache_kwargs(cache) -> dict:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever this transformers release expects."""
    return {CACHE_KW: cache}


def find_cache(kwargs: dict):
    """The cache object among ``kwargs`` under either name (or None)."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def output_cache(output):
    """The cache of a ``generate`` / forward output: ``.cache`` on 5.2x, ``.past_key_values`` before."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)
