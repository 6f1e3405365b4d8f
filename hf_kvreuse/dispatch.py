"""Measured choice between a kernel's Triton and torch paths (``HF_KVREUSE_KERNELS=auto``).

As ``torch.backends.cudnn.benchmark`` and Triton's autotuner do, the first call of a kernel for one
(device name, dtype, shape bucket) runs every candidate path on scratch copies of its arguments: the torch
reference first, then each other path, which must equal the reference within :data:`TOLERANCE` (a path that
raises or differs is never chosen, and the reason is kept); each path is warmed up, then timed over a few
synchronised repetitions; the fastest median wins, torch on a tie. The choice is kept in memory and in a JSON
file (one per environment: GPU name, driver, torch, triton and library versions; a file written under another
environment, or that fails verification, is ignored and rewritten), and the caches report the choices they ran
with in ``stats.kernels``. ``HF_KVREUSE_KERNELS=torch`` or ``triton`` freezes the choice (nothing is measured).

The shape bucket rounds every size up to a power of two, so a workload of varying lengths measures a handful of
times, not on every new length.

The choices file lives in ``HF_KVREUSE_KERNEL_CACHE`` (a folder; default ``~/.cache/hf_kvreuse/kernels``); its
name is derived from the environment, it is read only when it is a regular file inside that folder (no link
leading out), no larger than :data:`MAX_FILE_BYTES`, and every entry is checked (known kernel name form, a known
backend, finite timings); anything else is ignored. Writes are atomic (temporary file, then rename).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

CACHE_ENV = "HF_KVREUSE_KERNEL_CACHE"
FORMAT = 1
MAX_FILE_BYTES = 4 << 20
BACKENDS = ("torch", "triton")
#: a path's name: a backend, optionally with a tile variant of the Triton kernel (``"triton:bm16"``)
PATH_NAME = re.compile(r"^(torch|triton)(:[a-z0-9]{1,16})?$")

#: result equality against the torch reference, per result dtype (the GPU kernel tests' tolerances)
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3),
             torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def bucket(*sizes: int) -> tuple[int, ...]:
    """Each size rounded up to a power of two (0 and 1 stay)."""
    return tuple(int(s) if s <= 1 else 1 << (int(s) - 1).bit_length() for s in sizes)


def environment(device: torch.device) -> dict:
    """What a measured choice depends on besides the kernel and shape: device name, driver, torch, triton and
    library versions."""
    from .version import __version__ as lib_version

    env = dict(device=str(torch.device(device).type), torch=torch.__version__, library=lib_version)
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if torch.device(device).type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)
        env["driver"] = str(get_driver()) if get_driver else None
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = "cpu"
        env["driver"] = None
    return env


def _equal(got, want) -> str | None:
    """``None`` when ``got`` equals ``want`` within :data:`TOLERANCE`, else why not."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    if len(got) != len(want):
        return f"{len(got)} results, the torch reference gives {len(want)}"
    for g, w in zip(got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"result {tuple(g.shape)} {g.dtype}, the torch reference gives {tuple(w.shape)} {w.dtype}"
        tol = TOLERANCE.get(w.dtype, dict(atol=0, rtol=0))
        try:
            torch.testing.assert_close(g, w, equal_nan=True, **tol)
        except AssertionError as e:
            return "differs from the torch reference: " + str(e).splitlines()[0][:200]
    return None


@dataclass
class Choice:
    """One measured choice: the path kept (``"torch"``, ``"triton"`` or a tile variant ``"triton:<name>"``),
    each path's median seconds and why a path was out."""

    backend: str
    seconds: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return dict(backend=self.backend, seconds=self.seconds, refused=self.refused)

    @classmethod
    def from_json(cls, d) -> "Choice":
        if not isinstance(d, dict) or not isinstance(d.get("backend"), str) or not PATH_NAME.match(d["backend"]):
            raise ValueError("entry without a known backend")
        secs, refused = d.get("seconds", {}), d.get("refused", {})
        if not isinstance(secs, dict) or not isinstance(refused, dict):
            raise ValueError("malformed entry")
        for k, v in secs.items():
            if not PATH_NAME.match(k) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"bad timing {k}={v!r}")
        if not all(PATH_NAME.match(k) and isinstance(v, str) for k, v in refused.items()):
            raise ValueError("bad refusal")
        if d["backend"] in refused:
            raise ValueError("the chosen backend was refused")
        return cls(d["backend"], dict(secs), dict(refused))


