"""Partial recompute: run the model over a subset of token rows and scatter their fresh K/V into a full cache.

Rows ``S`` of a sequence are recomputed through every layer while all other rows keep the K/V already in the
cache (reused, possibly stale). Each recomputed row attends to every present column whose *original*
position is not after its own: ``mask[j, i] = pos[i] <= pos[S[j]]`` (METHODS.md §3.3: the CacheBlend research
code lets recomputed rows see future tokens; this engine does not). One engine serves every selective method:
OptimisticCache computes its unmatched rows with it; the selective-recompute caches choose other rows.

With ``layers=`` only a contiguous range of decoder layers runs (rows enter it as ``hidden_states``, the
residual stream after the layer before the range), which is what layer-wise methods such as CacheBlend need:
all rows through the first layers, then a selected subset through the rest. That path drives the decoder
layers directly and supports the Llama family layout (``model.model.{embed_tokens, layers, norm,
rotary_emb}``: Llama, Qwen2/3, Mistral). What a model's own ``forward`` does around its layers (embedding
multipliers, per-layer extras) is not reproduced there, so :func:`hf_kvreuse.model_check.check_model` compares
both modes with the model's own forward before any cache uses them. The scatter cache counts its writes and
raises if a layer of the range did not store its rows exactly once.

Attention of the selected rows (:mod:`hf_kvreuse.generation.selected`): under the ``triton`` backend a kernel
that builds the position mask per tile and skips the columns no row of a tile can see; on torch for ``sdpa``
models SDPA per block of rows over only the columns the block can see (measured faster than one call with the
full mask: ``research/performance/selected_attention_cpu.py``); otherwise the explicit mask below. On the first two paths the
``[R, N]`` mask is never built unless a layer falls back to the model's own attention (then once per forward): at
32k tokens with 16k recomputed rows it is ~2 GB of transient memory.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from .. import kernels
from ..compat import cache_kwargs
from ..devices import PerDevice
from ..kv import KV
from ..triton.selected_attention import SelectedPositions
from ..sliding import layer_windows
from .selected import base_attn, selected_path, selected_rows


class _ScatterCache(DynamicCache):
    """Write-through cache for one partial forward: ``update`` scatters the new rows and returns all rows."""

    def __init__(self, config, kv: KV, rows: torch.Tensor):
        super().__init__(config=config)
        self._kv, self._rows = kv, PerDevice(rows)  # layers of a device_map-split model live on several devices
        self.writes = [0] * len(kv)
        self._unchecked = True
        if len(kv) != len(self.layers):
            raise ValueError(f"KV has {len(kv)} layers, the model {len(self.layers)}")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.writes[layer_idx] += 1
        k, v = self._kv[layer_idx]
        rows = self._rows.on(k.device)
        # torch: index_copy_ of each (after .to(k.dtype)); Triton: K and V in one launch, cast on store, its
        # host-synchronising range check of the rows only on the first write (every layer holds the same N)
        kernels.scatter_kv_rows(k, v, rows, key_states.to(device=k.device), value_states.to(device=v.device),
                                check=self._unchecked)
        self._unchecked = False
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv[layer_idx][0].shape[-2]

    def check_writes(self, model, layers: range) -> None:
        """Every layer of ``layers`` wrote its rows exactly once (else the cache would hold stale rows)."""
        bad = {i: self.writes[i] for i in range(len(self.writes)) if self.writes[i] != (1 if i in layers else 0)}
        if bad:
            raise RuntimeError(f"partial recompute on {type(model).__name__}: cache writes per layer {bad} "
                               f"(expected one write for each of layers {layers.start}..{layers.stop - 1}); this "
                               "model's layers do not all store K/V through the cache, so recomputed rows would "
                               "be missing")


def position_causal_mask(row_pos: torch.Tensor, col_pos: torch.Tensor, dtype: torch.dtype,
                         col_valid: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Mask ``[1, 1, |rows|, |cols|]`` of the columns each row may see (``col_pos <= row_pos``, and the column
    valid; with a sliding ``window``, also ``row_pos - col_pos < window``, transformers' sliding-window rule):
    additive (0 / the dtype's min) for a float ``dtype``, ``True`` = visible for ``torch.bool``."""
    allowed = col_pos[None, :] <= row_pos[:, None]
    if window is not None:
        allowed = allowed & (row_pos[:, None] - col_pos[None, :] < window)
    if col_valid is not None:
        allowed = allowed & col_valid[None, :]
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=row_pos.device)
    mask.masked_fill_(allowed.logical_not_(), torch.finfo(dtype).min)  # in place: no third R x N temporary
    return mask[None, None]


