"""K/V that outlive the process: :class:`~hf_kvreuse.ReuseSession` save / load and the :class:`DiskTier` of a
:class:`~hf_kvreuse.ChunkStore`, shared by the processes of one machine.

Formats (safetensors + JSON, never pickles):

* **session folder** (:func:`save_session`, :func:`load_session`): ``manifest.json`` (format, version, the saving
  model's identity and fingerprint, the session's options, one record per held cache: its file, the file's sha256
  and the entry's fields) and one ``kv-<sha256>.safetensors`` per held cache (``ids``, ``k.<layer>``,
  ``v.<layer>``). Files are named by their content, so saving again rewrites only what changed.
* **disk tier** (:class:`DiskTier`): ``chunks/<key>.json`` (the chunk's key, its file and the file's sha256,
  start, prefix digest) and ``chunks/<key>.<sha>.safetensors`` (``token_ids``, ``k.<layer>``, ``v.<layer>``, and
  ``anchor.k.<layer>`` / ``anchor.v.<layer>`` for chunks computed under a prefix).

Every file follows :mod:`hf_kvreuse.safe_files` (docs/storage-safety.md): a name a manifest records is resolved
inside its folder (absolute names, ``..`` and symlinks out are refused, for reads and deletions), the manifest and
each chunk JSON carry the sha256 of their own fields, data files are hashed in memory before the rename that
publishes them, and a damaged file is rewritten by the next save or put of the same content.

What is checked on load, every time: the manifest's own digest, the sha256 of every file (a torn or edited file is
refused), the model's
fingerprint (:func:`hf_kvreuse.chunk_store.model_fingerprint`; a session saved from other weights, another dtype
or another active adapter is refused), and every tensor against the model: number of layers, KV heads, head dim
and dtype of each layer (read from the model's own cache after a one-token forward), the same number of rows as
ids, and finite values. A failed check raises :class:`PersistedKVError` naming the file and the reason; nothing
unverified is ever used.

Concurrency on one machine: every file is written to a temporary name in the same folder, flushed and
``os.replace``-d into place (atomic on POSIX), data files before the JSON that names them. A reader therefore
sees either the old state or the new one, never a partial file. Writers of one folder take an ``fcntl`` lock on
``.lock`` for the read-modify-write of the manifest, the budget pass and pruning; readers take no lock. A reader
that finds a listed file gone (pruned by a writer after it read the manifest) reads the manifest again (a few
times); a disk-tier chunk that vanished is a miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Sequence

import torch

from . import safe_files
from .devices import place_kv
from .kv import KV
from .session_entry import _Entry, _storage_bytes
from .errors import HFKVReuseError

FORMAT_SESSION = "hf_kvreuse.session"
FORMAT_CHUNK = "hf_kvreuse.chunk"
VERSION = 2  # 2: signed manifests and chunk JSONs, method_kwargs kept per key

__all__ = ["PersistedKVError", "DiskTier", "save_session", "load_session", "session_snapshot", "kv_layout",
           "entry_to_record", "entry_from_record"]


class PersistedKVError(HFKVReuseError, ValueError):
    """Saved K/V that cannot be used with this model: a file that fails its sha256, another model's fingerprint,
    shapes or dtype that do not match the model, non-finite values, or an unknown format."""


# -- what the model's own cache looks like ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Per layer: ``(kv_heads, head_dim)``, the K/V dtype and the device the model's own cache uses."""

    shapes: tuple[tuple[int, int], ...]
    dtype: torch.dtype
    devices: tuple[torch.device, ...]

    @property
    def layers(self) -> int:
        return len(self.shapes)


_LAYOUTS: "weakref.WeakKeyDictionary[Any, tuple[str, KVLayout]]" = weakref.WeakKeyDictionary()


