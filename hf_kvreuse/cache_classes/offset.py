"""OffsetCache: KVCOMM-style offset correction of reused blocks with a single anchor.

Based on KVCOMM, "KVCOMM: Online Cross-context KV-cache Communication for Efficient LLM-based Multi-agent
Systems" (NeurIPS 2025; METHODS.md §3.9): under a change of prefix, the K/V of a shared block shift by about
as much as the K/V of nearby tokens. This is the single-anchor variant of METHODS.md §2.2 item 10
(chenzhwsysu57/kvreuse ``calibrate_block``), not KVCOMM's anchor pool: the anchor is the token right before
the block. In RoPE-free space, per layer,

    k_blk' = k_anchor^target + (k_blk^source - k_anchor^source),   then re-RoPE'd at the target positions
    v_blk' = v_anchor^target + (v_blk^source - v_anchor^source)

Layer 0 is left as computed (its K/V do not depend on the context). Segments are processed left to right: the
rows before a block are computed first (they are its target anchor), then the block is corrected, then the
rows after it attend to the corrected block.
"""

from __future__ import annotations

import torch

from ..generation.partial import partial_forward
from ..kv import KV
from .block_reuse import BlockReuseCache


class OffsetCache(BlockReuseCache):
    """Reuse blocks computed under another prefix, shifted by the anchor token's K/V offset.

    Blocks must be computed under a prefix (``block_prefix_ids`` given, or ``"own"``), whose last token is
    the source anchor; the token before the block in this prompt is the target anchor, and the two must be the
    same token (checked).
    Other parameters are those of :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`.
    """

    def __init__(self, model, input_ids, blocks, store=None, block_prefix_ids=None):
        if block_prefix_ids is None or (not isinstance(block_prefix_ids, str) and len(block_prefix_ids) == 0):
            raise ValueError("OffsetCache needs blocks computed under a prefix (block_prefix_ids=ids or 'own'): "
                             "the prefix's last token is the anchor")
        super().__init__(model, input_ids, blocks, store, block_prefix_ids)
        if any(s == 0 for s, _ in self.blocks):
            raise ValueError("OffsetCache needs at least one prompt token before every block (the target anchor)")

    def recompute(self, kv: KV, fresh: torch.Tensor) -> torch.Tensor:
        covered = kv[0][0].shape[-2]
        ids = self.input_ids[:, :covered]
        device = kv[0][0].device
        computed = torch.zeros(covered, dtype=torch.bool, device=device)
        boundaries = [s for s, _ in self.blocks] + [covered]
        for (s, e), nxt in zip(self.blocks + [(covered, covered)], boundaries):
            todo = fresh[(fresh < nxt) & ~computed[fresh]]
            if todo.numel():  # rows up to this block, attending only to what precedes them
                partial_forward(self.model, ids, todo, kv)
                computed[todo] = True
            if s < covered:
                self._apply_offset(kv, s, e)
        return fresh

    def _apply_offset(self, kv: KV, s: int, e: int) -> None:
        chunk = self.chunks[(s, e)]
        if chunk.anchor is None or chunk.anchor_token != int(self.input_ids[0, s - 1]):
            raise ValueError(f"the block at {s}..{e} was computed after token {chunk.anchor_token}, but this prompt "
                             f"has token {int(self.input_ids[0, s - 1])} before it: the single-anchor offset needs "
                             "the same anchor token in both contexts (compute the block under a prefix ending "
                             "with it)")
        sh = self._shifter
        tables = {}

        def rotations(dev):  # per device: the layers of a device_map-split model live on several
            if dev not in tables:
                pos = torch.arange(s, e, device=dev)
                # RoPE-free space: un-rotate every key by its own position
                tables[dev] = (sh.cos_sin(-pos, dev), sh.cos_sin(torch.tensor([-(s - 1)], device=dev), dev),
                               sh.cos_sin(torch.tensor([-(chunk.start - 1)], device=dev), dev), sh.cos_sin(pos, dev))
            return tables[dev]

        for layer in range(1, len(kv)):
            k, v = kv[layer]
            cs_blk, cs_tgt, cs_src, cs_back = rotations(k.device)
            src_ak, src_av = (t.to(k.device) for t in chunk.anchor[layer])
            tgt_ak, tgt_av = k[..., s - 1: s, :], v[..., s - 1: s, :]
            k_blk = sh.shift(k[..., s:e, :], None, cs_blk)
            k_new = sh.shift(tgt_ak, None, cs_tgt) + k_blk - sh.shift(src_ak, None, cs_src)
            k[..., s:e, :] = sh.shift(k_new, None, cs_back)
            v[..., s:e, :] = tgt_av + v[..., s:e, :] - src_av
