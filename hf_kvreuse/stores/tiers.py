"""The library's stores on any :class:`~hf_kvreuse.stores.EntryBackend` (a folder, Redis / Valkey).

* :class:`StoreTier`: a :class:`~hf_kvreuse.ChunkStore` tier, ``ChunkStore(disk=StoreTier("redis://host:6379"))``;
* :class:`KVEntryStore`: the vLLM connector's store (the interface of
  :class:`~hf_kvreuse.vllm.store.KVDirStore`, the same entry fields), ``kv_connector_extra_config={"store":
  "redis://host:6379"}``;
* :func:`save_session` / :func:`load_session`: a :class:`~hf_kvreuse.ReuseSession` as one entry,
  ``session.save("redis://host:6379", name="agents")``.

Every load is verified twice: the backend's entry checks (sha256, namespace, key, recorded shapes, finite values)
and the model-level checks of the folder formats (weights fingerprint / identity, layers, KV heads, head dim,
dtype). An entry that fails is refused: logged, counted in ``refused``, deleted, and treated as a miss (its K/V
are recomputed), never used. A server that cannot be reached is a miss too (``unavailable`` counts them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from . import CorruptEntryError, StoreUnavailableError, check_name, namespace, open_backend

logger = logging.getLogger(__name__)

__all__ = ["StoreTier", "KVEntryStore", "open_kv_store", "save_session", "load_session"]


# -- ChunkStore tier --------------------------------------------------------------------------------------------------
@dataclass
class StoreTier:
    """A :class:`~hf_kvreuse.ChunkStore` second tier on a store backend (the interface of
    :class:`hf_kvreuse.persist.DiskTier`).

    Parameters
    ----------
    store : str, PathLike or EntryBackend
        ``redis://...`` / ``rediss://...`` / ``unix://...``, a folder, or a backend.
    tenant : str, optional
        Key prefix of this tenant (see :mod:`hf_kvreuse.stores.redis` for the ACL).
    max_bytes : int, optional
        Per-namespace byte budget kept by writers (beside the server's own ``maxmemory`` eviction).
    """

    store: Any
    tenant: str | None = None
    max_bytes: int | None = None
    hits: int = 0
    misses: int = 0
    writes: int = 0
    refused: int = 0
    unavailable: int = 0
    backend: Any = field(default=None, repr=False)

    def __post_init__(self):
        self.backend = open_backend(self.store, tenant=self.tenant, max_bytes=self.max_bytes)

    @staticmethod
    def _ns_key(key: tuple) -> tuple[str, str]:
        from ..persist import DiskTier

        return namespace("chunk", str(key[0])), DiskTier.name(key)

    def get(self, model, key: tuple):
        """The verified chunk of ``key``, or None (absent, evicted, server down, or refused)."""
        from ..persist import PersistedKVError, chunk_from_record

        ns, name = self._ns_key(key)
        try:
            got = self.backend.get(ns, name)
        except StoreUnavailableError as e:
            logger.warning("hf_kvreuse chunk store: %s (a miss)", e)
            self.unavailable += 1
            self.misses += 1
            return None
        except CorruptEntryError as e:
            return self._refuse(ns, name, e)
        if got is None:
            self.misses += 1
            return None
        meta, tensors = got
        where = f"{self.backend!r} entry {ns}/{name}"
        try:
            if [str(k) for k in meta.get("key", [])] != [str(k) for k in key]:
                raise PersistedKVError(f"{where}: holds the chunk of another key")
            chunk = chunk_from_record(model, meta, tensors, where)
        except (PersistedKVError, KeyError, TypeError, ValueError) as e:
            return self._refuse(ns, name, e)
        self.hits += 1
        return chunk

    def _refuse(self, ns: str, name: str, e: Exception):
        logger.error("hf_kvreuse chunk store %r: entry %s/%s refused (recomputed): %s", self.backend, ns, name, e)
        self.refused += 1
        self.misses += 1
        try:
            self.backend.delete(ns, name)
        except StoreUnavailableError:
            pass
        return None

    def put(self, model, key: tuple, chunk) -> bool:
        """Write ``chunk`` under ``key`` (False when the server cannot be reached)."""
        from ..persist import _kv_tensors

        tensors = {"token_ids": chunk.token_ids.reshape(-1), **_kv_tensors(chunk.kv)}
        if chunk.anchor:
            tensors.update(_kv_tensors(chunk.anchor, "anchor."))
        ns, name = self._ns_key(key)
        meta = dict(key=[str(k) for k in key], tokens=chunk.length, start=chunk.start,
                    prefix_digest=chunk.prefix_digest, anchor_token=chunk.anchor_token)
        try:
            self.backend.put(ns, name, meta, tensors)
        except StoreUnavailableError as e:
            logger.warning("hf_kvreuse chunk store: %s (not written)", e)
            self.unavailable += 1
            return False
        self.writes += 1
        return True

    def usage(self):
        return self.backend.usage()

    def __repr__(self) -> str:  # the backend's repr: no credentials
        return (f"StoreTier({self.backend!r}, hits={self.hits}, misses={self.misses}, writes={self.writes}, "
                f"refused={self.refused}, unavailable={self.unavailable})")


# -- the vLLM connector's store ---------------------------------------------------------------------------------------
class KVEntryStore:
    """The vLLM connector's store on a backend: the methods of :class:`~hf_kvreuse.vllm.store.KVDirStore`, the
    same entry fields (format, model identity, token ids, ``exact_len``, geometry, writer, the fields' own sha256)
    and tensors ``k`` / ``v`` ``[layers, kv_heads, tokens, head_dim]``; one namespace per model identity."""

    def __init__(self, store, tenant: str | None = None, max_bytes: int | None = None):
        self.backend = open_backend(store, tenant=tenant, max_bytes=max_bytes)
        self.refused: dict[str, str] = {}
        self.unavailable = 0
        self._seen: dict[str, str] = {}  # entry id -> namespace, from listings (the connector asks by id)
        self.path = None  # no folder: the connector logs elsewhere

    def __repr__(self) -> str:
        return f"KVEntryStore({self.backend!r})"

    @staticmethod
    def _ns(identity) -> str:
        return namespace("vllm", identity.key)

    def put(self, identity, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor,
            exact_len: int | None = None, written_by: str = "hf_kvreuse"):
        from .. import safe_files
        from ..vllm.store import entry_meta

        eid, meta = entry_meta(identity, token_ids, k, v, exact_len, written_by)
        old = self.info(eid, identity)
        if old is not None and old.exact_len >= meta["exact_len"]:
            return old
        meta = safe_files.sign(meta)
        try:
            self.backend.put(self._ns(identity), eid, meta, {"k": k.detach(), "v": v.detach()})
        except StoreUnavailableError as e:
            logger.warning("hf_kvreuse K/V store: %s (not written)", e)
            self.unavailable += 1
            return None
        return self._parse(eid, meta)

    def _parse(self, eid: str, meta: dict):
        from ..artifacts import CorruptArtifactError
        from ..vllm.store import KVDirStore

        try:
            try:
                return KVDirStore._info_of(eid, meta)  # the folder store's checks: format, own digest, key
            except CorruptArtifactError as e:
                raise CorruptEntryError(str(e)) from None
        except (ValueError, KeyError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
            if self.refused.get(eid) != why:
                logger.error("hf_kvreuse K/V store %r: entry %s refused: %s", self.backend, eid, why)
            self.refused[eid] = why
            return None

    def info(self, eid: str, identity=None):
        """The entry ``eid`` (of ``identity``'s namespace; without one, searched in every namespace)."""
        if identity is not None:
            nss = [self._ns(identity)]
        elif eid in self._seen:
            nss = [self._seen[eid]]
        else:
            nss = self._namespaces()
        for ns in nss:
            try:
                meta = self.backend.meta(ns, eid)
            except StoreUnavailableError:
                self.unavailable += 1
                return None
            except CorruptEntryError as e:
                self.refused[eid] = str(e)
                continue
            if meta is not None:
                return self._parse(eid, meta)
        return None

    def _namespaces(self) -> list[str]:
        try:
            return [n for n in self.backend.namespaces() if n.startswith("vllm-")]
        except StoreUnavailableError:
            self.unavailable += 1
            return []

    def _entries(self, ns: str):
        try:
            metas = self.backend.metas(ns)
        except StoreUnavailableError:
            self.unavailable += 1
            return []
        self._seen.update((eid, ns) for eid in metas)
        infos = [(m.get("created", 0.0), self._parse(eid, m)) for eid, m in metas.items()]
        return [i for _, i in sorted(infos, key=lambda x: x[0]) if i is not None]

    def entries(self):
        """Every entry of every model whose fields verify, oldest first per model."""
        return [e for ns in self._namespaces() for e in self._entries(ns)]

    def for_model(self, identity):
        return [e for e in self._entries(self._ns(identity)) if e.identity.key == identity.key]

    def longest_exact_prefix(self, identity, token_ids: Sequence[int], limit: int | None = None):
        from ..vllm.store import KVDirStore

        return KVDirStore.longest_exact_prefix(self, identity, token_ids, limit)

    def load(self, info, identity=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of an entry, verified (backend checks, fields, shapes, dtype, finite values); raises
        :class:`~hf_kvreuse.artifacts.CorruptArtifactError` (the entry is deleted), ``FileNotFoundError`` when
        it is gone (evicted: the caller recomputes) or :class:`~hf_kvreuse.stores.StoreUnavailableError` (an
        ``OSError``)."""
        from ..artifacts import CorruptArtifactError
        from ..vllm.identity import ModelMismatchError

        if identity is not None and info.identity.key != identity.key:
            raise ModelMismatchError(f"entry {info.entry_id} holds K/V of {info.identity.path or 'another model'} "
                                     f"({info.identity.key[:16]}...), not of {identity.path} ({identity.key[:16]}...)")
        ns = self._ns(info.identity)
        try:
            got = self.backend.get(ns, info.entry_id)
        except StoreUnavailableError:
            self.unavailable += 1
            raise
        except CorruptEntryError as e:
            self.refused[info.entry_id] = str(e)
            self.backend.delete(ns, info.entry_id)
            raise
        if got is None:
            raise FileNotFoundError(f"K/V store entry {info.entry_id} is gone (evicted or lost in a restart)")
        meta, tensors = got
        if self._parse(info.entry_id, meta) != info:
            raise CorruptArtifactError(f"K/V store entry {info.entry_id}: its fields changed or fail their digest "
                                       "since it was indexed")
        k, v = tensors.get("k"), tensors.get("v")
        want = (info.layers, info.kv_heads, info.length, info.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t is None or tuple(t.shape) != want or str(t.dtype).removeprefix("torch.") != info.dtype:
                raise CorruptArtifactError(f"K/V store entry {info.entry_id}: tensor {name!r} is "
                                           f"{None if t is None else (tuple(t.shape), t.dtype)}, its fields say "
                                           f"{want} {info.dtype}")
        return k, v

    def usage(self):
        return self.backend.usage()


def open_kv_store(spec, tenant: str | None = None, max_bytes: int | None = None):
    """The vLLM connector's store for ``spec``: a folder path gives the folder store
    (:class:`~hf_kvreuse.vllm.store.KVDirStore`, its own format), a URL or a backend a :class:`KVEntryStore`."""
    import os

    from ..vllm.store import KVDirStore

    if isinstance(spec, (KVDirStore, KVEntryStore)):
        return spec
    if isinstance(spec, (str, os.PathLike)) and "://" not in str(spec):
        return KVDirStore(spec)
    return KVEntryStore(spec, tenant=tenant, max_bytes=max_bytes)


# -- ReuseSession ----------------------------------------------------------------------------------------------------
def _session_ns(model) -> str:
    from ..fingerprint import model_fingerprint

    return namespace("session", model_fingerprint(model))


def save_session(session, store, name: str = "session", tenant: str | None = None) -> dict:
    """Write every cache ``session`` holds as one entry ``name`` of ``store`` (replacing the previous one
    atomically); returns the manifest written. The namespace is the model's fingerprint. Options are kept as
    :func:`hf_kvreuse.persist.save_session` keeps them (each JSON option on its own; the names of the others)."""
    from ..persist import _model_identity, entry_to_record, session_snapshot
    from ..version import __version__

    if getattr(session, "_trajectory", None) is not None:
        raise NotImplementedError("the base_lr policy's BaseLRCache trajectory cannot be saved yet (only the caches "
                                  "of the other policies are)")
    check_name(name, "session name")
    backend = open_backend(store, tenant=tenant)
    entries, options = session_snapshot(session)  # it warns of what is not saved
    tensors, records = {}, []
    for i, e in enumerate(entries):
        t, meta = entry_to_record(e)
        tensors.update({f"e{i}.{k}": v for k, v in t.items()})
        records.append(dict(tokens=int(e.ids.numel()), fields=meta))
    manifest = dict(library=__version__, model=_model_identity(session.model), session=options,
                    entries=records)
    backend.put(_session_ns(session.model), name, manifest, tensors)
    return manifest


def load_session(store, model, name: str = "session", session_cls=None, tenant: str | None = None, **options):
    """A new ``session_cls`` session over ``model`` holding the caches of entry ``name`` (verified: entry checks,
    then the model's fingerprint and every tensor against the model). ``KeyError`` when the entry is absent;
    ``method_kwargs`` are merged as :func:`hf_kvreuse.persist.load_session` merges them."""
    from ..persist import PersistedKVError, _check_identity, _merge_method_kwargs, _session_layout, entry_from_record
    from ..session_entry import _Entry

    if session_cls is None:
        raise TypeError("load_session needs the session class to build: call ReuseSession.load(url, model), or "
                        "pass session_cls=ReuseSession")
    check_name(name, "session name")
    backend = open_backend(store, tenant=tenant)
    ns = _session_ns(model)
    try:
        got = backend.get(ns, name)
    except CorruptEntryError as e:
        raise PersistedKVError(str(e)) from None
    if got is None:
        raise KeyError(f"no saved ReuseSession {name!r} of this model in {backend!r}")
    manifest, tensors = got
    where = f"{backend!r} session {name!r}"
    _check_identity(manifest["model"], model, where)
    saved = dict(manifest["session"])
    given = options.pop("method_kwargs", None)
    saved["method_kwargs"] = _merge_method_kwargs(saved, where, given)
    saved.pop("method_kwargs_not_saved", None)
    saved.update(options)
    layout = _session_layout(model, manifest["entries"], where)
    session = session_cls(model, **saved)
    windows = getattr(session, "_windows", None)
    entries = []
    for i, rec in enumerate(manifest["entries"]):
        pre = f"e{i}."
        t = {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}
        if int(t["ids"].numel() if "ids" in t else -1) != rec.get("tokens"):
            raise PersistedKVError(f"{where} entry {i}: holds a different number of tokens than its record says")
        entries.append(entry_from_record(_Entry, t, rec["fields"], layout, f"{where} entry {i}", windows))
    kept, total = [], 0
    for e in reversed(entries):
        if total + e.nbytes <= session.max_bytes:
            kept.append(e)
            total += e.nbytes
    for e in reversed(kept):
        session._entries[session._next_key] = e
        session._next_key += 1
    return session
