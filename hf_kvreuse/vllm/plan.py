"""Which tokens of a request the connector supplies, and from which stored rows (no vLLM needed).

vLLM's scheduler asks a connector for one number: how many tokens past those it has computed itself the
connector can supply. Those tokens must form a **contiguous prefix** of the request, so a re-positioned span can be
used only when every token before it is supplied too (by vLLM's own prefix cache, the store's exact prefix, or
earlier spans). The rule this module implements:

1. the **exact prefix**: the longest common prefix of the request with the exact rows (``exact_len``) of any entry
   of the same model;
2. with ``spans=True``, **re-positioned spans** right after it: the request's next tokens are aligned against every
   entry (:func:`hf_kvreuse.alignment.align_multi`, spans of at least ``min_span`` tokens); spans are taken while
   they continue the covered run without a gap. A span's keys are moved by ``target_start - donor_start``
   positions (RoPE, :class:`hf_kvreuse.rope.RopeShifter`) when loaded. This is direct reuse (METHODS.md §3.2):
   the span's K/V were computed in another context and are approximate;
3. **block granularity**: the claim ends at a multiple of vLLM's block size (rows past it are recomputed by vLLM,
   exactly, over what was loaded) and never includes the request's last prompt token (vLLM needs its logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..alignment import align_multi
from .store import EntryInfo


@dataclass(frozen=True)
class Piece:
    """Target rows ``target_start..+length`` come from rows ``donor_start..`` of entry ``entry_id``."""

    target_start: int
    length: int
    entry_id: str
    donor_start: int
    exact: bool

    @property
    def delta(self) -> int:
        """Positions the donor keys move by (0 for the exact prefix)."""
        return self.target_start - self.donor_start

    @property
    def target_end(self) -> int:
        return self.target_start + self.length


@dataclass
class Claim:
    """What the connector supplies for one request.

    Attributes
    ----------
    pieces : list of Piece
        Cover ``0..end`` without gaps, in order.
    end : int
        Tokens ``0..end`` are vouched for (a multiple of the block size; 0 when nothing is).
    exact_end : int
        Tokens ``0..exact_end`` are exact (the exact prefix, clipped to ``end``); everything vLLM computes after
        it is exact too when no span was used (``spans_used == 0``).
    """

    pieces: list[Piece] = field(default_factory=list)
    end: int = 0
    exact_end: int = 0

    @property
    def spans_used(self) -> int:
        return sum(1 for p in self.pieces if not p.exact)

    def between(self, a: int, b: int) -> list[Piece]:
        """The pieces clipped to target rows ``a..b``."""
        out = []
        for p in self.pieces:
            s, e = max(a, p.target_start), min(b, p.target_end)
            if s < e:
                out.append(Piece(s, e - s, p.entry_id, p.donor_start + s - p.target_start, p.exact))
        return out


def plan_claim(token_ids: Sequence[int], entries: Sequence[EntryInfo], block_size: int, spans: bool = False,
               min_span: int = 16) -> Claim:
    """The claim of the connector for a request of ``token_ids`` over ``entries`` (all of the request's model).

    Parameters
    ----------
    token_ids : sequence of int
        The request's prompt.
    entries : sequence of EntryInfo
        Candidate entries (same model identity: the caller filtered them).
    block_size : int
        vLLM's KV block size; the claim is a whole number of blocks.
    spans : bool, default=False
        Allow re-positioned spans after the exact prefix (direct reuse; approximate).
    min_span : int, default=16
        Shortest span reused (short coincidental matches save little and carry the most misalignment).
    """
    tokens = list(token_ids)
    limit = len(tokens) - 1  # the last prompt token is always computed: vLLM samples from its logits
    if limit <= 0 or block_size <= 0:
        return Claim()
    pieces: list[Piece] = []
    exact, exact_len = None, 0
    for e in entries:
        p = 0
        for a, b in zip(e.token_ids[:min(e.exact_len, limit)], tokens):
            if a != b:
                break
            p += 1
        if p > exact_len:
            exact, exact_len = e, p
    if exact is not None:
        pieces.append(Piece(0, exact_len, exact.entry_id, 0, True))
    covered = exact_len
    if spans and entries and covered < limit:
        al = align_multi([e.token_ids for e in entries], tokens[covered:limit], min_span=min_span, prefix_donors=[])
        for s in al.spans:
            start = covered if not pieces else pieces[-1].target_end
            if s.target_start + exact_len != start:
                break  # a gap: vLLM's claim is a prefix, nothing after it can be supplied
            pieces.append(Piece(start, s.length, entries[s.donor].entry_id, s.donor_start, False))
        covered = pieces[-1].target_end if pieces else 0
    end = (covered // block_size) * block_size
    claim = Claim(pieces=[], end=end, exact_end=min(exact_len, end))
    claim.pieces = Claim(pieces=pieces).between(0, end)
    return claim
