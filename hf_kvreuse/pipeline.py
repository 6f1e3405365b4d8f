"""A text-generation pipeline that reuses K/V across inputs: by method name (a ReuseSession) or by cache factory.

The stock ``text-generation`` pipeline forwards ``cache=`` to ``generate``, but hands the *same* cache object
to every input of a call (HF_API.md §5.1), and the cache must be built from ids the caller tokenized
separately. ``kvreuse-text-generation`` takes a factory instead, called with the model and the pipeline's own
prompt ids, like kvpress's press-per-call pipeline:

    pipe = pipeline("kvreuse-text-generation", model=model, tokenizer=tok)
    pipe(messages, cache_factory=lambda model, ids: OptimisticCache(model, input_ids=ids, donor_cache=c,
                                                                    donor_ids=seq), max_new_tokens=64)

or, simpler, a method name, backed by one :class:`~hf_kvreuse.ReuseSession` per method and pipeline, which
keeps the caches of every earlier input of the pipeline and reuses them (exact prefixes, donor spans)::

    pipe(messages, method="auto", max_new_tokens=64)                 # also "prefix", "optimistic", "blend", ...
    pipe(messages, method="blend", method_kwargs={"recompute_ratio": 0.3})
    pipe.sessions["auto"].last_stats                                   # what the last input reused

A list of inputs is served one by one through the same session, so it gets the answers separate calls get.
Everything else (chat templates, ``return_full_text``) is the stock pipeline's; batches of more than one prompt
per forward (``batch_size > 1``) are refused, as padding would change every position.
"""

from __future__ import annotations

import threading

from typing import Callable

from transformers import AutoModelForCausalLM
from transformers.pipelines import PIPELINE_REGISTRY, TextGenerationPipeline

from .compat import CACHE_KW

TASK = "kvreuse-text-generation"


class _SessionModel:
    """The pipeline's model, with ``generate`` routed through a ReuseSession (everything else delegated)."""

    def __init__(self, model, session):
        self._model, self._session = model, session

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        return self._session.generate(input_ids, attention_mask=attention_mask, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


class KVReuseTextGenerationPipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` plus ``method=`` (a ReuseSession per method) or ``cache_factory(model,
    input_ids) -> Cache``, called once per input."""

    def _sanitize_parameters(self, cache_factory: Callable | None = None, method: str | None = None,
                             method_kwargs: dict | None = None, **kwargs):
        preprocess, forward, postprocess = super()._sanitize_parameters(**kwargs)
        if cache_factory is not None and method is not None:
            raise ValueError("give either method= or cache_factory=, not both")
        if cache_factory is not None:
            if not callable(cache_factory):
                raise TypeError("cache_factory must be a callable (model, input_ids) -> Cache")
            forward["cache_factory"] = cache_factory
        if method is not None:
            from .session import MODES

            if method not in MODES:
                raise ValueError(f"method={method!r}: choose one of {sorted(MODES)}")
            forward["method"] = method
            forward["method_kwargs"] = dict(method_kwargs or {})
        elif method_kwargs:
            raise ValueError("method_kwargs= needs method=")
        return preprocess, forward, postprocess

    def session(self, method: str, method_kwargs: dict | None = None):
        """The pipeline's ReuseSession for ``method`` (made on first use; one per method and options)."""
        from .session import ReuseSession

        if not hasattr(self, "sessions"):
            self.sessions, self._session_lock = {}, threading.Lock()
        key = method if not method_kwargs else f"{method}:{sorted(method_kwargs.items())!r}"
        with self._session_lock:
            if key not in self.sessions:
                self.sessions[key] = ReuseSession.for_method(self.model, method, method_kwargs=method_kwargs)
            return self.sessions[key]

    def _forward(self, model_inputs, cache_factory: Callable | None = None, method: str | None = None,
                 method_kwargs: dict | None = None, **generate_kwargs):
        if method is not None:
            ids = model_inputs["input_ids"]
            if ids.shape[0] != 1:
                raise ValueError("method= serves one prompt per forward: call the pipeline with batch_size=1")
            model = self.model
            self.model = _SessionModel(model, self.session(method, method_kwargs))
            try:
                return super()._forward(model_inputs, **generate_kwargs)
            finally:
                self.model = model
        if cache_factory is not None:
            ids = model_inputs["input_ids"]
            if ids.shape[0] != 1:
                raise ValueError("cache_factory builds one cache per prompt: call the pipeline with batch_size=1")
            generate_kwargs[CACHE_KW] = cache_factory(self.model, ids)
        return super()._forward(model_inputs, **generate_kwargs)


def register() -> None:
    """Register the task (idempotent; done on ``import hf_kvreuse``)."""
    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=KVReuseTextGenerationPipeline,
                                            pt_model=AutoModelForCausalLM)