class Dispatcher:
    """Measures, keeps and reports the kernel choices of one process.

    Parameters
    ----------
    clock : callable
        Seconds (``time.perf_counter``); tests pass a fake clock.
    sync : callable or None
        Called with the device before each clock read (``torch.cuda.synchronize`` on CUDA by default).
    warmup, reps : int
        Untimed calls, then timed calls, per path.
    folder : str, Path or None
        Where the choices file lives (``None``: ``HF_KVREUSE_KERNEL_CACHE`` or ``~/.cache/hf_kvreuse/kernels``;
        ``False``: memory only).
    measure_cpu : bool
        Measure on CPU tensors too (tests, with Triton's interpreter); by default CPU tensors run torch.
    """

    def __init__(self, clock=time.perf_counter, sync=None, warmup: int = 2, reps: int = 5, folder=None,
                 measure_cpu: bool = False):
        self.clock, self._sync, self.warmup, self.reps = clock, sync, warmup, reps
        self.folder, self.measure_cpu = folder, measure_cpu
        self._lock = threading.RLock()
        self._choices: dict[str, dict[str, Choice]] = {}  # file name -> key -> choice
        self._loaded: set[str] = set()
        self._envs: dict[str, dict] = {}
        self.used: dict[str, dict[str, str]] = {}  # device name -> kernel -> backend last run

    # --- files ---------------------------------------------------------------------------------------------
    def _folder(self) -> Path | None:
        if self.folder is False:
            return None
        f = self.folder if self.folder is not None else os.environ.get(CACHE_ENV)
        return Path(f) if f else Path.home() / ".cache" / "hf_kvreuse" / "kernels"

    @staticmethod
    def file_name(env: dict) -> str:
        digest = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
        return f"choices-{digest}.json"

    def _env(self, device: torch.device) -> tuple[str, dict]:
        dk = str(device)
        if dk not in self._envs:
            self._envs[dk] = environment(device)
        env = self._envs[dk]
        return self.file_name(env), env

    def _read(self, name: str, env: dict) -> dict[str, Choice]:
        """The verified entries of the choices file ``name`` (empty when absent, outside the folder, too large,
        written under another environment or malformed)."""
        folder = self._folder()
        if folder is None:
            return {}
        path = folder / name
        try:
            root = folder.resolve(strict=True)
            real = path.resolve(strict=True)
            if real.parent != root or path.is_symlink() or not real.is_file():
                return {}
            if real.stat().st_size > MAX_FILE_BYTES:
                return {}
            doc = json.loads(real.read_text())
            if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("environment") != env:
                return {}
            return {str(k): Choice.from_json(v) for k, v in doc.get("choices", {}).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def _write(self, name: str, env: dict) -> None:
        folder = self._folder()
        if folder is None:
            return
        try:
            folder.mkdir(parents=True, exist_ok=True)
            doc = dict(format=FORMAT, environment=env,
                       choices={k: c.as_json() for k, c in sorted(self._choices[name].items())})
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".choices-", suffix=".tmp")
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=1)
            os.replace(tmp, folder / name)
        except OSError:  # a read-only home: the choice stays in memory
            pass

    # --- measuring -----------------------------------------------------------------------------------------
    def _sync_dev(self, device: torch.device) -> None:
        if self._sync is not None:
            self._sync(device)
        elif device.type == "cuda":
            torch.cuda.synchronize(device)

    def _time(self, fn, device) -> float:
        times = []
        for _ in range(self.reps):
            self._sync_dev(device)
            t0 = self.clock()
            fn()
            self._sync_dev(device)
            times.append(self.clock() - t0)
        return statistics.median(times)

    def measure(self, paths: dict[str, Callable[[], object]], device: torch.device) -> Choice:
        """Run and time every path (``"torch"`` first: the reference); see the module docstring."""
        want = paths["torch"]()
        for _ in range(self.warmup - 1):
            paths["torch"]()
        seconds, refused = {"torch": self._time(paths["torch"], device)}, {}
        for name, fn in paths.items():
            if name == "torch":
                continue
            try:
                got = fn()
                why = _equal(got, want)
                if why is None:
                    for _ in range(self.warmup - 1):
                        fn()
                    seconds[name] = self._time(fn, device)
                else:
                    refused[name] = why
            except Exception as e:  # a path that cannot run is never chosen
                refused[name] = f"{type(e).__name__}: {str(e)[:200]}"
        best = min(seconds, key=lambda n: (seconds[n], n != "torch"))
        return Choice(best, seconds, refused)

    def choose(self, kernel: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...],
               paths: dict[str, Callable[[], object]]) -> str:
        """The backend for this call: the stored choice for (kernel, device, dtype, bucket), measured now when
        there is none. ``paths`` run on scratch arguments (they must not write the caller's tensors)."""
        device = torch.device(device)
        key = f"{kernel}|{str(dtype).removeprefix('torch.')}|{'x'.join(map(str, bucket(*shape)))}"
        with self._lock:
            name, env = self._env(device)
            if name not in self._loaded:
                self._choices.setdefault(name, {}).update(self._read(name, env))
                self._loaded.add(name)
            store = self._choices.setdefault(name, {})
            choice = store.get(key)
            if choice is None:
                choice = self.measure(paths, device)
                store[key] = choice
                self._write(name, env)
            self.used.setdefault(env["device_name"], {})[kernel] = choice.backend
            return choice.backend

    def choices(self, device: torch.device) -> dict[str, Choice]:
        """Every choice known for ``device``'s environment (read from disk if not yet)."""
        with self._lock:
            name, env = self._env(torch.device(device))
            if name not in self._loaded:
                self._choices.setdefault(name, {}).update(self._read(name, env))
                self._loaded.add(name)
            return dict(self._choices.get(name, {}))

    def describe(self, device: torch.device) -> str:
        """``"auto"`` followed by the backend each kernel last ran on ``device``, e.g.
        ``"auto(rope_rebase=triton, selected_attention=torch)"`` (what ``stats.kernels`` reports)."""
        name = environment(torch.device(device))["device_name"] if str(device) not in self._envs \
            else self._envs[str(device)]["device_name"]
        used = self.used.get(name, {})
        return "auto(" + ", ".join(f"{k}={b}" for k, b in sorted(used.items())) + ")" if used else "auto"

    def clear(self) -> None:
        """Forget the choices in memory (the file stays; it is read again on the next call)."""
        with self._lock:
            self._choices.clear()
            self._loaded.clear()
            self.used.clear()


_DISPATCHER = Dispatcher()


def dispatcher() -> Dispatcher:
    """The process's :class:`Dispatcher`."""
    return _DISPATCHER