@torch.no_grad()
def kv_layout(model) -> KVLayout:
    """The K/V geometry the model's own cache holds: a one-token forward into a fresh ``DynamicCache`` (any
    architecture, whatever its head sizes per layer), remembered per model object and dtype."""
    from transformers import DynamicCache

    from .compat import cache_kwargs
    from .kv import kv_of

    p = next(model.parameters())
    tag = f"{p.dtype}:{p.device}"
    hit = _LAYOUTS.get(model)
    if hit is not None and hit[0] == tag:
        return hit[1]
    cache = DynamicCache(config=model.config)
    model(torch.zeros(1, 1, dtype=torch.long, device=p.device), use_cache=True, logits_to_keep=1,
          **cache_kwargs(cache))
    kv = kv_of(cache)
    layout = KVLayout(tuple((int(k.shape[1]), int(k.shape[-1])) for k, _ in kv), kv[0][0].dtype,
                      tuple(k.device for k, _ in kv))
    _LAYOUTS[model] = (tag, layout)
    return layout


def check_kv(kv: KV, layout: KVLayout, tokens: int | Sequence[int], where: str) -> None:
    """Refuse K/V that do not fit ``layout`` (layers, heads, head dim, dtype), do not hold ``tokens`` rows (one
    count, or one per layer: a sliding-window layer holds fewer), or hold non-finite values."""
    if len(kv) != layout.layers:
        raise PersistedKVError(f"{where}: {len(kv)} layers of K/V, the model has {layout.layers}: saved from another "
                               "model")
    rows = [int(tokens)] * len(kv) if isinstance(tokens, int) else [int(t) for t in tokens]
    for i, ((k, v), (heads, dim), tokens) in enumerate(zip(kv, layout.shapes, rows)):
        for name, t in (("K", k), ("V", v)):
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != heads or t.shape[-1] != dim or t.shape[2] != tokens:
                raise PersistedKVError(f"{where}: layer {i} {name} has shape {tuple(t.shape)}; the model needs "
                                       f"(1, {heads}, {tokens}, {dim}) (1 sequence, {heads} KV heads, {tokens} tokens, "
                                       f"head dim {dim})")
            if t.dtype != layout.dtype:
                raise PersistedKVError(f"{where}: layer {i} {name} is {t.dtype}, the model computes {layout.dtype}: "
                                       "load the model in the dtype the K/V were saved from")
            if not bool(torch.isfinite(t).all()):
                raise PersistedKVError(f"{where}: layer {i} {name} holds non-finite values")


# -- files (the rules live in safe_files) ------------------------------------------------------------------------
def _atomic_json(path: Path, obj: dict) -> None:
    safe_files.write_json(path.parent, path.name, safe_files.sign(obj))


