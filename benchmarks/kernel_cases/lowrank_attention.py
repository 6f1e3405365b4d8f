"""PReCache's low-rank value attention ``P·V_base + s·(P·L)·B`` (:mod:`hf_kvreuse.triton.lowrank_attention`).

Two cases at a serving model's attention shape (32 query heads on 8 KV heads, head dim 128, LoRA rank 8):

``lowrank_attention_prefill``
    One layer's causal prefill, ``q = T = tokens`` (compute-bound). The eager reference builds the score
    matrix; it runs over query chunks of 2048 rows (each chunk's keys end at its last query, the reference's
    causal convention), which is the same arithmetic in bounded memory (a 32k x 32k float32 score matrix per
    KV group would not fit).
``lowrank_attention_decode``
    Four decode queries per sequence (speculative / multi-token steps) over ``T = tokens`` cached tokens, the
    32 layers as 32 batch rows (memory-bound: K, V and L are read once).
"""

from __future__ import annotations

import torch

from hf_kvreuse.triton.lowrank_attention import lowrank_attention_torch, lowrank_attention_triton

from . import Case, Prepared

LAYERS, HEADS, KV_HEADS, DIM, RANK = 32, 32, 8, 128, 8
DECODE_QUERIES = 4
CHUNK = 2048


def _inputs(B: int, q: int, T: int, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device, dtype=torch.float32)).to(dtype)

    query = rnd(B, q, HEADS, DIM).transpose(1, 2)  # the model's layout: [B, q, H, D] viewed as [B, H, q, D]
    key, value = rnd(B, KV_HEADS, T, DIM), rnd(B, KV_HEADS, T, DIM)
    L, Bw = rnd(B, T, RANK), rnd(B, KV_HEADS * DIM, RANK, scale=0.1)
    s = torch.full((B,), 2.0, device=device, dtype=dtype)
    return query, key, value, L, Bw, s


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def make_prefill(device: torch.device, dtype: torch.dtype, tokens: int) -> Prepared:
    args = _inputs(1, tokens, tokens, device, dtype)
    query, key, value, L, Bw, s = args
    scaling = DIM ** -0.5

    def torch_fn():
        outs = []
        for a in range(0, tokens, CHUNK):
            b = min(tokens, a + CHUNK)
            outs.append(lowrank_attention_torch(query[:, :, a:b], key[:, :, :b], value[:, :, :b], L[:, :b], Bw, s,
                                                None, scaling))
        return torch.cat(outs, 1)

    def check() -> float:
        return (torch_fn().float() - lowrank_attention_triton(*args, None, scaling).float()).abs().max().item()

    # read Q, K, V, L, B once, write O (not what bounds it: ~4·H·T²·D flops)
    nbytes = _nbytes(query, key, value, L, Bw) + query.numel() * query.element_size()
    return Prepared(torch_fn, lambda: lowrank_attention_triton(*args, None, scaling), nbytes, False, check)


def make_decode(device: torch.device, dtype: torch.dtype, tokens: int) -> Prepared:
    args = _inputs(LAYERS, DECODE_QUERIES, tokens, device, dtype)
    query, key, value, L, Bw, s = args
    scaling = DIM ** -0.5

    def check() -> float:
        want = lowrank_attention_torch(*args, None, scaling)
        return (want.float() - lowrank_attention_triton(*args, None, scaling).float()).abs().max().item()

    nbytes = _nbytes(key, value, L)  # the cache reads; Q, B and O are < 0.1 % of it
    return Prepared(lambda: lowrank_attention_torch(*args, None, scaling),
                    lambda: lowrank_attention_triton(*args, None, scaling), nbytes, True, check)


CASES = [Case("lowrank_attention_prefill", make_prefill), Case("lowrank_attention_decode", make_decode)]
