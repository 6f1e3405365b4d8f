"""Row scatter and row gather of a whole model's K and V (:mod:`hf_kvreuse.triton.gather_scatter`): 10 % of the
cached tokens, unsorted, as a selective recompute writes its rows back (scatter) or a reuse step picks rows out of a
donor (gather)."""

from __future__ import annotations

import torch

from hf_kvreuse.triton.gather_scatter import (gather_kv_rows_torch, gather_kv_rows_triton, scatter_kv_rows_torch,
                                              scatter_kv_rows_triton)

from . import Case, Prepared

LAYERS, HEADS, DIM = 32, 8, 128
FRACTION = 0.10


def _setup(device, dtype, tokens):
    # one [LAYERS, H, T, D] tensor each for K and V seen as B=LAYERS: every layer in one launch
    k = torch.randn(LAYERS, HEADS, tokens, DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    n = max(1, int(tokens * FRACTION))
    rows = torch.randperm(tokens, device=device)[:n]  # unique, unsorted
    row_bytes = 2 * LAYERS * HEADS * n * DIM * k.element_size()  # K and V rows, once
    return k, v, rows, n, row_bytes


def make_scatter(device: torch.device, dtype: torch.dtype, tokens: int) -> Prepared:
    k, v, rows, n, row_bytes = _setup(device, dtype, tokens)
    sk = torch.randn(LAYERS, HEADS, n, DIM, device=device, dtype=dtype)
    sv = torch.randn_like(sk)

    def check() -> float:
        want_k, want_v, got_k, got_v = k.clone(), v.clone(), k.clone(), v.clone()
        scatter_kv_rows_torch(want_k, want_v, rows, sk, sv)
        scatter_kv_rows_triton(got_k, got_v, rows, sk, sv)
        return max((want_k.float() - got_k.float()).abs().max().item(),
                   (want_v.float() - got_v.float()).abs().max().item())

    # rows read + rows written + the index; check=False: the library range-checks the rows once per partial
    # forward, not per launch
    return Prepared(lambda: scatter_kv_rows_torch(k, v, rows, sk, sv),
                    lambda: scatter_kv_rows_triton(k, v, rows, sk, sv, check=False),
                    2 * row_bytes + rows.numel() * 8, True, check)


def make_gather(device: torch.device, dtype: torch.dtype, tokens: int) -> Prepared:
    k, v, rows, n, row_bytes = _setup(device, dtype, tokens)

    def check() -> float:
        (wk, wv), (gk, gv) = gather_kv_rows_torch(k, v, rows), gather_kv_rows_triton(k, v, rows)
        return max((wk.float() - gk.float()).abs().max().item(), (wv.float() - gv.float()).abs().max().item())

    return Prepared(lambda: gather_kv_rows_torch(k, v, rows), lambda: gather_kv_rows_triton(k, v, rows, check=False),
                    2 * row_bytes + rows.numel() * 8, True, check)


CASES = [Case("scatter_kv_rows", make_scatter), Case("gather_kv_rows", make_gather)]
