"""Low-rank value attention ``P·V_base + s·(P·L)·B`` (PReCache's Flash-LoRA-Attention): a Triton kernel and its
torch reference.

Jeon et al., "PReCache: training-free KV cache sharing for multi-LoRA agents" (2026; METHODS.md §2.3; code
``hjeon2k/PReCache``; its predecessor is LRAgent, arXiv 2602.01053). With a LoRA adapter on ``v_proj`` the values
of agent ``a`` are ``V_a = V_base + s_a · L_a · B_a`` with the shared base values ``V_base = X W_V``, the
per-adapter low-rank cache ``L_a = X A_a`` (``[T, r]``) and ``B_a`` (``[Hkv·D, r]``). Attention is linear in the
values, so with ``P = softmax(Q K^T · scaling + mask)``::

    O = P · (V_base + s_a L_a B_a^T) = P V_base + s_a (P L_a) B_a^T

and the ``T x Hkv·D`` per-agent values are never formed; ``L_a`` is read once per KV head group, like ``K`` and
``V`` (``B`` here is stored ``[Hkv·D, r]``, peft's ``lora_B.weight``, so the product is ``(P·L) · B_head^T``).

:func:`lowrank_attention_torch` computes this eagerly (the full ``[q, T]`` score matrix per KV group, query heads
packed per group so no ``repeat_kv`` copies). :func:`lowrank_attention_triton` is one flash-attention style
launch: per tile of keys it updates an online softmax (running max ``m``, sum ``l``, float32) and two float32
accumulators, ``P·V`` (``[M, D]``) and ``P·L`` (``[M, r]``, ``r`` padded to a power of two >= 16 for the tensor
cores); at the end ``o = acc_v / l + s · (acc_l / l) @ B_head^T``. Nothing of size ``T x T`` or ``T x D`` is
written. Few query rows (decode) split the keys over several programs (flash-decoding: partial results and
their log-sum-exp in a float32 workspace, merged by a second small kernel), so a long cache still fills the GPU.

Masks: ``None`` means causal with the queries at the last ``q`` positions of the ``T`` keys (sdpa's
``is_causal``; for ``q = 1`` that is every key); a bool mask (sdpa's, True = visible) or an additive float mask
(eager's) ``[B or 1, 1, >= q, >= T]`` is read at ``[..., -q:, :T]``, like the reference. A query row whose keys
are all masked gives zeros from the kernel (the reference's softmax gives NaN there).

Exactness: the kernel accumulates in float32 and rounds once at the end; the reference rounds the score matrix
product, ``P`` and ``P·L`` to the storage dtype on the way. In float32 the two agree to ~1e-6; in bfloat16 /
float16 they differ by the reference's roundings (the kernel is the closer one to the exact value).

This module never imports triton at import time: the kernels are built on the first call of
:func:`lowrank_attention_triton` (set ``TRITON_INTERPRET=1`` before that first call to run it on CPU tensors).
"""

from __future__ import annotations

import functools
import math

import torch

from . import sizing

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634


