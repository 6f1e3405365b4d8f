"""Timing and memory helpers shared by caches and benchmarks: wall clock with CUDA synchronisation, peak memory."""

from __future__ import annotations

import gc
import os
import threading
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


def floor_seconds(model, ids: torch.Tensor, exact_cache, new_tokens: int) -> float:
    """The TTFT floor of a reuse method: the forward of the last ``new_tokens`` prompt tokens on an exact cache of
    the tokens before them, done as prefill of all but the last one plus one decode step (synchronised).

    ``new_tokens`` counts as every stats object of the package does (``SessionStats.new_tokens``,
    ``OptimisticStats.new_tokens``): the prompt tokens computed before the first token, the last prompt token
    included (``generate`` always feeds it), so it is at least 1. ``exact_cache`` holds the exact K/V of at least
    ``ids[:, :-new_tokens]`` (it is copied, never modified)."""
    from .compat import cache_kwargs
    from .kv import dynamic_cache_from_kv, slice_kv

    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens}: the last prompt token is always computed (new_tokens >= 1)")
    covered = ids.shape[1] - 1
    start = covered - (new_tokens - 1)
    cache = dynamic_cache_from_kv([(k.clone(), v.clone()) for k, v in slice_kv(exact_cache, slice(0, start))],
                                  model.config)
    dev = ids.device
    with torch.no_grad():
        t0 = now(dev)
        if start < covered:
            model(ids[:, start:covered], position_ids=torch.arange(start, covered, device=dev)[None],
                  logits_to_keep=1, **cache_kwargs(cache))
        model(ids[:, covered:], position_ids=torch.tensor([[covered]], device=dev), logits_to_keep=1,
              **cache_kwargs(cache))
        return now(dev) - t0


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


# -- memory ------------------------------------------------------------------------------------------------------
def malloc_trim() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``); False where there is no glibc."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    return bool(_LIBC) and bool(_LIBC.malloc_trim(0))


_LIBC = None


def resident_bytes() -> int:
    """Resident memory of this process (``/proc/self/statm``; psutil elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):
    _PAGE = 4096


class PeakMemory:
    """Peak memory growth of a block of code above the level right before it (one helper for every benchmark).

    * CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the allocated bytes
      at entry (what tensors used; the caching allocator's reserve is not counted);
    * CPU: the process's resident memory, sampled every ``interval_s`` by a thread (background threads
      count too), minus the level at entry. ``malloc_trim`` runs first so that memory glibc kept from earlier
      work does not hide the growth.

    ``trace=True`` (CPU) also keeps every sample in ``timeline``, for plots and phase breakdowns.

    Usage::

        with PeakMemory(device) as mem:
            model.generate(...)
        mem.peak_bytes, mem.end_bytes     # peak growth during the block; growth still held at its end
    """

    def __init__(self, device: torch.device | str | None = "cpu", interval_s: float = 0.002, trim: bool = True,
                 trace: bool = False):
        self.device = torch.device(device if device is not None else "cpu")
        self.interval_s, self.trim, self.trace = interval_s, trim, trace
        self.timeline: list[tuple[float, int]] = []  # CPU with trace=True: (perf_counter, growth) per sample
        self.base_bytes = 0
        self.peak_bytes = 0
        self.end_bytes = 0
        self.samples = 0
        self._stop = None
        self._thread = None

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    def _sample(self) -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY) if os.path.exists("/proc/self/statm") else None
        peak = 0
        try:
            while True:
                if fd is not None:
                    rss = int(os.pread(fd, 128, 0).split()[1]) * _PAGE
                else:
                    rss = resident_bytes()
                peak = max(peak, rss)
                self.samples += 1
                if self.trace:
                    self.timeline.append((time.perf_counter(), rss - self.base_bytes))
                self._peak_rss = peak
                if self._stop.wait(self.interval_s):
                    break
        finally:
            if fd is not None:
                os.close(fd)

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_bytes = torch.cuda.memory_allocated(self.device)
            return self
        if self.trim:
            malloc_trim()
        self.base_bytes = resident_bytes()
        self._peak_rss = self.base_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="hf_kvreuse-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every stream: a background prefill counts too
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.base_bytes
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self.base_bytes
            return
        end = resident_bytes()
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self._peak_rss, end) - self.base_bytes
        self.end_bytes = end - self.base_bytes
