"""The generation mixin: lets hf_kvreuse caches prepare, swap and finish inside stock ``model.generate``.

:func:`enable` swaps the model's class for a subclass with :class:`KVReuseGenerationMixin` first in its MRO
(same class name, so ``save_pretrained`` still records the original architecture). The mixin only acts when
the cache passed to ``generate`` (``cache=`` or the older ``past_key_values=``) is a :class:`KVReuseCache`
(checked through its marker base :class:`~hf_kvreuse.generation.protocol.ReuseCacheHooks`: this package never
imports the cache classes):

* ``generate`` entry: validate the call (batch 1, no padding, no beams, the ids the cache was built for) and let
  the cache assemble itself, so assembly cost is inside time-to-first-token;
* before every forward (``prepare_inputs_for_generation``): the cache may change how many trailing tokens are
  fed, which is how an exact cache is swapped in with a replay of the tokens generated so far;
* every forward carrying the cache runs through ``cache.forward`` (e.g. to add a batch row);
* after every forward (``_update_model_kwargs_for_generation``): the cache sees the outputs (timing, divergence);
* ``generate`` exit, normal or not: the cache finishes (joins its background work, raises its errors).

**The one-expression form.** ``model.generate(ids, cache=OptimisticCache(model, ...))`` looks ``model.generate`` up
*before* the cache's constructor enables the model, so the stock ``generate`` would run and ignore the cache.
:func:`install_routing` (called on ``import hf_kvreuse``) therefore wraps ``transformers.GenerationMixin.generate``:
a call that carries an hf_kvreuse cache on a model that is not enabled enables it (as the cache's constructor
would) and runs the mixin's ``generate``; every other call goes straight to transformers' own. As a second line
of defence, a cache whose hooks never ran refuses its first ``update``
(:meth:`hf_kvreuse.KVReuseCache.update`), so a model class that overrides ``generate`` itself fails loudly
instead of silently running plain prefill.

After its first ``generate`` a cache is an ordinary ``DynamicCache`` holding exact-from-here K/V of the prompt and
the answer: passing it to the next ``generate`` (the next turn of a chat) runs transformers' own path, after the
cache is cropped to the longest common prefix of the tokens it holds and the new ids.
Arguments are bound to ``generate``'s signature first, so a positional ``generation_config`` is validated too.
"""

from __future__ import annotations

import contextvars
import copyreg
import functools
import inspect

import torch
from transformers import GenerationMixin

from ..compat import CACHE_KW, CACHE_NAMES, find_cache, output_cache, prepare_inputs
from ..devices import input_device
from ..fingerprint import tag_producer
from ..inputs import unpack_generate_inputs
from .protocol import ReuseCacheHooks

_ENABLED: dict[type, type] = {}
#: set while the mixin runs transformers' own generate (its ``super().generate``): the routing wrapper of
#: :func:`install_routing` then steps aside
_IN_MIXIN: contextvars.ContextVar = contextvars.ContextVar("hf_kvreuse_in_mixin", default=False)
#: the hf_kvreuse cache whose first generate runs in this context (its hooks see generate's own parts)
_RUNNING: contextvars.ContextVar = contextvars.ContextVar("hf_kvreuse_running_cache", default=None)


def _find_cache(kwargs: dict) -> ReuseCacheHooks | None:
    cache = find_cache(kwargs)
    return cache if isinstance(cache, ReuseCacheHooks) else None


def _bind_generate(model, inputs, args: tuple, kwargs: dict) -> dict:
    """All arguments of a ``generate`` call as keywords (a positional ``generation_config`` included)."""
    sig = inspect.signature(GenerationMixin.generate)
    try:
        bound = sig.bind(model, inputs, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"generate(): {e}") from None
    out = {}
    for name, value in bound.arguments.items():
        param = sig.parameters[name]
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"generate() got {len(value)} unexpected positional arguments")
        elif name != "self":
            out[name] = value
    return out


def _bind_method(fn, self, args: tuple, kwargs: dict) -> dict:
    """``fn(self, *args, **kwargs)``'s arguments by name (transformers releases pass them positionally or not)."""
    try:
        bound = inspect.signature(fn).bind(self, *args, **kwargs)
    except TypeError:
        return dict(kwargs)
    return dict(bound.arguments)


def _one_cache_keyword(kwargs: dict) -> None:
    """Move the cache to the keyword this release expects; refuse two different caches."""
    given = {n: kwargs[n] for n in CACHE_NAMES if kwargs.get(n) is not None}
    if len({id(c) for c in given.values()}) > 1:
        raise ValueError("generate() got two different caches (cache= and past_key_values=); pass one")
    for n in CACHE_NAMES:
        kwargs.pop(n, None)
    if given:
        kwargs[CACHE_KW] = next(iter(given.values()))