def lowrank_attention_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, L: torch.Tensor,
                            Bw: torch.Tensor, s: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float) -> torch.Tensor:
    """``P·V_base + s·(P·L)·B`` with ``P = softmax(Q K^T·scaling + mask)``, per-agent values never formed (torch).

    Parameters
    ----------
    query : Tensor ``[B, H, q, D]``
    key, value : Tensor ``[B, Hkv, T, D]``
        Base keys (already carrying any key-LoRA term) and base values; ``H`` a multiple of ``Hkv``.
    L : Tensor ``[B, T, r]``
        Low-rank value cache of each row's adapter (zeros for a row without one).
    Bw : Tensor ``[B, Hkv·D, r]``
        Each row's ``lora_B`` weight.
    s : Tensor ``[B]``
        Each row's LoRA scaling (0 for a row without an adapter).
    attention_mask : Tensor or None
        sdpa's bool mask (True = visible) or eager's additive float mask, ``[B or 1, 1, >= q, >= T]`` read at
        ``[..., -q:, :T]``; None: causal with the queries at the last ``q`` positions.
    scaling : float
        Score scale (``D ** -0.5`` usually).

    Returns
    -------
    Tensor ``[B, q, H, D]`` (contiguous), value's dtype.

    Notes
    -----
    Query heads are packed per KV group, so K, V and L are read once per group (no ``repeat_kv`` copies).
    """
    B, H, q, D = query.shape
    Hkv, T, r = key.shape[1], key.shape[2], L.shape[-1]
    g = H // Hkv
    qp = query.reshape(B, Hkv, g * q, D)
    w = torch.matmul(qp, key.transpose(-1, -2)).float() * scaling  # [B, Hkv, g·q, T]
    if attention_mask is None and q > 1:  # sdpa's "is_causal" case: the queries are the last q positions
        pos = torch.arange(T, device=query.device)
        attention_mask = (pos[None, :] <= pos[T - q:, None])[None, None]
    if attention_mask is not None:
        m = attention_mask[..., -q:, :T]
        m = m.expand(m.shape[0], 1, q, T)[:, :, None].expand(-1, 1, g, q, T).reshape(m.shape[0], 1, g * q, T)
        w = w.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else w + m.float()
    p = torch.softmax(w, dim=-1).to(value.dtype)
    o = torch.matmul(p, value).view(B, Hkv, g, q, D)
    pl = torch.matmul(p, L[:, None]).view(B, Hkv, g, q, r)  # P·L: L is shared by every KV head
    o = o + torch.einsum("bkgqr,bkdr->bkgqd", pl, Bw.view(B, Hkv, D, r)) * s.view(B, 1, 1, 1, 1)
    return o.reshape(B, H, q, D).transpose(1, 2).contiguous()


