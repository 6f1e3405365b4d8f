"""Attention for an arbitrary subset of query rows, causal by original positions: a Triton kernel, its torch
reference and a fast CPU formulation.

The partial-recompute engine (:func:`hf_kvreuse.generation.partial.partial_forward`) recomputes rows ``S`` of a
sequence whose K/V live in a full cache of ``N`` columns. Row ``r`` (position ``q_pos[r]``) attends to every column
``j`` with ``k_pos[j] <= q_pos[r]`` (and ``k_valid[j]``)::

    O[r] = sum_j softmax_j(s_rj) V[j],   s_rj = scaling * <Q[r], K[j]>  if k_pos[j] <= q_pos[r] else -inf

This is scaled dot-product attention (Vaswani et al., "Attention Is All You Need", 2017) under a mask that is
neither causal in row order nor full, so SDPA's ``is_causal`` fast path does not apply and the engine used to pass
an explicit ``[R, N]`` mask to every layer.

:func:`selected_attention_triton` is a FlashAttention-style kernel (Dao et al., "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness", arXiv:2205.14135; the online softmax of Milakov &
Gimelshein, arXiv:1805.02867): one program per ``BLOCK_M`` query rows of one head walks ``BLOCK_N``-key tiles,
keeping a running max ``m``, normaliser ``l`` and fp32 accumulator, and builds the position mask of each tile
from ``q_pos`` / ``k_pos`` in registers (no ``[R, N]`` mask in memory). Key tiles that no row of the query tile can
see are skipped: the host computes, per query tile, ``1 + max{j : k_pos[j] <= max q_pos of the tile}`` (exact for
any order of ``k_pos``: keys after that index are invisible to every row of the tile), so with increasing
positions a tile stops at its own position, about half the work of the full mask for rows spread over the
sequence. GQA reads each KV head for its group of query heads directly (no ``repeat_kv`` copy).

:func:`selected_attention_blocked` is the CPU formulation: rows sorted by position, ``block`` rows per
``torch.nn.functional.scaled_dot_product_attention`` call over only the keys the block can see (the same bound),
with a small boolean mask (none when every key of the range is visible to every row of the block). It skips the
invisible tail as the kernel does and stays on SDPA's fused CPU kernel; measured in
``research/performance/selected_attention_cpu.py``.

:func:`selected_attention_torch` is the plain reference (float32 softmax) and the oracle of the tests.

A row that sees no key at all gets zeros (every path agrees on that; the engine never produces one: a recomputed
row sees at least itself).

This module never imports triton at import time: the kernel is built on the first call of
:func:`selected_attention_triton` (set ``TRITON_INTERPRET=1`` before that first call to run it on CPU tensors).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from . import sizing

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           k_valid: torch.Tensor | None) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q must be [B, Hq, R, D] and k, v [B, Hkv, N, D] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, R, D = q.shape
    _, Hkv, N, Dk = k.shape
    if k.shape[0] != B or Dk != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch and head dim must match and the query "
                         "heads must be a multiple of the KV heads")
    if q_pos.shape != (R,) or k_pos.shape != (N,):
        raise ValueError(f"q_pos must be [R={R}] and k_pos [N={N}], got {tuple(q_pos.shape)}, {tuple(k_pos.shape)}")
    if k_valid is not None and k_valid.shape != (N,):
        raise ValueError(f"k_valid must be [N={N}], got {tuple(k_valid.shape)}")
    return B, Hq, Hkv, R, N, D


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None) -> torch.Tensor:
    allowed = k_pos[None, :] <= q_pos[:, None]
    return allowed & k_valid[None, :] if k_valid is not None else allowed


def selected_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                             k_pos: torch.Tensor, scaling: float, k_valid: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """Position-causal attention of selected rows (torch reference, float32 softmax).

    Parameters
    ----------
    q : Tensor ``[B, Hq, R, D]``
        Queries of the selected rows.
    k, v : Tensor ``[B, Hkv, N, D]``
        Keys / values of every column; ``Hq`` a multiple of ``Hkv`` (query head ``h`` reads KV head
        ``h // (Hq / Hkv)``, as ``repeat_kv`` maps them).
    q_pos : LongTensor ``[R]``
        Position of each selected row (any order).
    k_pos : LongTensor ``[N]``
        Position of each column (any order).
    scaling : float
        Factor of the scores (usually ``D ** -0.5``).
    k_valid : BoolTensor ``[N]``, optional
        Columns that may be attended to at all.

    Returns
    -------
    Tensor ``[B, Hq, R, D]`` in ``q``'s dtype; rows that see no column are zero.
    """
    B, Hq, Hkv, R, N, D = _check(q, k, v, q_pos, k_pos, k_valid)
    g = Hq // Hkv
    allowed = _allowed(q_pos.to(k.device), k_pos.to(k.device), None if k_valid is None else k_valid.to(k.device))
    qg = q.float().reshape(B, Hkv, g * R, D)  # query heads of one KV head side by side: no K/V copies
    s = torch.matmul(qg, k.float().transpose(-1, -2)).view(B, Hkv, g, R, N) * scaling
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a row with no visible column: all -inf -> NaN -> 0
    o = torch.matmul(p.view(B, Hkv, g * R, N), v.float())
    return o.view(B, Hq, R, D).to(q.dtype)


def visible_end(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None, block: int) -> torch.Tensor:
    """Per block of ``block`` consecutive rows of ``q_pos``: one past the last column any of its rows can see
    (``1 + max{j : k_pos[j] <= max q_pos of the block, k_valid[j]}``, 0 if none), as int32 ``[ceil(R / block)]``.

    Exact for any order of ``k_pos``: columns at or after the bound are masked for every row of the block."""
    R = q_pos.numel()
    n_blocks = -(-R // block)
    pad = torch.full((n_blocks * block - R,), torch.iinfo(torch.long).min, dtype=torch.long, device=q_pos.device)
    qmax = torch.cat([q_pos.to(torch.long), pad]).view(n_blocks, block).amax(dim=1)
    seen = _allowed(qmax, k_pos.to(q_pos.device), None if k_valid is None else k_valid.to(q_pos.device))
    idx = torch.arange(1, k_pos.numel() + 1, device=q_pos.device, dtype=torch.int32)
    return (seen * idx).amax(dim=1).to(torch.int32) if k_pos.numel() else torch.zeros(n_blocks, dtype=torch.int32)


class BlockPlan:
    """The sdpa calls of :func:`selected_attention_blocked` for one set of positions (built once per forward,
    reused by every layer): rows sorted by position, cut into blocks, each with its visible column range and a
    boolean mask over it (``None`` where every column of the range is visible to every row of the block)."""

    def __init__(self, q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None = None,
                 block: int | None = None):
        self.n_rows = q_pos.numel()
        # k calls read (1/2 + 1/(2k)) of the full mask's columns for rows spread evenly, but each call is one
        # parallel region of SDPA's CPU kernel: on a loaded machine a region costs milliseconds of waiting for
        # descheduled threads, so calls stay large (>= 256 rows) and few (<= 8); measured in
        # research/performance/selected_attention_cpu.py
        block = block or max(256, -(-self.n_rows // 8))
        ordered = bool((q_pos[1:] >= q_pos[:-1]).all()) if q_pos.numel() > 1 else True
        self.order = None if ordered else torch.argsort(q_pos, stable=True)
        qs = q_pos if ordered else q_pos[self.order]
        ends = visible_end(qs, k_pos, k_valid, block).tolist()
        self.blocks = []
        for i, end in enumerate(ends):
            r0, r1 = i * block, min((i + 1) * block, self.n_rows)
            mask = _allowed(qs[r0:r1], k_pos[:end], None if k_valid is None else k_valid[:end])
            # a row that sees nothing: SDPA's result for it differs between torch versions (NaN or 0)
            empty = bool((~mask.any(dim=-1)).any()) if end else True
            self.blocks.append((r0, r1, end, None if bool(mask.all()) else mask[None, None], empty))


def selected_attention_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                               k_pos: torch.Tensor, scaling: float, k_valid: torch.Tensor | None = None,
                               plan: BlockPlan | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Position-causal attention of selected rows through SDPA, block by block over the visible columns only.

    Same arguments and result as :func:`selected_attention_torch` (up to float rounding: SDPA's fused kernel
    with its own accumulation order); ``plan`` (a :class:`BlockPlan` of these positions) saves rebuilding the
    blocks per layer, ``out`` (``[B, Hq, R, D]``, any strides) receives the result.

    Why it is faster on CPU than one SDPA call with a ``[R, N]`` mask: the fused CPU kernel costs the same with
    or without a mask, so the gain is the columns it never reads: rows spread over the sequence see about half
    of them. GQA goes through ``enable_gqa`` (no ``repeat_kv`` copies).
    """
    B, Hq, Hkv, R, N, D = _check(q, k, v, q_pos, k_pos, k_valid)
    if plan is None:
        plan = BlockPlan(q_pos, k_pos, k_valid)
    if out is None:
        out = q.new_empty(B, Hq, R, D)
    qs = q if plan.order is None else q[:, :, plan.order]
    gqa = Hq != Hkv
    for r0, r1, end, mask, empty in plan.blocks:
        if end == 0:
            o = q.new_zeros(B, Hq, r1 - r0, D)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                qs[:, :, r0:r1], k[:, :, :end], v[:, :, :end], attn_mask=mask, scale=scaling, enable_gqa=gqa)
            if empty:
                o = o.masked_fill(~mask.any(dim=-1)[..., None], 0.0)
        if plan.order is None:
            out[:, :, r0:r1] = o
        else:
            out[:, :, plan.order[r0:r1]] = o
    return out