def _read_signed_json(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PersistedKVError(f"{path}: not valid JSON ({e})") from None
    if isinstance(meta, dict) and meta.get("version") not in (None, VERSION):
        raise PersistedKVError(f"{path}: format version {meta.get('version')} (this hf_kvreuse reads {VERSION}); "
                               "save it again")
    return safe_files.check_signed(meta, str(path), error=PersistedKVError)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor safetensors can write: contiguous and owning its whole storage (views of larger caches are
    copied)."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def _write_tensors(folder: Path, tensors: dict[str, torch.Tensor], stem: str) -> tuple[str, str, int]:
    """Write ``tensors`` as ``<stem><sha>.safetensors`` in ``folder``, hashed before the rename (content-addressed:
    an existing file is kept only when its bytes have that digest; a damaged one is rewritten). Returns
    (file name, sha256, bytes)."""
    from safetensors.torch import save

    data = save({k: _plain(t) for k, t in tensors.items()}, metadata={"format": "hf_kvreuse"})
    sha = safe_files.sha256_bytes(data)
    name = f"{stem}{sha[:32]}.safetensors"
    safe_files.write_atomic(folder, name, data, sha)
    return name, sha, len(data)


def _read_tensors(folder: Path, name, sha256: str) -> dict[str, torch.Tensor]:
    """The tensors of ``folder/name`` (contained in ``folder``) after its sha256 matched."""
    from safetensors.torch import load

    data = safe_files.read_verified(folder, name, sha256, str(folder), error=PersistedKVError)
    try:
        return load(data)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise PersistedKVError(f"{folder / name}: not a readable safetensors file ({e})") from None


@contextlib.contextmanager
def _dir_lock(folder: Path):
    """Exclusive lock of a folder's writers (``fcntl.flock`` on ``folder/.lock``; a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover -- not POSIX
        yield
        return
    with open(folder / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _prune(folder: Path, pattern: str, keep: set[str], older_than_s: float) -> int:
    """Delete files matching ``pattern`` that ``keep`` does not name and that are older than ``older_than_s`` (a
    reader that read an earlier manifest moments ago still finds them). Returns how many were deleted."""
    now, n = time.time(), 0
    for p in folder.glob(pattern):
        if p.name in keep:
            continue
        try:
            if now - p.stat().st_mtime >= older_than_s:
                p.unlink()
                n += 1
        except FileNotFoundError:
            pass
    for p in folder.glob(".tmp-*"):  # temporaries of writers that died long ago
        try:
            if now - p.stat().st_mtime >= max(older_than_s, 3600):
                p.unlink()
        except FileNotFoundError:
            pass
    return n


def _to_devices(kv: KV, layout: KVLayout) -> KV:
    return place_kv(kv, layout.devices)


# -- session entries: the one place that knows their fields --------------------------------------------------------
def _kv_tensors(kv: KV, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v) in enumerate(kv):
        out[f"{prefix}k.{i}"], out[f"{prefix}v.{i}"] = k, v
    return out


def _kv_from(tensors: dict[str, torch.Tensor], prefix: str = "") -> KV:
    n = sum(1 for k in tensors if k.startswith(f"{prefix}k."))
    try:
        return [(tensors[f"{prefix}k.{i}"], tensors[f"{prefix}v.{i}"]) for i in range(n)]
    except KeyError as e:
        raise PersistedKVError(f"K/V tensors are incomplete: {e} is missing") from None


def entry_to_record(entry) -> tuple[dict[str, torch.Tensor], dict]:
    """A session entry (``ReuseSession._entries`` value) as ``(tensors, fields)``: ``ids`` and the K/V as tensors,
    every other dataclass field as JSON (a tensor-valued field as a tensor ``field.<name>``). Fields added to the
    entry later are carried without changes here; :func:`entry_from_record` is its inverse."""
    tensors = {"ids": entry.ids.reshape(-1), **_kv_tensors(entry.kv)}
    meta = {}
    for f in dataclasses.fields(entry):
        if f.name in ("ids", "kv", "nbytes"):
            continue  # nbytes is recomputed from what is loaded
        value = getattr(entry, f.name)
        if isinstance(value, torch.Tensor):
            tensors[f"field.{f.name}"] = value
            continue
        if f.name == "marks":  # {m: per layer (K, V) or None}: the rows as tensors, the layer count as JSON
            for m, rows in value.items():
                for i, r in enumerate(rows):
                    if r is not None:
                        tensors[f"mark.{int(m)}.{i}.k"], tensors[f"mark.{int(m)}.{i}.v"] = r
            meta["marks"] = {str(int(m)): len(rows) for m, rows in value.items()}
            continue
        try:
            json.dumps(value)
        except TypeError:
            raise TypeError(f"session entry field {f.name!r} ({type(value).__name__}) is neither JSON nor a tensor: "
                            "teach hf_kvreuse.persist.entry_to_record to write it") from None
        meta[f.name] = value
    return tensors, meta


def entry_from_record(entry_cls, tensors: dict[str, torch.Tensor], meta: dict, layout: KVLayout, where: str,
                      windows: Sequence[int | None] | None = None):
    """The inverse of :func:`entry_to_record`, with the K/V checked against ``layout`` and moved to the model's
    devices. ``windows``: each layer's sliding window (None: full attention); such a layer holds every row or the last
    ``window - 1`` rows, as the session keeps them."""
    if "ids" not in tensors:
        raise PersistedKVError(f"{where}: no 'ids' tensor")
    ids = tensors["ids"].long().reshape(-1)
    kv = _kv_from(tensors)
    n = int(ids.numel())
    # a sliding-window layer holds every row (the session kept its history) or its window's
    check_kv(kv, layout, [n if not w or (i < len(kv) and kv[i][0].shape[-2] == n) else min(n, w - 1)
                          for i, w in enumerate(windows or [None] * len(kv))], where)
    kv = _to_devices(kv, layout)
    values = dict(meta)
    for name, t in tensors.items():
        if name.startswith("field."):
            values[name[len("field."):]] = t
    if "marks" in values:
        values["marks"] = _marks_from(tensors, values["marks"], n, layout, windows, where)
    kwargs = {}
    for f in dataclasses.fields(entry_cls):
        if f.name in ("ids", "kv", "nbytes"):
            continue
        if f.name in values:
            kwargs[f.name] = values[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise PersistedKVError(f"{where}: the saved entry has no field {f.name!r} (saved by an older hf_kvreuse?)")
    nbytes = _storage_bytes(kv) + sum(t.numel() * t.element_size() for rows in kwargs.get("marks", {}).values()
                                      for r in rows if r is not None for t in r)
    return entry_cls(ids=ids, kv=kv, nbytes=nbytes, **kwargs)


def _marks_from(tensors: dict[str, torch.Tensor], saved, n: int, layout: KVLayout,
                windows: Sequence[int | None] | None, where: str) -> dict:
    """An entry's prompt-boundary rows (``_Entry.marks``) from ``mark.<m>.<layer>.k|v`` tensors, each checked
    as the rows a cache of the first ``m`` tokens keeps in that sliding-window layer."""
    windows = list(windows or [None] * layout.layers)
    if not isinstance(saved, dict):
        raise PersistedKVError(f"{where}: field 'marks' is {type(saved).__name__}, not a dict")
    marks = {}
    for key, layers in saved.items():
        try:
            m = int(key)
        except ValueError:
            raise PersistedKVError(f"{where}: prompt boundary {key!r} is not a token count") from None
        if not 0 < m <= n or layers != layout.layers:
            raise PersistedKVError(f"{where}: prompt boundary {m} ({layers} layers) does not fit an entry of {n} "
                                   f"tokens and {layout.layers} layers")
        rows = []
        for i, w in enumerate(windows):
            k, v = tensors.get(f"mark.{m}.{i}.k"), tensors.get(f"mark.{m}.{i}.v")
            if w is None:
                if k is not None or v is not None:
                    raise PersistedKVError(f"{where}: prompt boundary {m} holds rows of full-attention layer {i}")
                rows.append(None)
                continue
            if k is None or v is None:
                raise PersistedKVError(f"{where}: prompt boundary {m} has no rows of sliding-window layer {i}")
            sub = KVLayout(shapes=(layout.shapes[i],), dtype=layout.dtype, devices=(layout.devices[i],))
            check_kv([(k, v)], sub, min(m, w - 1), f"{where} prompt boundary {m} (layer {i})")
            rows.append(_to_devices([(k, v)], sub)[0])
        marks[m] = rows
    return marks


# -- ReuseSession ---------------------------------------------------------------------------------------------------
def _session_layout(model, records: Sequence = (), where: str = "") -> KVLayout | None:
    """:func:`kv_layout` of ``model``, or None for a model with linear-attention / recurrent-state layers (its
    cache is not K/V in every layer: a session of such a model holds whole states, which are not saved, and no K/V
    entries). A saved session whose ``records`` list K/V entries is refused for such a model."""
    from .hybrid import state_layers

    states = state_layers(model.config)
    if not states:
        return kv_layout(model)
    if records:
        raise PersistedKVError(f"{where} holds {len(records)} K/V entries, but {type(model).__name__} has "
                               f"linear-attention / recurrent-state layers ({', '.join(states[:4])}): saved from "
                               "another model")
    return None


def _model_identity(model) -> dict:
    from .fingerprint import model_fingerprint

    layout = _session_layout(model)
    if layout is None:  # a linear-attention hybrid: no K/V layout to record
        from .hybrid import state_layers

        return dict(fingerprint=model_fingerprint(model), architecture=type(model).__name__,
                    layers=getattr(model.config, "num_hidden_layers", None), kv_shapes=None,
                    state_layers=state_layers(model.config), dtype=str(next(model.parameters()).dtype))
    return dict(fingerprint=model_fingerprint(model), architecture=type(model).__name__,
                layers=layout.layers, kv_shapes=[list(s) for s in layout.shapes], dtype=str(layout.dtype))


def _check_identity(saved: dict, model, where: str) -> None:
    from .fingerprint import model_fingerprint

    got = model_fingerprint(model)
    if saved.get("fingerprint") != got:
        raise PersistedKVError(
            f"{where} was saved from another model: fingerprint {saved.get('fingerprint')} "
            f"({saved.get('architecture')}, {saved.get('layers')} layers, {saved.get('dtype')}), this model is {got} "
            f"({type(model).__name__}, {model.dtype}). Load the same weights in the same dtype (with a peft model, the "
            "adapters active as when it was saved)")


def _is_store(path) -> bool:
    """A store URL (``redis://...``) or backend rather than a folder: :mod:`hf_kvreuse.stores` handles it."""
    return (isinstance(path, str) and "://" in path) or not isinstance(path, (str, os.PathLike))


def _shown(path) -> str:
    """``path`` as an error message may show it: a store URL without its credentials."""
    from .stores.base import redact_url

    return repr(redact_url(path) if isinstance(path, str) else path)


def session_snapshot(session) -> tuple[list, dict]:
    """``(entries, options)`` of a session to save (every store saves through it): the held entries, least
    recently used first, each with its weights' fingerprint (a session may hold a cheaper token of its weights),
    and the JSON options, ``method_kwargs`` split into those saved and the names load must be given again."""
    # the held caches' lock (a running call stores under it); held K/V are never written in place, so the files can
    # be written after it is released (an entry evicted meanwhile stays alive through this list)
    lock = getattr(session, "_state", None) or getattr(session, "_lock", None) or contextlib.nullcontext()
    with lock:
        identified = getattr(session, "_identified_entries", None)
        entries = identified() if identified is not None else list(session._entries.values())
        options = dict(policy=session.policy, max_bytes=session.max_bytes, min_span=session.min_span,
                       min_donor_tokens=session.min_donor_tokens)
        for name in ("rebase", "sliding_history"):
            if hasattr(session, name):
                options[name] = getattr(session, name)
        states = len(getattr(session, "_states", ()))
    if states:
        warnings.warn(f"the session holds {states} recurrent-state cache(s) of a linear-attention hybrid; they are "
                      "not saved (only K/V entries are): a loaded session starts without them", stacklevel=3)
    kept, again = _split_method_kwargs(session.method_kwargs)
    options["method_kwargs"] = kept
    options["method_kwargs_not_saved"] = again  # names load() must be given again (models, tokenizers, mappers)
    return entries, options


def save_session(session, path, prune_after_s: float = 60.0, **store_options) -> dict:
    """Write every cache ``session`` holds to the folder ``path``; returns the manifest written.

    A store URL or backend (``"redis://host:6379"``) is written by :meth:`ReuseSession.save
    <hf_kvreuse.ReuseSession.save>` through :func:`hf_kvreuse.stores.tiers.save_session` (this module imports no
    store).

    The folder may already hold a saved session (of this or another process): its manifest is replaced atomically,
    files of the same content are kept, and files no manifest names any more are deleted once older than
    ``prune_after_s`` (so a reader that read the previous manifest finds them). The held caches are listed under
    the lock of the session's held caches (a save during a call sees them before or after the call stores its
    cache) and written after it (calls may run meanwhile). The ``base_lr`` policy's
    trajectory (a :class:`~hf_kvreuse.BaseLRCache`) is not saved.
    """
    if getattr(session, "_trajectory", None) is not None:
        raise NotImplementedError("the base_lr policy's BaseLRCache trajectory cannot be saved yet (only the caches "
                                  "of the other policies are)")
    from .version import __version__

    if _is_store(path):
        raise TypeError(f"save_session writes a folder; {_shown(path)} is a store: call session.save(url) or "
                        "hf_kvreuse.stores.tiers.save_session")
    if store_options:
        raise TypeError(f"save_session: {sorted(store_options)} apply to a store URL or backend (session.save(url, "
                        "...)), not to a folder")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)

    entries, options = session_snapshot(session)  # first: it warns of what is not saved
    identity = _model_identity(session.model)
    with _dir_lock(folder):
        records = []
        for e in entries:
            tensors, meta = entry_to_record(e)
            name, sha, size = _write_tensors(folder, tensors, "kv-")
            records.append(dict(file=name, sha256=sha, bytes=size, tokens=int(e.ids.numel()), fields=meta))
        manifest = dict(format=FORMAT_SESSION, version=VERSION, library=__version__,
                        saved_at=time.time(), model=identity, session=options, entries=records)
        _atomic_json(folder / "manifest.json", manifest)
        _prune(folder, "kv-*.safetensors", {r["file"] for r in records}, prune_after_s)
    return manifest


def _split_method_kwargs(method_kwargs: dict) -> tuple[dict, list[str]]:
    """``(the JSON-able options, the names of the others)``: each option is kept on its own merits."""
    kept, again = {}, []
    for k, v in (method_kwargs or {}).items():
        try:
            json.dumps(v)
            kept[k] = v
        except (TypeError, ValueError):
            again.append(k)
    return kept, sorted(again)


def _merge_method_kwargs(saved: dict, where: str, given: dict | None) -> dict:
    """The saved JSON options plus those given to load; a given value that differs from a saved one, or a
    non-JSON option the session was saved with and that is not given again, is refused."""
    kept = dict(saved.get("method_kwargs") or {})
    again = list(saved.get("method_kwargs_not_saved") or [])
    given = dict(given or {})
    clash = {k: (kept[k], v) for k, v in given.items() if k in kept and kept[k] != v}
    if clash:
        raise ValueError(f"{where} was saved with method_kwargs " + ", ".join(f"{k}={a!r}" for k, (a, _) in
                         clash.items()) + "; load was given " + ", ".join(f"{k}={b!r}" for k, (_, b) in clash.items())
                         + ". Pass the saved values (or leave them out), or build a new session for other options")
    missing = [k for k in again if k not in given]
    if missing:
        raise ValueError(f"{where} was saved with method_kwargs {missing} that cannot be stored (not JSON): pass them "
                         f"again, e.g. load(path, model, method_kwargs=dict({missing[0]}=...))")
    return {**kept, **given}


def _read_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"no saved ReuseSession in {folder} (expected manifest.json; ReuseSession.save "
                                "writes it)")
    manifest = _read_signed_json(path)
    if manifest.get("format") != FORMAT_SESSION:
        raise PersistedKVError(f"{path}: format {manifest.get('format')!r} is not a saved ReuseSession")
    if manifest.get("version") != VERSION:
        raise PersistedKVError(f"{path}: format version {manifest.get('version')} (this hf_kvreuse reads {VERSION})")
    return manifest


