"""Timing helpers shared by caches and benchmarks: wall clock with CUDA synchronisation."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the work queued on the *current* CUDA stream of ``device`` (a no-op on CPU).

    Only the caller's stream: a device-wide ``torch.cuda.synchronize()`` would also wait for a background
    prefill on a side stream and so destroy the overlap it measures.
    """
    if not torch.cuda.is_available():
        return
    if device is None:
        torch.cuda.current_stream().synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.current_stream(torch.device(device)).synchronize()


def now(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` after a device synchronisation."""
    synchronize(device)
    return time.perf_counter()


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
