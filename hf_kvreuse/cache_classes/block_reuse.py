"""BlockReuseCache: the common assembly of every cache that reuses precomputed KV blocks (documents, answers).

The prompt is a sequence of token rows; some spans of it are *blocks* whose K/V come from a
:class:`~hf_kvreuse.chunk_store.ChunkStore` (computed once, standalone at position 0 by default, or under a
given prefix), re-positioned with RoPE to where the block sits in this prompt (METHODS.md §1.2–1.3). Every
row outside the blocks (system text, separators, the question) is computed. A subclass only chooses which
*reused* rows to recompute as well (:meth:`extra_rows`), or replaces the recompute step altogether
(:meth:`recompute`, e.g. CacheBlend's layer-wise selection). All recomputation goes through
:func:`hf_kvreuse.generation.partial.partial_forward`, with a mask causal by original positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from ..chunk_store import ChunkStore, KVChunk, model_fingerprint
from ..devices import layer_devices
from ..generation.fused import PendingRows, returns_internals
from ..generation.partial import partial_forward
from ..kv import KV, alloc_layer, copy_shifted_, load_kv
from ..reprs import stats_repr
from ..rope import RopeShifter
from ..timing import now
from .base import KVReuseCache


@dataclass
class BlockReuseStats:
    """What happened during one ``generate`` with a block-reuse cache (Direct, Blend, EPIC, Tail, Offset).

    Row counts are over the prompt's first ``N - 1`` rows, which the cache assembles; the last prompt token is
    fed by ``generate`` itself and counted in neither (``reused_tokens + recomputed_tokens == N - 1``).

    Attributes
    ----------
    reused_tokens : int
        Rows whose K/V came from blocks and were kept.
    recomputed_tokens : int
        Rows computed: those outside every block plus those the method selected for repair.
    blocks : int
        Blocks placed.
    store_hits, store_misses : int
        Chunk-store lookups of this call that found / did not find the block (a miss computes it).
    assemble_s : float or None
        Block lookup, re-positioning and recompute, before the first decoding forward (seconds); with a fused first
        step the recompute is in that forward, not here.
    fused_first_step : bool
        The rows were computed in the first token's forward (``fuse_first_step``).
    kernels : str
        Backend of the hot paths: ``"torch"`` or ``"triton"`` (``HF_KVREUSE_KERNELS``).
    """

    __repr__ = stats_repr

    reused_tokens: int = 0        # prompt tokens whose K/V came from blocks and were kept
    recomputed_tokens: int = 0    # prompt tokens computed (rows outside blocks + rows selected for repair)
    blocks: int = 0
    store_hits: int = 0
    store_misses: int = 0
    assemble_s: float | None = None
    fused_first_step: bool = False         # the rows were computed in the first token's forward
    kernels: str = "torch"                 # backend of the hot paths: "torch" or "triton" (HF_KVREUSE_KERNELS)

    def as_dict(self) -> dict:
        return asdict(self)


def find_blocks(input_ids: torch.Tensor, block_ids: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Token spans of each block's ids inside ``input_ids`` (first occurrence not overlapping earlier ones).

    Blocks may appear in any order. Prefer spans cut from the full prompt's tokens
    (:func:`hf_kvreuse.alignment.segment_prompt`): a block tokenized on its own can merge differently.
    """
    seq = input_ids.reshape(-1).tolist()
    taken: list[tuple[int, int]] = []
    for b in block_ids:
        b = torch.as_tensor(b).reshape(-1).tolist()
        n = len(b)
        for s in range(len(seq) - n + 1):
            if seq[s:s + n] == b and all(e <= s or s + n <= t for t, e in taken):
                taken.append((s, s + n))
                break
        else:
            raise ValueError(f"block of {n} tokens not found in the prompt (was it tokenized separately? cut "
                             "blocks from the full prompt's tokens, see hf_kvreuse.alignment.segment_prompt)")
    return taken


