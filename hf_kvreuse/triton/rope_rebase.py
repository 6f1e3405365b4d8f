"""Re-positioning of cached post-RoPE keys by per-token position deltas: a Triton kernel and its torch reference.

A key cached at position ``p`` is ``R(p) k`` with RoPE's block-diagonal rotation ``R`` (Su et al., "RoFormer:
Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864). Rotations compose, so the key moves to
``p + delta`` with ``R(delta) R(p) k``: each rotated pair ``(x1, x2)`` of a token becomes::

    y1 = x1 * cos(delta * f_j) - x2 * sin(delta * f_j)
    y2 = x2 * cos(delta * f_j) + x1 * sin(delta * f_j)

with ``f_j = inv_freq[j]`` of the model (:class:`hf_kvreuse.rope.RopeShifter`). The pairs are ``(j, j + rot/2)``
in the half-split layout (Llama, Qwen, Mistral) and ``(2j, 2j + 1)`` in the interleaved one (Cohere, GLM); with
partial rotary only the leading ``rot = 2 * len(inv_freq)`` dimensions turn and the rest are copied.

:func:`rope_rebase_triton` does this in one launch for keys ``[B, H, T, D]`` of any strides with one delta per
token (a scalar, ``[T]`` or ``[B, T]``), so spans with different deltas need no separate calls.
:func:`rope_rebase_torch` is the same operation through :meth:`RopeShifter.shift` / :meth:`RopeShifter.shift_into`:
the CPU fallback and the oracle of the kernel's tests.

Exactness: the kernel does not evaluate cos/sin itself. It reads the tables :meth:`RopeShifter.cos_sin` computes
(float32 ``delta * inv_freq``, no attention-scaling factor: that magnitude is already in the cached keys), one
row per token (a ``[T, rot/2]`` table, broadcast when ``delta`` is a scalar), so both paths turn by the same
float32 angles; the only differences left are the kernel's float32 multiply-add contraction (at most an ulp or
so of float32 before the cast to the storage dtype).

This module never imports triton at import time: the kernel is built on the first call of
:func:`rope_rebase_triton` (set ``TRITON_INTERPRET=1`` before that first call to run it on CPU tensors).
"""

from __future__ import annotations

import functools

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(dst: torch.Tensor, src: torch.Tensor, shifter) -> None:
    if src.dim() != 4 or dst.shape != src.shape:
        raise ValueError(f"src and dst must both be [B, H, T, D] of one shape, got {tuple(src.shape)} and "
                         f"{tuple(dst.shape)}")
    if shifter.rotary_dim > src.shape[-1]:
        raise ValueError(f"rotary dim {shifter.rotary_dim} exceeds the head dim {src.shape[-1]}")


def rope_rebase_torch(dst: torch.Tensor, src: torch.Tensor, delta: int | torch.Tensor, shifter,
                      chunk: int = 512) -> None:
    """``dst[:] = src`` with every token's key re-rotated by its position delta (torch reference).

    Parameters
    ----------
    dst : Tensor ``[B, H, T, D]``
        Output; may be ``src`` itself (the same storage and strides), not a partial overlap of it.
    src : Tensor ``[B, H, T, D]``
        Post-RoPE keys, float32 / bfloat16 / float16, any strides.
    delta : int or LongTensor ``[T]`` or ``[B, T]``
        Position delta of each token (negative, zero and mixed allowed).
    shifter : hf_kvreuse.rope.RopeShifter
        The model's frequencies and layout.
    chunk : int, default=512
        Tokens per temporary (bounded memory).

    Notes
    -----
    Math in float32 (:meth:`RopeShifter.shift`), rounded to ``src``'s dtype, then copied into ``dst``.
    """
    _check(dst, src, shifter)
    if not isinstance(delta, torch.Tensor):
        shifter.shift_into(dst, src, int(delta), chunk)  # exactly the library's scalar path
        return
    T = src.shape[-2]
    if delta.dim() not in (1, 2) or delta.shape[-1] != T:
        raise ValueError(f"delta must be [T] or [B, T] with T={T}, got {tuple(delta.shape)}")
    delta = delta.to(src.device)
    for c0 in range(0, T, chunk):
        d = delta[..., c0:c0 + chunk]
        dst[..., c0:c0 + chunk, :].copy_(shifter.shift(src[..., c0:c0 + chunk, :], d))


