"""A text-generation pipeline that builds a fresh hf_kvreuse cache for every input.

The stock ``text-generation`` pipeline forwards ``cache=`` to ``generate``, but hands the *same* cache object
to every input of a call (HF_API.md §5.1), and the cache must be built from ids the caller tokenized
separately. ``kvreuse-text-generation`` takes a factory instead, called with the model and the pipeline's own
prompt ids, like kvpress's press-per-call pipeline:

    pipe = pipeline("kvreuse-text-generation", model=model, tokenizer=tok)
    pipe(messages, cache_factory=lambda model, ids: OptimisticCache(model, input_ids=ids, donor_cache=c,
                                                                    donor_ids=seq), max_new_tokens=64)

Everything else (chat templates, ``return_full_text``, batching of the call) is the stock pipeline's.
"""

from __future__ import annotations

from typing import Callable

from transformers import AutoModelForCausalLM
from transformers.pipelines import PIPELINE_REGISTRY, TextGenerationPipeline

from .compat import CACHE_KW

TASK = "kvreuse-text-generation"


class KVReuseTextGenerationPipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` plus ``cache_factory(model, input_ids) -> Cache``, called once per input."""

    def _sanitize_parameters(self, cache_factory: Callable | None = None, **kwargs):
        preprocess, forward, postprocess = super()._sanitize_parameters(**kwargs)
        if cache_factory is not None:
            if not callable(cache_factory):
                raise TypeError("cache_factory must be a callable (model, input_ids) -> Cache")
            forward["cache_factory"] = cache_factory
        return preprocess, forward, postprocess

    def _forward(self, model_inputs, cache_factory: Callable | None = None, **generate_kwargs):
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
