"""Exact prefill off the critical path: a worker thread on CPU, side CUDA streams (driven by a thread) on GPU: one
on every device the model's layers use, so a ``device_map`` split overlaps on each of them.

The job prefills ``input_ids`` into a fresh ``DynamicCache`` and reports readiness without blocking the
decode loop. Pitfalls handled (HF_API.md §2.3): grad mode, inference mode and autocast are thread-local, so
the worker re-enters the caller's state (:class:`ThreadState`: grad / inference mode, autocast enabled and dtype
per device type; the default dtype is process-wide) and computes exactly what a full prefill in the caller
would; on GPU the work is queued on a side stream that first waits for the main stream, readiness is an
event polled with ``query()``, and the consumer waits on that event and calls ``record_stream`` on every tensor
it takes over, so the caching allocator does not recycle them early. An exception in the worker is kept and
re-raised in the caller by :meth:`result` / :meth:`raise_if_failed`. ``torch.set_num_threads`` is per thread,
so on CPU the worker sets its own intra-op thread count, and raises it between chunks once the foreground
stops decoding and waits (:meth:`boost`): otherwise a core would idle while the caller blocks.
``torch.set_num_threads`` also sets the count that threads created later start with, so every change goes
through :class:`ThreadBudget`, which puts the caller's count back when the last concurrent job ends.

Concurrency: several ``generate`` calls with hf_kvreuse caches may run at once in different Python threads (each
with its own cache); they give the tokens they would give one after the other. On CPU they share the process's
thread budget (a worker started while ``k`` jobs run gets ``1/k`` of it). One cache object serves one call at a
time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..compat import cache_kwargs
from ..devices import layer_devices
from ..kv import KV, kv_of, load_kv
from ..sliding import keep_history, take_history


@dataclass(frozen=True)
class ThreadState:
    """The thread-local torch state a computation depends on, captured in one thread and entered in another."""

    grad: bool
    inference: bool
    autocast: tuple  # ((device_type, enabled, dtype), ...)
    autocast_cache: bool

    @classmethod
    def capture(cls) -> "ThreadState":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        return cls(grad=torch.is_grad_enabled(), inference=torch.is_inference_mode_enabled(),
                   autocast=tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices),
                   autocast_cache=torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def enter(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            yield


class ThreadBudget:
    """Process-wide bookkeeping of intra-op CPU threads while background prefills run.

    The first job to start records the process's thread count (the ``baseline``); when the last running job
    ends, the count is set back to it, for the releasing thread and for threads created later alike.
    """

    _lock = threading.Lock()
    _active = 0
    _baseline: int | None = None

    @classmethod
    def acquire(cls) -> tuple[int, int]:
        """Register a job; return ``(baseline threads, jobs now running)``."""
        with cls._lock:
            if cls._active == 0:
                cls._baseline = torch.get_num_threads()
            cls._active += 1
            return cls._baseline, cls._active

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._active -= 1
            baseline = cls._baseline
            if cls._active == 0:
                cls._baseline = None
        torch.set_num_threads(baseline)

    @classmethod
    def running(cls) -> int:
        return cls._active


_SIDE_STREAMS: dict = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream of ``device``, made once and shared by every job.

    A new stream per job would leak: torch gives each (cuBLAS handle, stream) pair its own workspace (32 MiB on
    Hopper) and keeps it until the process ends, so memory grew by 32 MiB a call on an H200
    (``tests/test_gpu.py::test_no_leaks_over_twenty_calls``). Jobs sharing the stream are ordered on it, which
    stays correct: each first waits for its caller's stream and records its own event.
    """
    with _SIDE_STREAMS_LOCK:
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
        return stream


