"""A text-generation pipeline that reuses K/V across inputs: one shared context read by many questions or agents,
by method name (a :class:`~hf_kvreuse.ReuseSession`) or by cache factory.

**One context, many questions or agents** (the workload of this library; kvpress's ``pipe(context,
question=...)`` is the call kvpress users know)::

    pipe = pipeline("kvreuse-text-generation", model=model, tokenizer=tok, do_sample=False)   # greedy
    out = pipe(context, questions=["Who?", "When?"], max_new_tokens=32)       # method="auto" by default
    out["answers"], out["stats"]                                            # one SessionStats per answer
    pipe(context, question="Who?", agents={"critic": "You are a strict critic.", "writer": "You are a writer."})

Every prompt is the chat template of ``[system: the agent's role text] + [user: context, a blank line, the
question]`` (``user_template`` changes the user message). The prompts run one by one through the pipeline's
session for the method (``pipe.sessions[method]``), so the context's K/V computed for the first prompt serve every
later one: as an exact prefix when the prompts start alike (no agents, or the same agent again), re-positioned
from the held caches behind another agent's role text where the session's ``"auto"`` finds that verified drafts pay
(it is exact either way: ``stats.exact_output``; ``stats.reason`` says what it chose and why).

**One rule for the keys**: ``question=`` returns ``{"answer": ..., "stats": ...}`` and ``questions=`` returns
``{"answers": [...], "stats": [...]}``, with or without agents; with ``agents=`` each answer (and its stats) is a
dict by agent name (agents given as a mapping) or a list in agent order (a sequence of role texts). The context mode
runs its prompts one by one through the session: ``batch_size > 1`` is refused there.

**Chats**, as the stock ``text-generation`` pipeline takes them, with ``method=`` (one session per method and
pipeline, which keeps the caches of every earlier input) or ``cache_factory=`` (called with the model and the
pipeline's own prompt ids for every input, like kvpress's press-per-call pipeline)::

    pipe(messages, method="auto", max_new_tokens=64)                 # also "prefix", "optimistic", "blend", ...
    pipe(messages, method="blend", method_kwargs={"recompute_ratio": 0.3})
    pipe(messages, cache_factory=lambda model, ids: OptimisticCache(model, input_ids=ids, donor_cache=c,
                                                                    donor_ids=seq), max_new_tokens=64)

Every output record carries ``"stats"``: the input's own :class:`~hf_kvreuse.SessionStats` (``method=``) or its
cache's stats (``cache_factory=``). ``pipe.sessions`` exists from the start: ``pipe.sessions["auto"]`` is made on
first use, and assigning one (``pipe.sessions["auto"] = ReuseSession.load(folder, model)``) makes the pipeline
serve from it.

**Generation defaults** are the stock pipeline's: the model's ``generation_config``, and for what it leaves unset
the pipeline's own ``max_new_tokens=256, do_sample=True, temperature=0.7``. So answers are **sampled** unless
``do_sample=False`` is given (to the call, or once to ``pipeline(...)``). A list of inputs is served one by one
through the same session, so it gets the answers separate calls get. Batches of more than one prompt per forward
(``batch_size > 1``) are refused, as padding would change every position.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping, Sequence

from transformers import AutoModelForCausalLM
from transformers.pipelines import PIPELINE_REGISTRY, TextGenerationPipeline

from .compat import CACHE_KW

TASK = "kvreuse-text-generation"
DEFAULT_USER_TEMPLATE = "{context}\n\n{question}"


class _SessionModel:
    """The pipeline's model, with ``generate`` routed through a ReuseSession (everything else delegated)."""

    def __init__(self, model, session, agent: str | None = None):
        self._model, self._session, self._agent = model, session, agent
        self.stats = None  # this input's SessionStats

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        out = self._session.generate(input_ids, attention_mask=attention_mask, agent=self._agent, **kwargs)
        self.stats = self._session.last_stats
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