def half_cos_sin(shifter, delta: int | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[..., rot/2]`` of ``delta`` (one value per rotated pair), taken from
    :meth:`RopeShifter.cos_sin` (which repeats each angle for both members of its pair), so the kernel turns by
    exactly the reference's float32 values. A scalar ``delta`` gives ``[1, rot/2]``."""
    d = delta if isinstance(delta, torch.Tensor) else torch.tensor([int(delta)])
    cos, sin = shifter.cos_sin(d, device)
    half = shifter.rotary_dim // 2
    if shifter.layout == "half":  # cat((ang, ang)): the first half
        return cos[..., :half], sin[..., :half]
    return cos[..., 0::2], sin[..., 0::2]  # repeat_interleave(2): every other


@functools.lru_cache(maxsize=None)
def _kernel():
    """The jitted kernel, defined on first use (``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rope_rebase_kernel(src_ptr, dst_ptr, cos_ptr, sin_ptr,
                           H, T, D, HALF, n_tblocks,
                           s_b, s_h, s_t, s_d,
                           d_b, d_h, d_t, d_d,
                           c_b, c_t, c_j,
                           INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
                           BLOCK_PASS: tl.constexpr):
        # one program: BLOCK_T tokens of one (batch, head)
        pid = tl.program_id(0)
        bh = pid // n_tblocks
        tb = pid % n_tblocks
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        t64 = t.to(tl.int64)
        src_row = src_ptr + b * s_b + h * s_h + t64[:, None] * s_t
        dst_row = dst_ptr + b * d_b + h * d_h + t64[:, None] * d_t

        j = tl.arange(0, BLOCK_HALF)
        m = t_ok[:, None] & (j < HALF)[None, :]
        if INTERLEAVED:
            i1 = 2 * j
            i2 = 2 * j + 1
        else:
            i1 = j
            i2 = j + HALF
        i1 = i1.to(tl.int64)[None, :]
        i2 = i2.to(tl.int64)[None, :]
        x1 = tl.load(src_row + i1 * s_d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src_row + i2 * s_d, mask=m, other=0.0).to(tl.float32)
        cs = b * c_b + t64[:, None] * c_t + j.to(tl.int64)[None, :] * c_j
        c = tl.load(cos_ptr + cs, mask=m, other=0.0)
        s = tl.load(sin_ptr + cs, mask=m, other=0.0)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        # round to src's dtype first, as the reference does before its copy into dst
        y1 = y1.to(src_ptr.dtype.element_ty).to(dst_ptr.dtype.element_ty)
        y2 = y2.to(src_ptr.dtype.element_ty).to(dst_ptr.dtype.element_ty)
        tl.store(dst_row + i1 * d_d, y1, mask=m)
        tl.store(dst_row + i2 * d_d, y2, mask=m)
        if BLOCK_PASS > 0:  # partial rotary: dims rot..D-1 are copied
            p = (2 * HALF + tl.arange(0, BLOCK_PASS)).to(tl.int64)
            pm = t_ok[:, None] & (p < D)[None, :]
            xp = tl.load(src_row + p[None, :] * s_d, mask=pm, other=0.0)
            tl.store(dst_row + p[None, :] * d_d, xp.to(dst_ptr.dtype.element_ty), mask=pm)

    return triton, rope_rebase_kernel


def rope_rebase_triton(dst: torch.Tensor, src: torch.Tensor, delta: int | torch.Tensor, shifter) -> None:
    """``dst[:] = src`` with every token's key re-rotated by its position delta, in one Triton launch.

    Parameters
    ----------
    dst : Tensor ``[B, H, T, D]``
        Output, on ``src``'s device; any strides; may be ``src`` itself (the same storage and strides), not a
        partial overlap of it.
    src : Tensor ``[B, H, T, D]``
        Post-RoPE keys, float32 / bfloat16 / float16, any strides (non-contiguous views allowed).
    delta : int or LongTensor ``[T]`` or ``[B, T]``
        Position delta of each token (negative, zero and mixed allowed).
    shifter : hf_kvreuse.rope.RopeShifter
        The model's frequencies (``inv_freq``, float32) and layout; partial rotary when ``rot < D``.

    Notes
    -----
    Equal to :func:`rope_rebase_torch` up to float32 rounding of the multiply-adds (see the module docstring).
    CPU tensors need ``TRITON_INTERPRET=1`` set before the first call.
    """
    _check(dst, src, shifter)
    if src.dtype not in SUPPORTED_DTYPES or dst.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rope_rebase_triton supports {SUPPORTED_DTYPES}, got {src.dtype} -> {dst.dtype}")
    if dst.device != src.device:
        raise ValueError(f"dst is on {dst.device}, src on {src.device}")
    B, H, T, D = src.shape
    if isinstance(delta, torch.Tensor) and (delta.dim() not in (1, 2) or delta.shape[-1] != T
                                            or (delta.dim() == 2 and delta.shape[0] not in (1, B))):
        raise ValueError(f"delta must be [T] or [B, T] with B={B}, T={T}, got {tuple(delta.shape)}")
    if src.numel() == 0:
        return
    cos, sin = half_cos_sin(shifter, delta, src.device)  # [1 | T, half] or [B, T, half]
    half = cos.shape[-1]
    cos = cos.reshape(-1, *cos.shape[-2:]).expand(B, -1, -1)  # [B, 1 | T, half]: broadcast strides are 0
    sin = sin.reshape(-1, *sin.shape[-2:]).expand(B, -1, -1)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    c_b, c_t, c_j = cos.stride()
    if cos.shape[1] == 1:
        c_t = 0
    triton, kernel = _kernel()
    block_half = triton.next_power_of_2(half)
    n_pass = D - 2 * half
    block_pass = triton.next_power_of_2(n_pass) if n_pass else 0
    # ~4k elements per program of each of x1, x2, cos, sin (and of the copied dims: partial rotary at head dim
    # 256 with 64 tokens spilled registers in the compile check)
    block_t = max(1, min(triton.next_power_of_2(T), 64, 4096 // max(block_half, block_pass)))
    n_tblocks = triton.cdiv(T, block_t)
    kernel[(B * H * n_tblocks,)](
        src, dst, cos, sin,
        H, T, D, half, n_tblocks,
        *src.stride(), *dst.stride(),
        c_b, c_t, c_j,
        INTERLEAVED=shifter.layout == "interleaved", BLOCK_T=block_t, BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass)