class BlockReuseCache(KVReuseCache):
    """Assemble a prompt's cache from reused blocks plus computed rows.

    Parameters
    ----------
    model : PreTrainedModel
    input_ids : LongTensor ``[1, N]``
        The full prompt; ``generate`` must be called with it.
    blocks : sequence of (start, end) spans, or sequence of LongTensor token ids
        The reusable spans of ``input_ids`` (tuples or 2-int lists); token-id tensors are located with
        :func:`find_blocks`.
    store : ChunkStore, optional
        Where block K/V are looked up and kept (default: a private store).
    block_prefix_ids : LongTensor, list of LongTensor, or "own", optional
        Prefix under which missing blocks are computed: none (default: standalone at position 0, as documents
        are precomputed), the same ids for every block, one prefix per block (in prompt order), or ``"own"``:
        each block under its actual prefix in this prompt, which makes the reused K/V exact (the
        self-control gate of METHODS.md §1.4).
    fuse_first_step : bool, default=True
        Methods that recompute rows with one forward over them (direct reuse, EPIC, Tail-k): compute the rows in
        the first token's forward, the last prompt token as one more row of the same partial forward
        (:mod:`hf_kvreuse.generation.fused`: the same K/V and logits up to float rounding, one pass over the weights
        less). Not when ``generate`` returns attentions or hidden states. False: a forward over the rows, then
        ``generate``'s one-token step.
    """

    def __init__(self, model, input_ids: torch.Tensor, blocks, store: ChunkStore | None = None,
                 block_prefix_ids: torch.Tensor | None = None, *, fuse_first_step: bool = True):
        from ..generation.mixin import enable

        super().__init__(model)
        enable(model)
        self._shifter = RopeShifter(model, layout=self.model_check.rope_layout)  # layout probed on this model
        self.set_target(input_ids)
        blocks = list(blocks)
        if all(isinstance(b, torch.Tensor) for b in blocks):
            blocks = find_blocks(self.input_ids, blocks)
        elif all(isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(x, int) for x in b) for b in blocks):
            blocks = [tuple(b) for b in blocks]
        else:
            raise TypeError("blocks must be all (start, end) spans or all LongTensors of token ids")
        covered = self.input_ids.shape[1] - 1
        spans = []
        for s, e in sorted(blocks):
            if not 0 <= s < e <= self.input_ids.shape[1]:
                raise ValueError(f"block span {(s, e)} is outside the prompt of {self.input_ids.shape[1]} tokens")
            if spans and s < spans[-1][1]:
                raise ValueError(f"blocks overlap: {spans[-1]} and {(s, e)}")
            spans.append((s, min(e, covered)))  # the last prompt token is always fed by generate
        self.blocks = [(s, e) for s, e in spans if e > s]
        self.store = store if store is not None else ChunkStore()
        self.block_prefix_ids = block_prefix_ids
        if not isinstance(fuse_first_step, bool):
            raise TypeError(f"fuse_first_step must be True or False, got {fuse_first_step!r}")
        self.fuse_first_step = fuse_first_step
        self.stats = BlockReuseStats(blocks=len(self.blocks))

    # -- the two steps a method may change ---------------------------------------------------------------
    def extra_rows(self) -> torch.Tensor:
        """Reused rows to recompute as well (default: none, i.e. direct reuse)."""
        return torch.zeros(0, dtype=torch.long)

    def rows_to_compute(self, fresh: torch.Tensor) -> torch.Tensor:
        """Rows ``fresh`` and the method's repaired rows (:meth:`extra_rows`), increasing."""
        return torch.unique(torch.cat([fresh, self.extra_rows().to(fresh.device)]))

    def recompute(self, kv: KV, fresh: torch.Tensor) -> torch.Tensor:
        """Compute rows ``fresh`` (and the method's repaired rows) into ``kv``; return all recomputed rows."""
        rows = self.rows_to_compute(fresh)
        if rows.numel():
            partial_forward(self.model, self.input_ids[:, : kv[0][0].shape[-2]], rows, kv)
        return rows

    # -- assembly --------------------------------------------------------------------------------------------
    def prefix_for(self, s: int):
        """The prefix under which the block starting at ``s`` is (or was) computed."""
        p = self.block_prefix_ids
        if isinstance(p, str):
            if p != "own":
                raise ValueError(f"block_prefix_ids={p!r}: pass token ids, one list of ids per block, None or 'own'")
            return self.input_ids[0, :s]
        if isinstance(p, (list, tuple)):
            if len(p) != len(self.blocks):
                raise ValueError(f"{len(p)} block prefixes for {len(self.blocks)} blocks")
            return p[[b[0] for b in self.blocks].index(s)]
        return p

    def fresh_rows(self, covered: int) -> torch.Tensor:
        """The rows outside every block (always computed), increasing."""
        in_block = torch.zeros(covered, dtype=torch.bool)
        for s, e in self.blocks:
            in_block[s:e] = True
        return torch.nonzero(~in_block).flatten()

    def block_chunk(self, s: int, e: int) -> KVChunk:
        before = (self.store.hits, self.store.misses)
        chunk = self.store.get_or_compute(self.model, self.input_ids[0, s:e], self.prefix_for(s),
                                          producer=self._producer)
        self.stats.store_hits += self.store.hits - before[0]
        self.stats.store_misses += self.store.misses - before[1]
        return chunk

    def fuses(self, model, generate_kwargs: dict) -> bool:
        """Does this call compute its rows in the first token's forward? (Only methods whose :meth:`recompute` is
        the one forward over :meth:`rows_to_compute` of this class: a method that overrides it computes its own
        way.)"""
        return (self.fuse_first_step and type(self).recompute is BlockReuseCache.recompute
                and not returns_internals(model, generate_kwargs))

    def prepare(self, model, input_ids, generate_kwargs) -> None:
        self.begin_generate(model, input_ids, generate_kwargs)
        t0 = now(self.input_ids.device)
        self._pending = None
        fuse = self.fuses(model, generate_kwargs)
        covered = self.input_ids.shape[1] - 1
        with torch.no_grad():
            # fused: storage for the last prompt token's row too, written by the first forward
            kv = self.assemble_blocks(extra_rows=1 if fuse else 0)
            fresh = self.fresh_rows(covered).to(kv[0][0].device)
            if fuse:
                rows = self.rows_to_compute(fresh)
                pending = PendingRows(kv, rows, self.input_ids)
                kv = pending.visible()
                fuse = bool(rows.numel())  # nothing to compute: generate's own one-token step
                self._pending = pending if fuse else None
            else:
                rows = self.recompute(kv, fresh)
        self.stats.fused_first_step = fuse
        load_kv(self, kv)
        self.stats.recomputed_tokens = int(rows.numel())
        self.stats.reused_tokens = covered - self.stats.recomputed_tokens
        self.stats.assemble_s = now(self.input_ids.device) - t0

    def assemble_blocks(self, extra_rows: int = 0) -> KV:
        """Full-length K/V of the covered prompt with every block placed (other rows zero), and ``extra_rows``
        uninitialised rows after it (storage for rows a fused first step computes).

        Layer by layer, straight into each layer's storage (the RoPE re-positioning runs in place, in chunks of
        tokens): no full-size rotated temporaries. Only the rows outside blocks are zeroed (a recompute may run
        before all of them are written, and masked columns must still hold finite numbers).
        """
        covered = self.input_ids.shape[1] - 1
        self._producer = model_fingerprint(self.model)  # once per assembly, not per block
        self.chunks: dict[tuple[int, int], KVChunk] = {}
        for s, e in self.blocks:
            self.chunks[(s, e)] = self.block_chunk(s, e)
        if not self.blocks:  # no blocks: plain prefill of everything
            p = next(self.model.parameters())
            mc = self.model_check  # K/V geometry as the model's own cache stores it
            shape = (1, mc.kv_heads, covered + extra_rows, mc.head_dim)
            return [(torch.zeros(shape, dtype=p.dtype, device=d), torch.zeros(shape, dtype=p.dtype, device=d))
                    for d in layer_devices(self.model)]
        gaps, prev = [], 0
        for s, e in self.blocks:
            if s > prev:
                gaps.append((prev, s))
            prev = e
        if prev < covered:
            gaps.append((prev, covered))
        first = self.chunks[self.blocks[0]].kv
        kv = []
        for layer in range(len(first)):
            dk = alloc_layer(first[layer][0], covered + extra_rows)
            dv = alloc_layer(first[layer][1], covered + extra_rows)
            for a, b in gaps:
                dk[..., a:b, :].zero_()
                dv[..., a:b, :].zero_()
            for s, e in self.blocks:
                chunk = self.chunks[(s, e)]
                k, v = chunk.kv[layer]
                copy_shifted_(dk[..., s:e, :], k.to(dk.device), self._shifter, s - chunk.start)
                dv[..., s:e, :].copy_(v.to(dv.device))
            kv.append((dk, dv))
        return kv


class EdgeRecomputeCache(BlockReuseCache):
    """Recompute ``recompute_tokens`` rows at one edge (``edge``: "head" or "tail") of every reused block."""

    edge: str = "head"

    def __init__(self, model, input_ids, blocks, store=None, block_prefix_ids=None, recompute_tokens: int = 16, *,
                 fuse_first_step: bool = True):
        if recompute_tokens < 0:
            raise ValueError("recompute_tokens must be >= 0")
        self.recompute_tokens = recompute_tokens
        super().__init__(model, input_ids, blocks, store, block_prefix_ids, fuse_first_step=fuse_first_step)

    def extra_rows(self) -> torch.Tensor:
        rows = []
        for s, e in self.blocks:
            n = min(self.recompute_tokens, e - s)
            rows.append(torch.arange(s, s + n) if self.edge == "head" else torch.arange(e - n, e))
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
