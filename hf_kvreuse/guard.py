"""The online guard of the ``"fast"`` policy: per agent, how often committed drafts left full prefill's answer.

``ReuseSession(policy="fast")`` streams optimistic tokens from re-positioned K/V of other calls
(:class:`~hf_kvreuse.OptimisticCache` with ``rebase="commit"`` and a confidence gate). Such tokens can differ
from what full prefill would have produced, but the session learns *how often* for free: once the exact cache
arrives (the swap), the cache counts the optimistic tokens that full prefill would have chosen differently
(``divergent_tokens``), and a verified call (``rebase="verify"``) tells, from its draft margins and its first
withdrawn draft, whether a gated commit would have emitted a wrong token. The guard keeps that record per key (the
agent's name: one step of a workflow) and chooses, per call:

* ``"commit"`` (fast, approximate) while the key's recent calls were clean: at most ``max_unclean`` of the last
  ``window`` calls emitted a token full prefill would not have;
* ``"verify"`` (exact answer; the first verified token waits for the exact prefill) once the record is worse, for
  at least ``cooldown`` calls, during which the verified drafts keep measuring what a commit would have done; the
  key returns to ``"commit"`` when its window is clean again.

This is the online guard of speculative decoding's "acceptance-rate" controllers applied to reuse: the gate stops
the uncertain first tokens (most wrong drafts are the first token: research notes, "Verified drafts, the
confidence gate and repair on Qwen"), the guard stops agents whose drafts are confidently wrong.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GuardConfig:
    """Hyperparameters of :class:`DivergenceGuard` (validated on construction).

    gate: the commit mode's confidence gate (top-1 minus top-2 probability below it: that step's token comes from
    the exact cache). window / max_unclean: a key runs ``"commit"`` while at most ``max_unclean`` of its last
    ``window`` recorded calls were unclean. cooldown: calls a key stays on ``"verify"`` once it tripped."""

    gate: float = 0.5
    window: int = 8
    max_unclean: int = 1
    cooldown: int = 4

    def __post_init__(self):
        if not 0.0 <= self.gate <= 1.0:
            raise ValueError(f"GuardConfig.gate must be a probability margin in [0, 1], got {self.gate}")
        if self.window < 1:
            raise ValueError(f"GuardConfig.window must be >= 1, got {self.window}")
        if not 0 <= self.max_unclean < self.window:
            raise ValueError(f"GuardConfig.max_unclean must be in [0, window), got {self.max_unclean} "
                             f"(window {self.window})")
        if self.cooldown < 0:
            raise ValueError(f"GuardConfig.cooldown must be >= 0, got {self.cooldown}")


def unclean_under_gate(cache_stats: dict, gate: float) -> bool | None:
    """Whether a call's optimistic tokens, under ``rebase="commit"`` with ``gate``, included one that full prefill
    would not have produced. None: the call says nothing about it (no drafts, or an exact method).

    A commit call (``rebase == "commit"``): its own count, ``divergent_tokens > 0`` (clean when the gate fired at
    its first token: it emitted none). A verified call: replay the
    gate on its drafts: the first withdrawn draft (index ``accepted_tokens`` when ``rejected_tokens``) is unclean
    when no step before it or at it had a margin below ``gate`` (``draft_margins``)."""
    rebase = cache_stats.get("rebase")
    if rebase == "commit":
        div = cache_stats.get("divergent_tokens")
        if div is None:  # no optimistic token emitted (the gate fired at the first one): nothing left full prefill
            return False if cache_stats.get("optimistic_tokens") == 0 and cache_stats.get("gated_step") == 0 else None
        return div > 0
    if rebase != "verify":
        return None
    accepted = cache_stats.get("accepted_tokens")
    rejected = cache_stats.get("rejected_tokens")
    if accepted is None or rejected is None or accepted + rejected == 0:
        return None
    if not rejected:
        return False
    margins = cache_stats.get("draft_margins") or []
    gated = next((i for i, m in enumerate(margins) if m < gate), None)
    return gated is None or gated > accepted


@dataclass
class _Record:
    outcomes: deque = field(default_factory=deque)
    cooldown: int = 0   # calls left on "verify"
    calls: int = 0
    unclean: int = 0


class DivergenceGuard:
    """Per-key record of committed drafts that left full prefill's tokens, and the mode it allows next.

    Thread-safe (one lock around every record). ``decide(key)`` returns ``("commit" | "verify", reason)``;
    ``record(key, cache_stats)`` takes an :class:`~hf_kvreuse.cache_classes.optimistic.OptimisticStats`'s
    ``as_dict()`` after the call."""

    def __init__(self, config: GuardConfig | None = None):
        self.config = config or GuardConfig()
        self._records: dict[str, _Record] = {}
        self._lock = threading.Lock()

    def decide(self, key: str | None) -> tuple[str, str]:
        key = "" if key is None else str(key)
        c = self.config
        with self._lock:
            r = self._records.get(key)
            if r is None or not r.outcomes:
                return "commit", f"fast: no record of agent {key!r} yet: gated commit (gate {c.gate})"
            bad = sum(r.outcomes)
            if r.cooldown > 0 or bad > c.max_unclean:
                return "verify", (f"fast: the drafts of agent {key!r} left full prefill's tokens in {bad} of its "
                                  f"last {len(r.outcomes)} calls (limit {c.max_unclean}"
                                  f"{', cooling down' if r.cooldown else ''}): verified drafts (exact)")
            return "commit", (f"fast: the drafts of agent {key!r} were clean in {len(r.outcomes) - bad} of its last "
                              f"{len(r.outcomes)} calls: gated commit (gate {c.gate})")

    def record(self, key: str | None, cache_stats: dict | None) -> bool | None:
        """Add one call's outcome (see :func:`unclean_under_gate`); returns it (None: nothing recorded)."""
        if not cache_stats:
            return None
        outcome = unclean_under_gate(cache_stats, self.config.gate)
        if outcome is None:
            return None
        key = "" if key is None else str(key)
        c = self.config
        with self._lock:
            r = self._records.setdefault(key, _Record())
            r.outcomes.append(bool(outcome))
            while len(r.outcomes) > c.window:
                r.outcomes.popleft()
            r.calls += 1
            r.unclean += bool(outcome)
            if r.cooldown > 0:
                r.cooldown -= 1
            elif sum(r.outcomes) > c.max_unclean:
                r.cooldown = c.cooldown
        return outcome

    def summary(self) -> dict[str, dict]:
        """Per key: calls recorded, unclean calls, the recent window and the mode it allows now."""
        with self._lock:
            keys = list(self._records)
        out = {}
        for k in keys:
            mode, _ = self.decide(k)
            with self._lock:
                r = self._records[k]
                out[k] = dict(calls=r.calls, unclean=r.unclean, recent=list(r.outcomes), mode=mode)
        return out

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