class Sessions(dict):
    """``pipe.sessions``: the pipeline's :class:`~hf_kvreuse.ReuseSession` per method, made on first use
    (``pipe.sessions["auto"]`` works before any call); a session assigned to a method name serves that method."""

    def __init__(self, pipe):
        super().__init__()
        self._pipe = pipe

    def __missing__(self, key: str):
        from .session import MODES

        if key not in MODES:
            raise KeyError(f"{key!r}: pipe.sessions makes sessions for the methods {sorted(MODES)}")
        return self._pipe.session(key)


class KVReuseTextGenerationPipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` plus a context mode, ``pipe(context, question=... | questions=[...],
    agents=...)``, and for chats ``method=`` (a ReuseSession per method) or ``cache_factory(model, input_ids) ->
    Cache``, called once per input (module docstring)."""

    def __init__(self, *args, **kwargs):
        self.sessions = Sessions(self)
        self._session_lock = threading.RLock()
        super().__init__(*args, **kwargs)

    def _sanitize_parameters(self, cache_factory: Callable | None = None, method: str | None = None,
                             method_kwargs: dict | None = None, agent: str | None = None, **kwargs):
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
            if agent is not None:
                forward["agent"] = agent
        elif method_kwargs:
            raise ValueError("method_kwargs= needs method=")
        return preprocess, forward, postprocess

    def session(self, method: str, method_kwargs: dict | None = None):
        """The pipeline's ReuseSession for ``method`` (made on first use; one per method and options)."""
        from .session import ReuseSession

        key = method if not method_kwargs else f"{method}:{sorted(method_kwargs.items())!r}"
        if method.split(":")[0] == "focus" and "tokenizer" not in (method_kwargs or {}):
            method_kwargs = {**(method_kwargs or {}), "tokenizer": self.tokenizer}  # the rows are found in words
        with self._session_lock:
            if key not in self.sessions:
                dict.__setitem__(self.sessions, key,
                                 ReuseSession.for_method(self.model, method, method_kwargs=method_kwargs))
            return dict.__getitem__(self.sessions, key)

    # -- one context, many questions or agents ---------------------------------------------------------------
    def __call__(self, text_inputs=None, *, context: str | None = None, question: str | None = None,
                 questions: Sequence[str] | None = None, agents: Mapping[str, str] | Sequence[str] | None = None,
                 **kwargs):
        if context is None and question is None and questions is None and agents is None:
            return super().__call__(text_inputs, **kwargs)
        if context is not None and text_inputs is not None:
            raise ValueError("give the context once: pipe(context, ...) or pipe(context=...)")
        return self.ask(context if context is not None else text_inputs, question=question, questions=questions,
                        agents=agents, **kwargs)

    def ask(self, context: str, question: str | None = None, questions: Sequence[str] | None = None,
            agents: Mapping[str, str] | Sequence[str] | None = None, method: str = "auto",
            method_kwargs: dict | None = None, user_template: str = DEFAULT_USER_TEMPLATE, **generate_kwargs):
        """Answer ``question`` (or each of ``questions``) about ``context``, as each of ``agents``, through one
        session, so the context's K/V are computed once and reused by every later prompt.

        Parameters
        ----------
        context : str
            The shared document.
        question, questions : str, or sequence of str
            One question, or several (give exactly one of the two).
        agents : mapping name -> role text, or sequence of role texts, optional
            Each question is asked by every agent in turn; the role text is the system message. Without agents
            the prompt has no system message (the chat template's default applies).
        method : str, default="auto"
            The session policy or named mode (:data:`hf_kvreuse.session.MODES`, e.g. ``"auto-commit"``).
        method_kwargs : dict, optional
            Options of the method's cache class (e.g. ``{"max_optimistic_tokens": 0}``).
        user_template : str
            The user message, formatted with ``context`` and ``question``.
        **generate_kwargs
            Passed to ``generate`` (``max_new_tokens``, ``do_sample``, ...), on top of the pipeline's defaults
            (module docstring: sampling unless ``do_sample=False``).

        Returns
        -------
        dict
            ``{"answer": ..., "stats": ...}`` for ``question=``; ``{"answers": [...], "stats": [...]}`` (one per
            question) for ``questions=``. Without agents an answer is a string and its stats a
            :class:`~hf_kvreuse.SessionStats`; with agents, each is a dict keyed by agent name (agents given as a
            mapping) or a list in agent order (a sequence).
        """
        if not isinstance(context, str):
            raise TypeError(f"context must be a string (the shared document), got {type(context).__name__}; for "
                            "chats call pipe(messages, method=...)")
        if (question is None) == (questions is None):
            raise ValueError("give exactly one of question= (a string) or questions= (a list of strings)")
        if "cache_factory" in generate_kwargs:
            raise ValueError("the context mode shares K/V through the pipeline's session: use method=, not "
                             "cache_factory=")
        batch = generate_kwargs.pop("batch_size", None) or getattr(self, "_batch_size", None) or 1
        if batch > 1:
            raise ValueError(f"batch_size={batch}: the context mode runs its prompts one by one through one session "
                             "(each prompt reuses the K/V of the ones before it; a padded batch would change every "
                             "position): call it with batch_size=1")
        qs = [question] if question is not None else list(questions)
        if not all(isinstance(q, str) for q in qs):
            raise TypeError("questions must be strings")
        named = isinstance(agents, Mapping)
        roles = list(agents.items()) if named else [(None, r) for r in (agents or [])]
        generate_kwargs.setdefault("return_full_text", False)
        answers, stats = [], []
        for q in qs:
            user = {"role": "user", "content": user_template.format(context=context, question=q)}
            per_a, per_s = [], []
            for i, (name, role) in enumerate(roles or [(None, None)]):
                chat = ([{"role": "system", "content": role}] if role is not None else []) + [user]
                agent = name if name is not None else (f"agent{i}" if roles else None)
                (rec,) = super().__call__(chat, method=method, method_kwargs=method_kwargs, agent=agent,
                                          **generate_kwargs)
                text = rec["generated_text"]
                per_a.append(text[-1]["content"] if isinstance(text, list) else text)
                per_s.append(rec["stats"])
            if roles:
                per_a = dict(zip(agents, per_a)) if named else per_a
                per_s = dict(zip(agents, per_s)) if named else per_s
            else:
                per_a, per_s = per_a[0], per_s[0]
            answers.append(per_a)
            stats.append(per_s)
        if question is not None:
            return {"answer": answers[0], "stats": stats[0]}
        return {"answers": answers, "stats": stats}

    # -- per input -------------------------------------------------------------------------------------------
    def _forward(self, model_inputs, cache_factory: Callable | None = None, method: str | None = None,
                 method_kwargs: dict | None = None, agent: str | None = None, **generate_kwargs):
        if method is not None:
            ids = model_inputs["input_ids"]
            if ids.shape[0] != 1:
                raise ValueError("method= serves one prompt per forward: call the pipeline with batch_size=1")
            model = self.model
            routed = _SessionModel(model, self.session(method, method_kwargs), agent)
            self.model = routed
            try:
                out = super()._forward(model_inputs, **generate_kwargs)
            finally:
                self.model = model
            out["kvreuse_stats"] = routed.stats
            return out
        if cache_factory is not None:
            ids = model_inputs["input_ids"]
            if ids.shape[0] != 1:
                raise ValueError("cache_factory builds one cache per prompt: call the pipeline with batch_size=1")
            cache = cache_factory(self.model, ids)
            generate_kwargs[CACHE_KW] = cache
            out = super()._forward(model_inputs, **generate_kwargs)
            out["kvreuse_stats"] = getattr(cache, "stats", None)
            return out
        return super()._forward(model_inputs, **generate_kwargs)

    def postprocess(self, model_outputs, *args, **kwargs):
        has = "kvreuse_stats" in model_outputs
        stats = model_outputs.pop("kvreuse_stats", None)
        records = super().postprocess(model_outputs, *args, **kwargs)
        if has:
            for r in records:
                r["stats"] = stats
        return records


def register() -> None:
    """Register the task (idempotent; done on ``import hf_kvreuse``)."""
    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=KVReuseTextGenerationPipeline,
                                            pt_model=AutoModelForCausalLM)
