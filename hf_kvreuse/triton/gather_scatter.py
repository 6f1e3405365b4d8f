"""Row gather and row scatter of cached K/V along the token axis: Triton kernels and their torch references.

Reuse methods assemble a prompt's cache from reused blocks and recomputed rows (CacheBlend's selected tokens, EPIC's
block starts, the rows a partial forward recomputes): every such step copies whole token rows ``[D]`` of every
``(batch, head)`` from one ``[B, H, *, D]`` tensor into another, at positions given by an index vector::

    gather:   out[b, h, r, :]        = src[b, h, rows[r], :]       (torch: src.index_select(-2, rows))
    scatter:  dst[b, h, rows[r], :]  = src[b, h, r, :]             (torch: dst.index_copy_(-2, rows, src.to(dst.dtype)))

The kernels move exactly those rows (no whole-cache copy, no contiguous temporary of a strided view: every tensor
is addressed through its own strides), cast on store when ``src`` has another float dtype than ``dst`` (what the
reference's ``.to(dst.dtype)`` does in a separate pass), and do a layer's K and V in one launch
(:func:`gather_kv_rows_triton`, :func:`scatter_kv_rows_triton`), since every call site handles the two together.

Exactness: a copy is exact. With a cast (e.g. float32 rows into a bfloat16 cache) the kernel rounds as Triton's
conversion does: round-to-nearest-even on GPUs, like torch; Triton's CPU interpreter truncates instead (one ulp
of the storage dtype at most).

Index rules follow the references: gather rows may repeat and come in any order; scatter rows must be unique (a
repeated row gets one of its sources, unspecified which). Rows outside ``[0, N)`` raise ``IndexError`` when
``check=True`` (the default; one host sync for the min/max); with ``check=False`` the kernel still never touches
memory outside the tensors (such rows are masked out) but leaves their output unwritten.

This module never imports triton at import time: the kernel is built on the first call of a ``*_triton`` function
(set ``TRITON_INTERPRET=1`` before that first call to run it on CPU tensors).
"""

from __future__ import annotations

import functools

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------- torch references


