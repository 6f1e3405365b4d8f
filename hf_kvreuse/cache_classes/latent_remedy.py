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
   latents included; then decoding. A bridge with a LoRA (``lora_rank > 0``, RestoreKV's variant) adapts the
   model's projections on the latent rows of that pass only.

A gated bridge (``readout="gated"``, this project's variant) runs step 3 into scratch rows and keeps the latents
out of the cache: step 4 runs at the prompt's own positions, and every row computed while the cache serves
``generate`` (the recomputed block rows, the question, the answer) reads the latents' per-layer states through the
bridge's zero-initialised cross-attention (:class:`~hf_kvreuse.latent.bridge.GatedReadout`), a hook that acts in
the calling thread only and is removed when ``generate`` returns. Untrained, it is exactly the cache without
latents.

The cache physically holds ``n`` more entries than the prompt has tokens (``logical_offset = -n``); decoding
positions are the physical ones (``before_forward``). When ``generate`` returns, the latent rows are removed and
the later keys moved back by ``n`` (RoPE), so the returned cache is an ordinary cache of the conversation's
tokens that continues like a ``DynamicCache``. ``n = 0`` is direct reuse exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generation.fused import PendingForward, returns_internals
from ..generation.partial import partial_forward
from ..kv import KV, empty_kv, load_kv
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
    focus_rows : int
        With ``focus=``: recomputed block rows chosen as focus rows (the others are tail rows).
    """

    __repr__ = BlockReuseStats.__repr__

    latent_tokens: int = 0
    bridge_s: float = 0.0  # the bridge MLP and the one pass over the latents and the rows after them
    focus_rows: int = 0    # recomputed block rows chosen as focus rows (``focus=``); the rest are tail rows


class LatentRemedyCache(BlockReuseCache):
    """Direct block reuse plus ``bridge.n_latent`` latent tokens after the last block.

    Parameters
    ----------
    model, input_ids, blocks, store, block_prefix_ids
        As for :class:`~hf_kvreuse.cache_classes.block_reuse.BlockReuseCache`. The prompt starts with the target's
        own prefix (its instructions, whose hidden states drive the bridge): either computed, or given as a block
        at token 0 whose K/V were computed standalone (no ``block_prefix_ids`` for it), i.e. exactly the agent's
        own prefix as a chunk store or a :class:`~hf_kvreuse.session.ReuseSession` holds it. The bridge's
        read-out of such a leading block is kept with its chunk (``KVChunk.extra``), so a later call with the
        same prefix runs one pass over the latents and the question. A block at 0 computed under some other
        prefix is refused (there is no own prefix then); a prompt whose only block is its own leading prefix has
        nothing to remedy and gets no latents (exact prefix reuse).
    bridge : LatentBridge, optional
        Default: the shipped checkpoint for this model (:meth:`LatentBridge.from_pretrained`).
    tail_tokens : int, optional
        Latents plus Tail-k: the last ``k`` rows of every reused block are recomputed too, in the same pass as the
        latents and the question. Default: the value the bridge was trained with (``bridge.tail_tokens``).
    focus : tokenizer, optional
        Latents plus focus rows: the ``tail_tokens`` recomputed rows of each reused block go first to the rows that
        mention what the own prefix and the block's donor prefix disagree on (:mod:`hf_kvreuse.focus`, as
        :class:`~hf_kvreuse.cache_classes.focus.FocusRecomputeCache`), the rest to its tail. Give the model's
        tokenizer; ``None`` (default): the tail only. ``stats.focus_rows`` counts them. Measured with the shipped
        bridge (trained with Tail-16): 31 accuracy points below the focus rows without latents (research notes,
        LatentRemedy and FocusRecompute), so for that checkpoint prefer ``FocusRecomputeCache``.
    focus_window : int, default=8
        With ``focus``: tokens after each occurrence of a differing word recomputed with it.
    fuse_first_step : bool, default=True
        The pass over the latents and the rows after them includes the last prompt token and runs as the first
        forward of ``generate`` (:mod:`hf_kvreuse.generation.fused`): one pass over the weights less before the
        first token, the same K/V and logits up to float rounding. Not when ``generate`` returns attentions or
        hidden states. False: that pass in the assembly, then ``generate``'s one-token step.
    """

    requires = {"rope": True, "engine": True, "layers": True}

    def __init__(self, model, input_ids, blocks, bridge=None, store=None, block_prefix_ids=None,
                 tail_tokens: int | None = None, *, focus=None, focus_window: int = 8, fuse_first_step: bool = True):
        from ..compat import HAS_QUERY_OFFSET, TRANSFORMERS_VERSION
        from ..latent.bridge import LatentBridge

        if bridge is None:
            bridge = LatentBridge.from_pretrained(model)
        if not isinstance(bridge, LatentBridge):
            raise TypeError(f"bridge must be a LatentBridge, got {type(bridge).__name__}")
        if bridge.d != model.config.hidden_size:
            raise ValueError(f"the bridge makes embeddings of size {bridge.d}; the model's hidden size is "
                             f"{model.config.hidden_size} (a bridge of another model?)")
        if bridge.n_latent and not bridge.gated and not HAS_QUERY_OFFSET:
            raise NotImplementedError(
                f"LatentRemedyCache holds {bridge.n_latent} latent entries that are not prompt tokens; sizing the "
                f"causal mask for them needs transformers>=5.17 (Cache.get_query_offset), this is "
                f"{'.'.join(map(str, TRANSFORMERS_VERSION))}")
        tail_tokens = bridge.tail_tokens if tail_tokens is None else int(tail_tokens)
        if tail_tokens < 0:
            raise ValueError("tail_tokens must be >= 0")
        if focus is not None and not callable(getattr(focus, "batch_decode", None)):
            raise TypeError(f"focus must be the model's tokenizer (with batch_decode), got {type(focus).__name__}")
        if focus_window < 0:
            raise ValueError(f"focus_window must be >= 0, got {focus_window}")
        if bridge.rows == "focus" and focus is None:
            raise ValueError("this LatentBridge was trained with focus rows recomputed beside its latents "
                             "(rows='focus'): pass the model's tokenizer as focus=")
        super().__init__(model, input_ids, blocks, store, block_prefix_ids, fuse_first_step=fuse_first_step)
        if not self.blocks:
            raise ValueError("LatentRemedyCache needs at least one reused block")
        self.lead: tuple[int, int] | None = None
        if self.blocks[0][0] == 0:
            own = self.prefix_for(0)
            if own is not None and torch.as_tensor(own).numel():
                raise ValueError("the first block starts at token 0 and was computed under another prefix: "
                                 "LatentRemedy needs the target's own prefix before the reused block (its hidden "
                                 "states drive the latents)")
            self.lead = self.blocks[0]  # the agent's own prefix, exact K/V from the store
        self.reused = self.blocks[1:] if self.lead else list(self.blocks)
        self.bridge = bridge
        self.tail_tokens = tail_tokens
        self.focus, self.focus_window = focus, int(focus_window)
        # latent rows held in the cache (a gated bridge's are read through its hook instead)
        self.n_latent = bridge.n_latent if self.reused and not bridge.gated else 0
        self.gated = bool(self.reused and bridge.gated)
        self.stats = LatentRemedyStats(blocks=len(self.blocks),
                                       latent_tokens=bridge.n_latent if self.reused else 0)
        self._latents_at: int | None = None
        self._readout = None  # a gated bridge's hooks while the cache serves generate

    _shared_attrs = BlockReuseCache._shared_attrs + ("bridge",)

    def prepare(self, model, input_ids, generate_kwargs) -> None:
        if self.gated:
            return self._prepare_gated(model, input_ids, generate_kwargs)
        # n = 0 runs the same steps with no latent rows: direct reuse, computed in two passes (before / after e)
        device, t0, fuse, covered, storage, kv, fresh, e, tails, pre, post, ids = \
            self._layout(model, input_ids, generate_kwargs)
        with torch.no_grad():
            feats = None
            if self.n_latent:
                feats = self.prefix_features(ids, pre, kv)
                if self.bridge.donor:
                    feats = (feats, self.donor_features())
            elif pre.numel():
                partial_forward(self.model, ids, pre, kv)
        st = self.stats
        st.recomputed_tokens = int(fresh.numel() + tails.numel()) + getattr(self, "_lead_rows_computed", 0)
        st.reused_tokens = covered - st.recomputed_tokens
        st.fused_first_step = fuse
        last = torch.tensor([covered], device=device, dtype=post.dtype)

        def latents_pass(first_token: bool):
            t1 = now(device)
            with torch.no_grad():
                if first_token:  # the last prompt token is one more row after the question's: its logits
                    kv2, out = self.insert_latents(storage, self.input_ids, e, feats, torch.cat([post, last]),
                                                   tails.to(device), logits=True)
                else:
                    kv2, out = self.insert_latents(kv, ids, e, feats, post, tails.to(device)), None
            load_kv(self, kv2)
            self.logical_offset = -self.n_latent
            self._latents_at = e
            st.bridge_s = now(device) - t1
            return out

        if fuse:  # the cache shows generate the prompt's first N - 1 rows (no latents yet) until the first forward
            load_kv(self, kv)
            self.logical_offset, self._latents_at = 0, None
            self._pending = PendingForward(int(self.input_ids[0, -1]), lambda model, cache: latents_pass(True))
        else:
            latents_pass(False)
        st.assemble_s = now(device) - t0

    def _layout(self, model, input_ids, generate_kwargs):
        """The start of both preparations: ``begin_generate``, the blocks placed into full-length storage (fused:
        with the last token's row too) and the rows split around the last block's end ``e``. Returns ``(device,
        t0, fuse, covered, storage, kv, fresh, e, tails, pre, post, ids)``; ``kv`` views the first ``covered``
        rows of ``storage``."""
        self.begin_generate(model, input_ids, generate_kwargs)
        device = self.input_ids.device
        t0 = now(device)
        self._pending = None
        fuse = self.fuse_first_step and not returns_internals(model, generate_kwargs)
        covered = self.input_ids.shape[1] - 1
        with torch.no_grad():
            storage = self.assemble_blocks(extra_rows=1 if fuse else 0)  # fused: the last token's row too
            kv = [(k[..., :covered, :], v[..., :covered, :]) for k, v in storage] if fuse else storage
            fresh = self.fresh_rows(covered).to(device)
            e = self.blocks[-1][1]
            tails = self.tail_rows().to(device)
        return (device, t0, fuse, covered, storage, kv, fresh, e, tails, fresh[fresh < e], fresh[fresh >= e],
                self.input_ids[:, :covered])

    def _prepare_gated(self, model, input_ids, generate_kwargs) -> None:
        """A gated bridge: own prefix rows; the latents into scratch rows after the block, their per-layer states
        kept; then the read-out hook on, and the recomputed block rows with the question (and, fused, the last
        prompt token) in one pass at the prompt's own positions, as FocusRecompute / Tail-k compute them."""
        import contextlib

        from ..generation.fused import PendingRows
        from ..local_hooks import local_hooks

        device, t0, fuse, covered, storage, kv, fresh, e, tails, pre, post, ids = \
            self._layout(model, input_ids, generate_kwargs)
        with torch.no_grad():
            feats = self.prefix_features(ids, pre, kv)
            if self.bridge.donor:
                feats = (feats, self.donor_features())
            t1 = now(device)
            states = self.latent_states(storage, e, feats)
            rows = torch.unique(torch.cat([tails, post]))
        stack = contextlib.ExitStack()
        try:
            hooks = stack.enter_context(local_hooks())  # this context only, until generate returns
            self.bridge.readout_hooks(hooks, self.model, states)
            with torch.no_grad():
                if fuse:
                    pending = PendingRows(storage, rows, self.input_ids)
                    kv = pending.visible()
                    self._pending = pending
                elif rows.numel():
                    partial_forward(self.model, ids, rows, kv)
        except BaseException:
            stack.close()
            raise
        self._readout = stack
        load_kv(self, kv)
        st = self.stats
        st.bridge_s = now(device) - t1
        st.recomputed_tokens = int(torch.unique(torch.cat([fresh, tails])).numel()) + \
            getattr(self, "_lead_rows_computed", 0)
        st.reused_tokens = covered - st.recomputed_tokens
        st.fused_first_step = fuse
        st.assemble_s = now(device) - t0

    def latent_states(self, storage: KV, e: int, feats) -> list[torch.Tensor]:
        """Run the gated bridge's latents at positions ``e .. e+n-1`` after the prefix and the reused block(s)
        (rows ``0 .. e-1`` of ``storage``); their states after every decoder layer (``[1, n, d]`` each). Their
        K/V go to scratch: rows ``e ..`` of ``storage`` where the prompt has ``n`` rows after the block (the
        question's rows, computed afterwards), else a copy of rows ``0 .. e-1`` with ``n`` more."""
        n = self.bridge.n_latent
        z = self.latent_embeddings(feats)
        scratch = storage if storage[0][0].shape[-2] >= e + n else \
            [(torch.cat([k[..., :e, :], k.new_zeros(*k.shape[:-2], n, k.shape[-1])], -2),
              torch.cat([v[..., :e, :], v.new_zeros(*v.shape[:-2], n, v.shape[-1])], -2)) for k, v in storage]
        ids = self.input_ids.new_zeros(1, scratch[0][0].shape[-2])
        rows = torch.arange(e, e + n, device=ids.device)
        with self.bridge.capture_states(self.model) as states:
            partial_forward(self.model, ids, rows, scratch, layers=range(len(storage)), hidden_states=z)
        return [s.detach() for s in states]

    def tail_rows(self) -> torch.Tensor:
        """The ``tail_tokens`` rows of every reused block recomputed with the latents: its last ones, or with
        ``focus`` its focus rows first."""
        if self.focus is not None:
            from .focus import block_focus_rows

            rows, self.stats.focus_rows = block_focus_rows(self, self.reused, self.tail_tokens, self.focus,
                                                           self.focus_window)
            return rows
        rows = [torch.arange(e - min(self.tail_tokens, e - s), e) for s, e in self.reused]
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)

    def prefix_features(self, ids: torch.Tensor, pre: torch.Tensor, kv: KV) -> list[torch.Tensor]:
        """Compute rows ``pre`` (prefix and gaps) into ``kv``; return the bridge's read-out of the prefix (the rows
        before the first reused block) as a one-element list of ``[len(bridge.layers), T, d]``, ``T`` = 1 (the last
        row) or every prefix row (``read="attn"``).

        Rows of a leading own-prefix block are computed again only when its chunk does not hold their read-out
        yet (``KVChunk.extra``); then it does, for the next call."""
        b = self.bridge
        s1 = self.reused[0][0]
        dev = pre.device
        want = torch.arange(s1, device=dev) if b.all_rows else torch.tensor([s1 - 1], device=dev)
        lead_end = self.lead[1] if self.lead else 0
        chunk = self.chunks[self.lead] if self.lead else None
        key = ("latent_readout", b.layers, b.read)
        stored = chunk.extra.get(key) if chunk is not None else None  # rows 0..lead_end-1 (or only the last)
        from_store = want < lead_end if stored is not None else torch.zeros_like(want, dtype=torch.bool)
        rows = torch.unique(torch.cat([want[~from_store], pre]))  # sorted
        self._lead_rows_computed = int((rows < lead_end).sum())
        per_layer = self._read_layers(ids, rows, kv) if rows.numel() else None  # [R, |rows|, d]
        parts = []
        if bool(from_store.any()):
            parts.append(stored.to(dev) if b.all_rows else stored[:, -1:].to(dev))
        if bool((~from_store).any()):
            parts.append(per_layer[:, torch.isin(rows, want[~from_store])])
        if stored is None and chunk is not None and chunk.start == 0 and per_layer is not None:
            lead_rows = torch.arange(lead_end, device=dev) if b.all_rows else torch.tensor([lead_end - 1], device=dev)
            if bool(torch.isin(lead_rows, rows).all()):
                chunk.extra[key] = per_layer[:, torch.isin(rows, lead_rows)].detach().clone()
        return [torch.cat(parts, 1)]

    def _read_layers(self, ids: torch.Tensor, rows: torch.Tensor, kv: KV) -> torch.Tensor:
        """Compute ``rows`` through every layer into ``kv``; their hidden states at the bridge's layers."""
        n_layers = len(kv)
        cuts = sorted({n_layers - 1 if x < 0 else x for x in self.bridge.layers})
        grabbed, hidden, start = {}, None, 0
        for cut in cuts:  # the range ending at the last layer applies the final norm (what -1 reads)
            hidden = partial_forward(self.model, ids, rows, kv, layers=range(start, cut + 1), hidden_states=hidden)
            grabbed[cut] = hidden[0]
            start = cut + 1
        if start < n_layers:
            partial_forward(self.model, ids, rows, kv, layers=range(start, n_layers), hidden_states=hidden)
        parts = [grabbed[n_layers - 1 if x < 0 else x] for x in self.bridge.layers]
        return torch.stack([t.to(parts[0].device) for t in parts])  # layers of a split model: one device

    def donor_features(self) -> list[torch.Tensor]:
        """A ``donor=True`` bridge's read-out of the donor prefix: the tokens the last reused block (the one the
        latents follow) was computed after, read as :meth:`prefix_features` reads the own prefix. The prefix runs
        alone from position 0 (as the donor ran it: the data module reads it from the donor's own forward), once
        per chunk (kept in ``KVChunk.extra``)."""
        b = self.bridge
        donor = self.prefix_for(self.reused[-1][0])
        donor = None if donor is None else torch.as_tensor(donor).reshape(-1)
        if donor is None or not donor.numel():
            raise ValueError(f"this LatentBridge reads the donor's prefix (donor=True), but the reused block "
                             f"{self.reused[-1]} was computed standalone (no block_prefix_ids): there is no donor "
                             "prefix to read")
        chunk = self.chunks[self.reused[-1]]
        key = ("donor_readout", b.layers, b.read)
        if key not in chunk.extra:  # the donor prefix alone, from position 0, through the same layer engine
            ids = donor[None].to(chunk.kv[0][0].device)
            f = self._read_layers(ids, torch.arange(ids.shape[1], device=ids.device), empty_kv(chunk.kv, ids.shape[1]))
            chunk.extra[key] = (f if b.all_rows else f[:, -1:]).detach().clone()  # [R, T, d]
        return [chunk.extra[key]]

    def prefix_hidden(self, ids: torch.Tensor, pre: torch.Tensor, kv: KV) -> torch.Tensor:
        """Compute rows ``pre`` into ``kv``; ``h`` ``[1, d]``: the last prefix row at the bridge's first layer."""
        return self.prefix_features(ids, pre, kv)[0][0, -1:]

    def latent_embeddings(self, feats) -> torch.Tensor:
        p = next(self.model.parameters())
        own, donor = feats if self.bridge.donor else (feats, None)
        return self.bridge.to(p.device)(own, donor).to(p.dtype)

    def insert_latents(self, kv: KV, ids: torch.Tensor, e: int, feats, post: torch.Tensor,
                       tails: torch.Tensor | None = None, logits: bool = False):
        """``kv`` with ``n`` latent rows at ``e .. e+n-1`` (the rows from ``e`` on move up by ``n``), computed in one
        pass together with the recomputed block tails ``tails`` before them and the rows ``post`` after them (the
        question), which attend to the latents. ``logits=True``: the pass runs through the model's own forward
        (the rows' embeddings as ``inputs_embeds``; the model check's layer probe, which this cache requires,
        shows that its forward does nothing else around the layers) and ``(kv, output)`` is returned, the output
        holding the last row's logits."""
        n = self.n_latent
        if n:
            out = []
            for k, v in kv:
                k2 = torch.cat([k[..., :e, :], k.new_zeros(*k.shape[:-2], n, k.shape[-1]), k[..., e:, :]], dim=-2)
                v2 = torch.cat([v[..., :e, :], v.new_zeros(*v.shape[:-2], n, v.shape[-1]), v[..., e:, :]], dim=-2)
                out.append((k2, v2))
            kv.clear()
            kv = out
        tails = post[:0] if tails is None else tails
        ids_ext = torch.cat([ids[:, :e], ids.new_zeros(1, n), ids[:, e:]], dim=1)
        rows = torch.cat([tails, torch.arange(e, e + n, device=ids.device), post + n])
        if rows.numel():
            embed = self.model.get_input_embeddings()
            parts = [embed(ids_ext[:, tails])] if tails.numel() else []
            if n:
                parts.append(self.latent_embeddings(feats))
            parts.append(embed(ids_ext[:, post + n]))
            on_latents = torch.zeros(1, rows.numel(), dtype=torch.bool, device=ids.device)
            on_latents[:, tails.numel(): tails.numel() + n] = True  # the bridge's LoRA, if any, acts there only
            with self.bridge.lora_active(self.model, on_latents):
                out = partial_forward(self.model, ids_ext, rows, kv, layers=None if logits else range(len(kv)),
                                      hidden_states=torch.cat(parts, 1))
            if logits:
                return kv, out
        return kv

    # -- decoding at physical positions ----------------------------------------------------------------------
    def before_forward(self, input_ids, next_sequence_length):
        if not self.n_latent:
            return next_sequence_length, {}
        fed = next_sequence_length or (input_ids.shape[1] - self.get_seq_length())
        start = self.physical_length()
        pos = torch.arange(start, start + fed, device=self.input_ids.device)[None]  # the model's input device
        # generate's 2D mask counts prompt tokens only; the causal mask is sized on the physical cache
        # (get_query_offset) and batch 1 has no padding to carry
        return next_sequence_length, {"position_ids": pos, "attention_mask": None}

    def end_generate(self, sequences, error) -> None:
        if self._readout is not None:  # a gated bridge's hooks end with the generate they served
            stack, self._readout = self._readout, None
            stack.close()
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
