"""What a ``generate`` call will do, read from its keywords and the model's generation config, in one place.

Caches refuse the options they cannot serve (:meth:`hf_kvreuse.KVReuseCache.check_call`) and
:class:`~hf_kvreuse.ReuseSession` routes calls by them (beam search or several returned sequences keep only the
exact-prefix path; ``use_cache=False`` runs plain ``generate``), so both read the same effective config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

#: the decoding modes whose tokens an hf_kvreuse cache produces step by step (one sequence, one token a step)
STEPWISE_MODES = ("greedy_search", "sample")


@dataclass(frozen=True)
class CallOptions:
    """The effective options of one ``generate`` call."""

    config: object          # the GenerationConfig generate will use (the model's, updated by the call's keywords)
    mode: str               # GenerationMode value: "greedy_search", "sample", "beam_search", "assisted_generation", ...
    use_cache: bool
    sequences: int          # sequences generate runs per prompt (num_beams x num_return_sequences for beams)

    @property
    def stepwise(self) -> bool:
        """One sequence decoded one token a step (what every hf_kvreuse cache supports)."""
        return self.mode in STEPWISE_MODES and self.sequences == 1


def call_options(model, generate_kwargs: dict) -> CallOptions:
    """The :class:`CallOptions` of ``model.generate(**generate_kwargs)`` (nothing is modified)."""
    cfg = copy.deepcopy(generate_kwargs.get("generation_config") or model.generation_config)
    cfg.update(**{k: v for k, v in generate_kwargs.items() if hasattr(cfg, k)})
    mode = str(getattr(cfg.get_generation_mode(generate_kwargs.get("assistant_model")), "value", ""))
    beams = int(getattr(cfg, "num_beams", 1) or 1)
    ret = int(getattr(cfg, "num_return_sequences", 1) or 1)
    use_cache = generate_kwargs.get("use_cache", getattr(cfg, "use_cache", True))
    return CallOptions(config=cfg, mode=mode, use_cache=bool(True if use_cache is None else use_cache),
                       sequences=max(beams, ret))


#: the decoding modes that run over a held exact prefix as they run over their own prefill (the cache generate is
#: handed is its cache: one row per sequence, repeated for beams); assisted generation (``assistant_model``,
#: ``prompt_lookup_num_tokens``, ``use_mtp``), contrastive search, DoLa and constrained / group beam search are
#: not among them (assisted generation crops and re-feeds the cache it is handed and its tokens differed)
PREFIX_MODES = STEPWISE_MODES + ("beam_search", "beam_sample")

#: options with which ``generate`` returns something of every prompt token (the forward of the whole prompt):
#: a held prefix is not recomputed, so only plain ``generate`` returns them as it does
WHOLE_PROMPT_OUTPUTS = ("output_hidden_states", "output_attentions")


def plain_only_call(options: CallOptions, generate_kwargs: dict) -> str | None:
    """Why no held K/V may serve this call (it runs as plain ``generate``, with no cache of the caller's or a
    session's), naming the option; None when the exact prefix path serves it. The one list of the generate options
    and model configs a reuse method cannot honour: a session's ``"auto"`` steps down to plain ``generate`` on it
    (the reason in ``last_stats.reason``) and an explicitly requested reuse policy refuses with it."""
    cfg = options.config
    impl = getattr(cfg, "cache_implementation", None)
    if impl is not None:
        return (f"cache_implementation={impl!r} (generate builds a cache of that kind itself and takes no other; "
                "set on the call or in the model's generation_config)")
    for key in WHOLE_PROMPT_OUTPUTS:
        if getattr(cfg, key, False):
            return (f"{key}=True (generate returns it for every prompt token, and held rows are not recomputed)")
    if generate_kwargs.get("custom_generate") is not None:
        return "custom_generate (a decoding loop the library does not know)"
    if options.mode not in PREFIX_MODES:
        return (f"{options.mode or 'an unknown'} decoding (assistant_model, prompt_lookup_num_tokens, penalty_alpha, "
                "dola_layers, constraints or num_beam_groups: it does not run over a held cache as over its own)")
    return None


#: transformers' logits processors / warpers and stopping criteria that are pure functions of ``(input_ids,
#: scores)``: applying one again to a replayed row gives what it gave the first time and changes nothing for the
#: next call (audited on transformers 4.57.1, 5.0, 5.17 and 5.24: their ``__call__`` only caches device copies of
#: constructor arguments or bias tables built from them). Not in it, because they keep state across calls: the
#: classifier-free-guidance processors (``guidance_scale``: their own model calls and cache), SynthID
#: watermarking (a per-call context state), Whisper's no-speech detection, Dia's EOS delay pattern, Bark's and
#: MusicGen's codebook processors; and every processor or criterion defined outside transformers (unknown).
STATELESS_STEPS = frozenset({
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "TemperatureLogitsWarper",
    "RepetitionPenaltyLogitsProcessor", "TopPLogitsWarper", "TopKLogitsWarper", "TopHLogitsWarper",
    "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
    "NoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor",
    "PrefixConstrainedLogitsProcessor", "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty", "LogitNormalization",
    "SuppressTokensAtBeginLogitsProcessor", "SuppressTokensLogitsProcessor", "WatermarkLogitsProcessor",
    "MaxLengthCriteria", "MaxNewTokensCriteria", "MaxTimeCriteria", "StopStringCriteria", "EosTokenCriteria",
    "ConfidenceCriteria",
})


def _is_stateless(step) -> bool:
    cls = type(step)
    return (cls.__name__ in STATELESS_STEPS and cls.__module__.startswith("transformers.")) or bool(
        getattr(step, "hf_kvreuse_stateless", False))


def stateful_steps(steps) -> list[str]:
    """Class names of the logits processors / stopping criteria in ``steps`` that are not known to be pure functions
    of their inputs (:data:`STATELESS_STEPS`): a cache that replays rows through them (draft verification,
    divergence counts) would call them more than once per emitted token and change what they do next. A
    processor of your own that is such a pure function may say so with the attribute
    ``hf_kvreuse_stateless = True``."""
    return [type(s).__name__ for s in (steps or []) if not _is_stateless(s)]


def replay_unsafe_call(options: CallOptions, generate_kwargs: dict) -> str | None:
    """Why a call's logits processors or stopping criteria must run exactly once per emitted token (so drafts
    cannot be verified by replay), predicted before ``generate`` builds them; None when nothing in the call keeps
    state."""
    cfg = options.config
    scale = getattr(cfg, "guidance_scale", None)
    if scale is not None and scale != 1:
        return f"guidance_scale={scale} (classifier-free guidance runs its own model calls and keeps their cache)"
    if getattr(cfg, "watermarking_config", None) is not None:
        return "watermarking_config (a watermarking processor may keep state across steps)"
    names = stateful_steps(generate_kwargs.get("logits_processor")) + stateful_steps(
        generate_kwargs.get("stopping_criteria"))
    if names:
        return f"{', '.join(names)} (not known to be a pure function of the ids and scores)"
    return None
