"""A directory of K/V entries that vLLM (through :mod:`hf_kvreuse.vllm.connector`) and hf_kvreuse share.

One entry is the K/V of one token sequence from position 0 (a request's prompt and answer, or a transformers
prefill), computed by one model (:class:`~hf_kvreuse.vllm.identity.ModelIdentity`):

* ``<id>.<sha>.safetensors``: ``k`` and ``v``, each ``[layers, kv_heads, tokens, head_dim]``, keys post-RoPE at
  positions
  ``0..tokens-1`` (as both transformers and vLLM cache them), in the dtype the model computed them;
* ``<id>.json``: the format tag, the model identity, the token ids, ``exact_len`` (rows ``0..exact_len-1`` are the
  K/V a plain prefill of those tokens computes; rows past it were computed over re-positioned rows and serve only
  as re-positioned donors), the geometry, who wrote it, the name and sha256 of the tensor file and a sha256 of
  the JSON's own fields (an edited token list is detected, not trusted).

Writes follow :mod:`hf_kvreuse.safe_files`: the tensor file is named by its content and hashed before the rename
that publishes it, then the JSON that names it is renamed into place. Several processes (engines on one machine,
or machines sharing the folder over a network filesystem) may write and read one store; the id is a hash of the
model key and the tokens, so two writers of the same sequence write the same JSON name, and whichever JSON a
reader finds names the tensors its own writer wrote (never one writer's fields over another's K/V). Tensor files no
JSON names are deleted once older than a minute. Every read verifies both digests, that the tensor file lies in the
folder, the tensors' shapes against the JSON and that every value is finite;
:class:`~hf_kvreuse.artifacts.CorruptArtifactError` names the file otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .. import safe_files
from ..artifacts import CorruptArtifactError, read_artifact, write_artifact
from .identity import ModelIdentity, ModelMismatchError

logger = logging.getLogger(__name__)

FORMAT = "hf_kvreuse.kvstore/2"  # 2: content-named tensor files, identity with the config, whole-JSON digest
#: seconds a tensor file no JSON names is kept (a reader that read the previous JSON still finds it)
ORPHAN_GRACE_S = 60.0


@dataclass(frozen=True)
class EntryInfo:
    """An entry's JSON, parsed and self-verified (the tensors are read by :meth:`KVDirStore.load`)."""

    entry_id: str
    identity: ModelIdentity
    token_ids: tuple[int, ...]
    exact_len: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    written_by: str

    @property
    def length(self) -> int:
        return len(self.token_ids)


def entry_id(identity: ModelIdentity, token_ids: Sequence[int]) -> str:
    """The file stem of the entry of ``token_ids`` by ``identity`` (the same for every writer)."""
    h = hashlib.sha256(identity.key.encode())
    h.update(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:32]


def entry_meta(identity: ModelIdentity, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor,
               exact_len: int | None = None, written_by: str = "hf_kvreuse") -> tuple[str, dict]:
    """``(entry id, JSON fields)`` of the K/V of ``token_ids`` (``k``, ``v``: ``[layers, kv_heads, tokens,
    head_dim]``) under ``identity``, after the shapes, ``exact_len`` and the dtype are checked. Every store of
    this format (the folder's :class:`KVDirStore`, :class:`hf_kvreuse.stores.tiers.KVEntryStore`) writes these."""
    token_ids = [int(t) for t in token_ids]
    n = len(token_ids)
    if k.dim() != 4 or k.shape != v.shape or k.shape[2] != n:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [layers, kv_heads, {n}, "
                         "head_dim] for the given tokens")
    exact_len = n if exact_len is None else int(exact_len)
    if not 0 <= exact_len <= n:
        raise ValueError(f"exact_len={exact_len} outside 0..{n}")
    dtype = str(k.dtype).removeprefix("torch.")
    if dtype != identity.dtype:
        raise ModelMismatchError(f"K/V of dtype {dtype} stored under a model identity of dtype {identity.dtype}")
    meta = {"format": FORMAT, "model": identity.as_dict(), "token_ids": token_ids, "exact_len": exact_len,
            "layers": int(k.shape[0]), "kv_heads": int(k.shape[1]), "head_dim": int(k.shape[3]), "dtype": dtype,
            "written_by": written_by, "created": time.time()}
    return entry_id(identity, token_ids), meta


