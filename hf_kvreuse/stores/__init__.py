"""One store protocol for saved K/V, several backends: a folder (embedded, the default) and Redis / Valkey.

An *entry* is one JSON object (``meta``) and a set of named tensors, stored under a *namespace* and a *key*. Every
backend stores an entry as one unit (one file renamed into place, one Redis hash written by one command), so its
meta and its tensors appear together or not at all, and an eviction removes the whole entry. The entry's bytes are
self-describing and content-hashed: :func:`encode_entry` records the namespace, the key, each tensor's dtype and
shape, the sha256 of the tensor bytes and a sha256 of the meta's own fields; :func:`decode_entry` checks all of
them and that every floating value is finite, on every load. A failing entry raises :class:`CorruptEntryError`
(the stores built on a backend refuse it, delete it and recompute).

Namespaces separate models and tenants: :func:`namespace` hashes a model identity (the string that names the
weights and every K/V-relevant config field) with a kind (``"vllm"``, ``"chunk"``, ``"session"``); a backend's
optional ``tenant`` prefixes every key, so Redis ACL key patterns (``~tenant:*``) confine a tenant's client to its
own entries.

Users of the protocol: :class:`hf_kvreuse.stores.tiers.StoreTier` (a :class:`~hf_kvreuse.ChunkStore` tier),
:class:`hf_kvreuse.stores.tiers.KVEntryStore` (the vLLM connector's store), :func:`hf_kvreuse.stores.tiers.save_session`
/ :func:`~hf_kvreuse.stores.tiers.load_session` (a :class:`~hf_kvreuse.ReuseSession`).
"""

from __future__ import annotations

import os

from .base import (FORMAT, NO_TENANT, CorruptEntryError, EntryBackend, FolderBackend, NamespaceUsage,  # noqa: F401
                   StoreUnavailableError, _BudgetMixin, _iter_chunks, check_name, decode_entry, decode_meta,
                   encode_entry, namespace, redact_url, valid_name)

__all__ = ["FORMAT", "CorruptEntryError", "StoreUnavailableError", "EntryBackend", "NamespaceUsage",
           "FolderBackend", "encode_entry", "decode_entry", "namespace", "open_backend", "check_name", "redact_url"]

_URL_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


def open_backend(spec, tenant: str | None = None, max_bytes: int | None = None, **kwargs) -> EntryBackend:
    """A backend from ``spec``: a backend (returned as it is), a ``redis://``, ``rediss://`` (TLS) or ``unix://``
    URL (:class:`~hf_kvreuse.stores.redis.RedisBackend`; ``kwargs`` go to it), or a folder path
    (:class:`FolderBackend`)."""
    if isinstance(spec, EntryBackend) and not isinstance(spec, (str, os.PathLike)):
        return spec
    if isinstance(spec, str) and spec.split("://", 1)[0].lower() in _URL_SCHEMES:  # schemes ignore case
        from .redis import RedisBackend

        return RedisBackend(spec, tenant=tenant, max_bytes=max_bytes, **kwargs)
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and "://" not in spec):
        return FolderBackend(spec, tenant=tenant, max_bytes=max_bytes)
    if isinstance(spec, str):
        raise ValueError(f"store {redact_url(spec)}: unknown scheme (a store URL is one of "
                         f"{', '.join(s + '://' for s in _URL_SCHEMES)}; a folder is a path)")
    raise TypeError(f"a store is a folder path, a redis:// URL or an EntryBackend, not {type(spec).__name__}")
