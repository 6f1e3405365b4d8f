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
import re
import time

from .base import (_SECRET_PARAM, CorruptEntryError, NamespaceUsage, StoreUnavailableError, _BudgetMixin, _iter_chunks,
                   check_name, decode_entry, decode_meta, encode_entry, redact_url, valid_name)

PREFIX = "hfkv"


def _secrets(url: str, kwargs: dict) -> list[str]:
    """Every secret ``url`` and ``kwargs`` hold (user, password, secret query values; raw and decoded), longest
    first: :meth:`RedisBackend._scrub` removes them from the server's and the client's error messages."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    found = [v for k, v in kwargs.items() if _SECRET_PARAM.search(k) and isinstance(v, (str, bytes))]
    try:
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        found += re.split(r"[:@]", userinfo) + [unquote(x) for x in userinfo.split(":", 1)]
        found += [v for k, v in parse_qsl(parts.query) if _SECRET_PARAM.search(k)]
    except ValueError:
        pass
    return sorted({x.decode() if isinstance(x, bytes) else x for x in found if x}, key=len, reverse=True)


def _client_desc(client) -> str:
    """A ready client as it may be shown: its class and where it connects (never its credentials)."""
    kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None) or {}
    where = kw.get("path") or (f"{kw.get('host')}:{kw.get('port')}/{kw.get('db', 0)}" if kw.get("host") else "")
    return f"{type(client).__name__}({where})"


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
            url = re.sub(r"^valkey(s?)://", r"redis\1://", url, count=1, flags=re.I)
            self._hidden = _secrets(url, kwargs)
            kwargs.setdefault("socket_timeout", 30)
            try:
                self.client = redis.Redis.from_url(url, **kwargs)
            except ValueError as e:  # a malformed URL: the message may quote a part of it
                raise ValueError(f"Redis store {redact_url(url)}: {self._scrub(str(e))}") from None
            self.url = redact_url(url)  # no credentials in reprs, logs and errors
        else:
            kw = getattr(getattr(url, "connection_pool", None), "connection_kwargs", None) or {}
            self._hidden = _secrets("", kw)
            self.client, self.url = url, _client_desc(url)
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
            raise StoreUnavailableError(f"Redis store {self.url}: {type(e).__name__}: {self._scrub(str(e))}") from e

    def _scrub(self, text: str) -> str:
        """``text`` without any credential this backend was given (a server or client message may quote one)."""
        for secret in self._hidden:
            text = text.replace(secret, "***")
        return text

    # -- the protocol ---------------------------------------------------------------------------------------------
    def put(self, ns, key, meta, tensors) -> None:
        mb, data = encode_entry(ns, key, meta, tensors)
        try:  # one command: applied whole or not at all
            self._call(self.client.hset, self._key(ns, key), mapping={"meta": mb, "data": data})
        except self._refusals as e:  # over maxmemory (a single entry larger than it), over proto-max-bulk-len, ...
            raise StoreUnavailableError(f"Redis store {self.url}: the server refused an entry of {len(data)} bytes: "
                                        f"{self._scrub(str(e))}") from e
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
        """The keys of the entries of ``ns``: ``<base><ns>:<key>`` with a valid key (the pattern also matches keys
        of another layout, e.g. those of a tenant named like this backend's prefix; they are not this backend's)."""
        head = f"{self.base}{check_name(ns, 'namespace')}:"
        keys = (k.decode() if isinstance(k, bytes) else k
                for k in self._call(lambda: list(self.client.scan_iter(match=f"{head}*", count=1000))))
        return sorted(k for k in keys if valid_name(k[len(head):]))

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
        names = [(k.decode() if isinstance(k, bytes) else k)[len(self.base):].split(":") for k in keys]
        return sorted({n[0] for n in names if len(n) == 2 and valid_name(n[0]) and valid_name(n[1])})

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