def gather_rows_torch(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src[..., rows, :]`` (torch reference: ``index_select(-2, rows)``), into ``out`` when given.

    Parameters
    ----------
    src : Tensor ``[B, H, N, D]``
    rows : LongTensor ``[R]``
        Token positions, any order, repeats allowed.
    out : Tensor ``[B, H, R, D]``, optional
        Destination (any strides); a new tensor when omitted.

    Returns
    -------
    Tensor ``[B, H, R, D]``
    """
    got = src.index_select(-2, rows)
    if out is None:
        return got
    out.copy_(got)
    return out


def scatter_rows_torch(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """In place ``dst[..., rows, :] = src`` (torch reference: ``index_copy_(-2, rows, src.to(dst.dtype))``).

    Parameters
    ----------
    dst : Tensor ``[B, H, N, D]``
    rows : LongTensor ``[R]``
        Unique token positions of ``dst``.
    src : Tensor ``[B, H, R, D]``
        Rows to write; cast to ``dst``'s dtype.
    """
    dst.index_copy_(-2, rows, src.to(dst.dtype))


def gather_kv_rows_torch(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k[..., rows, :], v[..., rows, :])`` through :func:`gather_rows_torch`."""
    return k.index_select(-2, rows), v.index_select(-2, rows)


def scatter_kv_rows_torch(dk: torch.Tensor, dv: torch.Tensor, rows: torch.Tensor, sk: torch.Tensor,
                          sv: torch.Tensor) -> None:
    """In place ``dk[..., rows, :] = sk`` and ``dv[..., rows, :] = sv`` through :func:`scatter_rows_torch`."""
    scatter_rows_torch(dk, rows, sk)
    scatter_rows_torch(dv, rows, sv)


# ----------------------------------------------------------------------------------------------------- kernel


@functools.lru_cache(maxsize=None)
def _kernel():
    """The jitted kernel, defined on first use (``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rows_kernel(a_src, a_dst, b_src, b_dst, rows_ptr,
                    H, R, N, DA, DB, n_rblocks,
                    as_b, as_h, as_t, as_d, ad_b, ad_h, ad_t, ad_d,
                    bs_b, bs_h, bs_t, bs_d, bd_b, bd_h, bd_t, bd_d,
                    SCATTER: tl.constexpr, PAIR: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr):
        # one program: BLOCK_R indexed rows of one (batch, head), of tensor a (and of b when PAIR: K and V)
        pid = tl.program_id(0)
        bh = pid // n_rblocks
        rb = pid % n_rblocks
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        r = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        r_ok = r < R
        idx = tl.load(rows_ptr + r, mask=r_ok, other=0).to(tl.int64)
        ok = r_ok & (idx >= 0) & (idx < N)  # an out-of-range row touches nothing (the launcher raises first)
        if SCATTER:
            src_t = r
            dst_t = idx
        else:
            src_t = idx
            dst_t = r
        # rows src_t -> dst_t of all DA dims, cast on store (a nested @triton.jit helper would have to live at
        # module level, i.e. import triton with the package: the two copies are written out instead)
        d = tl.arange(0, BLOCK_DA).to(tl.int64)
        m = ok[:, None] & (d < DA)[None, :]
        x = tl.load(a_src + b * as_b + h * as_h + src_t[:, None] * as_t + d[None, :] * as_d, mask=m)
        tl.store(a_dst + b * ad_b + h * ad_h + dst_t[:, None] * ad_t + d[None, :] * ad_d,
                 x.to(a_dst.dtype.element_ty), mask=m)
        if PAIR:  # the same rows of the second tensor: the index is read once for both
            e = tl.arange(0, BLOCK_DB).to(tl.int64)
            me = ok[:, None] & (e < DB)[None, :]
            y = tl.load(b_src + b * bs_b + h * bs_h + src_t[:, None] * bs_t + e[None, :] * bs_d, mask=me)
            tl.store(b_dst + b * bd_b + h * bd_h + dst_t[:, None] * bd_t + e[None, :] * bd_d,
                     y.to(b_dst.dtype.element_ty), mask=me)

    return triton, rows_kernel


def _check_pair(big: torch.Tensor, small: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    if big.dim() != 4 or small.dim() != 4:
        raise ValueError(f"{what}: tensors must be [B, H, N, D], got {tuple(big.shape)} and {tuple(small.shape)}")
    if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise ValueError(f"{what}: rows must be a 1-D integer tensor, got {rows.dtype} {tuple(rows.shape)}")
    want = (*big.shape[:2], rows.numel(), big.shape[3])
    if tuple(small.shape) != want:
        raise ValueError(f"{what}: the rows tensor must be {want}, got {tuple(small.shape)}")
    for t in (big, small):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{what} supports {SUPPORTED_DTYPES}, got {t.dtype}")
        if t.device != big.device:
            raise ValueError(f"{what}: tensors on {big.device} and {t.device}")


def _rows_on(rows: torch.Tensor, device: torch.device, n: int, check: bool) -> torch.Tensor:
    rows = rows.to(device=device, dtype=torch.long).contiguous()
    if check and rows.numel():
        lo, hi = torch.aminmax(rows)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= n:
            raise IndexError(f"rows out of range [0, {n}): min {lo}, max {hi}")
    return rows


def _launch(scatter: bool, a_src, a_dst, b_src, b_dst, rows: torch.Tensor, n: int) -> None:
    """One launch over ``a`` (and ``b`` when given): ``*_src`` / ``*_dst`` ``[B, H, *, D]``, ``rows`` checked."""
    B, H = a_src.shape[:2]
    R = rows.numel()
    if R == 0 or B * H == 0:
        return
    triton, kernel = _kernel()
    pair = b_src is not None
    da = a_src.shape[3]
    db = b_src.shape[3] if pair else da
    block_da = triton.next_power_of_2(max(da, 1))
    block_db = triton.next_power_of_2(max(db, 1)) if pair else block_da
    # ~4k elements per tensor per program: 32 rows of a 128-dim head (16 KB of bf16 K+V)
    block_r = max(1, min(triton.next_power_of_2(R), 4096 // max(block_da, block_db)))
    n_rblocks = triton.cdiv(R, block_r)
    if not pair:
        b_src, b_dst = a_src, a_dst  # unused (PAIR=False): any valid pointers and strides
    kernel[(B * H * n_rblocks,)](
        a_src, a_dst, b_src, b_dst, rows,
        H, R, n, da, db, n_rblocks,
        *a_src.stride(), *a_dst.stride(), *b_src.stride(), *b_dst.stride(),
        SCATTER=scatter, PAIR=pair, BLOCK_R=block_r, BLOCK_DA=block_da, BLOCK_DB=block_db)


# ---------------------------------------------------------------------------------------------------- launchers


def gather_rows_triton(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None,
                       check: bool = True) -> torch.Tensor:
    """``src[..., rows, :]`` in one Triton launch (see :func:`gather_rows_torch`).

    Parameters
    ----------
    src : Tensor ``[B, H, N, D]``
        float32 / bfloat16 / float16, any strides.
    rows : integer Tensor ``[R]``
        Token positions, any order, repeats allowed (moved to ``src``'s device).
    out : Tensor ``[B, H, R, D]``, optional
        Destination (any strides, any supported dtype: cast on store); a new contiguous tensor of ``src``'s
        dtype when omitted.
    check : bool, default=True
        Raise ``IndexError`` for rows outside ``[0, N)`` (one host sync).

    Returns
    -------
    Tensor ``[B, H, R, D]``
    """
    if out is None:
        out = src.new_empty(*src.shape[:2], rows.numel(), src.shape[-1])
    _check_pair(src, out, rows, "gather_rows_triton")
    rows = _rows_on(rows, src.device, src.shape[2], check)
    _launch(False, src, out, None, None, rows, src.shape[2])
    return out


def scatter_rows_triton(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, check: bool = True) -> None:
    """In place ``dst[..., rows, :] = src`` in one Triton launch, cast to ``dst``'s dtype on store (see
    :func:`scatter_rows_torch`).

    Parameters
    ----------
    dst : Tensor ``[B, H, N, D]``
        float32 / bfloat16 / float16, any strides.
    rows : integer Tensor ``[R]``
        Unique token positions of ``dst`` (moved to ``dst``'s device).
    src : Tensor ``[B, H, R, D]``
        Rows to write, on ``dst``'s device, any supported dtype and strides.
    check : bool, default=True
        Raise ``IndexError`` for rows outside ``[0, N)`` (one host sync).
    """
    _check_pair(dst, src, rows, "scatter_rows_triton")
    rows = _rows_on(rows, dst.device, dst.shape[2], check)
    _launch(True, src, dst, None, None, rows, dst.shape[2])


def gather_kv_rows_triton(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                          check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k[..., rows, :], v[..., rows, :])`` in one Triton launch for both (see :func:`gather_rows_triton`).

    ``k`` and ``v`` share ``B``, ``H`` and ``N``; their head dims, dtypes and strides may differ.
    """
    ok = k.new_empty(*k.shape[:2], rows.numel(), k.shape[-1])
    ov = v.new_empty(*v.shape[:2], rows.numel(), v.shape[-1])
    _check_pair(k, ok, rows, "gather_kv_rows_triton")
    _check_pair(v, ov, rows, "gather_kv_rows_triton")
    if k.shape[:3] != v.shape[:3] or k.device != v.device:
        raise ValueError(f"gather_kv_rows_triton: K {tuple(k.shape)} on {k.device} and V {tuple(v.shape)} on "
                         f"{v.device} must share B, H, N and the device")
    rows = _rows_on(rows, k.device, k.shape[2], check)
    _launch(False, k, ok, v, ov, rows, k.shape[2])
    return ok, ov


def scatter_kv_rows_triton(dk: torch.Tensor, dv: torch.Tensor, rows: torch.Tensor, sk: torch.Tensor,
                           sv: torch.Tensor, check: bool = True) -> None:
    """In place ``dk[..., rows, :] = sk`` and ``dv[..., rows, :] = sv`` in one Triton launch for both, cast to
    each destination's dtype on store (see :func:`scatter_rows_triton`).

    ``dk`` and ``dv`` share ``B``, ``H`` and ``N``; their head dims, dtypes and strides may differ.
    """
    _check_pair(dk, sk, rows, "scatter_kv_rows_triton")
    _check_pair(dv, sv, rows, "scatter_kv_rows_triton")
    if dk.shape[:3] != dv.shape[:3] or dk.device != dv.device:
        raise ValueError(f"scatter_kv_rows_triton: K {tuple(dk.shape)} on {dk.device} and V {tuple(dv.shape)} on "
                         f"{dv.device} must share B, H, N and the device")
    rows = _rows_on(rows, dk.device, dk.shape[2], check)
    _launch(True, sk, dk, sv, dv, rows, dk.shape[2])
