"""One precomputed chunk of K/V (:class:`KVChunk`): the unit a :class:`~hf_kvreuse.ChunkStore` and its tiers hold."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv import KV


@dataclass
class KVChunk:
    """K/V of ``token_ids`` with keys rotated at positions ``start..start+len``.

    ``anchor`` is the K/V of the prefix token right before the chunk (position ``start - 1``), kept for
    offset-based methods; None for standalone chunks.
    """

    token_ids: torch.Tensor
    kv: KV
    start: int
    prefix_digest: str = "-"
    anchor: KV | None = None
    anchor_token: int | None = None
    #: read-outs computed with the chunk's K/V that a cache may keep with it (LatentRemedy: the bridge's read-out of
    #: an agent's own prefix); not counted in ``nbytes``
    extra: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.kv + (self.anchor or []))