class BackgroundPrefill:
    """Prefill ``input_ids`` in the background (all of it, or what follows a given exact prefix).

    Parameters
    ----------
    model : PreTrainedModel
    input_ids : LongTensor ``[1, T]``
        Tokens to prefill at positions ``0..T-1``.
    prefix_kv : list of (K, V), optional
        The exact K/V of ``input_ids[:, :P]`` (e.g. rows of an earlier call's cache that shares this prefix):
        the job starts from them and computes only positions ``P..T-1``. They are read, never modified.
    chunk_tokens : int, optional
        Prefill in chunks of this many tokens (cancellation is checked between chunks). Default: one forward.
    cpu_threads : int, default=1
        Intra-op threads of the worker on CPU while the foreground also computes.
    max_threads : int, optional
        Threads the worker may use once the foreground waits for it (default: the caller's thread count).
    synchronous : bool, default=False
        Run in the caller's thread at :meth:`start` (used when nothing should overlap).
    windows : list of (int or None), optional
        Each layer's sliding window (:func:`hf_kvreuse.sliding.layer_windows`): the sliding layers also keep every
        row on the side (``prefix_kv`` then holds every row of those layers too), and :meth:`result` gives every
        row of every layer.
    start_cache : transformers Cache, optional
        Models with recurrent-state layers (:mod:`hf_kvreuse.hybrid`): a cache of the model's own layer kinds
        standing for the first tokens of ``input_ids`` (empty: none), which the job owns and fills;
        :meth:`result` then returns that cache whole (its states cannot be given as K/V). Not with ``prefix_kv``.
    snapshot_every : int, default=0
        With ``start_cache``: keep a copy of the recurrent-state layers at multiples of this many tokens
        (``snapshots``: ``{tokens: {layer index: copy}}``), the points where a later call can start from or draft
        with them; the prefill runs in one forward per point. 0: none.
    snapshot_last : int or None, default=None
        Only the last this many of those points (:func:`hf_kvreuse.hybrid.copy_points`); None: every one.
    """

    def __init__(self, model, input_ids: torch.Tensor, chunk_tokens: int | None = None, cpu_threads: int = 1,
                 max_threads: int | None = None, synchronous: bool = False, prefix_kv: KV | None = None,
                 windows: list | None = None, start_cache=None, snapshot_every: int = 0,
                 snapshot_last: int | None = None):
        from ..hybrid import attention_rows, state_indices

        self.model, self.input_ids = model, input_ids
        self.windows = windows if windows and any(windows) else None
        self.prefix_kv = prefix_kv
        self.prefix_len = prefix_kv[0][0].shape[-2] if prefix_kv else 0
        self.start_cache, self.snapshot_every, self.snapshots = start_cache, int(snapshot_every), {}
        self.snapshot_last = snapshot_last
        self._states = None
        if start_cache is not None:
            if prefix_kv or self.windows is not None:
                raise ValueError("start_cache replaces prefix_kv and windows")
            self._states = state_indices(start_cache)
            if self._states is None:
                raise ValueError("start_cache must hold K/V layers and recurrent-state layers only")
            self.prefix_len = attention_rows(start_cache, self._states)
        if self.prefix_len > input_ids.shape[1] or (self.prefix_len == input_ids.shape[1] and input_ids.shape[1]
                                                    and start_cache is None):
            raise ValueError(f"prefix_kv covers {self.prefix_len} tokens of a {input_ids.shape[1]}-token prefill")
        self.chunk_tokens, self.cpu_threads, self.synchronous = chunk_tokens, cpu_threads, synchronous
        self.max_threads = max_threads or torch.get_num_threads()
        self._threads_wanted = cpu_threads
        self.device = input_ids.device
        self.on_cuda = self.device.type == "cuda"
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cache: DynamicCache | None = None
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._events: dict = {}
        self._streams: dict = {}
        self.elapsed_s: float | None = None
        self.started = False
        self.state = ThreadState.capture()  # built in the caller's thread: the worker computes as the caller would

    # -- worker --------------------------------------------------------------------------------------------
    def _prefill(self) -> DynamicCache:
        if self.start_cache is not None:
            return self._prefill_states()
        cache = DynamicCache(config=self.model.config)
        if self.prefix_kv:
            # DynamicCache appends by concatenation: the caller's prefix tensors are never written
            load_kv(cache, list(self.prefix_kv))
        if self.windows is not None and not keep_history(cache, self.windows, self.prefix_kv):
            raise ValueError("prefix_kv must hold every row of every layer to keep the sliding layers' history")
        ids = self.input_ids
        p = self.prefix_len
        step = self.chunk_tokens or (ids.shape[1] - p)
        threads = None
        for s in range(p, ids.shape[1], step):
            if self._cancel.is_set():
                raise _Cancelled()
            if not self.on_cuda and not self.synchronous and threads != self._threads_wanted:
                threads = self._threads_wanted
                torch.set_num_threads(threads)
            e = min(s + step, ids.shape[1])
            pos = torch.arange(s, e, device=ids.device)[None]
            self.model(input_ids=ids[:, s:e], position_ids=pos, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        return cache

    def _prefill_states(self):
        """A recurrent-state model: fill ``start_cache`` in chunks (ending at the snapshot points), copying the
        state layers at each point."""
        from ..hybrid import copy_points, copy_states

        cache, ids = self.start_cache, self.input_ids
        s, end = self.prefix_len, ids.shape[1]
        points = copy_points(s, end, self.snapshot_every, self.snapshot_last)
        threads = None
        while s < end:
            if self._cancel.is_set():
                raise _Cancelled()
            if not self.on_cuda and not self.synchronous and threads != self._threads_wanted:
                threads = self._threads_wanted
                torch.set_num_threads(threads)
            e = min([p for p in points if p > s] + [end])
            if self.chunk_tokens:
                e = min(e, s + self.chunk_tokens)
            pos = torch.arange(s, e, device=ids.device)[None]
            self.model(input_ids=ids[:, s:e], position_ids=pos, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
            if e in points:
                self.snapshots[e] = copy_states(cache, self._states)
            s = e
        return cache

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            with self.state.enter(), torch.no_grad():
                if self.on_cuda:
                    with contextlib.ExitStack() as stack:  # the side stream of every device the layers use
                        for stream in self._streams.values():
                            stack.enter_context(torch.cuda.stream(stream))
                        self._cache = self._prefill()
                        for d, stream in self._streams.items():
                            self._events[d].record(stream)
                    for stream in self._streams.values():
                        stream.synchronize()  # this thread only: elapsed_s then covers the GPU work
                else:
                    self._cache = self._prefill()
        except _Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - every failure must reach the caller of generate
            self._error = e
        finally:
            self.elapsed_s = time.perf_counter() - t0
            self._done.set()

    # -- control -------------------------------------------------------------------------------------------
    def start(self) -> "BackgroundPrefill":
        if self.started:
            return self
        self.started = True
        if self.on_cuda:
            # one side stream per CUDA device the model's layers run on (a device_map split uses several); each
            # first waits for the caller's stream there: the prompt and the weights were produced on it
            devices = {self.device} | {d for d in layer_devices(self.model) if d.type == "cuda"}
            self._streams = {d: _side_stream(d) for d in devices}
            self._events = {d: torch.cuda.Event(enable_timing=False) for d in devices}
            for d, stream in self._streams.items():
                stream.wait_stream(torch.cuda.current_stream(d))
        if self.synchronous:
            self._run()
        else:
            self._thread = threading.Thread(target=self._run, name="hf_kvreuse-prefill", daemon=True)
            self._thread.start()
        return self

    def ready(self) -> bool:
        """True when the exact cache can be taken without waiting (never blocks)."""
        if not self._done.is_set():
            return False
        if self.on_cuda and self._error is None and self._cache is not None:
            return all(e.query() for e in self._events.values())
        return True

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None

    def raise_if_failed(self) -> None:
        if self.failed:
            raise RuntimeError("background exact prefill failed") from self._error

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def boost(self) -> None:
        """Let the worker use ``max_threads`` from its next chunk on (the caller has stopped computing)."""
        self._threads_wanted = self.max_threads

    def result(self) -> KV:
        """Wait for the job and return the exact KV, ready for use on the caller's current stream."""
        if not self.started:
            self.start()
        self.boost()
        self.join()
        self.raise_if_failed()
        if self._cache is None:
            raise RuntimeError("background exact prefill was cancelled")
        if self.start_cache is not None:  # the whole cache: recurrent states are not K/V
            if self.on_cuda:
                for d, event in self._events.items():
                    torch.cuda.current_stream(d).wait_event(event)
            return self._cache
        kv = kv_of(self._cache)
        if self.windows is not None:  # every row of every layer (the sliding layers' from their history)
            kv = take_history(self._cache, self.windows, self.input_ids.shape[1])
            if kv is None:
                raise RuntimeError("the background prefill's sliding layers lost their history")
        if self.on_cuda:
            for d, event in self._events.items():
                torch.cuda.current_stream(d).wait_event(event)
            for k, v in kv:  # tensors allocated on a side stream are now used on their device's current stream
                for t in (k, v):
                    if t.device.type == "cuda":
                        t.record_stream(torch.cuda.current_stream(t.device))
        return kv

    def cancel(self) -> None:
        """Stop at the next chunk boundary and wait for the worker to exit (errors are dropped)."""
        self._cancel.set()
        self.join()
        if self.on_cuda:
            for stream in self._streams.values():
                stream.synchronize()


class _Cancelled(Exception):
    pass
