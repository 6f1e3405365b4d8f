"""Per-token K/V deviation, CacheBlend's recompute selection: a Triton kernel and its torch reference.

CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion",
arXiv:2405.16444) recomputes the early layers of a prompt assembled from separately cached chunks and picks the
tokens whose fresh K (or V) at a check layer deviates most from the reused one. The deviation of token ``t`` is
the squared distance summed over batch rows, heads and head dims::

    dev[t] = sum_{b, h, d} (new[b, h, t, d] - old[b, h, t, d])^2        (float32)

and the tokens recomputed in the remaining layers are the top-k of ``dev`` among the candidate (reused) rows
(:func:`deviation_topk`).

:func:`token_deviation_triton` reads ``new`` and ``old`` once, in any strides, and accumulates in float32 registers:
no ``new - old`` temporary and no float32 upcast copies (the torch reference makes both, each the size of a
layer's K or V). It can also return ``sum_{b, h, d} new^2`` from the same pass (``norm=True``), the normaliser the
translated-cache scorer divides by.

Two definitions of the difference, as the callers have them: by default it is rounded to the inputs' dtype
before the square (``(new - old).float()``: the cache's subtraction, :class:`hf_kvreuse.BlendCache`);
``upcast=True`` takes it between the float32 upcasts (``new.float() - old.float()``,
:class:`hf_kvreuse.translation.scorers.FirstLayerDeviationScorer`). The two agree for float32 inputs.

Exactness: the kernel sums in another order than torch's reduction (relative differences of a few float32 ulps
per token), so ties and near-ties among candidates can be broken differently; Triton's CPU interpreter also
truncates the rounded difference (bfloat16 / float16 inputs, default mode) where torch rounds to nearest.

This module never imports triton at import time: the kernel is built on the first call of
:func:`token_deviation_triton` (set ``TRITON_INTERPRET=1`` before that first call to run it on CPU tensors).
"""

from __future__ import annotations

import functools

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(new: torch.Tensor, old: torch.Tensor) -> None:
    if new.dim() != 4 or new.shape != old.shape:
        raise ValueError(f"new and old must both be [B, H, T, D] of one shape, got {tuple(new.shape)} and "
                         f"{tuple(old.shape)}")


