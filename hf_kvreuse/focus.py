"""Focus rows: the rows of a reused block that mention what two prefixes disagree on.

A block computed after one agent's prefix and reused after another's carries the first agent's focus in the rows
its instructions pointed at (the LatentRemedy diagnosis, ``research/latent/latent_rows_probe.py``: recomputing the 16 rows whose
K/V deviate most from full prefill recovers far more than recomputing the block's last 16). Those rows cannot be
found from the K/V without computing the block again, but on the conflicting-task workloads they are the rows
that *mention* what the two instructions differ in ("report entry orchid" / "report entry quartz"): the words one
prefix has and the other lacks, where they occur in the block, and the few tokens after each occurrence (the value
that follows a key). This module finds them from token ids and a tokenizer; no model runs.

The heuristic is this project's (not from a paper); it selects nothing when the prefixes differ in no word the
block contains, and callers then spend the budget on the block's tail (Tail-k).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

import torch

_WORD = re.compile(r"\w+")


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's text as it reads inside the sequence (its left neighbour decoded with it, so tokenizers that drop
    a word-start space at the beginning of a decode keep it), ``len(ids)`` strings whose concatenation is the text.

    Two short decodes per token: linear in ``len(ids)`` (a decode of every prefix would be quadratic)."""
    ids = [int(t) for t in ids]
    if not ids:
        return []
    pairs = [[ids[i - 1], ids[i]] if i else [ids[0]] for i in range(len(ids))]
    lefts = [[ids[i - 1]] if i else [] for i in range(len(ids))]
    both = tokenizer.batch_decode(pairs, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    left = tokenizer.batch_decode(lefts, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return [b[len(a):] if b.startswith(a) else b for a, b in zip(left, both)]


def words(tokenizer, ids: Sequence[int]) -> set[str]:
    """The lower-cased words (``\\w+``) of a token sequence."""
    return {w.lower() for w in _WORD.findall("".join(token_texts(tokenizer, ids)))}


def focus_rows(tokenizer, block_ids: Sequence[int], own_prefix: Sequence[int], donor_prefix: Sequence[int],
               budget: int, window: int = 8, *, block_texts: list[str] | None = None,
               donor_words: set[str] | None = None) -> torch.Tensor:
    """Rows of a block (0-based within it) that mention a word of one prefix but not the other.

    Parameters
    ----------
    tokenizer
        The model's tokenizer (``batch_decode``).
    block_ids : sequence of int
        The reused block's tokens.
    own_prefix, donor_prefix : sequence of int
        The tokens before the block in this prompt, and those it was computed after.
    budget : int
        At most this many rows.
    window : int, default=8
        Each occurrence brings its own tokens and the ``window`` tokens after it (the value after a key, which
        may sit on the next line, as a function's return value does).
    block_texts, donor_words : optional
        :func:`token_texts` of the block and :func:`words` of the donor prefix, when the caller keeps them (a chunk
        reused by many calls decodes its tokens once).

    Returns
    -------
    LongTensor of increasing row indices, at most ``budget``. Occurrences of rarer words (fewer occurrences in the
    block) come first, so a common word the prefixes happen to differ in does not take the budget; within a word,
    in block order. Empty when the prefixes differ in no word of the block.
    """
    if budget < 0 or window < 0:
        raise ValueError(f"budget and window must be >= 0, got {budget} and {window}")
    diff = words(tokenizer, own_prefix) ^ (words(tokenizer, donor_prefix) if donor_words is None else donor_words)
    texts = token_texts(tokenizer, block_ids) if block_texts is None else block_texts
    if len(texts) != len(block_ids):
        raise ValueError(f"block_texts has {len(texts)} entries for {len(block_ids)} block tokens")
    if not diff or not texts or not budget:
        return torch.zeros(0, dtype=torch.long)
    return mention_rows(texts, diff, budget, window)


def mention_rows(texts: list[str], wanted: set[str], budget: int, window: int = 8, before: int = 0, *,
                 ordered: bool = False) -> torch.Tensor:
    """Rows (token indices into ``texts``, :func:`token_texts` of a sequence) whose text holds a word of ``wanted``
    (lower-cased ``\\w+`` words), each with the ``before`` tokens before it and the ``window`` tokens after it; at
    most ``budget``, increasing (``ordered``: in the order taken). Occurrences of rarer words (fewer occurrences in
    the sequence) come first, within a word in order; a window stops at the sequence's end."""
    if budget < 0 or window < 0 or before < 0:
        raise ValueError(f"budget, window and before must be >= 0, got {budget}, {window} and {before}")
    if not wanted or not texts or not budget:
        return torch.zeros(0, dtype=torch.long)
    text = "".join(texts)
    ends = torch.tensor([len(t) for t in texts]).cumsum(0)  # token j covers [ends[j] - len, ends[j])
    hits = [m for m in _WORD.finditer(text) if m.group(0).lower() in wanted]
    count = Counter(m.group(0).lower() for m in hits)
    hits.sort(key=lambda m: (count[m.group(0).lower()], m.start()))
    chosen: list[int] = []
    seen: set[int] = set()
    for m in hits:
        first = int(torch.searchsorted(ends, m.start(), right=True))  # the token holding the word's first char
        last = int(torch.searchsorted(ends, m.end() - 1, right=True))
        for j in range(max(0, first - before), min(last + window, len(texts) - 1) + 1):
            if j not in seen and len(chosen) < budget:
                seen.add(j)
                chosen.append(j)
        if len(chosen) >= budget:
            break
    return torch.tensor(chosen if ordered else sorted(chosen), dtype=torch.long)


def focus_then_tail(tokenizer, block_ids: Sequence[int], own_prefix: Sequence[int], donor_prefix: Sequence[int] | None,
                    budget: int, window: int = 8, **kept) -> tuple[torch.Tensor, int]:
    """``budget`` rows of a block: :func:`focus_rows` first, the rest from the block's end (Tail-k). Returns the
    rows (0-based, increasing) and how many of them are focus rows. A block with no donor prefix (computed
    standalone) has no disagreement to find: all tail. ``kept``: :func:`focus_rows`' ``block_texts`` /
    ``donor_words``."""
    n = len(block_ids)
    budget = min(budget, n)
    focus = (focus_rows(tokenizer, block_ids, own_prefix, donor_prefix, budget, window, **kept)
             if donor_prefix is not None and len(donor_prefix) else torch.zeros(0, dtype=torch.long))
    rows, j = set(focus.tolist()), n - 1
    while len(rows) < budget:
        rows.add(j)
        j -= 1
    return torch.tensor(sorted(rows), dtype=torch.long), int(focus.numel())
