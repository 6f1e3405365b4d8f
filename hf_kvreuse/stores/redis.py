"""The Redis / Valkey backend of the store protocol (:mod:`hf_kvreuse.stores`), through the ``redis`` client.

Layout: an entry is **one hash key** ``[<tenant>:]hfkv:<namespace>:<key>`` with two fields, ``meta`` (the JSON of
:func:`~hf_kvreuse.stores.encode_entry`) and ``data`` (safetensors bytes), written by one ``HSET`` (a single
command is applied whole or not at all: a client or connection that dies mid-command leaves nothing). So:

* a reader sees the whole entry or none, and checks it (sha256, namespace, key, shapes, finite values) anyway;
* the server's eviction (``maxmemory`` with ``allkeys-lru`` / ``allkeys-lfu``) removes whole entries; an evicted
  entry is a miss and its K/V are recomputed;
* with a tenant, every key starts with ``<tenant>:``, so an ACL user restricted to ``~<tenant>:*`` can read and
  write its own entries only (``ACL SETUSER alice on >pw ~alice:* +@all -@dangerous``).

Listing a namespace is a ``SCAN`` over its key pattern plus one pipelined ``HGET meta`` per key (no index key that
could survive its entries). Connection failures raise :class:`~hf_kvreuse.stores.StoreUnavailableError`, which the
stores built on a backend treat as a miss.
"""

from __future__ import annotations

import json
import time

from .base import (CorruptEntryError, NamespaceUsage, StoreUnavailableError, _BudgetMixin, _iter_chunks, check_name,
               decode_entry, decode_meta, encode_entry)

PREFIX = "hfkv"


def _redis():
    try:
        import redis
    except ImportError:  # pragma: no cover -- the optional dependency
        raise ImportError("the Redis store needs the redis client: pip install 'hf_kvreuse[redis]'") from None
    return redis