class SelectedPositions:
    """The positions of one selected-row attention (``q_pos``, ``k_pos``, ``k_valid``) with what every layer of a
    forward can share, built on first use per device: :func:`visible_end` bounds for the kernel, the
    :class:`BlockPlan` of the CPU formulation, and the explicit ``[1, 1, R, N]`` mask (``mask``: a function that
    builds it) for a layer that cannot take this attention and falls back to the model's own."""

    def __init__(self, q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None = None,
                 block_m: int | None = None, block_n: int | None = None, cpu_block: int | None = None,
                 mask: Callable[[], torch.Tensor] | None = None):
        self.q_pos, self.k_pos, self.k_valid = q_pos, k_pos, k_valid
        self.block_m, self.block_n, self.cpu_block = block_m, block_n, cpu_block
        self._mask = mask
        self._ends: dict = {}
        self._plans: dict = {}
        self._masks: dict = {}

    @property
    def has_mask(self) -> bool:
        """Whether a fallback mask can be built (the partial-recompute engine passes the model a placeholder)."""
        return self._mask is not None

    def fallback_mask(self, device: torch.device) -> torch.Tensor:
        """The explicit mask on ``device``, built on the first call (for the layers that fall back to it)."""
        if device not in self._masks:
            base = self._masks.get(None)
            if base is None:
                base = self._masks[None] = self._mask()
            self._masks[device] = base.to(device)
        return self._masks[device]

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``q_pos``, ``k_pos``, ``k_valid`` on ``device`` (layers of a split model live on several devices)."""
        move = (lambda t: None if t is None else t.to(device))
        return move(self.q_pos), move(self.k_pos), move(self.k_valid)

    def ends(self, device: torch.device, block_m: int) -> torch.Tensor:
        """:func:`visible_end` of these positions for tiles of ``block_m`` rows, on ``device`` (built once)."""
        if (device, block_m) not in self._ends:
            self._ends[device, block_m] = visible_end(*self.on(device), block_m)
        return self._ends[device, block_m]

    def plan(self, device: torch.device) -> BlockPlan:
        if device not in self._plans:
            self._plans[device] = BlockPlan(*self.on(device), block=self.cpu_block)
        return self._plans[device]


@functools.lru_cache(maxsize=None)
def _kernel():
    """The jitted kernel, defined on first use (``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates)."""
    import triton
    import triton.language as tl

    @triton.jit
    def selected_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qpos_ptr, kpos_ptr, valid_ptr, end_ptr,
                                  Hq, R, D, G, qk_scale,
                                  q_b, q_h, q_r, q_d,
                                  k_b, k_h, k_n, k_d,
                                  v_b, v_h, v_n, v_d,
                                  o_b, o_h, o_r, o_d,
                                  HAS_VALID: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program: BLOCK_M selected rows of one (batch, query head)
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // Hq).to(tl.int64)
        h = bh % Hq
        kvh = (h // G).to(tl.int64)  # GQA: the KV head of this query head, read in place
        h = h.to(tl.int64)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = r < R
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D  # head dims 80 etc. padded to a power of two
        d64 = d.to(tl.int64)
        q = tl.load(q_ptr + b * q_b + h * q_h + r.to(tl.int64)[:, None] * q_r + d64[None, :] * q_d,
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        qp = tl.load(qpos_ptr + r, mask=r_ok, other=-1)
        end = tl.load(end_ptr + pid_m)  # columns from here on are invisible to every row of this tile

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
        k_base = k_ptr + b * k_b + kvh * k_h
        v_base = v_ptr + b * v_b + kvh * v_h
        for n0 in range(0, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            n64 = n.to(tl.int64)
            kt = tl.load(k_base + n64[None, :] * k_n + d64[:, None] * k_d, mask=n_ok[None, :] & d_ok[:, None],
                         other=0.0)  # [BLOCK_D, BLOCK_N]
            if UPCAST:
                kt = kt.to(tl.float32)
            kp = tl.load(kpos_ptr + n, mask=n_ok, other=0)
            ok = n_ok[None, :] & (kp[None, :] <= qp[:, None])
            if HAS_VALID:
                ok = ok & (tl.load(valid_ptr + n, mask=n_ok, other=0) != 0)[None, :]
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(ok, s * qk_scale, float("-inf"))  # log2 domain: qk_scale holds log2(e)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: avoid (-inf) - (-inf)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + n64[:, None] * v_n + d64[None, :] * v_d, mask=n_ok[:, None] & d_ok[None, :],
                         other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            elif UPCAST:  # same rounding of p to the value dtype, product in float32
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that saw nothing stays 0
        tl.store(o_ptr + b * o_b + h * o_h + r.to(tl.int64)[:, None] * o_r + d64[None, :] * o_d,
                 out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])

    return triton, selected_attention_kernel


def selected_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                              k_pos: torch.Tensor, scaling: float, k_valid: torch.Tensor | None = None,
                              out: torch.Tensor | None = None, block_m: int | None = None,
                              block_n: int | None = None,
                              ends: torch.Tensor | Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """Position-causal attention of selected rows in one Triton launch (FlashAttention-style online softmax).

    Parameters
    ----------
    q, k, v, q_pos, k_pos, scaling, k_valid
        As :func:`selected_attention_torch`; float32 / bfloat16 / float16, any strides, head dims up to 256
        (non powers of two such as 80 are padded with masks).
    out : Tensor ``[B, Hq, R, D]``, optional
        Receives the result (any strides: e.g. a transposed view of a ``[B, R, Hq, D]`` buffer).
    block_m, block_n : int, optional
        Rows / columns per tile (powers of two >= 16); by default
        :func:`~hf_kvreuse.triton.sizing.attention_tiles` sizes them for the dtype, head dim, rows and the GPU's
        shared memory.
    ends : callable or IntTensor, optional
        :func:`visible_end` of these positions: a function of ``block_m`` returning it (e.g.
        ``functools.partial(SelectedPositions.ends, positions, device)``, shared by every layer), or the tensor
        itself, which needs an explicit ``block_m`` (it is only valid for that tile height). Computed when not
        given.

    Notes
    -----
    Scores and the softmax are float32. float32 inputs multiply in IEEE float32 (no TF32); half-precision
    probabilities are rounded to the value dtype before ``P V`` (as FlashAttention does), about one ulp of the
    output. CPU tensors need ``TRITON_INTERPRET=1`` set before the first call; under the interpreter (whatever the
    tensors' device) half-precision tiles are multiplied as float32 (exact widening; the interpreter's bfloat16
    ``tl.dot`` returns garbage in triton 3.9).
    """
    B, Hq, Hkv, R, N, D = _check(q, k, v, q_pos, k_pos, k_valid)
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"selected_attention_triton supports one dtype of {SUPPORTED_DTYPES}, got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}")
    if D > 256:
        raise ValueError(f"head dim {D} > 256 is not supported")
    if isinstance(ends, torch.Tensor) and block_m is None:
        raise ValueError("ends given as a tensor needs the block_m it was computed for (or pass a function of "
                         "block_m)")
    if out is None:
        out = q.new_empty(B, Hq, R, D)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if q.numel() == 0:
        return out
    dev = q.device
    triton, kernel = _kernel()
    block_d = max(16, triton.next_power_of_2(D))
    tile = sizing.attention_tiles(q.element_size(), block_d, sizing.target(dev).shared_memory, rows=R,
                                  block_m=block_m, block_n=block_n)
    q_pos = q_pos.to(device=dev, dtype=torch.long).contiguous()
    k_pos = k_pos.to(device=dev, dtype=torch.long).contiguous()
    valid = k_valid.to(device=dev, dtype=torch.int8).contiguous() if k_valid is not None else k_pos
    if ends is None:
        ends = visible_end(q_pos, k_pos, None if k_valid is None else k_valid.to(dev), tile.block_m)
    elif not isinstance(ends, torch.Tensor):
        ends = ends(tile.block_m)
    ends = ends.to(device=dev, dtype=torch.int32)
    grid = (triton.cdiv(R, tile.block_m), B * Hq)
    kernel[grid](q, k, v, out, q_pos, k_pos, valid, ends,
                 Hq, R, D, Hq // Hkv, float(scaling) * math.log2(math.e),
                 *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                 HAS_VALID=k_valid is not None, IEEE=q.dtype == torch.float32,
                 UPCAST=q.dtype != torch.float32 and sizing.interpreted(kernel),
                 BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_D=block_d,
                 num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out