#: the key of a model's per-layer-type mask mapping each layer reads (False: full attention, True: sliding)
LAYER_MASK = {False: "full_attention", True: "sliding_attention"}


def _sliding_masks(config, row_pos, positions, dtype, col_valid, windows: set):
    """The masks of a model with sliding-window layers: one tensor when every layer slides (the model uses it for
    all), else the per-layer-type mapping (``{"full_attention": .., "sliding_attention": ..}``) the models with
    mixed layers take as ``attention_mask`` (transformers' ``causal_mask_mapping``)."""
    if len(windows) != 1:
        raise NotImplementedError(f"layers with different sliding windows {sorted(windows)}")
    (w,) = windows
    sliding = position_causal_mask(row_pos, positions, dtype, col_valid, window=w)
    if all(x is not None for x in layer_windows(config)):
        return sliding
    return {LAYER_MASK[False]: position_causal_mask(row_pos, positions, dtype, col_valid), LAYER_MASK[True]: sliding}


def _placeholder(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What the model gets as its mask when the selected-row attention replaces it: a ``[1, 1, rows, cols]`` view of
    one NaN (no memory). The wrapper hands the layers it does not handle the real mask instead (built then); any
    other reader gets NaN, which the model check's engine probe refuses, never a silently unmasked attention."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(1, 1, rows, cols)


def _decoder(model):
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise NotImplementedError(f"layer-range recompute needs the Llama-family layout (model.model.embed_tokens, "
                                  f".layers, .norm, .rotary_emb); {type(model).__name__} does not have it")
    return base


_HEADS = None  # model -> (config digest, whether head_logits reproduces the model's own logits)


def _head(model, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def plain_head(model) -> bool:
    """Whether the model's own forward computes its logits as :func:`head_logits` does (the output embedding, then
    ``final_logit_softcapping`` where set), not with a logit scale or another head: probed once per model and
    config, a 4-token forward compared with the base model's last hidden state put through that head."""
    import weakref

    from ..devices import input_device
    from ..fingerprint import config_digest

    global _HEADS
    if _HEADS is None:
        _HEADS = weakref.WeakKeyDictionary()
    key = config_digest(model.config)
    hit = _HEADS.get(model)
    if hit is None or hit[0] != key:
        try:
            vocab = int(model.config.vocab_size)
            ids = (torch.arange(4) * 7 % max(vocab - 3, 1) + 3)[None].to(input_device(model))
            want = model(input_ids=ids, use_cache=False).logits.float()
            got = _head(model, _decoder(model)(input_ids=ids, use_cache=False).last_hidden_state).float()
            ok = want.shape == got.shape and bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(
                want.abs().max().clamp_min(1.0))))
        except Exception:  # noqa: BLE001 - no output embedding or another layout: not this head
            ok = False
        hit = _HEADS[model] = (key, ok)
    return hit[1]


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits of final-norm hidden states ``hidden`` ``[1, R, hidden]``; only for a model whose
    :func:`plain_head` holds (refused otherwise)."""
    if not plain_head(model):
        raise NotImplementedError(f"{type(model).__name__}'s forward does not compute its logits as its output "
                                  "embedding (and soft-capping) does: run the model's own forward instead")
    return _head(model, hidden)


@torch.no_grad()
def run_layers(model, layers: range, hidden_states: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
               cache) -> torch.Tensor:
    """Run decoder layers ``layers`` on ``hidden_states`` ``[1, R, hidden]`` at ``position_ids`` ``[1, R]``."""
    base = _decoder(model)
    pos_emb = base.rotary_emb(hidden_states, position_ids=position_ids)
    windows = layer_windows(model.config) if isinstance(mask, dict) else None
    for i in layers:
        m = mask[LAYER_MASK[windows[i] is not None]] if windows is not None else mask
        out = base.layers[i](hidden_states, attention_mask=m, position_ids=position_ids, use_cache=True,
                             position_embeddings=pos_emb, **cache_kwargs(cache))
        hidden_states = out[0] if isinstance(out, tuple) else out
    return hidden_states


@torch.no_grad()
def partial_forward(model, input_ids: torch.Tensor, rows: torch.Tensor, kv: KV,
                    positions: torch.Tensor | None = None, col_valid: torch.Tensor | None = None,
                    logits_to_keep: int = 1, layers: range | None = None,
                    hidden_states: torch.Tensor | None = None):
    """Recompute rows ``rows`` of ``input_ids`` in place of their entries in ``kv``.

    Parameters
    ----------
    model : PreTrainedModel
        Causal LM whose layers call ``cache.update`` (Llama, Qwen2/3, Mistral, ...).
    input_ids : LongTensor ``[1, N]``
        Token of every row of ``kv`` (only ``input_ids[:, rows]`` is fed).
    rows : LongTensor ``[R]``
        Row indices to recompute, increasing.
    kv : list of (K, V) ``[1, H, N, D]``
        Full-length K/V, written in place at ``rows``. Rows not recomputed must already hold valid K/V (or be
        excluded with ``col_valid``).
    positions : LongTensor ``[N]``, optional
        Original position of each row (default ``arange(N)``): RoPE positions and the causal order.
    col_valid : BoolTensor ``[N]``, optional
        Columns that may be attended to at all (default: all).
    logits_to_keep : int, default=1
        Passed to the model; 0 keeps the logits of every recomputed row.
    layers : range, optional
        Run only these decoder layers (default: the whole model through the HF forward).
    hidden_states : Tensor ``[1, R, hidden]``, optional
        With ``layers``: the rows' input to ``layers[0]`` (default: their token embeddings, for ranges that
        start at layer 0). Without: the rows' input embeddings (``inputs_embeds`` of the model's own forward, e.g.
        rows that are not tokens); ``input_ids`` then only gives the number of rows.

    Returns
    -------
    The model output (``logits`` of the kept recomputed rows); with ``layers``, the rows' hidden states after
    the last layer of the range (the final norm applied only if the range ends at the last layer).
    """
    if input_ids.shape[0] != 1:
        raise ValueError("partial_forward runs one sequence at a time (batch size 1)")
    n = kv[0][0].shape[-2]
    device = kv[0][0].device
    rows = rows.to(device=device, dtype=torch.long)
    if positions is None:
        positions = torch.arange(n, device=device)
    row_pos = positions[rows]
    cache = _ScatterCache(model.config, kv, rows)
    dtype = kv[0][0].dtype
    if layers is not None and base_attn(model.config) == "sdpa" and col_valid is None:
        # the |rows| x N float mask is N^2 floats for all rows (280 MB at 8k tokens): under sdpa every row in
        # order needs no mask (the causal kernel, as full prefill) and a subset takes a boolean one (4x
        # smaller). The model check probes both forms on each model (model_check._probe_layers).
        in_order = rows.numel() == n and bool((row_pos == torch.arange(n, device=device)).all())
        dtype = None if in_order else torch.bool
    # the selected-row attention (Triton kernel, or SDPA over the visible columns per block of rows) needs no
    # R x N mask: it is built only on the mask path, or on first use by a layer the wrapper does not handle
    windows = {w for w in layer_windows(model.config) if w is not None}
    if windows:  # sliding-window layers: their mask adds the window (per layer type), on the explicit-mask path
        dtype = dtype or torch.bool
        path = "mask"
        build = lambda: _sliding_masks(model.config, row_pos, positions, dtype, col_valid, windows)  # noqa: E731
    else:
        path = selected_path(model, kv[0][0]) if dtype is not None else "mask"
        build = (lambda: position_causal_mask(row_pos, positions, dtype, col_valid)) if dtype is not None else None
    if path == "mask":
        mask, attend = (build() if build else None), contextlib.nullcontext()
    else:
        mask = _placeholder(rows.numel(), n, kv[0][0].dtype, device)
        attend = selected_rows(model, SelectedPositions(row_pos, positions, col_valid, mask=build))
    if layers is not None:
        base = _decoder(model)
        if hidden_states is None:
            if layers.start != 0:
                raise ValueError("a layer range that does not start at layer 0 needs the rows' hidden_states")
            hidden_states = base.embed_tokens(input_ids[:, rows.to(input_ids.device)])
        with attend:
            h = run_layers(model, layers, hidden_states, row_pos[None], mask, cache)
        cache.check_writes(model, layers)
        return base.norm(h) if layers.stop >= len(base.layers) else h
    fed = (dict(input_ids=input_ids[:, rows.to(input_ids.device)]) if hidden_states is None
           else dict(inputs_embeds=hidden_states))
    with attend:
        out = model(**fed, position_ids=row_pos[None], attention_mask=mask, use_cache=True,
                    logits_to_keep=logits_to_keep, **cache_kwargs(cache))
    cache.check_writes(model, range(len(kv)))
    return out
