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