_FORWARD_POSITIONALS: dict[type, list[str]] = {}


def _forward_positionals(model) -> list[str]:
    cls = type(model)
    names = _FORWARD_POSITIONALS.get(cls)
    if names is None:
        params = inspect.signature(model.forward).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        _FORWARD_POSITIONALS[cls] = names
    return names


class KVReuseGenerationMixin(GenerationMixin):
    def generate(self, inputs=None, *args, **kwargs):
        if not args and _find_cache(kwargs) is None:
            return self._plain_generate(inputs=inputs, **kwargs)
        kwargs = _bind_generate(self, inputs, args, kwargs)
        unpack_generate_inputs(kwargs)  # generate(enc, cache=...) with a tokenizer's BatchEncoding
        # either keyword works on every supported release (and spares users a deprecation warning)
        _one_cache_keyword(kwargs)
        cache = _find_cache(kwargs)
        if cache is None:
            return self._plain_generate(**kwargs)
        _to_input_device(self, kwargs)
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            input_ids = kwargs.get("inputs")
        if cache.phase == "done" and not cache.multi_turn:
            return self._continue_generate(cache, input_ids, kwargs)
        error, out = None, None
        try:
            cache.prepare(self, input_ids, kwargs)
            token = _RUNNING.set(cache)
            try:
                out = cache.drive(self, kwargs)
            finally:
                _RUNNING.reset(token)
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
            cache.end_generate(sequences, error or finish_error)
            if error is None and finish_error is None:
                tag_producer(cache, self)
            if finish_error is not None and error is None:
                raise finish_error

    def _continue_generate(self, cache: ReuseCacheHooks, input_ids, kwargs: dict):
        """A later turn on a cache whose first generate finished: transformers' own DynamicCache path."""
        cache.begin_continuation(self, input_ids, kwargs)
        out = None
        try:
            out = self._stock_generate(**kwargs)
            tag_producer(cache, self)
            return out
        finally:
            cache.end_continuation(getattr(out, "sequences", out) if out is not None else None,
                                   None if out is not None else RuntimeError("generate failed"))

    def _plain_generate(self, **kwargs):
        """A generate without an hf_kvreuse cache: transformers' own, the returned (or given) cache tagged with its
        producer, so it is recognised as this model's own when it later serves as a donor."""
        out = self._stock_generate(**kwargs)
        tag_producer(find_cache(kwargs) or output_cache(out), self)
        return out

    def _stock_generate(self, **kwargs):
        """transformers' own ``generate`` (past the routing wrapper of :func:`install_routing`)."""
        token = _IN_MIXIN.set(True)
        try:
            return super().generate(**kwargs)
        finally:
            _IN_MIXIN.reset(token)

    def __call__(self, *args, **kwargs):
        # __call__, not forward: generate validates model kwargs against forward's signature
        if args:
            names = _forward_positionals(self)
            if len(args) > len(names):
                return super().__call__(*args, **kwargs)
            for name, value in zip(names, args):
                if name in kwargs:
                    raise TypeError(f"{type(self).__name__}() got multiple values for argument {name!r}")
                kwargs[name] = value
        cache = _find_cache(kwargs)
        if cache is None or (cache.phase != "active" and not cache.multi_turn):
            return super().__call__(**kwargs)
        return cache.forward(super().__call__, **kwargs)

    def _get_logits_processor(self, *args, **kwargs):
        # the processors (and warpers) generate applies to every step's logits: a cache that compares its own
        # logits with generate's choices (divergence counts, draft verification) must apply the same ones; a
        # continuing generate of the same call reuses the first one's (built for the original prompt length)
        bound = _bind_method(GenerationMixin._get_logits_processor, self, args, kwargs)
        cache = find_cache(bound.get("model_kwargs") or {})
        active = isinstance(cache, ReuseCacheHooks) and cache.phase == "active"
        if active and cache.continuing_parts() is not None:
            return cache.continuing_parts()[0]
        processors = super()._get_logits_processor(*args, **kwargs)
        if active:
            cache.set_logits_processor(processors, bound.get("generation_config"))
        return processors

    def _get_stopping_criteria(self, *args, **kwargs):
        # the cache of this thread's running generate (a cache that drives several generates of one call sees
        # the stopping rules built for the original prompt, and the continuing one reuses them)
        cache = _RUNNING.get()
        if cache is not None and cache.continuing_parts() is not None:
            return cache.continuing_parts()[1]
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        if cache is not None:
            cache.set_stopping_criteria(criteria)
        return criteria

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, **kwargs):
        extra = {}
        cache = find_cache(kwargs)
        if isinstance(cache, ReuseCacheHooks) and cache.phase == "active":
            next_sequence_length, extra = cache.before_forward(input_ids, next_sequence_length)
        inputs = prepare_inputs(super().prepare_inputs_for_generation, input_ids, next_sequence_length, kwargs)
        inputs.update(extra)
        return inputs

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        cache = find_cache(model_kwargs)
        if isinstance(cache, ReuseCacheHooks) and cache.phase == "active":
            cache.after_forward(outputs)
        return super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)

    def __reduce_ex__(self, protocol):
        # the enabled class is made at run time and cannot be found by name: pickle (and deepcopy) the model as
        # its plain class and enable it again when it is loaded
        state = self.__getstate__() if hasattr(self, "__getstate__") else self.__dict__
        return _new_enabled, (_plain_class(type(self)),), state


