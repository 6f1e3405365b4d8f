"""CacheBlend's per-token deviation at the check layer (:mod:`hf_kvreuse.triton.deviation`): one layer's fresh and
reused V (or K), every cached token, reduced to one float32 per token."""

from __future__ import annotations

import torch

from hf_kvreuse.triton.deviation import token_deviation_torch, token_deviation_triton

from . import Case, Prepared

HEADS, DIM = 8, 128


def make(device: torch.device, dtype: torch.dtype, tokens: int) -> Prepared:
    new = torch.randn(1, HEADS, tokens, DIM, device=device, dtype=dtype)
    old = (new.float() + 0.1 * torch.randn_like(new, dtype=torch.float32)).to(dtype)
    nbytes = 2 * new.numel() * new.element_size() + tokens * 4  # both read once, [T] float32 written

    def check() -> float:
        want, got = token_deviation_torch(new, old), token_deviation_triton(new, old)
        return (want - got).abs().max().item()

    return Prepared(lambda: token_deviation_torch(new, old), lambda: token_deviation_triton(new, old), nbytes, True,
                    check)


CASES = [Case("token_deviation", make)]
