"""The transformers side of the store: write a model's K/V, read entries back for generate, a ReuseSession or a
ChunkStore (so that what a vLLM engine computed serves hf_kvreuse's caches, and the other way round).

Every function checks the model against the entry's identity first (:func:`~hf_kvreuse.vllm.identity.
hf_model_identity`: the model's weights equal its folder's, element for element, and the dtype is the entry's).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from ..chunk_store import ChunkStore, KVChunk, _ids_digest
from ..devices import layer_devices, place_kv
from ..kv import KV, dynamic_cache_from_kv, kv_of
from .identity import ModelIdentity, ModelMismatchError, hf_model_identity
from .store import EntryInfo, KVDirStore


def _ids_list(input_ids) -> list[int]:
    t = torch.as_tensor(input_ids)
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise ValueError(f"one sequence at a time, got a batch of {t.shape[0]}")
        t = t[0]
    return [int(x) for x in t.tolist()]


def stack_kv(kv: KV) -> tuple[torch.Tensor, torch.Tensor]:
    """A KV list (batch 1, ``[1, H, T, D]`` per layer) as ``k``, ``v`` of ``[layers, H, T, D]``."""
    if any(k.shape[0] != 1 for k, _ in kv):
        raise ValueError("the store holds one sequence per entry: batch size must be 1")
    return torch.stack([k[0].cpu() for k, _ in kv]), torch.stack([v[0].cpu() for _, v in kv])


def unstack_kv(k: torch.Tensor, v: torch.Tensor, device=None) -> KV:
    """``[layers, H, T, D]`` tensors as a KV list (``[1, H, T, D]`` per layer), moved to ``device``: one device, or
    one per layer (:func:`~hf_kvreuse.devices.layer_devices`: a model split over devices keeps each layer's K/V on
    that layer's device)."""
    kv = [(k[i][None], v[i][None]) for i in range(k.shape[0])]
    if device is None:
        return kv
    return place_kv(kv, list(device) if isinstance(device, (list, tuple)) else [device] * len(kv))


def save_cache(store: KVDirStore, model, input_ids, cache, exact: bool = True,
               folder: str | os.PathLike | None = None) -> EntryInfo:
    """Write the K/V of ``cache`` (a transformers cache or KV list of ``input_ids``' first rows) to ``store``.

    ``exact``: the rows are what a plain prefill of those tokens computes (a ``model(ids)`` or ``generate``
    cache); pass False for K/V of an approximate method (they then serve as re-positioned donors only).
    """
    identity = hf_model_identity(model, folder)
    kv = list(kv_of(cache))
    n = kv[0][0].shape[-2]
    ids = _ids_list(input_ids)
    if n > len(ids) or any(k.shape[-2] != n for k, _ in kv):
        raise ValueError(f"the cache holds {n} rows (or differs between layers) for {len(ids)} token ids")
    k, v = stack_kv(kv)
    return store.put(identity, ids[:n], k, v, exact_len=n if exact else 0, written_by="hf_kvreuse")


def _identity(model, folder) -> ModelIdentity:
    return hf_model_identity(model, folder)


def load_prefix(store: KVDirStore, model, input_ids, folder: str | os.PathLike | None = None):
    """The longest exact prefix of ``input_ids`` in ``store`` (at most ``len - 1`` tokens, so ``generate`` has a
    token to feed) as ``(DynamicCache, n_tokens)``; ``(None, 0)`` when none."""
    identity = _identity(model, folder)
    ids = _ids_list(input_ids)
    info, n = store.longest_exact_prefix(identity, ids, limit=len(ids) - 1)
    if info is None or n == 0:
        return None, 0
    k, v = store.load(info, identity)
    device = layer_devices(model)
    kv = unstack_kv(k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), device)
    return dynamic_cache_from_kv(kv, model.config), n


def to_chunk_store(store: KVDirStore, chunks: ChunkStore, model, info: EntryInfo, span: tuple[int, int],
                   folder: str | os.PathLike | None = None) -> KVChunk:
    """Put rows ``span`` of an entry into a :class:`~hf_kvreuse.ChunkStore` as the chunk of those tokens computed
    under the entry's tokens before them (what ``BlockReuseCache(block_prefix_ids=...)`` looks up): the rows must
    be exact (``span[1] <= info.exact_len``)."""
    identity = _identity(model, folder)
    s, e = span
    if not 0 <= s < e <= info.exact_len:
        raise ValueError(f"span {span}: only the exact rows 0..{info.exact_len} of entry {info.entry_id} are the "
                         "chunk of their tokens under their prefix")
    k, v = store.load(info, identity)
    device = layer_devices(model)
    kv = unstack_kv(k[:, :, s:e].contiguous(), v[:, :, s:e].contiguous(), device)
    prefix = torch.tensor(info.token_ids[:s], dtype=torch.long)
    anchor = unstack_kv(k[:, :, s - 1:s].contiguous(), v[:, :, s - 1:s].contiguous(), device) if s else None
    chunk = KVChunk(torch.tensor(info.token_ids[s:e], dtype=torch.long), kv, start=s,
                    prefix_digest=_ids_digest(prefix if s else None), anchor=anchor,
                    anchor_token=info.token_ids[s - 1] if s else None)
    chunks.put(model, chunk, prefix if s else None, producer=identity.hf_fingerprint)
    return chunk


def to_session(store: KVDirStore, session, entries: Sequence[EntryInfo] | None = None,
               folder: str | os.PathLike | None = None) -> int:
    """Hand store entries (default: every entry of the session model's identity) to a
    :class:`~hf_kvreuse.ReuseSession` as held caches; exact rows serve as exact prefixes. Returns how many."""
    identity = _identity(session.model, folder)
    entries = store.for_model(identity) if entries is None else list(entries)
    device = layer_devices(session.model)
    for info in entries:
        if info.identity.key != identity.key:
            raise ModelMismatchError(f"entry {info.entry_id} is not of the session's model")
        k, v = store.load(info, identity)
        n = info.exact_len if info.exact_len else info.length
        kv = unstack_kv(k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), device)
        session.hold(info.token_ids[:n], kv, exact=bool(info.exact_len), agent=f"store:{info.written_by}")
    return len(entries)
