"""ChunkStore: KV blocks computed once and assembled in any order, under a byte budget with LRU eviction.

A chunk is the K/V of a run of tokens (a document, an earlier agent's answer) computed by one model (and
adapter) under one prefix: standalone at position 0 ("position-independent", as CacheBlend and EPIC
precompute documents), or after given prefix tokens (the exact KV of those tokens in that context). The key
is (producer fingerprint, adapter, prefix token ids, chunk token ids); keys are stored post-RoPE at
``start..start+len`` and re-positioned by whoever uses them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache

from .compat import cache_kwargs
from .devices import input_device
from .fingerprint import model_fingerprint  # noqa: F401 - re-exported: chunk keys use it
from .chunk import KVChunk  # noqa: F401 - re-exported
from .kv import KV, kv_of, slice_kv


def _ids_digest(ids: Sequence[int] | torch.Tensor | None) -> str:
    if ids is None:
        return "-"
    t = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu().contiguous()
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()


@dataclass
class ChunkStore:
    """An LRU store of :class:`KVChunk` under a byte budget.

    Parameters
    ----------
    max_bytes : int, default=2 GiB
        Least recently used chunks are evicted beyond this.
    disk : DiskTier, optional
        A second tier on disk (:class:`hf_kvreuse.persist.DiskTier`, its own byte budget), shared with other
        processes: memory misses are looked up there (verified before use), every chunk put is written there too.
        ``ChunkStore(max_bytes=1 << 30, disk=DiskTier("kv_chunks", max_bytes=20 << 30))``; a store URL
        (``disk="redis://host:6379"``) or :class:`hf_kvreuse.stores.tiers.StoreTier` puts the tier on a server.

    Attributes
    ----------
    hits, misses : int
        Lookups of this store that found / did not find the chunk (a disk-tier hit counts as a hit).
    evictions : int
        Chunks evicted from memory to stay under ``max_bytes``.
    """

    max_bytes: int = 2 << 30
    _items: "OrderedDict[tuple, KVChunk]" = field(default_factory=OrderedDict, repr=False)
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    disk: "DiskTier | None" = None  # noqa: F821 -- hf_kvreuse.persist.DiskTier

    def __post_init__(self):
        if isinstance(self.disk, str) and "://" in self.disk:  # a store URL: hf_kvreuse.stores.tiers.StoreTier
            from .stores.tiers import StoreTier

            self.disk = StoreTier(self.disk)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def key(model, token_ids, prefix_ids=None, adapter: str | None = None, producer: str | None = None) -> tuple:
        """``producer`` is :func:`model_fingerprint` of ``model`` when the caller already computed it."""
        return (producer or model_fingerprint(model), adapter or "-", _ids_digest(prefix_ids), _ids_digest(token_ids))

    def get(self, model, token_ids, prefix_ids=None, adapter: str | None = None,
            producer: str | None = None) -> KVChunk | None:
        k = self.key(model, token_ids, prefix_ids, adapter, producer)
        chunk = self._items.get(k)
        if chunk is None and self.disk is not None:
            chunk = self.disk.get(model, k)  # verified against the model, or PersistedKVError
            if chunk is not None:
                self._put_memory(k, chunk)
        if chunk is None:
            self.misses += 1
            return None
        self.hits += 1
        if k in self._items:
            self._items.move_to_end(k)
        return chunk

    def put(self, model, chunk: KVChunk, prefix_ids=None, adapter: str | None = None,
            producer: str | None = None) -> None:
        if chunk.nbytes > self.max_bytes:
            raise ValueError(f"a chunk of {chunk.nbytes} bytes does not fit the store's budget of {self.max_bytes}")
        k = self.key(model, chunk.token_ids, prefix_ids, adapter, producer)
        self._put_memory(k, chunk)
        if self.disk is not None:
            self.disk.put(model, k, chunk)

    def _put_memory(self, k: tuple, chunk: KVChunk) -> None:
        if chunk.nbytes > self.max_bytes:
            return  # a disk-tier chunk larger than the memory budget is used once, not kept
        self._items[k] = chunk
        self._items.move_to_end(k)
        while self.nbytes > self.max_bytes:
            self._items.popitem(last=False)
            self.evictions += 1

    def __repr__(self) -> str:
        from .reprs import store_repr

        return store_repr(self)

    @torch.no_grad()
    def get_or_compute(self, model, token_ids, prefix_ids=None, adapter: str | None = None,
                       producer: str | None = None) -> KVChunk:
        """The chunk of ``token_ids`` computed under ``prefix_ids`` (None: standalone at position 0)."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1).cpu()
        producer = producer or model_fingerprint(model)
        chunk = self.get(model, token_ids, prefix_ids, adapter, producer)
        if chunk is not None:
            return chunk
        device = input_device(model)
        # ids may come from the caller's device: build on the CPU, then move the whole sequence to the model's
        prefix = torch.as_tensor(prefix_ids if prefix_ids is not None else [], dtype=torch.long).reshape(1, -1).cpu()
        ids = torch.cat([prefix, token_ids], 1).to(device)
        cache = DynamicCache(config=model.config)
        model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        p = prefix.shape[1]
        # without a prefix the cache's own tensors are the chunk (no second copy); with one, copy the chunk's rows
        # so the prefix's storage is not kept alive
        kv = list(kv_of(cache))
        if p:
            kv = [(k.clone(), v.clone()) for k, v in slice_kv(kv, slice(p, None))]
        anchor = [(k.clone(), v.clone()) for k, v in slice_kv(kv_of(cache), slice(p - 1, p))] if p else None
        chunk = KVChunk(token_ids[0].cpu(), kv, start=p, prefix_digest=_ids_digest(prefix_ids), anchor=anchor,
                        anchor_token=int(prefix[0, -1]) if p else None)
        self.put(model, chunk, prefix_ids, adapter, producer)
        return chunk
