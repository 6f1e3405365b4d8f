"""The store protocol's shared parts: the entry encoding, its errors and names, and the folder backend (see
:mod:`hf_kvreuse.stores`)."""


from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

import torch

from ..artifacts import CorruptArtifactError, check_finite
from ..errors import HFKVReuseError

FORMAT = "hf_kvreuse.entry/1"
# the name rule (check_name): a letter or digit first, then letters, digits, '_', '.', '-'; not ending in '.'
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# names Windows gives to devices, whatever follows a '.' ("nul.entry" is the null device there)
_DEVICE_NAMES = frozenset(["con", "prn", "aux", "nul", *(f"{p}{i}" for p in ("com", "lpt") for i in range(10))])
#: the folder of the entries of a backend without a tenant: a name no tenant can take (tenants start with a letter
#: or a digit)
NO_TENANT = "_"



class CorruptEntryError(CorruptArtifactError):
    """A stored entry that fails a check: unreadable meta, another namespace or key, a sha256 mismatch, tensors
    that differ from their recorded dtypes and shapes, non-finite values."""


class StoreUnavailableError(HFKVReuseError, ConnectionError):
    """The store's server cannot be reached (down, restarting, network): callers treat it as a miss."""


@dataclass(frozen=True)
class NamespaceUsage:
    """What one namespace holds now: entries and bytes (meta + tensors, as stored), against its budget."""

    namespace: str
    entries: int
    nbytes: int
    max_bytes: int | None = None


def valid_name(name) -> bool:
    """Whether ``name`` follows the name rule of :func:`check_name`."""
    return (isinstance(name, str) and _NAME.fullmatch(name) is not None and not name.endswith(".")
            and name.split(".", 1)[0].lower() not in _DEVICE_NAMES)


def check_name(name: str, what: str) -> str:
    """``name`` if it may name a tenant, a namespace, an entry or a session, else ``ValueError``.

    The one rule for every name a caller gives that becomes a path or a key, on every backend: 1-128 characters of
    letters, digits, ``_``, ``.``, ``-``; a letter or digit first; not ending in ``.``; not a Windows device name
    (``con``, ``nul``, ``com1``, ...). So a name is never ``.`` or ``..``, never holds a separator (``/``, ``\\``,
    ``:``), never names a hidden or temporary file, never takes :data:`NO_TENANT` (the folder of the entries
    without a tenant), and two distinct names are two distinct files, folders or keys."""
    if not valid_name(name):
        raise ValueError(f"{what} {name!r} must be 1-128 characters of letters, digits, '_', '.', '-', starting "
                         "with a letter or digit and not ending in '.' (no separators, no '.' or '..', not a "
                         "device name such as 'nul')")
    return name


_SECRET_PARAM = re.compile(r"pass|pwd|user|secret|token|auth|cred|key", re.I)


def redact_url(url) -> str:
    """``url`` as it may be shown (reprs, logs, exception messages): no user name, password or secret query value.

    The user information before ``@`` becomes ``***`` (``redis://user:pw@h``, ``redis://:pw@h``,
    ``unix://user@/path``), the value of every query parameter whose name speaks of a secret (``password``,
    ``username``, ``ssl_password``, ..., in any case, percent-encoded or not) becomes ``***``, and a fragment is
    dropped. A URL whose parts cannot be told apart (an ``@`` after the host: a password holding ``/``, ``?``,
    ``#`` or a query value holding ``@``) keeps its scheme only. A string without ``://`` (a folder) is returned
    as it is."""
    from urllib.parse import unquote_plus, urlsplit

    text = str(url)
    if "://" not in text:
        return text
    scheme = text.split("://", 1)[0]
    try:
        parts = urlsplit(text)
    except ValueError:
        return f"{scheme}://***"
    hostport = parts.netloc.rpartition("@")[2]
    if "@" in parts.path + parts.query + parts.fragment:
        return f"{scheme}://***"
    out = f"{scheme}://{'***@' if '@' in parts.netloc else ''}{hostport}{parts.path}"
    if parts.query:
        shown = []
        for piece in re.split(r"([&;])", parts.query):
            name, eq, _ = piece.partition("=")
            shown.append(f"{name}=***" if eq and _SECRET_PARAM.search(unquote_plus(name)) else piece)
        out += "?" + "".join(shown)
    return out


