"""The one rule for every file hf_kvreuse writes and reads back (sessions, the disk tier, the K/V store, artifacts).

* **Contained**: a file named by a manifest is resolved inside its folder: an absolute name, a name with a path
  separator or ``..``, or a symlink that leads out of the folder is refused (:func:`inside`), for reads and for
  deletions alike.
* **Content-hashed**: the bytes are hashed in memory *before* they are written and renamed into place, so the
  digest a manifest records is the digest of the bytes that writer wrote (:func:`write_atomic`), and every read
  compares the bytes it parses with the recorded digest (:func:`read_verified`).
* **Unique temporaries**: each write goes to ``.tmp-<pid>-<random>`` in the same folder, is flushed and
  ``os.replace``-d into place (atomic on POSIX): two writers of one name never share a temporary file.
* **Damaged files are rewritten**: an existing file of the target name is kept only when its bytes hash to the
  digest being written; otherwise it is replaced.
* **Signed manifests**: a JSON manifest carries the sha256 of its own canonical form (:func:`sign`), checked on
  every read (:func:`check_signed`): an edited field is refused, not trusted.

This module is a primitive: it imports no cache, session or storage module. Errors are raised as the caller's
error type (``error=``), :class:`FileIntegrityError` by default.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from .errors import HFKVReuseError

__all__ = ["FileIntegrityError", "inside", "sha256_bytes", "write_atomic", "read_verified", "remove_inside",
           "canonical", "sign", "check_signed", "write_json", "SIGNATURE"]

SIGNATURE = "meta_sha256"


class FileIntegrityError(HFKVReuseError, ValueError):
    """A file name that leaves its folder, a file whose bytes do not match their recorded digest, or a manifest
    whose fields do not match its own signature."""


def inside(folder: str | os.PathLike, name, where: str = "", error: type[Exception] = FileIntegrityError) -> Path:
    """``folder / name`` after checking that it stays in ``folder``.

    ``name`` must be a single file name (a non-empty ``str`` without path separators, not ``.`` or ``..``, no NUL);
    a symlink there must resolve to a file of the same folder.
    """
    what = where or str(folder)
    if not isinstance(name, str) or not name or name in (".", "..") or "\x00" in name:
        raise error(f"{what}: {name!r} is not a file name")
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if any(s in name for s in seps) or os.path.isabs(name):
        raise error(f"{what}: file name {name!r} leaves its folder {folder} (absolute or with a path separator); "
                    "refused")
    base = Path(folder)
    path = base / name
    if path.resolve().parent != base.resolve():
        raise error(f"{what}: {name!r} resolves to {path.resolve()}, outside its folder {base.resolve()} (a symlink "
                    "out of the folder); refused")
    return path


def sha256_bytes(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _tmp(folder: Path, suffix: str) -> Path:
    return folder / f".tmp-{os.getpid()}-{uuid.uuid4().hex}{suffix}"


def write_atomic(folder: str | os.PathLike, name: str, data: bytes, sha256: str | None = None) -> str:
    """Write ``data`` as ``folder/name`` (unique temporary, fsync, rename); returns the sha256 of ``data``.

    An existing file of that name is kept only when its bytes hash to the same digest (a damaged one is replaced).
    """
    folder = Path(folder)
    final = inside(folder, name)
    sha = sha256 or sha256_bytes(data)
    try:
        if final.is_file() and not final.is_symlink() and sha256_bytes(final.read_bytes()) == sha:
            return sha
    except OSError:
        pass
    tmp = _tmp(folder, Path(name).suffix)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return sha


def read_verified(folder: str | os.PathLike, name, sha256: str, where: str = "",
                  error: type[Exception] = FileIntegrityError) -> bytes:
    """The bytes of ``folder/name`` (contained, see :func:`inside`) after their sha256 matched ``sha256``.

    Raises ``FileNotFoundError`` when the file is missing (a concurrent writer may have pruned it)."""
    path = inside(folder, name, where, error)
    data = path.read_bytes()
    got = sha256_bytes(data)
    if not isinstance(sha256, str) or got != sha256:
        raise error(f"{path}: sha256 {got[:16]}... does not match the recorded {str(sha256)[:16]}... (the file is "
                    "damaged or was changed after it was written)")
    return data


def remove_inside(folder: str | os.PathLike, name) -> int:
    """Delete ``folder/name`` when it is a file of ``folder`` (a name leaving it is ignored); returns its size."""
    try:
        path = inside(folder, name)
    except FileIntegrityError:
        return 0
    try:
        size = path.lstat().st_size
        path.unlink()
        return size
    except FileNotFoundError:
        return 0


def canonical(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), default=str)


def sign(meta: dict, field: str = SIGNATURE) -> dict:
    """``meta`` plus ``field``: the sha256 of the canonical JSON of every other field."""
    body = {k: v for k, v in meta.items() if k != field}
    return dict(body, **{field: sha256_bytes(canonical(body).encode())})


def check_signed(meta, where: str, field: str = SIGNATURE, error: type[Exception] = FileIntegrityError) -> dict:
    """Refuse a manifest that is not a JSON object, has no ``field`` or whose fields do not hash to it."""
    if not isinstance(meta, dict):
        raise error(f"{where}: not a JSON object")
    if field not in meta:
        raise error(f"{where}: no {field!r} signature (edited, or written by an older hf_kvreuse); refused")
    body = {k: v for k, v in meta.items() if k != field}
    if sha256_bytes(canonical(body).encode()) != meta[field]:
        raise error(f"{where}: its fields do not match their recorded sha256 (the manifest was edited or damaged)")
    return meta


def write_json(folder: str | os.PathLike, name: str, meta: dict) -> str:
    """Write ``meta`` (signed by the caller when it should be) atomically as ``folder/name``."""
    return write_atomic(folder, name, json.dumps(meta, indent=1, sort_keys=True).encode())
