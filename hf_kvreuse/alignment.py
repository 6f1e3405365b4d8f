"""Prompt alignment: which spans of a target prompt can be taken from a donor's KV cache.

Two entry points, one per level at which a caller knows the shared text:

* :func:`align_token_ids` aligns two token-id sequences (donor vs target): the longest common prefix, which
  is exactly reusable, then matching non-prefix spans, which are reusable after RoPE re-positioning (and are
  context-misaligned beyond layer 0). Spans are found greedily through an index of the donor's n-grams, in
  time linear in the lengths; they may come from the donor in any order (reordered documents or answers).
* :func:`block_token_span` maps a block of the *rendered* prompt, given by character offsets, onto the token
  stream of the full prompt, with the boundary rule of METHODS.md §1.1 (chenzhwsysu57/kvreuse
  ``build_prompt_parts``): a token straddling the block start stays with the prefix, a token straddling the
  block end goes with the block. Always cut the token stream of the full prompt; tokenizing fragments
  separately changes whitespace-merge tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Span:
    """``length`` tokens at donor positions ``donor_start..`` equal the target tokens at ``target_start..``.

    ``donor`` is the index of the donor (in the list given to :func:`align_multi`; always 0 for
    :func:`align_token_ids`).
    """

    donor_start: int
    target_start: int
    length: int
    donor: int = 0

    @property
    def delta(self) -> int:
        """Position shift that moves the donor tokens to their target positions."""
        return self.target_start - self.donor_start


@dataclass(frozen=True)
class Alignment:
    """Result of :func:`align_token_ids`.

    Attributes
    ----------
    spans : list of Span
        Non-overlapping, in increasing target order; donor positions may come in any order. A common prefix, if
        any, is ``spans[0]`` with ``donor_start == target_start == 0`` (from donor ``prefix_donor``).
    prefix_len : int
        Length of the exact common prefix (reusable without any approximation).
    prefix_donor : int
        The donor the prefix comes from (the first of the donors sharing the longest prefix).
    target_len : int
        Number of target tokens that were aligned.
    """

    spans: list[Span]
    prefix_len: int
    target_len: int
    prefix_donor: int = 0

    @property
    def matched(self) -> int:
        return sum(s.length for s in self.spans)

    def target_to_donor(self) -> torch.Tensor:
        """LongTensor ``[target_len]``: the donor position of each target token, or -1 where unmatched."""
        out = torch.full((self.target_len,), -1, dtype=torch.long)
        for s in self.spans:
            out[s.target_start:s.target_start + s.length] = torch.arange(s.donor_start, s.donor_start + s.length)
        return out

    def unmatched(self) -> torch.Tensor:
        """LongTensor: the target positions no span covers, increasing."""
        covered = torch.zeros(self.target_len, dtype=torch.bool)
        for s in self.spans:
            covered[s.target_start:s.target_start + s.length] = True
        return torch.nonzero(~covered).flatten()


def _as_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"alignment takes one sequence, got a batch of {ids.shape[0]}")
            ids = ids[0]
        return ids.tolist()
    return list(ids)


def align_token_ids(donor_ids: Sequence[int] | torch.Tensor, target_ids: Sequence[int] | torch.Tensor,
                    min_span: int = 4, donor_limit: int | None = None, target_limit: int | None = None,
                    max_candidates: int = 32) -> Alignment:
    """Align donor token ids against target token ids (one donor: :func:`align_multi` with a list of one).

    Parameters
    ----------
    donor_ids, target_ids : sequence of int or LongTensor ``[T]`` / ``[1, T]``
    min_span : int, default=4
        Shortest non-prefix match reused: short coincidental matches (punctuation, template tokens) save little
        prefill and carry the most context misalignment.
    donor_limit : int, optional
        Only donor positions ``< donor_limit`` may be used (e.g. the donor cache's length: the last generated
        token of a donor is never in its cache).
    target_limit : int, optional
        Only target positions ``< target_limit`` are aligned (e.g. ``len(target) - 1``: the last prompt token is
        always fed to the model so that there are logits).
    max_candidates : int, default=32
        Donor occurrences of one n-gram that are tried (bounds the time on very repetitive text).
    """
    return align_multi([donor_ids], target_ids, min_span=min_span, donor_limits=[donor_limit],
                       target_limit=target_limit, max_candidates=max_candidates)


def align_multi(donors: Sequence[Sequence[int] | torch.Tensor], target_ids: Sequence[int] | torch.Tensor,
                min_span: int = 4, donor_limits: Sequence[int | None] | None = None, target_limit: int | None = None,
                max_candidates: int = 32, prefix_donors: Sequence[int] | None = None) -> Alignment:
    """Align several donors' token ids against one target: spans may come from any donor, in any order.

    The exact prefix is the longest common prefix with any donor allowed by ``prefix_donors`` (ties: the
    earliest such donor). After it the target is scanned left to right; at each position the occurrences of
    the next ``min_span`` tokens in every donor are looked up in one n-gram index, the longest match is taken
    (ties: the earliest donor, then the earliest position), and the scan jumps past it. Unmatched positions
    advance by one. Time is linear in the total length.

    Parameters
    ----------
    donors : sequence of (sequence of int or LongTensor)
    target_ids : sequence of int or LongTensor ``[T]`` / ``[1, T]``
    min_span, target_limit, max_candidates
        As in :func:`align_token_ids`.
    donor_limits : sequence of (int or None), optional
        Per donor: only positions ``< limit`` may be used.
    prefix_donors : sequence of int, optional
        Donors whose common prefix with the target may serve as the exact prefix (default: every donor). A
        caller that knows some donors are not the exact cache of their tokens leaves them out here; they still
        supply (re-positioned, approximate) spans.
    """
    if min_span < 1:
        raise ValueError("min_span must be >= 1")
    limits = list(donor_limits) if donor_limits is not None else [None] * len(donors)
    if len(limits) != len(donors):
        raise ValueError(f"{len(limits)} donor limits for {len(donors)} donors")
    seqs = [_as_list(d)[:lim] for d, lim in zip(donors, limits)]
    target = _as_list(target_ids)[:target_limit]
    allowed = range(len(seqs)) if prefix_donors is None else prefix_donors
    prefix, prefix_donor = 0, 0
    for d in allowed:
        p = 0
        for a, b in zip(seqs[d], target):
            if a != b:
                break
            p += 1
        if p > prefix:
            prefix, prefix_donor = p, d
    spans = [Span(0, 0, prefix, prefix_donor)] if prefix else []
    k = min_span
    index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for d, seq in enumerate(seqs):
        for j in range(len(seq) - k + 1):
            index.setdefault(tuple(seq[j:j + k]), []).append((d, j))
    i, n_t = prefix, len(target)
    while i + k <= n_t:
        best_len, best = 0, None
        for d, j in index.get(tuple(target[i:i + k]), ())[:max_candidates]:
            seq, length = seqs[d], k
            while i + length < n_t and j + length < len(seq) and target[i + length] == seq[j + length]:
                length += 1
            if length > best_len:
                best_len, best = length, (d, j)
        if best is not None:
            spans.append(Span(best[1], i, best_len, best[0]))
            i += best_len
        else:
            i += 1
    return Alignment(spans=spans, prefix_len=prefix, target_len=len(target), prefix_donor=prefix_donor)


def block_token_span(offsets: Sequence[tuple[int, int]] | torch.Tensor, char_start: int, char_end: int) -> tuple[int, int]:
    """Token span ``[start, end)`` of the character block ``[char_start, char_end)`` of a rendered prompt.

    ``offsets`` is the tokenizer's ``offset_mapping`` of the *full* prompt. The span starts at the first token
    whose start is ``>= char_start`` (a token straddling the block start stays with the prefix) and ends before
    the first token whose start is ``>= char_end`` (a token straddling the block end joins the block).
    """
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.reshape(-1, 2).tolist()
    if not 0 <= char_start <= char_end:
        raise ValueError(f"bad character block [{char_start}, {char_end})")
    starts = [int(s) for s, _ in offsets]
    n = len(starts)
    start = next((i for i, s in enumerate(starts) if s >= char_start), n)
    end = next((i for i, s in enumerate(starts) if s >= char_end and i >= start), n)
    return start, end


def segment_prompt(tokenizer, text: str, blocks: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Tokenize ``text`` once and locate each character block in its token stream.

    Returns the full ids ``[1, T]`` and one token span per block (see :func:`block_token_span`). Spans are
    checked to be ordered and non-overlapping, so prefix ⊕ blocks ⊕ suffix re-assembles the full ids.
    """
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False, return_tensors="pt")
    offsets = enc["offset_mapping"][0]
    spans = [block_token_span(offsets, a, b) for a, b in blocks]
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        if a1 > b0:
            raise ValueError(f"blocks overlap in token space: {spans}")
    return enc["input_ids"], spans
