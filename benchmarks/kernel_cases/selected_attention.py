"""Position-causal attention of selected rows (:mod:`hf_kvreuse.triton.selected_attention`): one layer of a
serving model (32 query heads, 8 KV heads, 128 dims) over ``tokens`` cached columns, with 15 % of the rows
selected at random plus a 64-row tail (CacheBlend's recompute). The torch reference is what the partial-recompute
engine ran before: transformers' SDPA attention function with the ``[R, N]`` boolean mask (``repeat_kv``
included). Compute-bound: the bytes are only what must be read and written at least (q, k, v, out)."""

from __future__ import annotations

import torch

from hf_kvreuse.triton.selected_attention import SelectedPositions, selected_attention_triton

from . import Case, Prepared

Q_HEADS, KV_HEADS, DIM, RATIO, TAIL = 32, 8, 128, 0.15, 64


class _Layer:  # what transformers' sdpa_attention_forward reads from the attention module
    num_key_value_groups = Q_HEADS // KV_HEADS
    is_causal = True
    training = False


def make(device: torch.device, dtype: torch.dtype, tokens: int) -> Prepared:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    tail = min(TAIL, tokens)
    body = tokens - tail
    rows = torch.sort(torch.cat([torch.randperm(body, generator=g)[: int(body * RATIO)],
                                 torch.arange(body, tokens)])).values.to(device)
    R = rows.numel()
    q = torch.randn(1, Q_HEADS, R, DIM, device=device, dtype=dtype)
    k = torch.randn(1, KV_HEADS, tokens, DIM, device=device, dtype=dtype)
    v = torch.randn(1, KV_HEADS, tokens, DIM, device=device, dtype=dtype)
    pos = torch.arange(tokens, device=device)
    mask = (pos[None, :] <= rows[:, None])[None, None]
    scale = DIM ** -0.5
    sel = SelectedPositions(rows, pos)  # once per forward in the engine, shared by every layer
    out = torch.empty(1, R, Q_HEADS, DIM, device=device, dtype=dtype)  # the layout attention functions return
    layer = _Layer()
    nbytes = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()

    def ref():
        return sdpa_attention_forward(layer, q, k, v, mask, scaling=scale)[0]

    def tri():
        return selected_attention_triton(q, k, v, rows, pos, scale, out=out.transpose(1, 2),
                                         ends=lambda bm: sel.ends(device, bm))

    def check() -> float:
        return (tri().transpose(1, 2).float() - ref().float()).abs().max().item()

    return Prepared(ref, tri, nbytes, False, check)


CASES = [Case("selected_attention", make)]