def namespace(kind: str, identity_key: str) -> str:
    """The namespace of ``kind`` entries of one model: ``<kind>-<sha256(identity_key)[:24]>``."""
    check_name(kind, "namespace kind")
    return f"{kind}-{hashlib.sha256(identity_key.encode()).hexdigest()[:24]}"


def _digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def encode_entry(ns: str, key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    """``(meta bytes, tensor bytes)`` of an entry: the tensors as safetensors, the meta with the entry's
    namespace, key, tensor dtypes and shapes, the tensors' sha256 and its own sha256."""
    from safetensors.torch import save

    plain, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() or ptr in seen:
            t = t.clone()  # a view, or the same storage as another tensor: safetensors writes owners only
        seen.add(t.untyped_storage().data_ptr())
        plain[name] = t
    data = save(plain, metadata={"format": FORMAT})
    full = {"format": FORMAT, "namespace": ns, "key": key, "user": meta, "written_at": time.time(),
            "tensors": {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in plain.items()},
            "data_sha256": hashlib.sha256(data).hexdigest(), "data_bytes": len(data)}
    full["meta_sha256"] = _digest(full)
    return json.dumps(full, sort_keys=True, separators=(",", ":")).encode(), data


def decode_meta(ns: str, key: str, meta_bytes: bytes, where: str) -> dict:
    """The full meta of an entry after its own checks (format, namespace, key, its sha256)."""
    try:
        full = json.loads(meta_bytes)
    except (ValueError, TypeError) as e:
        raise CorruptEntryError(f"{where}: meta is not JSON ({e})") from None
    if not isinstance(full, dict) or full.get("format") != FORMAT:
        raise CorruptEntryError(f"{where}: format {full.get('format') if isinstance(full, dict) else None!r}, "
                                f"expected {FORMAT!r}")
    if full.get("meta_sha256") != _digest(full):
        raise CorruptEntryError(f"{where}: meta fields do not match their recorded sha256 (edited or corrupted)")
    if full.get("namespace") != ns or full.get("key") != key:
        raise CorruptEntryError(f"{where}: holds the entry {full.get('namespace')}/{full.get('key')}, not {ns}/{key}")
    return full


def decode_entry(ns: str, key: str, meta_bytes: bytes, data: bytes, where: str) -> tuple[dict, dict]:
    """``(user meta, tensors)`` of an entry, verified (module docstring), or :class:`CorruptEntryError`."""
    from safetensors.torch import load

    full = decode_meta(ns, key, meta_bytes, where)
    got = hashlib.sha256(data).hexdigest()
    if got != full["data_sha256"]:
        raise CorruptEntryError(f"{where}: tensor bytes have sha256 {got[:16]}..., the meta records "
                                f"{full['data_sha256'][:16]}... (damaged or changed after writing)")
    try:
        tensors = load(bytes(data))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise CorruptEntryError(f"{where}: not readable safetensors ({e})") from None
    want = {n: (d, tuple(s)) for n, (d, s) in full["tensors"].items()}
    have = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}
    if want != have:
        raise CorruptEntryError(f"{where}: tensors {have} differ from the recorded {want}")
    try:
        check_finite(tensors, where)
    except CorruptArtifactError as e:
        raise CorruptEntryError(str(e)) from None
    return full["user"], tensors