def _plain_class(cls: type) -> type:
    return next(c for c in cls.__mro__ if not issubclass(c, KVReuseGenerationMixin))


def _enabled_class(cls: type) -> type:
    new_cls = _ENABLED.get(cls)
    if new_cls is None:
        # same __name__/__qualname__: save_pretrained writes config.architectures from the class name
        new_cls = type(cls.__name__, (KVReuseGenerationMixin, cls), {"__qualname__": cls.__qualname__,
                                                                      "__module__": cls.__module__})
        _ENABLED[cls] = new_cls
    return new_cls


def _new_enabled(cls: type):
    """Unpickling: an empty instance of the enabled subclass of ``cls`` (its state is set by pickle)."""
    obj = copyreg.__newobj__(cls, cls)
    obj.__class__ = _enabled_class(cls)
    return obj


def _generation_target(model):
    """The module whose ``generate`` runs: a peft ``PeftModel`` delegates to its underlying causal LM."""
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        return model.get_base_model()
    return model


def _to_input_device(model, kwargs: dict) -> None:
    """Move the prompt (and its mask) to the model's input device, where the cache keeps its own copy of the ids.

    transformers accepts ids on another device (CPU ids, CUDA model): it keeps the growing sequence there and moves
    only each forward's inputs. The caches' own forwards, position ids and logits processors read that sequence, so
    on a GPU they would mix devices; moving it once here keeps every tensor of the call on one device (the returned
    sequences are then on the model's device, as for ids passed there)."""
    device = input_device(model)
    for key in ("input_ids", "inputs", "attention_mask"):
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.device != device:
            kwargs[key] = t.to(device)


def enable(model):
    """Mix :class:`KVReuseGenerationMixin` into ``model`` (in place, idempotent) and return ``model``.

    Plain ``generate`` calls are unaffected; only hf_kvreuse caches use the hooks. An enabled model pickles
    and deep-copies; the copy comes back enabled.
    """
    target = _generation_target(model)
    cls = type(target)
    if issubclass(cls, KVReuseGenerationMixin):
        return model
    if not isinstance(target, GenerationMixin):
        raise TypeError(f"{cls.__name__} cannot generate: hf_kvreuse needs a causal LM (e.g. AutoModelForCausalLM)")
    target.__class__ = _enabled_class(cls)
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


_STOCK_GENERATE = None


def install_routing() -> None:
    """Wrap ``transformers.GenerationMixin.generate`` (once; idempotent) so that a ``generate`` call carrying an
    hf_kvreuse cache on a model that was never :func:`enable`-d runs through the mixin (module docstring)."""
    global _STOCK_GENERATE
    current = GenerationMixin.generate
    if getattr(current, "_hf_kvreuse_routing", False):
        return
    _STOCK_GENERATE = stock = current

    @functools.wraps(stock)
    def generate(self, *args, **kwargs):
        # an hf_kvreuse cache reached transformers' generate without the mixin: ``model.generate`` was looked up
        # before the cache's constructor enabled the model (or the model never was)
        if not _IN_MIXIN.get() and _find_cache(kwargs) is not None:
            enable(self)  # in place (idempotent): the class is now the enabled subclass
            return KVReuseGenerationMixin.generate(self, *args, **kwargs)
        return stock(self, *args, **kwargs)

    generate._hf_kvreuse_routing = True
    GenerationMixin.generate = generate


def uninstall_routing() -> None:
    """Undo :func:`install_routing` (tests use it to check the second line of defence)."""
    global _STOCK_GENERATE
    if _STOCK_GENERATE is not None:
        GenerationMixin.generate = _STOCK_GENERATE
        _STOCK_GENERATE = None
