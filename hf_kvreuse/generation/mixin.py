"""The generation mixin: lets hf_kvreuse caches prepare, swap and finish inside stock ``model.generate``.

:func:`enable` swaps the model's class for a subclass with :class:`KVReuseGenerationMixin` first in its MRO
(same class name, so ``save_pretrained`` still records the original architecture). The mixin only acts when
the cache passed to ``generate`` (``cache=`` or the older ``past_key_values=``) is a :class:`KVReuseCache`:

* ``generate`` entry: validate the call (batch 1, no padding, no beams, the ids the cache was built for) and let
  the cache assemble itself, so assembly cost is inside time-to-first-token;
* before every forward (``prepare_inputs_for_generation``): the cache may change how many trailing tokens are
  fed, which is how an exact cache is swapped in with a replay of the tokens generated so far;
* every forward carrying the cache runs through ``cache.forward`` (e.g. to add a batch row);
* after every forward (``_update_model_kwargs_for_generation``): the cache sees the outputs (timing, divergence);
* ``generate`` exit, normal or not: the cache finishes (joins its background work, raises its errors).
"""

from __future__ import annotations

from transformers import GenerationMixin

from ..cache_classes.base import KVReuseCache
from ..compat import CACHE_KW, find_cache, prepare_inputs

_ENABLED: dict[type, type] = {}


def _find_cache(kwargs: dict) -> KVReuseCache | None:
    cache = find_cache(kwargs)
    return cache if isinstance(cache, KVReuseCache) else None


class KVReuseGenerationMixin(GenerationMixin):
    def generate(self, inputs=None, *args, **kwargs):
        cache = _find_cache(kwargs)
        if cache is None:
            return super().generate(inputs, *args, **kwargs)
        # either keyword works on every supported release (and spares users a deprecation warning)
        other = "past_key_values" if CACHE_KW == "cache" else "cache"
        if other in kwargs:
            kwargs[CACHE_KW] = kwargs.pop(other)
        input_ids = kwargs.get("input_ids", inputs)
        error, out = None, None
        try:
            cache.prepare(self, input_ids, kwargs)
            out = super().generate(inputs, *args, **kwargs)
            return out
        except BaseException as e:
            error = e
            raise
        finally:
            sequences = getattr(out, "sequences", out) if out is not None else None
            finish_error = None
            try:
                cache.finish(sequences, error)
            except BaseException as e:  # noqa: BLE001
                finish_error = e
            if finish_error is not None and error is None:
                raise finish_error

    def __call__(self, *args, **kwargs):
        # __call__, not forward: generate validates model kwargs against forward's signature
        cache = _find_cache(kwargs)
        if cache is None or args:
            return super().__call__(*args, **kwargs)
        return cache.forward(super().__call__, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, **kwargs):
        extra = {}
        cache = find_cache(kwargs)
        if isinstance(cache, KVReuseCache):
            next_sequence_length, extra = cache.before_forward(input_ids, next_sequence_length)
        inputs = prepare_inputs(super().prepare_inputs_for_generation, input_ids, next_sequence_length, kwargs)
        inputs.update(extra)
        return inputs

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        cache = find_cache(model_kwargs)
        if isinstance(cache, KVReuseCache):
            cache.after_forward(outputs)
        return super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)


def _generation_target(model):
    """The module whose ``generate`` runs: a peft ``PeftModel`` delegates to its underlying causal LM."""
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        return model.get_base_model()
    return model


def enable(model):
    """Mix :class:`KVReuseGenerationMixin` into ``model`` (in place, idempotent) and return ``model``.

    Plain ``generate`` calls are unaffected; only hf_kvreuse caches use the hooks.
    """
    target = _generation_target(model)
    cls = type(target)
    if issubclass(cls, KVReuseGenerationMixin):
        return model
    if not isinstance(target, GenerationMixin):
        raise TypeError(f"{cls.__name__} cannot generate: hf_kvreuse needs a causal LM (e.g. AutoModelForCausalLM)")
    new_cls = _ENABLED.get(cls)
    if new_cls is None:
        # same __name__/__qualname__: save_pretrained writes config.architectures from the class name
        new_cls = type(cls.__name__, (KVReuseGenerationMixin, cls), {"__qualname__": cls.__qualname__,
                                                                      "__module__": cls.__module__})
        _ENABLED[cls] = new_cls
    target.__class__ = new_cls
    return model


def disable(model):
    """Undo :func:`enable`."""
    target = _generation_target(model)
    cls = type(target)
    if issubclass(cls, KVReuseGenerationMixin):
        target.__class__ = next(c for c in cls.__mro__[1:] if not issubclass(c, KVReuseGenerationMixin))
    return model


def is_enabled(model) -> bool:
    return isinstance(_generation_target(model), KVReuseGenerationMixin)