class RedisBackend(_BudgetMixin):
    """Entries in a Redis 7 / Valkey server (module docstring).

    Parameters
    ----------
    url : str or redis.Redis
        ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS; ``ssl_ca_certs=`` etc. in ``kwargs``),
        ``unix:///path/redis.sock``, or a ready client (``redis.Redis`` or ``redis.cluster.RedisCluster``).
    tenant : str, optional
        Prefix of every key (the ACL unit).
    max_bytes : int, optional
        Per-namespace budget kept by writers (oldest entries deleted beyond it); the server's ``maxmemory`` evicts
        independently.
    kwargs
        Passed to ``redis.Redis.from_url`` (``username``, ``password``, ``ssl_ca_certs``, ``socket_timeout``, ...).
    """

    def __init__(self, url, tenant: str | None = None, max_bytes: int | None = None, **kwargs):
        redis = _redis()
        self.tenant = None if tenant is None else check_name(tenant, "tenant")
        self.max_bytes = max_bytes
        self.evictions = 0
        if isinstance(url, str):
            url = url.replace("valkey://", "redis://", 1).replace("valkeys://", "rediss://", 1)
            kwargs.setdefault("socket_timeout", 30)
            self.client = redis.Redis.from_url(url, **kwargs)
            self.url = url.split("@")[-1]  # no credentials in reprs and logs
        else:
            self.client, self.url = url, repr(url)
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        # a write the server refuses for its size or memory is a lost write (a future miss); an ACL refusal
        # (NoPermissionError) is a configuration error and propagates
        self._refusals = tuple(c for c in (getattr(redis.exceptions, "OutOfMemoryError", None),) if c) or ()
        self.base = f"{self.tenant}:{PREFIX}:" if self.tenant else f"{PREFIX}:"

    def __repr__(self) -> str:
        return f"RedisBackend({self.url!r}, tenant={self.tenant!r})"

    def _key(self, ns: str, key: str) -> str:
        return f"{self.base}{check_name(ns, 'namespace')}:{check_name(key, 'key')}"

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise StoreUnavailableError(f"Redis store {self.url}: {type(e).__name__}: {e}") from e

    # -- the protocol ---------------------------------------------------------------------------------------------
    def put(self, ns, key, meta, tensors) -> None:
        mb, data = encode_entry(ns, key, meta, tensors)
        try:  # one command: applied whole or not at all
            self._call(self.client.hset, self._key(ns, key), mapping={"meta": mb, "data": data})
        except self._refusals as e:  # over maxmemory (a single entry larger than it), over proto-max-bulk-len, ...
            raise StoreUnavailableError(f"Redis store {self.url}: the server refused an entry of {len(data)} bytes: "
                                        f"{e}") from e
        self._enforce(ns, keep=key)

    def get(self, ns, key):
        rk = self._key(ns, key)
        mb, data = self._call(self.client.hmget, rk, ["meta", "data"])
        if mb is None and data is None:
            return None
        if mb is None or data is None:
            raise CorruptEntryError(f"redis key {rk}: holds {'data' if mb is None else 'meta'} only")
        return decode_entry(ns, key, mb, data, f"redis key {rk}")

    def meta(self, ns, key):
        rk = self._key(ns, key)
        mb = self._call(self.client.hget, rk, "meta")
        return None if mb is None else decode_meta(ns, key, mb, f"redis key {rk}")["user"]

    def _keys(self, ns: str) -> list[str]:
        pattern = f"{self.base}{check_name(ns, 'namespace')}:*"
        return sorted(k.decode() if isinstance(k, bytes) else k
                      for k in self._call(lambda: list(self.client.scan_iter(match=pattern, count=1000))))

    def metas(self, ns):
        out = {}
        keys = self._keys(ns)
        for part in _iter_chunks(keys, 256):
            pipe = self.client.pipeline(transaction=False)
            for rk in part:
                pipe.hget(rk, "meta")
            for rk, mb in zip(part, self._call(pipe.execute)):
                if mb is None:
                    continue  # evicted between the scan and the read
                key = rk.rsplit(":", 1)[1]
                try:
                    out[key] = decode_meta(ns, key, mb, f"redis key {rk}")["user"]
                except CorruptEntryError:
                    continue
        return out

    def delete(self, ns, key) -> None:
        self._call(self.client.delete, self._key(ns, key))

    def namespaces(self) -> list[str]:
        keys = self._call(lambda: list(self.client.scan_iter(match=f"{self.base}*", count=1000)))
        return sorted({(k.decode() if isinstance(k, bytes) else k)[len(self.base):].split(":", 1)[0] for k in keys})

    def _sizes(self, ns):
        keys = self._keys(ns)
        out = []
        for part in _iter_chunks(keys, 256):
            pipe = self.client.pipeline(transaction=False)
            for rk in part:
                pipe.hstrlen(rk, "meta")
                pipe.hstrlen(rk, "data")
                pipe.hget(rk, "meta")
            got = self._call(pipe.execute)
            for i, rk in enumerate(part):
                m, d, mb = got[3 * i:3 * i + 3]
                if mb is None:
                    continue
                try:
                    written = float(json.loads(mb).get("written_at", 0.0))
                except ValueError:
                    written = 0.0
                out.append((written, rk.rsplit(":", 1)[1], int(m) + int(d)))
        return out

    def usage(self, ns=None) -> list[NamespaceUsage]:
        return [NamespaceUsage(n, len(s), sum(x[2] for x in s), self.max_bytes)
                for n in ([ns] if ns else self.namespaces()) for s in [self._sizes(n)]]

    def clear(self, ns) -> None:
        keys = self._keys(ns)
        for part in _iter_chunks(keys, 512):
            self._call(self.client.delete, *part)

    def server_memory(self) -> dict:
        """The server's ``used_memory``, ``maxmemory``, ``maxmemory_policy`` and ``evicted_keys`` (INFO)."""
        info = {**self._call(self.client.info, "memory"), **self._call(self.client.info, "stats")}
        return {k: info.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys")}

    def ping(self, timeout_s: float = 5.0) -> bool:
        end = time.time() + timeout_s
        while True:
            try:
                return bool(self.client.ping())
            except self._errors:
                if time.time() > end:
                    return False
                time.sleep(0.05)
