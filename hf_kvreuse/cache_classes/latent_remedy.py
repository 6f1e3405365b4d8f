"""LatentRemedyCache: latent tokens after a reused block (LatentRemedy, seed 003, arXiv 2610.18014;
METHODS.md §2.2).

For a prompt ``[target prefix][reused block(s)][suffix]``:

1. the block K/V come from the chunk store, RoPE-moved to their positions (direct reuse, as
   :class:`~hf_kvreuse.cache_classes.direct.DirectReuseCache`); the rows before the last block (the target's
   own prefix, gaps between blocks) are computed through every layer;
2. ``h`` = the hidden state of the last prefix token; the bridge maps it to ``n`` latent embeddings
   (:class:`~hf_kvreuse.latent.bridge.LatentBridge`);
3. the latents run right after the last block (positions ``e .. e+n-1``), attending to the prefix and the
   reused block; their K/V enter the cache;
4. the suffix (question, assistant header) runs at positions shifted by ``n``, attending to everything before,
   latents included; then decoding.

The cache physically holds ``n`` more entries than the prompt has tokens (``logical_offset = -n``); decoding
positions are the physical ones (``before_forward``). When ``generate`` returns, the latent rows are removed and
the later keys moved back by ``n`` (RoPE), so the returned cache is an ordinary cache of the conversation's
tokens that continues like a ``DynamicCache``. ``n = 0`` is direct reuse exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generation.partial import partial_forward
from ..kv import KV, load_kv
from ..timing import now
from .block_reuse import BlockReuseCache, BlockReuseStats


@dataclass
class LatentRemedyStats(BlockReuseStats):
    """:class:`BlockReuseStats` of a :class:`LatentRemedyCache` call, plus the latents.

    Attributes
    ----------
    latent_tokens : int
        Latent embeddings placed after the reused block (0: direct reuse).
    bridge_s : float
        The bridge MLP and the one pass over the latents and the rows after them (seconds).
    """

    __repr__ = BlockReuseStats.__repr__

    latent_tokens: int = 0
    bridge_s: float = 0.0  # the bridge MLP and the one pass over the latents and the rows after them


class LatentRemedyCache(BlockReuseCache):
    """Direct block reuse plus ``bridge.n_latent`` latent tokens after the last block.

    Parameters
    ----------
    model, input_ids, blocks, store, block_prefix_ids
        As for :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`; the first block must start after
        at least one prefix token (the target's own instructions, whose last hidden state drives the bridge).
    bridge : LatentBridge, optional
        Default: the shipped checkpoint for this model (:meth:`LatentBridge.from_pretrained`).
    """

    requires = {"rope": True, "engine": True, "layers": True}

    def __init__(self, model, input_ids, blocks, bridge=None, store=None, block_prefix_ids=None):
        from ..compat import HAS_QUERY_OFFSET, TRANSFORMERS_VERSION
        from ..latent.bridge import LatentBridge

        if bridge is None:
            bridge = LatentBridge.from_pretrained(model)
        if not isinstance(bridge, LatentBridge):
            raise TypeError(f"bridge must be a LatentBridge, got {type(bridge).__name__}")
        if bridge.d != model.config.hidden_size:
            raise ValueError(f"the bridge makes embeddings of size {bridge.d}; the model's hidden size is "
                             f"{model.config.hidden_size} (a bridge of another model?)")
        if bridge.n_latent and not HAS_QUERY_OFFSET:
            raise NotImplementedError(
                f"LatentRemedyCache holds {bridge.n_latent} latent entries that are not prompt tokens; sizing the "
                f"causal mask for them needs transformers>=5.17 (Cache.get_query_offset), this is "
                f"{'.'.join(map(str, TRANSFORMERS_VERSION))}")
        super().__init__(model, input_ids, blocks, store, block_prefix_ids)
        if not self.blocks:
            raise ValueError("LatentRemedyCache needs at least one reused block")
        if self.blocks[0][0] < 1:
            raise ValueError("the first block starts at token 0: LatentRemedy needs the target's own prefix before "
                             "the reused block (its last hidden state drives the latents)")
        self.bridge = bridge
        self.n_latent = bridge.n_latent
        self.stats = LatentRemedyStats(blocks=len(self.blocks), latent_tokens=self.n_latent)
        self._latents_at: int | None = None

    _shared_attrs = BlockReuseCache._shared_attrs + ("bridge",)

    def prepare(self, model, input_ids, generate_kwargs) -> None:
        # n = 0 runs the same steps with no latent rows: direct reuse, computed in two passes (before / after e)
        self.begin_generate(model, input_ids, generate_kwargs)
        device = self.input_ids.device
        t0 = now(device)
        with torch.no_grad():
            kv = self.assemble_blocks()
            covered = kv[0][0].shape[-2]
            fresh = self.fresh_rows(covered)
            e = self.blocks[-1][1]
            pre, post = fresh[fresh < e].to(device), fresh[fresh >= e].to(device)
            ids = self.input_ids[:, :covered]
            h = self.prefix_hidden(ids, pre, kv)
            t1 = now(device)
            kv = self.insert_latents(kv, ids, e, h, post)
            t2 = now(device)
        load_kv(self, kv)
        self.logical_offset = -self.n_latent
        self._latents_at = e
        st = self.stats
        st.recomputed_tokens = int(fresh.numel())
        st.reused_tokens = covered - st.recomputed_tokens
        st.bridge_s = t2 - t1
        st.assemble_s = now(device) - t0

    def prefix_hidden(self, ids: torch.Tensor, pre: torch.Tensor, kv: KV) -> torch.Tensor:
        """Compute rows ``pre`` (prefix and gaps) into ``kv``; return ``h`` of the last prefix token ``[1, d]``."""
        n_layers = len(kv)
        last = int((pre < self.blocks[0][0]).sum()) - 1  # index in `pre` of the token right before block 1
        cut = self.bridge.hidden_layer
        if cut < 0 or cut == n_layers - 1:
            hidden = partial_forward(self.model, ids, pre, kv, layers=range(n_layers))
            return hidden[:, last]
        hidden = partial_forward(self.model, ids, pre, kv, layers=range(0, cut + 1))
        h = hidden[:, last].clone()
        partial_forward(self.model, ids, pre, kv, layers=range(cut + 1, n_layers), hidden_states=hidden)
        return h

    def latent_embeddings(self, h: torch.Tensor) -> torch.Tensor:
        p = next(self.model.parameters())
        return self.bridge.to(p.device)(h).to(p.dtype)

    def insert_latents(self, kv: KV, ids: torch.Tensor, e: int, h: torch.Tensor, post: torch.Tensor) -> KV:
        """``kv`` with ``n`` latent rows at ``e .. e+n-1`` (the rows from ``e`` on move up by ``n``), computed in one
        pass together with the rows ``post`` after them (the question), which attend to the latents."""
        n = self.n_latent
        if n:
            out = []
            for k, v in kv:
                k2 = torch.cat([k[..., :e, :], k.new_zeros(*k.shape[:-2], n, k.shape[-1]), k[..., e:, :]], dim=-2)
                v2 = torch.cat([v[..., :e, :], v.new_zeros(*v.shape[:-2], n, v.shape[-1]), v[..., e:, :]], dim=-2)
                out.append((k2, v2))
            kv.clear()
            kv = out
        ids_ext = torch.cat([ids[:, :e], ids.new_zeros(1, n), ids[:, e:]], dim=1)
        rows = torch.cat([torch.arange(e, e + n, device=ids.device), post + n])
        if rows.numel():
            embed = self.model.get_input_embeddings()
            hidden = embed(ids_ext[:, post + n])
            if n:
                hidden = torch.cat([self.latent_embeddings(h), hidden], dim=1)
            partial_forward(self.model, ids_ext, rows, kv, layers=range(len(kv)), hidden_states=hidden)
        return kv

    # -- decoding at physical positions ----------------------------------------------------------------------
    def before_forward(self, input_ids, next_sequence_length):
        if not self.n_latent:
            return next_sequence_length, {}
        fed = next_sequence_length or (input_ids.shape[1] - self.get_seq_length())
        start = self.physical_length()
        pos = torch.arange(start, start + fed, device=input_ids.device)[None]
        # generate's 2D mask counts prompt tokens only; the causal mask is sized on the physical cache
        # (get_query_offset) and batch 1 has no padding to carry
        return next_sequence_length, {"position_ids": pos, "attention_mask": None}

    def end_generate(self, sequences, error) -> None:
        if error is None and sequences is not None and self.n_latent and self._latents_at is not None:
            self.drop_latents()
        super().end_generate(sequences, error)

    def drop_latents(self) -> None:
        """Remove the latent rows; keys after them move back by ``n`` positions: a cache of real tokens only."""
        e, n = self._latents_at, self.n_latent
        for layer in self.layers:
            k, v = layer.keys, layer.values
            tail = self._shifter.shift(k[..., e + n:, :], -n)
            layer.keys = torch.cat([k[..., :e, :], tail], dim=-2)
            layer.values = torch.cat([v[..., :e, :], v[..., e + n:, :]], dim=-2)
        self.logical_offset = 0
        self._latents_at = None
