"""A directory of K/V entries that vLLM (through :mod:`hf_kvreuse.vllm.connector`) and hf_kvreuse share.

One entry is the K/V of one token sequence from position 0 (a request's prompt and answer, or a transformers
prefill), computed by one model (:class:`~hf_kvreuse.vllm.identity.ModelIdentity`):

* ``<id>.safetensors``: ``k`` and ``v``, each ``[layers, kv_heads, tokens, head_dim]``, keys post-RoPE at positions
  ``0..tokens-1`` (as both transformers and vLLM cache them), in the dtype the model computed them;
* ``<id>.json``: the format tag, the model identity, the token ids, ``exact_len`` (rows ``0..exact_len-1`` are the
  K/V a plain prefill of those tokens computes; rows past it were computed over re-positioned rows and serve only
  as re-positioned donors), the geometry, who wrote it, the sha256 of the tensor file and a sha256 of the JSON's
  own fields (an edited token list is detected, not trusted).

Writes are atomic (a temporary file renamed), so several processes (engines on one machine, or machines sharing
the folder over a network filesystem) may write and read one store; the id is a hash of the model key and the
tokens, so two writers of the same sequence write the same file. Every read verifies both digests, the tensors'
shapes against the JSON and that every value is finite; :class:`~hf_kvreuse.artifacts.CorruptArtifactError` names
the file otherwise.
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

from ..artifacts import CorruptArtifactError, read_artifact, write_artifact
from .identity import ModelIdentity, ModelMismatchError, canonical_json

logger = logging.getLogger(__name__)

FORMAT = "hf_kvreuse.kvstore/1"


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


def _self_digest(meta: dict) -> str:
    return hashlib.sha256(canonical_json({k: v for k, v in meta.items() if k not in ("sha256", "meta_sha256")})
                          .encode()).hexdigest()


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
        eid = entry_id(identity, token_ids)
        meta = {"format": FORMAT, "model": identity.as_dict(), "token_ids": token_ids, "exact_len": exact_len,
                "layers": int(k.shape[0]), "kv_heads": int(k.shape[1]), "head_dim": int(k.shape[3]), "dtype": dtype,
                "written_by": written_by, "created": time.time()}
        old = self.info(eid)
        if old is not None and old.exact_len >= exact_len and old.identity.key == identity.key:
            return old  # the same rows are there, at least as exact
        meta["meta_sha256"] = _self_digest(meta)
        write_artifact(self.path, eid, {"k": k.detach().contiguous().cpu(), "v": v.detach().contiguous().cpu()},
                       meta)
        return self.info(eid)

    # -- index -------------------------------------------------------------------------------------------
    def _parse(self, stem: str, file: Path) -> EntryInfo | None:
        try:
            meta = json.loads(file.read_text())
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            if meta.get("meta_sha256") != _self_digest(meta):
                raise CorruptArtifactError("its fields do not match their recorded sha256 (edited or corrupted)")
            info = EntryInfo(entry_id=stem, identity=ModelIdentity.from_dict(meta["model"]),
                             token_ids=tuple(int(t) for t in meta["token_ids"]), exact_len=int(meta["exact_len"]),
                             layers=int(meta["layers"]), kv_heads=int(meta["kv_heads"]),
                             head_dim=int(meta["head_dim"]), dtype=str(meta["dtype"]),
                             written_by=str(meta.get("written_by", "")))
            if entry_id(info.identity, info.token_ids) != stem:
                raise CorruptArtifactError("its file name is not the hash of its model and tokens")
            return info
        except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and CorruptArtifactError are ValueErrors
            why = f"{type(e).__name__}: {e}"
            if self.refused.get(stem) != why:
                logger.error("hf_kvreuse K/V store %s: entry %s refused: %s", self.path, stem, why)
            self.refused[stem] = why
            return None

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
        tensors, meta = read_artifact(self.path, info.entry_id, "hf_kvreuse K/V store entry")
        fresh = self._parse(info.entry_id, self.path / f"{info.entry_id}.json")
        if fresh != info:
            raise CorruptArtifactError(f"K/V store entry {info.entry_id}: its JSON changed or fails its digest since "
                                       "it was indexed")
        k, v = tensors.get("k"), tensors.get("v")
        want = (info.layers, info.kv_heads, info.length, info.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t is None or tuple(t.shape) != want or str(t.dtype).removeprefix("torch.") != info.dtype:
                raise CorruptArtifactError(f"K/V store entry {info.entry_id}: tensor {name!r} is "
                                           f"{None if t is None else (tuple(t.shape), t.dtype)}, its JSON says "
                                           f"{want} {info.dtype}")
        return k, v