def token_deviation_torch(new: torch.Tensor, old: torch.Tensor, upcast: bool = False,
                          norm: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Squared deviation of each token, summed over batch, heads and head dims, in float32 (torch reference).

    Parameters
    ----------
    new, old : Tensor ``[B, H, T, D]``
        Fresh and reused K (or V) of one layer.
    upcast : bool, default=False
        Difference of the float32 upcasts (``new.float() - old.float()``) instead of the difference rounded to
        the inputs' dtype (``(new - old).float()``).
    norm : bool, default=False
        Also return ``sum_{b, h, d} new^2`` per token.

    Returns
    -------
    Tensor ``[T]`` float32, or a pair of them with ``norm=True``, on ``new``'s device.
    """
    _check(new, old)
    nf = new.float() if upcast or norm else None  # no copy for float32
    if upcast:
        dev = ((nf - old.float()) ** 2).sum(dim=(0, 1, 3))
    else:
        dev = ((new - old).float() ** 2).sum(dim=(0, 1, 3))
    return (dev, (nf * nf).sum(dim=(0, 1, 3))) if norm else dev


@functools.lru_cache(maxsize=None)
def _kernel():
    """The jitted kernel, defined on first use (``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates)."""
    import triton
    import triton.language as tl

    @triton.jit
    def deviation_kernel(new_ptr, old_ptr, dev_ptr, sq_ptr,
                         H, BH, T, D,
                         n_b, n_h, n_t, n_d,
                         o_b, o_h, o_t, o_d,
                         ROUND: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program: BLOCK_T tokens, looping over every (batch, head); the sum stays in registers, so each
        # token's result is written once (no atomics: deterministic)
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        d = tl.arange(0, BLOCK_D).to(tl.int64)
        m = (t < T)[:, None] & (d < D)[None, :]
        acc = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
        acc2 = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
        for bh in range(0, BH):
            b = (bh // H).to(tl.int64)
            h = (bh % H).to(tl.int64)
            x = tl.load(new_ptr + b * n_b + h * n_h + t[:, None] * n_t + d[None, :] * n_d, mask=m, other=0.0)
            y = tl.load(old_ptr + b * o_b + h * o_h + t[:, None] * o_t + d[None, :] * o_d, mask=m, other=0.0)
            xf = x.to(tl.float32)
            diff = xf - y.to(tl.float32)
            if ROUND:  # the reference subtracts in the inputs' dtype: round the difference as it does
                diff = diff.to(new_ptr.dtype.element_ty).to(tl.float32)
            acc += diff * diff
            if NORM:
                acc2 += xf * xf
        tl.store(dev_ptr + t, tl.sum(acc, 1), mask=t < T)
        if NORM:
            tl.store(sq_ptr + t, tl.sum(acc2, 1), mask=t < T)

    return triton, deviation_kernel


def token_deviation_triton(new: torch.Tensor, old: torch.Tensor, upcast: bool = False,
                           norm: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_deviation_torch` in one fused Triton pass over ``new`` and ``old``.

    Parameters
    ----------
    new, old : Tensor ``[B, H, T, D]``
        One dtype (float32 / bfloat16 / float16), one device, any strides.
    upcast, norm : bool
        As in :func:`token_deviation_torch`.

    Returns
    -------
    Tensor ``[T]`` float32, or a pair of them with ``norm=True``.

    Notes
    -----
    Equal to the reference up to float32 summation order (see the module docstring). CPU tensors need
    ``TRITON_INTERPRET=1`` set before the first call.
    """
    _check(new, old)
    if new.dtype not in SUPPORTED_DTYPES or old.dtype != new.dtype:
        raise TypeError(f"token_deviation_triton supports one dtype of {SUPPORTED_DTYPES} for both, got "
                        f"{new.dtype} and {old.dtype}")
    if new.device != old.device:
        raise ValueError(f"new is on {new.device}, old on {old.device}")
    B, H, T, D = new.shape
    dev = torch.zeros(T, dtype=torch.float32, device=new.device)
    sq = torch.zeros(T, dtype=torch.float32, device=new.device) if norm else dev
    if T and B * H and D:
        triton, kernel = _kernel()
        block_d = triton.next_power_of_2(D)
        block_t = max(1, min(triton.next_power_of_2(T), 4096 // block_d))
        kernel[(triton.cdiv(T, block_t),)](
            new, old, dev, sq, H, B * H, T, D, *new.stride(), *old.stride(),
            ROUND=not upcast and new.dtype != torch.float32, NORM=norm, BLOCK_T=block_t, BLOCK_D=block_d)
    return (dev, sq) if norm else dev


def deviation_topk(new: torch.Tensor, old: torch.Tensor, candidates: torch.Tensor, k: int,
                   use_triton: bool = False) -> torch.Tensor:
    """The ``k`` candidate rows of largest :func:`token_deviation_torch` (CacheBlend's selection).

    Parameters
    ----------
    new, old : Tensor ``[B, H, T, D]``
        Fresh and reused K (or V) of the check layer.
    candidates : LongTensor ``[C]``
        Rows that may be picked (the reused ones); the result is on their device.
    k : int
        How many to pick (``0 <= k <= C``).
    use_triton : bool, default=False
        Compute the deviation with :func:`token_deviation_triton` (the top-k is ``torch.topk`` either way).

    Returns
    -------
    LongTensor ``[k]``
        ``candidates[torch.topk(dev[candidates], k).indices]``: in decreasing deviation, ties as ``torch.topk``.
    """
    if not k:
        return candidates[:0]
    dev = (token_deviation_triton if use_triton else token_deviation_torch)(new, old)
    dev = dev.to(candidates.device)  # the check layer may sit on another device than the candidates
    return candidates[torch.topk(dev[candidates], k).indices]
