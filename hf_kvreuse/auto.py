"""How :class:`~hf_kvreuse.ReuseSession`'s default policy ``"auto"`` chooses, per call, between exact prefix reuse
(+ a prefill of the rest) and verified drafts, from what the session measured on its own calls.

Verified drafts (:class:`~hf_kvreuse.OptimisticCache`, ``rebase="verify"``) hand the caller nothing before the exact
prefill of the rows after the exact prefix is done: the same rows exact prefix reuse prefills before its first
token, now shared with the drafting on the same device. So their first token is never earlier than prefix reuse's
by construction, and whether the kept drafts win the end-to-end time back depends on the device, the thread count
and the load (measured on a 2-core CPU: from 0.6x to 1.8x of plain ``generate``'s first token). The chooser
therefore

* keys its measurements by device and thread count (a session moved to another thread count learns anew);
* learns the exact prefill's cost per token and the decode cost per token from the session's exact calls;
* measures every verified-draft call against what exact prefix reuse would have cost on the same call
  (``ratio = measured / predicted``, for the first token and end to end);
* tries verified drafts (at most ``explore_calls`` times per key) only where, even at a pessimistic ``prior``
  times prefix reuse's cost, the call is not slower than plain ``generate`` (the exact prefix is long enough);
* afterwards picks them only while the median measured ratios are <= 1 (first token and end to end);
* runs plain prefill instead of exact prefix reuse where the prefix is too short to pay: a prefill behind a held
  prefix attends through an explicit mask (not the causal kernel a fresh prefill uses), measured 3-10% slower per
  token on a 2-core CPU, so a prefix of a few tokens (a chat template's header) made the first token later than
  plain ``generate``'s. Before both kinds of exact call are measured a prefix must cover ``min_prefix_share`` of
  the prompt; afterwards the measured per-token costs decide.

Every choice comes with a reason (``SessionStats.reason``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch


@dataclass
class _Key:
    rates: list = field(default_factory=list)      # s per prefilled token (exact calls)
    full_rates: list = field(default_factory=list)    # the same, calls without a held prefix
    prefix_rates: list = field(default_factory=list)  # the same, calls behind a held exact prefix
    decode: list = field(default_factory=list)     # s per decoded token after the first (exact calls)
    ttft_ratio: list = field(default_factory=list)  # verified drafts' first token / prefix reuse's, predicted
    e2e_ratio: list = field(default_factory=list)


class AutoChooser:
    """Per-session measurements behind ``"auto"`` (module docstring).

    Parameters
    ----------
    prior : float, default=2.0
        Assumed ratio of a verified-draft call's time to exact prefix reuse's before any was measured (one core
        shared by drafting and the exact prefill costs about twice).
    explore_calls : int, default=2
        Verified-draft calls tried per device and thread count before the measured ratios decide alone.
    window : int, default=16
        Measurements kept per list (the latest).
    min_prefix_share : float, default=0.1
        Share of the prompt an exact prefix must cover for prefix reuse before its cost is measured.
    """

    def __init__(self, prior: float = 2.0, explore_calls: int = 2, window: int = 16, min_prefix_share: float = 0.1):
        self.prior, self.explore_calls, self.window = prior, explore_calls, window
        self.min_prefix_share = min_prefix_share
        self._keys: dict[tuple, _Key] = {}

    @staticmethod
    def key(device) -> tuple:
        device = torch.device(device)
        return (device.type, device.index, torch.get_num_threads() if device.type == "cpu" else None)

    def _k(self, device) -> _Key:
        return self._keys.setdefault(self.key(device), _Key())

    def _push(self, values: list, x: float) -> None:
        values.append(float(x))
        del values[:-self.window]

    def record_exact(self, device, new_tokens: int, ttft_s, total_s, generated: int, past: int = 0) -> None:
        """An exact prefill of ``new_tokens`` rows (``full`` / ``prefix``, behind ``past`` held rows) took ``ttft_s``
        to the first token."""
        k = self._k(device)
        if ttft_s and new_tokens > 0:
            self._push(k.rates, ttft_s / new_tokens)
            self._push(k.prefix_rates if past else k.full_rates, ttft_s / new_tokens)
        if total_s and ttft_s is not None and generated > 1:
            self._push(k.decode, (total_s - ttft_s) / (generated - 1))

    def predict_prefix(self, device, new_tokens: int, generated: int) -> tuple[float, float] | None:
        """(first token, end to end) of exact prefix reuse prefilling ``new_tokens`` rows, or None (unmeasured)."""
        k = self._k(device)
        if not k.rates:
            return None
        ttft = statistics.median(k.rates) * new_tokens
        return ttft, ttft + (statistics.median(k.decode) if k.decode else 0.0) * max(generated - 1, 0)

    def record_drafts(self, device, new_tokens: int, ttft_s, total_s, generated: int) -> None:
        """A verified-draft call whose exact prefill covered ``new_tokens`` rows: its times against prefix reuse's
        prediction for the same rows."""
        pred = self.predict_prefix(device, new_tokens, generated)
        if pred is None or not ttft_s or not total_s:
            return
        k = self._k(device)
        self._push(k.ttft_ratio, ttft_s / pred[0])
        self._push(k.e2e_ratio, total_s / pred[1])

    def choose(self, device, prompt_tokens: int, new_tokens: int) -> tuple[bool, str]:
        """(draft?, reason) for a call whose exact prefix leaves ``new_tokens`` rows to prefill."""
        k = self._k(device)
        key = self.key(device)
        where = f"cpu with {key[2]} threads" if key[0] == "cpu" else str(torch.device(device))
        if not k.rates:
            return False, f"nothing measured yet on {where}: exact prefix reuse"
        if len(k.ttft_ratio) < self.explore_calls:
            # a try is allowed only where even a pessimistic verified-draft call is no slower than plain generate
            if self.prior * new_tokens <= prompt_tokens:
                return True, (f"trying verified drafts on {where} ({len(k.ttft_ratio) + 1} of {self.explore_calls}): "
                              f"even at {self.prior:g}x exact prefix reuse's cost they are no slower than plain "
                              "generate here")
            return False, (f"verified drafts not measured on {where} and the exact prefix is too short to try them "
                           "without risk of being slower than plain generate: exact prefix reuse")
        t, e = statistics.median(k.ttft_ratio), statistics.median(k.e2e_ratio)
        if t <= 1.0 and e <= 1.0:
            return True, (f"measured on {where}: verified drafts' first token {t:.2f}x and end to end {e:.2f}x of "
                          "exact prefix reuse")
        return False, (f"measured on {where}: verified drafts' first token {t:.2f}x and end to end {e:.2f}x of exact "
                       "prefix reuse: exact prefix reuse")

    def prefix_pays(self, device, prompt_tokens: int, prefix_tokens: int) -> tuple[bool, str]:
        """(reuse the exact prefix?, reason) for a call whose held exact prefix covers ``prefix_tokens`` of its
        ``prompt_tokens``: False where plain prefill of the whole prompt is measured (or, unmeasured, expected) to
        give the first token sooner."""
        if prefix_tokens <= 0:
            return False, "no exact prefix held"
        k = self._k(device)
        if k.full_rates and k.prefix_rates:
            full = statistics.median(k.full_rates) * prompt_tokens
            behind = statistics.median(k.prefix_rates) * (prompt_tokens - prefix_tokens)
            if behind < full:
                return True, f"exact prefix of {prefix_tokens} tokens: measured {behind:.3f} s vs {full:.3f} s plain"
            return False, (f"exact prefix of {prefix_tokens} of {prompt_tokens} tokens: plain prefill measured sooner "
                           f"({full:.3f} s vs {behind:.3f} s)")
        if prefix_tokens >= self.min_prefix_share * prompt_tokens:
            return True, f"exact prefix of {prefix_tokens} of {prompt_tokens} tokens"
        return False, (f"exact prefix of {prefix_tokens} of {prompt_tokens} tokens is under "
                       f"{self.min_prefix_share:.0%} of the prompt: plain prefill")