def load_session(path, model, session_cls=None, retries: int = 5, **options):
    """A new session over ``model`` holding the caches saved in ``path``, each verified (module docstring).

    ``options`` override the saved session options (``policy``, ``max_bytes``, ``min_span``, ``min_donor_tokens``).
    ``method_kwargs`` are merged with the saved ones: those that were not JSON (a tokenizer, a source model) must be
    given again, and a value that differs from a saved one is refused (``ValueError``).
    When the saved caches exceed ``max_bytes``, the most recently used ones that fit are kept. A store URL is
    read by :meth:`ReuseSession.load <hf_kvreuse.ReuseSession.load>` (:func:`hf_kvreuse.stores.tiers.load_session`).
    ``session_cls``: the class to build (:meth:`ReuseSession.load <hf_kvreuse.ReuseSession.load>` passes itself;
    this module imports no session).
    """
    if session_cls is None:
        raise TypeError("load_session needs the session class to build: call ReuseSession.load(path, model), or "
                        "pass session_cls=ReuseSession")
    if _is_store(path):
        raise TypeError(f"load_session reads a folder; {_shown(path)} is a store: call ReuseSession.load(url, model) "
                        "or hf_kvreuse.stores.tiers.load_session")
    folder = Path(path)
    cls = session_cls
    session = None
    for attempt in range(retries):
        manifest = _read_manifest(folder)
        _check_identity(manifest["model"], model, f"the session in {folder}")
        layout = _session_layout(model, manifest["entries"], f"the session in {folder}")
        if session is None:
            saved = dict(manifest["session"])
            given = options.pop("method_kwargs", None)
            saved["method_kwargs"] = _merge_method_kwargs(saved, f"the session in {folder}", given)
            saved.pop("method_kwargs_not_saved", None)
            saved.update(options)
            session = cls(model, **saved)
        windows = getattr(session, "_windows", None)
        try:
            entries = []
            for rec in manifest["entries"]:
                where = str(safe_files.inside(folder, rec["file"], str(folder), PersistedKVError))
                tensors = _read_tensors(folder, rec["file"], rec["sha256"])
                if int(tensors["ids"].numel() if "ids" in tensors else -1) != rec.get("tokens"):
                    raise PersistedKVError(f"{where}: holds a different number of tokens than its record says")
                entries.append(entry_from_record(_Entry, tensors, rec["fields"], layout, where, windows))
            break
        except FileNotFoundError:  # a writer replaced the manifest and pruned a file meanwhile: read it again
            if attempt == retries - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    kept, total = [], 0
    for e in reversed(entries):  # most recent first, under the budget
        if total + e.nbytes <= session.max_bytes:
            kept.append(e)
            total += e.nbytes
    for e in reversed(kept):
        session._entries[session._next_key] = e
        session._next_key += 1
    return session


