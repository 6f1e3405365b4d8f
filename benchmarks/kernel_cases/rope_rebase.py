"""RoPE rebase of every layer's keys by per-token deltas (:mod:`hf_kvreuse.triton.rope_rebase`)."""

from __future__ import annotations

import torch

from hf_kvreuse.rope import RopeShifter
from hf_kvreuse.triton.rope_rebase import rope_rebase_torch, rope_rebase_triton

from . import Case, Prepared

LAYERS, HEADS, DIM = 32, 8, 128


class _Rotary:
    def __init__(self, rot: int, device):
        self.inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))


def make(device: torch.device, dtype: torch.dtype, tokens: int) -> Prepared:
    # one [LAYERS, H, T, D] tensor seen as B=LAYERS: the whole model's keys in one launch
    src = torch.randn(LAYERS, HEADS, tokens, DIM, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    delta = torch.randint(-4096, 4096, (tokens,), device=device)
    sh = RopeShifter(_Rotary(DIM, device), layout="half")
    nbytes = 2 * src.numel() * src.element_size()

    def check() -> float:
        want = torch.empty_like(src)
        rope_rebase_torch(want, src, delta, sh)
        rope_rebase_triton(dst, src, delta, sh)
        return (want.float() - dst.float()).abs().max().item()

    return Prepared(lambda: rope_rebase_torch(dst, src, delta, sh), lambda: rope_rebase_triton(dst, src, delta, sh),
                    nbytes, True, check)


CASES = [Case("rope_rebase", make)]