@runtime_checkable
class EntryBackend(Protocol):
    """What a store backend provides. Keys and namespaces are :func:`check_name` strings.

    ``put`` writes an entry as one unit (replacing one of the same key); ``get`` returns ``(user meta, tensors)``
    verified, None when absent (never written, evicted, lost in a restart), or raises :class:`CorruptEntryError`;
    ``metas`` returns the verified user meta of every entry of a namespace (entries whose meta fails are left
    out); ``usage`` reports each namespace's entries and bytes.
    """

    tenant: str | None
    max_bytes: int | None

    def put(self, ns: str, key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None: ...

    def get(self, ns: str, key: str) -> tuple[dict, dict] | None: ...

    def meta(self, ns: str, key: str) -> dict | None: ...

    def metas(self, ns: str) -> dict[str, dict]: ...

    def delete(self, ns: str, key: str) -> None: ...

    def namespaces(self) -> list[str]: ...

    def usage(self, ns: str | None = None) -> list[NamespaceUsage]: ...

    def clear(self, ns: str) -> None: ...


class _BudgetMixin:
    """A per-namespace byte budget kept by the writers: after a put, the oldest entries (by write time) of that
    namespace (but never the one just written) are deleted while it holds more than ``max_bytes``. The server's own
    eviction (Redis ``maxmemory``) works beside it."""

    max_bytes: int | None

    def _sizes(self, ns: str) -> list[tuple[float, str, int]]:
        raise NotImplementedError

    def _enforce(self, ns: str, keep: str | None = None) -> int:
        if self.max_bytes is None:
            return 0
        sizes = sorted(self._sizes(ns))
        total, n = sum(s for _, _, s in sizes), 0
        for _, key, size in sizes:
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            self.delete(ns, key)
            total -= size
            n += 1
        self.evictions += n
        return n


class FolderBackend(_BudgetMixin):
    """Entries as files of a folder: ``<folder>/<tenant>/<namespace>/<key>.entry`` (8-byte meta length, meta JSON,
    safetensors bytes), written to a unique temporary name and renamed into place (atomic on POSIX). Shared by the
    processes of one machine (or a network filesystem with atomic renames)."""

    SUFFIX = ".entry"

    def __init__(self, path: str | os.PathLike, tenant: str | None = None, max_bytes: int | None = None):
        self.root = Path(path)
        self.tenant = None if tenant is None else check_name(tenant, "tenant")
        self.max_bytes = max_bytes
        self.evictions = 0
        self.base = self.root / (self.tenant or NO_TENANT)
        self.base.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"FolderBackend({str(self.root)!r}, tenant={self.tenant!r})"

    def _file(self, ns: str, key: str) -> Path:
        return self.base / check_name(ns, "namespace") / f"{check_name(key, 'key')}{self.SUFFIX}"

    def put(self, ns, key, meta, tensors) -> None:
        import uuid

        mb, data = encode_entry(ns, key, meta, tensors)
        file = self._file(ns, key)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(len(mb).to_bytes(8, "little") + mb + data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, file)
        finally:
            if tmp.exists():
                tmp.unlink()
        self._enforce(ns, keep=key)

    def _read(self, file: Path) -> tuple[bytes, bytes] | None:
        try:
            raw = file.read_bytes()
        except FileNotFoundError:
            return None
        n = int.from_bytes(raw[:8], "little")
        if len(raw) < 8 or n > len(raw) - 8:
            raise CorruptEntryError(f"{file}: truncated entry")
        return raw[8:8 + n], raw[8 + n:]

    def get(self, ns, key):
        file = self._file(ns, key)
        got = self._read(file)
        if got is None:
            return None
        return decode_entry(ns, key, got[0], got[1], str(file))

    def meta(self, ns, key):
        file = self._file(ns, key)
        got = self._read(file)
        return None if got is None else decode_meta(ns, key, got[0], str(file))["user"]

    def metas(self, ns):
        out = {}
        for file in sorted((self.base / check_name(ns, "namespace")).glob(f"*{self.SUFFIX}")):
            key = file.name[:-len(self.SUFFIX)]
            if not valid_name(key):
                continue  # not a file this backend wrote
            try:
                m = self.meta(ns, key)
            except CorruptEntryError:
                continue
            if m is not None:
                out[key] = m
        return out

    def delete(self, ns, key) -> None:
        self._file(ns, key).unlink(missing_ok=True)

    def namespaces(self) -> list[str]:
        return sorted(p.name for p in self.base.iterdir() if p.is_dir() and valid_name(p.name))

    def _sizes(self, ns):
        out = []
        for file in (self.base / check_name(ns, "namespace")).glob(f"*{self.SUFFIX}"):
            try:
                st = file.stat()
            except FileNotFoundError:
                continue
            if valid_name(file.name[:-len(self.SUFFIX)]):
                out.append((st.st_mtime, file.name[:-len(self.SUFFIX)], st.st_size))
        return out

    def usage(self, ns=None) -> list[NamespaceUsage]:
        return [NamespaceUsage(n, len(s), sum(x[2] for x in s), self.max_bytes)
                for n in ([ns] if ns else self.namespaces()) for s in [self._sizes(n)]]

    def clear(self, ns) -> None:
        for _, key, _ in self._sizes(ns):
            self.delete(ns, key)


def _iter_chunks(seq: list, n: int) -> Iterable[list]:
    for i in range(0, len(seq), n):
        yield seq[i:i + n]