def chunk_from_record(model, meta: dict, tensors: dict[str, torch.Tensor], where: str):
    """The :class:`~hf_kvreuse.chunk.KVChunk` a stored chunk record describes (``meta``: ``start``,
    ``prefix_digest``, ``anchor_token``; ``tensors``: ``token_ids``, the K/V and the optional ``anchor.`` K/V),
    every tensor checked against ``model``'s K/V layout; :class:`PersistedKVError` otherwise. Shared by every
    chunk tier (the folder's :class:`DiskTier`, :class:`hf_kvreuse.stores.tiers.StoreTier`)."""
    from .chunk import KVChunk

    layout = kv_layout(model)
    token_ids = tensors.get("token_ids")
    if token_ids is None:
        raise PersistedKVError(f"{where}: no 'token_ids' tensor")
    kv = _kv_from(tensors)
    check_kv(kv, layout, int(token_ids.numel()), where)
    anchor = None
    if any(k.startswith("anchor.") for k in tensors):
        anchor = _kv_from(tensors, "anchor.")
        check_kv(anchor, layout, 1, where + " (anchor)")
        anchor = _to_devices(anchor, layout)
    return KVChunk(token_ids.long().reshape(-1), _to_devices(kv, layout), start=int(meta["start"]),
                   prefix_digest=meta["prefix_digest"], anchor=anchor, anchor_token=meta["anchor_token"])


