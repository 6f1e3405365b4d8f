"""Timing helpers shared by caches and benchmarks: wall clock with CUDA synchronisation."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (a no-op on CPU) so that wall-clock readings mean something."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def now(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` after a device synchronisation."""
    synchronize(device)
    return time.perf_counter()


@contextmanager
def timed(out: dict, key: str, device: torch.device | str | None = None):
    """``with timed(stats, "prefill_s"): ...`` adds the synchronised wall time of the block to ``stats[key]``."""
    t0 = now(device)
    try:
        yield
    finally:
        out[key] = out.get(key, 0.0) + now(device) - t0


class TokenTimer:
    """A ``generate`` streamer that timestamps every generated token (method-agnostic TTFT / end-to-end).

    Use ``timer.start()`` right before ``model.generate(..., streamer=timer)``; then ``timer.ttft_s`` is the time
    to the first generated token and ``timer.total_s`` the time to the last one.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.t0: float | None = None
        self.stamps: list[float] = []
        self._prompt_seen = False

    def start(self) -> "TokenTimer":
        self.t0, self.stamps, self._prompt_seen = now(self.device), [], False
        return self

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.stamps.append(now(self.device))

    def end(self) -> None:
        pass

    @property
    def ttft_s(self) -> float:
        return self.stamps[0] - self.t0

    @property
    def total_s(self) -> float:
        return self.stamps[-1] - self.t0


@dataclass
class Samples:
    """Repeated measurements of one quantity."""

    values: list[float] = field(default_factory=list)

    def add(self, v: float) -> None:
        self.values.append(float(v))

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def summary(self) -> dict:
        v = self.values
        return {"median": self.median, "min": min(v), "max": max(v), "n": len(v)}
