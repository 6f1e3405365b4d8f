"""Differences between the transformers releases we support (4.57.1 and every 5.x up to 5.24; docs: Tested
versions). Everything that depends on the release lives here; the rest of the package calls these helpers.

* the cache keyword of model forwards, ``generate`` and ``prepare_inputs_for_generation``: ``past_key_values``
  before 5.24, ``cache`` from 5.24 (HF_API.md §0). Every forward the library issues itself goes through
  :func:`cache_kwargs`, and every place that receives one reads it with :func:`find_cache`;
* the output field: ``.past_key_values`` / ``.cache`` (:func:`output_cache`);
* how ``generate`` tells ``prepare_inputs_for_generation`` which trailing tokens to feed: the
  ``next_sequence_length`` argument from 5.3, a ``cache_position`` tensor before 5.6 (both in 5.3 to 5.5;
  :func:`prepare_inputs`);
* mask sizing: the causal mask's query offset is ``cache_position[0]`` up to 5.5 and ``get_seq_length()`` in
  5.6 to 5.16 (both the *logical* length), ``Cache.get_query_offset()`` (the physical one) from 5.17. They
  agree while ``KVReuseCache.logical_offset`` is 0, which every cache keeps today; a cache with a non-zero
  offset raises an error naming 5.17 on older releases (:func:`check_mask_geometry`);
* cache layers: ``DynamicCache(config=...)`` builds one ``DynamicLayer`` per decoder layer on every supported
  release; ``lazy_initialization`` takes the keys only on 4.x, keys and values on 5.x (:func:`init_layer`);
* peft: 0.17 works with transformers 4.57 only (it imports ``HybridCache``, gone in 5.0); 5.x needs peft 0.18+
  (:func:`import_peft` says so instead of an ImportError from inside peft);
* configs: RoPE scaling is ``rope_parameters`` (with ``rope_theta`` inside) on 5.x, ``rope_scaling`` plus a
  separate ``rope_theta`` on 4.x (:func:`config_kwargs`).
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import Cache, GenerationMixin

TRANSFORMERS_VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
MIN_TRANSFORMERS = "4.57.1"

_PREPARE_PARAMS = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
CACHE_KW = "cache" if "cache" in _PREPARE_PARAMS else "past_key_values"
CACHE_NAMES = ("cache", "past_key_values")
#: 5.3+: generate passes ``next_sequence_length`` (tokens to feed); before, a ``cache_position`` tensor
HAS_NEXT_SEQUENCE_LENGTH = "next_sequence_length" in _PREPARE_PARAMS
#: before 5.6: generate passes ``cache_position`` (the positions of the tokens to feed)
HAS_CACHE_POSITION = "cache_position" in _PREPARE_PARAMS
#: 5.17+: the causal mask asks the cache for the query offset (``Cache.get_query_offset``)
HAS_QUERY_OFFSET = hasattr(Cache, "get_query_offset")


MIN_PEFT_FOR_TRANSFORMERS_5 = "0.18.0"


def import_peft():
    """``import peft``, or an ImportError that names the peft release this transformers release needs."""
    try:
        import peft
    except ImportError as e:
        if TRANSFORMERS_VERSION >= (5, 0) and "HybridCache" in str(e):
            from importlib.metadata import version

            raise ImportError(f"peft {version('peft')} does not work with transformers {transformers.__version__}: "
                              f"transformers 5.x needs peft>={MIN_PEFT_FOR_TRANSFORMERS_5} "
                              f"(pip install -U 'peft>={MIN_PEFT_FOR_TRANSFORMERS_5}')") from e
        raise
    return peft


def init_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Lazily initialise an empty cache layer for ``keys`` / ``values`` (dtype, device, shapes)."""
    if getattr(layer, "is_initialized", False):
        return
    if len(inspect.signature(layer.lazy_initialization).parameters) >= 2:
        layer.lazy_initialization(keys, values)
    else:  # 4.x: keys only
        layer.lazy_initialization(keys)


def config_kwargs(overrides: dict) -> dict:
    """Model-config keyword arguments written for 5.x, translated for this release.

    ``rope_parameters={"rope_type": ..., "rope_theta": ..., ...}`` becomes ``rope_scaling`` (without the theta)
    plus ``rope_theta`` on 4.x; 4.x longrope reads ``original_max_position_embeddings`` from the config itself.
    """
    if TRANSFORMERS_VERSION >= (5, 0) or "rope_parameters" not in overrides:
        return dict(overrides)
    out = dict(overrides)
    params = dict(out.pop("rope_parameters") or {})
    if "rope_theta" in params:
        out["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        out["rope_scaling"] = params
    if params.get("rope_type") == "longrope" and "original_max_position_embeddings" in params:
        out.setdefault("original_max_position_embeddings", params["original_max_position_embeddings"])
    return out


def check_mask_geometry(cache) -> None:
    """Refuse a cache whose logical length differs from its physical one where the mask cannot be told (< 5.17)."""
    offset = getattr(cache, "logical_offset", 0)
    if offset and not HAS_QUERY_OFFSET:
        raise NotImplementedError(
            f"{type(cache).__name__} stands for {offset} tokens that have no K/V entries (logical_offset); sizing "
            f"the causal mask for it needs transformers>=5.17 (Cache.get_query_offset), this is "
            f"{transformers.__version__}")


def prepare_inputs(prepare, input_ids: torch.Tensor, next_sequence_length: int | None, kwargs: dict) -> dict:
    """Call ``GenerationMixin.prepare_inputs_for_generation`` (``prepare``, bound) so that it feeds the last
    ``next_sequence_length`` tokens of ``input_ids`` (None: what ``generate`` chose), on every release.

    Releases before 5.6 also take a ``cache_position`` tensor (the absolute positions of the fed tokens; before
    5.3 it alone selects them): when the feed differs from what ``generate`` planned (a replay), it is rebuilt.
    ``generate`` keeps its own copy and advances it from the last position, so the next step continues correctly.
    """
    check_mask_geometry(find_cache(kwargs))
    if next_sequence_length is not None and HAS_CACHE_POSITION:
        planned = kwargs.get("cache_position")
        if planned is None or planned.shape[0] != next_sequence_length:
            n = input_ids.shape[1]
            kwargs = dict(kwargs, cache_position=torch.arange(n - next_sequence_length, n, device=input_ids.device))
    if HAS_NEXT_SEQUENCE_LENGTH:
        return prepare(input_ids, next_sequence_length=next_sequence_length, **kwargs)
    return prepare(input_ids, **kwargs)


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


def set_output_cache(output, cache) -> None:
    """Put ``cache`` into a model output under the field this release names it (``cache`` on 5.2x, where writing
    ``past_key_values`` warns, ``past_key_values`` before)."""
    fields = getattr(output, "__dataclass_fields__", {})
    output["cache" if "cache" in fields else "past_key_values"] = cache


def register_attention_wrapper(name: str, base_name: str, wrap) -> str:
    """Register (once) ``wrap(base_fn)`` as transformers attention implementation ``name``, where ``base_fn`` is the
    attention function of ``base_name`` ("sdpa" or "eager"), with ``base_name``'s mask builder; return ``name``.

    The library's attention wrappers (BaseLRCache's low-rank values, partial recompute's selected rows) are
    selected through ``config._attn_implementation`` and fall back to ``base_fn`` outside their calls."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        if base_name == "eager":
            from transformers.models.llama.modeling_llama import eager_attention_forward as base_fn
        else:
            base_fn = ALL_ATTENTION_FUNCTIONS._global_mapping[base_name]
        AttentionInterface.register(name, wrap(base_fn))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[base_name])
    return name