@functools.lru_cache(maxsize=None)
def _kernels():
    """The jitted kernels, defined on first use (``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates)."""
    import triton
    import triton.language as tl

    @triton.jit
    def lowrank_attention_kernel(
            q_ptr, k_ptr, v_ptr, l_ptr, bw_ptr, s_ptr, mask_ptr, o_ptr, wv_ptr, wl_ptr, lse_ptr,
            Hkv, G, Q, T, D, R, qk_scale, split_tokens, n_rows_pad,
            sq_b, sq_h, sq_q, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
            sl_b, sl_t, sl_r, sb_b, sb_o, sb_r, ss_b, sm_b, sm_q, sm_t,
            so_b, so_q, so_h, so_d,
            MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr, COLUMNS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
        # one program: BLOCK_M packed query rows (row = g·Q + query index) of one (batch, KV head), over the keys
        # [lo, hi) of its split
        mb = tl.program_id(0)
        bk = tl.program_id(1)
        sp = tl.program_id(2)
        n_splits = tl.num_programs(2)
        b = (bk // Hkv).to(tl.int64)
        kvh = (bk % Hkv).to(tl.int64)
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < G * Q
        qi32 = rows % Q
        qi = qi32.to(tl.int64)
        h = kvh * G + (rows // Q).to(tl.int64)
        d = tl.arange(0, BLOCK_D).to(tl.int64)
        d_ok = d < D
        j = tl.arange(0, BLOCK_R).to(tl.int64)
        j_ok = j < R
        qv = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + qi[:, None] * sq_q + d[None, :] * sq_d,
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            qv = qv.to(tl.float32)
        qpos = T - Q + qi  # absolute position of each query among the keys (causal convention)

        lo = sp * split_tokens
        hi = tl.minimum(T, lo + split_tokens)
        if CAUSAL:  # no key tile past the block's last query position
            hi = tl.minimum(hi, T - Q + tl.max(tl.where(row_ok, qi32, 0), 0) + 1)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc_v = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        acc_l = tl.full([BLOCK_M, BLOCK_R], 0.0, tl.float32)
        k_base = k_ptr + b * sk_b + kvh * sk_h
        v_base = v_ptr + b * sv_b + kvh * sv_h
        l_base = l_ptr + b * sl_b
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
            n_ok = n < hi
            kt = tl.load(k_base + n[None, :] * sk_t + d[:, None] * sk_d, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
            sc = tl.dot(qv, kt, input_precision=PRECISION) * qk_scale  # [M, N], log2 domain
            valid = n_ok[None, :] & (rows[:, None] >= 0)
            if CAUSAL:
                valid = valid & (n[None, :] <= qpos[:, None])
            if MASK_KIND == 1:  # bool mask (as uint8): nonzero = visible
                mv = tl.load(mask_ptr + b * sm_b + qi[:, None] * sm_q + n[None, :] * sm_t,
                             mask=row_ok[:, None] & n_ok[None, :], other=1)
                valid = valid & (mv != 0)
            if MASK_KIND == 2:  # additive float mask
                add = tl.load(mask_ptr + b * sm_b + qi[:, None] * sm_q + n[None, :] * sm_t,
                              mask=row_ok[:, None] & n_ok[None, :], other=0.0)
                # clamped: finfo.min · log2(e) would overflow to -inf (a fully hidden row then stays finite,
                # uniform like the reference's softmax over finfo.min scores)
                sc = sc + tl.maximum(add.to(tl.float32), -1.0e30) * 1.4426950408889634
            sc = tl.where(valid, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(sc - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + n[:, None] * sv_t + d[None, :] * sv_d, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            pv = p.to(vt.dtype)  # P rounded to the value dtype, as the tensor-core dot reads it
            if UPCAST:
                pv = pv.to(tl.float32)
                vt = vt.to(tl.float32)
            acc_v = acc_v * alpha[:, None] + tl.dot(pv, vt, input_precision=PRECISION)
            lt = tl.load(l_base + n[:, None] * sl_t + j[None, :] * sl_r, mask=n_ok[:, None] & j_ok[None, :], other=0.0)
            pv = p.to(lt.dtype)
            if UPCAST:
                pv = pv.to(tl.float32)
                lt = lt.to(tl.float32)
            acc_l = acc_l * alpha[:, None] + tl.dot(pv, lt, input_precision=PRECISION)
            m_i = m_new

        l_use = tl.where(l_i == 0.0, 1.0, l_i)  # nothing visible: zeros, not NaN
        ov = acc_v / l_use[:, None]
        pl = acc_l / l_use[:, None]
        if SPLIT:  # partial results of this split, merged by lowrank_merge_kernel
            w_row = (bk * n_splits + sp) * n_rows_pad + rows.to(tl.int64)
            tl.store(wv_ptr + w_row[:, None] * BLOCK_D + d[None, :], ov)
            tl.store(wl_ptr + w_row[:, None] * BLOCK_R + j[None, :], pl)
            tl.store(lse_ptr + w_row, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_use)))
        else:
            if COLUMNS:  # (P·L) · B_head^T one rank column at a time (float32 FMAs): see the launcher
                lb = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                b_row = bw_ptr + b * sb_b + (kvh * D + d) * sb_o
                for jj in range(0, R):
                    pl_j = tl.sum(tl.where(j[None, :] == jj, pl, 0.0), 1)
                    lb += pl_j[:, None] * tl.load(b_row + jj * sb_r, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            else:
                bt = tl.load(bw_ptr + b * sb_b + (kvh * D + d)[None, :] * sb_o + j[:, None] * sb_r,
                             mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [R, D]: B_head^T
                lb = tl.dot(pl, bt, input_precision="ieee")
            sv = tl.load(s_ptr + b * ss_b).to(tl.float32)
            out = ov + sv * lb
            tl.store(o_ptr + b * so_b + qi[:, None] * so_q + h[:, None] * so_h + d[None, :] * so_d,
                     out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def lowrank_merge_kernel(
            bw_ptr, s_ptr, o_ptr, wv_ptr, wl_ptr, lse_ptr,
            Hkv, G, Q, D, R, n_splits, n_rows_pad,
            sb_b, sb_o, sb_r, ss_b, so_b, so_q, so_h, so_d,
            COLUMNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
        # one program: BLOCK_M packed rows of one (batch, KV head); merges the splits by their log-sum-exp
        mb = tl.program_id(0)
        bk = tl.program_id(1)
        b = (bk // Hkv).to(tl.int64)
        kvh = (bk % Hkv).to(tl.int64)
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < G * Q
        qi = (rows % Q).to(tl.int64)
        h = kvh * G + (rows // Q).to(tl.int64)
        d = tl.arange(0, BLOCK_D).to(tl.int64)
        d_ok = d < D
        j = tl.arange(0, BLOCK_R).to(tl.int64)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        den = tl.full([BLOCK_M], 0.0, tl.float32)
        acc_v = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        acc_l = tl.full([BLOCK_M, BLOCK_R], 0.0, tl.float32)
        for sp in range(0, n_splits):
            w_row = (bk * n_splits + sp) * n_rows_pad + rows.to(tl.int64)
            lse = tl.load(lse_ptr + w_row)
            m_new = tl.maximum(m_i, lse)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            w = tl.exp2(lse - m_use)
            acc_v = acc_v * alpha[:, None] + w[:, None] * tl.load(wv_ptr + w_row[:, None] * BLOCK_D + d[None, :])
            acc_l = acc_l * alpha[:, None] + w[:, None] * tl.load(wl_ptr + w_row[:, None] * BLOCK_R + j[None, :])
            den = den * alpha + w
            m_i = m_new
        den = tl.where(den == 0.0, 1.0, den)
        ov = acc_v / den[:, None]
        pl = acc_l / den[:, None]
        if COLUMNS:  # (P·L) · B_head^T as in the main kernel's epilogue
            lb = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            b_row = bw_ptr + b * sb_b + (kvh * D + d) * sb_o
            for jj in range(0, R):
                pl_j = tl.sum(tl.where(j[None, :] == jj, pl, 0.0), 1)
                lb += pl_j[:, None] * tl.load(b_row + jj * sb_r, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        else:
            bt = tl.load(bw_ptr + b * sb_b + (kvh * D + d)[None, :] * sb_o + j[:, None] * sb_r,
                         mask=(j < R)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            lb = tl.dot(pl, bt, input_precision="ieee")
        sv = tl.load(s_ptr + b * ss_b).to(tl.float32)
        out = ov + sv * lb
        tl.store(o_ptr + b * so_b + qi[:, None] * so_q + h[:, None] * so_h + d[None, :] * so_d,
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return triton, lowrank_attention_kernel, lowrank_merge_kernel


def _mask_view(attention_mask: torch.Tensor, B: int, q: int, T: int) -> tuple[int, torch.Tensor, tuple[int, int, int]]:
    """(kind, tensor, (batch, query, key) strides) of the mask the kernel reads: 1 bool (as uint8), 2 additive."""
    m = attention_mask
    if m.dim() != 4 or m.shape[1] != 1:
        raise ValueError(f"attention_mask must be [B or 1, 1, q, T], got {tuple(m.shape)}")
    m = m[..., -q:, :T]
    if m.shape[0] not in (1, B) or m.shape[-1] != T:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not cover batch {B}, {q} queries, "
                         f"{T} keys")
    m = m.expand(m.shape[0], 1, q, T)  # a broadcast query dim gets stride 0
    sb, _, sq, st = m.stride()
    if m.shape[0] == 1:
        sb = 0
    if m.dtype == torch.bool:
        return 1, m.view(torch.uint8), (sb, sq, st)
    return 2, m, (sb, sq, st)


def _num_splits(programs: int, T: int, block_n: int, device: torch.device) -> int:
    """Key splits per program for a launch of ``programs`` programs: enough to fill the GPU twice over, at least
    4 key tiles each; 1 off CUDA (the interpreter gains nothing from more programs)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), T // (4 * block_n)))


def lowrank_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, L: torch.Tensor,
                             Bw: torch.Tensor, s: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float, num_splits: int | None = None) -> torch.Tensor:
    """``P·V_base + s·(P·L)·B`` in one flash-attention style Triton launch (two when the keys are split).

    Parameters
    ----------
    query, key, value, L, Bw, s, attention_mask, scaling
        As :func:`lowrank_attention_torch`: query ``[B, H, q, D]``, key/value ``[B, Hkv, T, D]``, ``L [B, T, r]``,
        ``Bw [B, Hkv·D, r]``, ``s [B]``, mask bool / additive float / None (causal), any strides. Query, key,
        value, L and Bw share one dtype (float32 / bfloat16 / float16); ``r <= 64``.
    num_splits : int, optional
        Key splits per (batch, KV head, query block) (flash-decoding); by default more than one only when the
        launch would leave CUDA SMs idle (decode steps).

    Returns
    -------
    Tensor ``[B, q, H, D]`` (contiguous), value's dtype.

    Notes
    -----
    Float32 softmax statistics and accumulators; see the module docstring for how it differs from the
    reference in bfloat16 / float16. CPU tensors need ``TRITON_INTERPRET=1`` set before the first call.
    """
    B, H, q, D = query.shape
    Bk, Hkv, T, Dk = key.shape
    r = L.shape[-1]
    if (Bk, Dk) != (B, D) or value.shape != key.shape or H % Hkv:
        raise ValueError(f"query {tuple(query.shape)} / key {tuple(key.shape)} / value {tuple(value.shape)} do not "
                         "fit [B, H, q, D] / [B, Hkv, T, D] with H a multiple of Hkv")
    if L.shape != (B, T, r) or Bw.shape != (B, Hkv * D, r) or s.shape != (B,):
        raise ValueError(f"L {tuple(L.shape)}, Bw {tuple(Bw.shape)}, s {tuple(s.shape)} do not fit B={B}, T={T}, "
                         f"Hkv·D={Hkv * D}")
    dtypes = {t.dtype for t in (query, key, value, L, Bw)}
    if len(dtypes) != 1 or value.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"lowrank_attention_triton needs one dtype of {SUPPORTED_DTYPES} for query/key/value/L/Bw, "
                        f"got {sorted(map(str, dtypes))}")
    if r > 64:
        raise ValueError(f"rank {r} > 64 is not supported by the kernel")
    out = torch.empty(B, q, H, D, device=value.device, dtype=value.dtype)
    if out.numel() == 0:
        return out
    if T == 0:
        return out.zero_()
    triton, kernel, merge = _kernels()
    G = H // Hkv
    n_rows = G * q
    block_d = max(16, triton.next_power_of_2(D))
    block_r = max(16, triton.next_power_of_2(r))
    # tiles, warps and stages for the dtype, head dim, rank and the GPU's shared memory (see attention_tiles)
    tile = sizing.attention_tiles(value.element_size(), block_d, sizing.target(value.device).shared_memory,
                                  rows=n_rows, block_r=block_r)
    block_m, block_n = tile.block_m, tile.block_n
    n_mblocks = triton.cdiv(n_rows, block_m)
    splits = num_splits or _num_splits(n_mblocks * B * Hkv, T, block_n, value.device)
    split_tokens = triton.cdiv(triton.cdiv(T, splits), block_n) * block_n
    splits = triton.cdiv(T, split_tokens)
    if attention_mask is None:
        kind, mask, (sm_b, sm_q, sm_t), causal = 0, value, (0, 0, 0), True
    else:
        (kind, mask, (sm_b, sm_q, sm_t)), causal = _mask_view(attention_mask, B, q, T), False
    n_rows_pad = n_mblocks * block_m
    if splits > 1:
        f32 = dict(device=value.device, dtype=torch.float32)
        wv = torch.empty(B * Hkv * splits * n_rows_pad, block_d, **f32)
        wl = torch.empty(B * Hkv * splits * n_rows_pad, block_r, **f32)
        lse = torch.empty(B * Hkv * splits * n_rows_pad, **f32)
    else:
        wv = wl = lse = out  # never touched
    # Triton's interpreter multiplies bfloat16 dot operands wrongly (as raw bits): while it runs (whatever the
    # tensors' device) the operands are widened to float32 after the same roundings, which is exact (products of
    # 8/11-bit mantissas fit float32)
    upcast = sizing.interpreted(kernel)
    precision = "ieee" if value.dtype == torch.float32 or upcast else "tf32"  # float32 stays float32 (no TF32)
    # the epilogue's (P·L) · B_head^T: a tl.dot on an [r, D] float32 tile of B up to 32 KB; past that (r = 64,
    # D = 256: 64 KB) one rank column at a time, which the dot's operand tile spilled ~250 B per thread for
    columns = block_r * block_d > 8192
    kernel[(n_mblocks, B * Hkv, splits)](
        query, key, value, L, Bw, s, mask, out, wv, wl, lse,
        Hkv, G, q, T, D, r, float(scaling) * LOG2E, split_tokens, n_rows_pad,
        *query.stride(), *key.stride(), *value.stride(), *L.stride(), *Bw.stride(), s.stride(0),
        sm_b, sm_q, sm_t, *out.stride(),
        MASK_KIND=kind, CAUSAL=causal, SPLIT=splits > 1, PRECISION=precision, UPCAST=upcast, COLUMNS=columns,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    if splits > 1:
        merge[(n_mblocks, B * Hkv)](
            Bw, s, out, wv, wl, lse, Hkv, G, q, D, r, splits, n_rows_pad,
            *Bw.stride(), s.stride(0), *out.stride(),
            COLUMNS=columns, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4)
    return out
