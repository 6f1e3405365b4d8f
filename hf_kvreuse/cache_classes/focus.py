"""FocusRecomputeCache: recompute the rows of each reused block that mention what the prompt's own prefix and the
block's donor prefix disagree on (:mod:`hf_kvreuse.focus`), then the block's tail, ``k`` rows per block.

When two agents read one block under different instructions ("report entry orchid" / "report entry quartz"), the
block's K/V carry the donor's focus in the rows its instructions pointed at; the rows that mention the differing
words are where both agents' focus sits. Measured on Qwen2.5-Coder-0.5B's conflicting-task dev records
(``research/latent/latent_rows_probe.py``, research notes: LatentRemedy and FocusRecompute). This project's heuristic, not a paper's; at a given
``k`` it costs what Tail-k costs (the same number of rows in the same one forward) plus two short tokenizer decodes
per token of the block and prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..focus import focus_then_tail
from .block_reuse import BlockReuseCache, BlockReuseStats


@dataclass
class FocusRecomputeStats(BlockReuseStats):
    """:class:`BlockReuseStats` plus ``focus_rows``: how many recomputed block rows were focus rows (the others came
    from the blocks' tails)."""

    __repr__ = BlockReuseStats.__repr__

    focus_rows: int = 0


class FocusRecomputeCache(BlockReuseCache):
    """Recompute ``recompute_tokens`` rows of every reused block: focus rows first, the rest from its tail.

    Parameters
    ----------
    model, input_ids, blocks, store, block_prefix_ids
        As for :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`. The donor prefix of a block is its
        ``block_prefix_ids`` entry (what it was computed after); the own prefix is everything before it in this
        prompt. A block with no donor prefix (computed standalone) or the same one (``"own"``) gets its tail only;
        a block at token 0 computed standalone (the agent's own prefix from the store) is exact and gets none.
    tokenizer
        The model's tokenizer (its ``batch_decode`` turns ids into words).
    recompute_tokens : int, default=16
        Rows per block (as Tail-k's ``k``).
    window : int, default=8
        Tokens after each occurrence of a differing word that are recomputed with it (the value after a key).
    """

    def __init__(self, model, input_ids, blocks, tokenizer, store=None, block_prefix_ids=None,
                 recompute_tokens: int = 16, window: int = 8, *, fuse_first_step: bool = True):
        if not callable(getattr(tokenizer, "batch_decode", None)):
            raise TypeError("tokenizer must be the model's tokenizer (with batch_decode), got "
                            f"{type(tokenizer).__name__}")
        if recompute_tokens < 0 or window < 0:
            raise ValueError(f"recompute_tokens and window must be >= 0, got {recompute_tokens} and {window}")
        self.tokenizer, self.recompute_tokens, self.window = tokenizer, int(recompute_tokens), int(window)
        super().__init__(model, input_ids, blocks, store, block_prefix_ids, fuse_first_step=fuse_first_step)
        self.stats = FocusRecomputeStats(blocks=len(self.blocks))

    def extra_rows(self) -> torch.Tensor:
        rows, n_focus = block_focus_rows(self, self.blocks, self.recompute_tokens, self.tokenizer, self.window)
        self.stats.focus_rows = n_focus
        return rows


def block_focus_rows(cache: BlockReuseCache, blocks, k: int, tokenizer, window: int) -> tuple[torch.Tensor, int]:
    """``k`` rows of each of ``blocks`` of a block-reuse cache (absolute, increasing): focus rows against the block's
    donor prefix, the rest from its tail; and how many were focus rows. A block at token 0 computed standalone is
    the prompt's own start, exact: none of its rows. The block's token texts and its donor prefix's words are kept
    with its chunk (``KVChunk.extra``), so a block reused by many calls is decoded once."""
    from ..focus import token_texts, words

    ids = cache.input_ids[0].tolist()
    key = ("focus_texts", type(tokenizer).__name__, getattr(tokenizer, "name_or_path", None), len(tokenizer)
           if hasattr(tokenizer, "__len__") else None)
    out, n_focus = [], 0
    for s, e in blocks:
        donor = cache.prefix_for(s)
        donor = None if donor is None else torch.as_tensor(donor).reshape(-1).tolist()
        if s == 0 and not donor:
            continue  # the prompt's own start, computed standalone at 0: exact
        chunk = getattr(cache, "chunks", {}).get((s, e))
        kept = {}
        if chunk is not None and donor:
            if key not in chunk.extra:  # the chunk's tokens and the prefix it was computed after are its own
                chunk.extra[key] = (token_texts(tokenizer, ids[s:e]), words(tokenizer, donor))
            kept = dict(zip(("block_texts", "donor_words"), chunk.extra[key]))
        rel, nf = focus_then_tail(tokenizer, ids[s:e], ids[:s], donor, k, window, **kept)
        out.append(rel + s)
        n_focus += nf
    return (torch.cat(out) if out else torch.zeros(0, dtype=torch.long)), n_focus