class KVDirStore:
    """Entries of one folder: write, index (longest exact prefix, donors) and verified reads.

    Parameters
    ----------
    path : str or PathLike
        The folder (created if missing).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        # stem -> (mtime_ns, size, EntryInfo | None): a JSON is parsed once per version of its file
        self._index: dict[str, tuple[int, int, EntryInfo | None]] = {}
        self.refused: dict[str, str] = {}   # stem -> why its JSON was not indexed (logged once)

    # -- writing -----------------------------------------------------------------------------------------
    def put(self, identity: ModelIdentity, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor,
            exact_len: int | None = None, written_by: str = "hf_kvreuse") -> EntryInfo:
        """Write the K/V of ``token_ids`` (``k``, ``v``: ``[layers, kv_heads, tokens, head_dim]``).

        ``exact_len`` (default: every row): how many leading rows are exactly what a plain prefill computes.
        """
        eid, meta = entry_meta(identity, token_ids, k, v, exact_len, written_by)
        exact_len = meta["exact_len"]
        old = self.info(eid)
        if old is not None and old.exact_len >= exact_len and old.identity.key == identity.key:
            return old  # the same rows are there, at least as exact
        write_artifact(self.path, eid, {"k": k.detach().contiguous().cpu(), "v": v.detach().contiguous().cpu()},
                       meta, content_named=True)
        self._prune(eid)
        return self.info(eid)

    def _prune(self, eid: str) -> None:
        """Delete tensor files of ``eid`` that its JSON does not name, once older than :data:`ORPHAN_GRACE_S`."""
        try:
            named = json.loads((self.path / f"{eid}.json").read_text()).get("file")
        except (OSError, ValueError, AttributeError):
            return
        now = time.time()
        for f in self.path.glob(f"{eid}.*safetensors"):
            try:
                if f.name != named and now - f.stat().st_mtime >= ORPHAN_GRACE_S:
                    safe_files.remove_inside(self.path, f.name)
            except FileNotFoundError:
                pass

    # -- index -------------------------------------------------------------------------------------------
    def _parse(self, stem: str, file: Path) -> EntryInfo | None:
        try:
            return self._info_of(stem, json.loads(file.read_text()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
            why = f"{type(e).__name__}: {e}"
            if self.refused.get(stem) != why:
                logger.error("hf_kvreuse K/V store %s: entry %s refused: %s", self.path, stem, why)
            self.refused[stem] = why
            return None

    @staticmethod
    def _info_of(stem: str, meta: dict) -> EntryInfo:
        """The entry a JSON describes, after its format and its own digest are checked."""
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}")
        safe_files.check_signed(meta, f"entry {stem}", error=CorruptArtifactError)
        info = EntryInfo(entry_id=stem, identity=ModelIdentity.from_dict(meta["model"]),
                         token_ids=tuple(int(t) for t in meta["token_ids"]), exact_len=int(meta["exact_len"]),
                         layers=int(meta["layers"]), kv_heads=int(meta["kv_heads"]),
                         head_dim=int(meta["head_dim"]), dtype=str(meta["dtype"]),
                         written_by=str(meta.get("written_by", "")))
        if entry_id(info.identity, info.token_ids) != stem:
            raise CorruptArtifactError("its file name is not the hash of its model and tokens")
        return info

    def entries(self) -> list[EntryInfo]:
        """Every entry whose JSON parses and verifies (re-read when its file changed), oldest first."""
        found = {}
        for file in self.path.glob("*.json"):
            stem = file.stem
            try:
                st = file.stat()
            except FileNotFoundError:  # removed meanwhile
                continue
            hit = self._index.get(stem)
            if hit is None or hit[:2] != (st.st_mtime_ns, st.st_size):
                hit = (st.st_mtime_ns, st.st_size, self._parse(stem, file))
                self._index[stem] = hit
            found[stem] = hit
        for stem in set(self._index) - set(found):
            del self._index[stem]
        return [h[2] for _, h in sorted(found.items(), key=lambda kv: kv[1][0]) if h[2] is not None]

    def info(self, eid: str) -> EntryInfo | None:
        """The entry ``eid``, or None (absent, its JSON fails, or ``eid`` is not a name an entry can have)."""
        from ..stores.base import valid_name

        if not valid_name(eid):  # every id is a hex digest: never a path out of the folder
            return None
        file = self.path / f"{eid}.json"
        if not file.exists():
            return None
        return self._parse(eid, file)

    def for_model(self, identity: ModelIdentity) -> list[EntryInfo]:
        """The entries ``identity`` may reuse (same weights digest and dtype)."""
        return [e for e in self.entries() if e.identity.key == identity.key]

    def longest_exact_prefix(self, identity: ModelIdentity, token_ids: Sequence[int],
                             limit: int | None = None) -> tuple[EntryInfo | None, int]:
        """The entry with the longest exact common prefix with ``token_ids`` (at most ``limit`` tokens)."""
        token_ids = list(token_ids)[:limit]
        best, best_len = None, 0
        for e in self.for_model(identity):
            p = 0
            for a, b in zip(e.token_ids[:e.exact_len], token_ids):
                if a != b:
                    break
                p += 1
            if p > best_len:
                best, best_len = e, p
        return best, best_len

    # -- reading -----------------------------------------------------------------------------------------
    def load(self, info: EntryInfo, identity: ModelIdentity | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of an entry, verified: sha256 of the tensor file, JSON fields, shapes, dtype, finite values.

        ``identity``: refuse unless the entry was written for it (:class:`ModelMismatchError`).
        """
        if identity is not None and info.identity.key != identity.key:
            raise ModelMismatchError(f"entry {info.entry_id} holds K/V of {info.identity.path or 'another model'} "
                                     f"({info.identity.key[:16]}...), not of {identity.path} ({identity.key[:16]}...)")
        from ..stores.base import check_name

        check_name(info.entry_id, "entry id")  # never a path out of the folder
        # the tensors and the JSON that names them are read together: the fields checked are those of the writer
        # of these tensors
        tensors, meta = read_artifact(self.path, info.entry_id, "hf_kvreuse K/V store entry")
        try:
            fresh = self._info_of(info.entry_id, meta)
        except (KeyError, TypeError, AttributeError) as e:
            raise CorruptArtifactError(f"K/V store entry {info.entry_id}: {type(e).__name__}: {e}") from None
        if fresh != info:
            raise CorruptArtifactError(f"K/V store entry {info.entry_id}: its JSON changed since it was indexed "
                                       f"(another "
                                       "writer replaced the entry); index the store again")
        k, v = tensors.get("k"), tensors.get("v")
        want = (info.layers, info.kv_heads, info.length, info.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t is None or tuple(t.shape) != want or str(t.dtype).removeprefix("torch.") != info.dtype:
                raise CorruptArtifactError(f"K/V store entry {info.entry_id}: tensor {name!r} is "
                                           f"{None if t is None else (tuple(t.shape), t.dtype)}, its JSON says "
                                           f"{want} {info.dtype}")
        return k, v