# -- ChunkStore disk tier -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DiskTier:
    """The disk tier of a :class:`~hf_kvreuse.ChunkStore`: chunks as safetensors + JSON in ``path``, under
    ``max_bytes``, shared by every process that opens the same folder.

    ``ChunkStore(max_bytes=1 << 30, disk=DiskTier("kv_chunks", max_bytes=20 << 30))``: a chunk the memory tier
    misses is looked up here (and, when found and verified, kept in memory too); every chunk put in the store is
    written here as well. Least recently used chunks (by their last read or write) are deleted beyond
    ``max_bytes``. Keys are the store's: producer fingerprint, adapter, prefix digest, token digest, so chunks of
    other weights are simply misses; what a key finds is verified (module docstring) before use.

    Attributes
    ----------
    path : str or Path
        The folder (created if missing).
    max_bytes : int
        Bytes of chunk files the folder may hold; the least recently used are deleted beyond it.
    hits, misses, writes, evictions : int
        Counts of this process.
    """

    path: str | os.PathLike
    max_bytes: int = 8 << 30
    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0

    def __post_init__(self):
        if self.max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        self.folder = Path(self.path) / "chunks"
        self.folder.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def name(key: tuple) -> str:
        return hashlib.sha256("|".join(map(str, key)).encode()).hexdigest()[:40]

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk files on disk now."""
        total = 0
        for p in self.folder.glob("*.safetensors"):
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def __len__(self) -> int:
        return sum(1 for _ in self.folder.glob("*.json"))

    def get(self, model, key: tuple):
        """The verified chunk stored under ``key``, or None. Raises :class:`PersistedKVError` for a stored chunk
        that fails its checks."""

        meta_path = self.folder / f"{self.name(key)}.json"
        try:
            meta = _read_signed_json(meta_path)
            tensors = _read_tensors(self.folder, meta.get("file"), meta.get("sha256"))
        except FileNotFoundError:  # never written, or evicted by another process meanwhile
            self.misses += 1
            return None
        where = str(self.folder / meta["file"])
        if meta.get("format") != FORMAT_CHUNK or meta.get("version") != VERSION:
            raise PersistedKVError(f"{meta_path}: format {meta.get('format')!r} v{meta.get('version')} is not a chunk "
                                   f"of this hf_kvreuse (v{VERSION})")
        if [str(k) for k in meta.get("key", [])] != [str(k) for k in key]:
            raise PersistedKVError(f"{meta_path}: holds the chunk of another key")
        chunk = chunk_from_record(model, meta, tensors, where)
        with contextlib.suppress(FileNotFoundError):
            os.utime(meta_path)  # recently used: the last to be evicted
        self.hits += 1
        return chunk

    def put(self, model, key: tuple, chunk) -> bool:
        """Write ``chunk`` under ``key`` (False when it alone exceeds ``max_bytes``), then delete the least
        recently used chunks beyond the budget."""
        tensors = {"token_ids": chunk.token_ids.reshape(-1), **_kv_tensors(chunk.kv)}
        if chunk.anchor:
            tensors.update(_kv_tensors(chunk.anchor, "anchor."))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.max_bytes:
            return False
        stem = self.name(key)
        with _dir_lock(self.folder):
            file, sha, nbytes = _write_tensors(self.folder, tensors, f"{stem}.")
            meta = dict(format=FORMAT_CHUNK, version=VERSION, key=list(key), file=file, sha256=sha, bytes=nbytes,
                        tokens=chunk.length, start=chunk.start, prefix_digest=chunk.prefix_digest,
                        anchor_token=chunk.anchor_token, written_at=time.time())
            _atomic_json(self.folder / f"{stem}.json", meta)
            self.writes += 1
            self._enforce_budget()
        return True

    def _enforce_budget(self, grace_s: float = 60.0) -> None:
        """Under the writers' lock: delete chunks least recently used first until the files fit ``max_bytes``;
        data files no JSON names (a writer's lost race) go once older than ``grace_s``."""
        metas = []
        named = set()
        for p in self.folder.glob("*.json"):
            try:
                meta = json.loads(p.read_text())
                metas.append((p.stat().st_mtime, p, meta))
                named.add(str(meta["file"]))
            except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
                continue
        _prune(self.folder, "*.safetensors", named, grace_s)
        total = self.nbytes
        for _, p, meta in sorted(metas, key=lambda m: m[0]):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                p.unlink()  # the JSON first: a reader then misses instead of finding a half-deleted chunk
            total -= safe_files.remove_inside(self.folder, meta.get("file"))  # never a file outside the folder
            self.evictions += 1

    def __repr__(self) -> str:
        from .reprs import disk_repr

        return disk_repr(self)

    def clear(self) -> None:
        """Delete every chunk of the folder."""
        with _dir_lock(self.folder):
            for p in list(self.folder.glob("*.json")) + list(self.folder.glob("*.safetensors")):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
