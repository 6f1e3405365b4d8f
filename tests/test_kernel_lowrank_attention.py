"""The Triton low-rank value attention kernel (PReCache's ``P·V_base + s·(P·L)·B``) against its torch reference
(Triton's interpreter on CPU), and BaseLRCache end to end on the Triton backend."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports a @triton.jit kernel in this process

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_kvreuse import BaseLRCache, kernels, lora  # noqa: E402
from hf_kvreuse.triton import lowrank_attention as la  # noqa: E402

from test_base_lr import TRACE, multi_lora, rand_ids  # noqa: E402

# one unit of error per dtype, relative to the largest output: an ulp for bfloat16 / float16 (the kernel rounds P
# and the output once each); for float32 4 ulps (sums over T keys and r ranks in a different order than torch)
EPS = {torch.float32: 2 ** -21, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
DTYPES = list(EPS)


def _inputs(B, H, Hkv, q, T, D, r, dtype, seed=0, s=None):
    """Non-contiguous inputs the way a model hands them over: query a transposed ``[B, q, H, D]`` buffer, key /
    value transposed ``[B, T, Hkv, D + 8]`` buffers sliced to ``D``, ``L`` a slice of a wider ``[B, T, r + 3]``,
    ``Bw`` a transposed ``[B, r, Hkv·D]`` buffer."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    query = rnd(B, q, H, D).transpose(1, 2)
    key = rnd(B, T, Hkv, D + 8).transpose(1, 2)[..., :D]
    value = rnd(B, T, Hkv, D + 8).transpose(1, 2)[..., :D]
    L = rnd(B, T, r + 3)[..., 1:r + 1]
    Bw = rnd(B, r, Hkv * D, scale=0.3).transpose(1, 2)
    s = (torch.linspace(0.5, 2.0, B) if s is None else torch.as_tensor(s, dtype=torch.float32)).to(dtype)
    return query, key, value, L, Bw, s


def _check(args, mask=None, scaling=None, num_splits=None, C=4.0):
    """Kernel vs torch reference vs the exact (float64) value: the kernel is within ``C`` ulps of the largest
    output of the exact value, and so within ``2 C`` of the reference. Returns the kernel's output."""
    query = args[0]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    got = la.lowrank_attention_triton(*args, mask, scaling, num_splits=num_splits)
    want = la.lowrank_attention_torch(*args, mask, scaling)
    exact_mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    exact = la.lowrank_attention_torch(*(t.double() for t in args), exact_mask, scaling)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    tol = C * EPS[query.dtype] * exact.abs().max().item()
    err = (got.double() - exact).abs().max().item()
    assert err <= tol, f"kernel vs exact {err:.3g} > {tol:.3g}"
    diff = (got.double() - want.double()).abs().max().item()
    assert diff <= 2 * tol, f"kernel vs reference {diff:.3g} > {2 * tol:.3g}"
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,r", [(64, 1), (80, 8), (128, 16)])
@pytest.mark.parametrize("q,T", [(1, 37), (37, 37), (5, 70)])
def test_matches_reference(dtype, D, r, q, T):
    """GQA (4 query heads on 2 KV heads), odd lengths, one decode query and a causal prefill (q = T, mask None),
    head dims 64 / 80 / 128 with ranks 1 / 8 / 16, every dtype, non-contiguous inputs: the kernel equals the
    reference (within a few ulps of the exact value).

    Planted bug that fails it: the final low-rank term uses the unnormalised ``acc_l`` (``pl = acc_l``
    instead of ``acc_l / l``)."""
    _check(_inputs(2, 4, 2, q, T, D, r, dtype))


@pytest.mark.parametrize("H,Hkv", [(3, 3), (8, 2), (6, 1)])
def test_gqa_groups(H, Hkv):
    """Group sizes 1, 4 and 6 (packed rows of one KV head cross the query heads), causal q = 9 over T = 20.

    Planted bug that fails it: the query head of a packed row is ``kvh * G + rows % Q`` (query index and head
    swapped)."""
    _check(_inputs(2, H, Hkv, 9, 20, 64, 8, torch.float32, seed=1))


def test_causal_convention_queries_are_the_last_positions():
    """Mask None with q < T: query i sits at position T - q + i and sees keys 0..T-q+i, not more (a causal
    chunked prefill over a cached prefix).

    Planted bug that fails it: the causal test is ``n < qpos`` (each query misses its own key)."""
    _check(_inputs(1, 4, 2, 11, 75, 64, 8, torch.float32, seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_explicit_masks(dtype):
    """sdpa's bool mask (per batch row, and a batch-1 mask broadcast over rows), a mask larger than needed (read
    at ``[..., -q:, :T]``), and eager's additive float mask (``finfo.min`` where hidden): all equal the reference.

    Planted bug that fails it: the bool mask's batch stride is dropped (``sm_b = 0``: every row reads row 0's
    mask)."""
    B, q, T = 2, 6, 29
    args = _inputs(B, 4, 2, q, T, 64, 8, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    vis = torch.rand(B, 1, q + 3, T + 5, generator=g) < 0.6
    vis[..., -1] = vis[..., T - 1] = True  # every query keeps a key (a fully hidden row is NaN in the reference)
    _check(args, vis)
    _check(args, vis[:1])
    add = torch.zeros(vis.shape, dtype=dtype).masked_fill(~vis, torch.finfo(dtype).min)
    _check(args, add)


@pytest.mark.parametrize("q,T,splits", [(1, 300, 3), (4, 257, 5), (7, 200, 4)])
def test_split_keys(q, T, splits):
    """Flash-decoding: the keys split over programs (partial results merged by their log-sum-exp) give the
    unsplit result; with a causal prefill some splits of the early queries see no key at all.

    Planted bug that fails it: the merge weighs every split equally (``w = 1.0`` instead of
    ``exp2(lse - m_use)``)."""
    args = _inputs(2, 4, 2, q, T, 80, 8, torch.float32, seed=5)
    one = _check(args, num_splits=1)
    many = _check(args, num_splits=splits)
    torch.testing.assert_close(many, one, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("r", [1, 3, 24, 64])
def test_ranks_padded(r):
    """Ranks that are not the tile width: 1 and 3 (padded to 16), 24 (to 32) and 64; ``L`` is a slice of a wider
    buffer whose other columns are NaN, so a padded column read from memory shows.

    Planted bug that fails it: the ``L`` tile ignores the rank mask (``mask=n_ok[:, None]``: padded columns
    read the neighbouring elements of the wider buffer)."""
    query, key, value, L, Bw, s = _inputs(2, 4, 2, 3, 41, 64, r, torch.float32, seed=6)
    wide = torch.full((2, 41, r + 3), float("nan"))
    wide[..., 1:r + 1] = L
    _check((query, key, value, wide[..., 1:r + 1], Bw, s))


def test_mixed_readers_and_zero_scaling():
    """A batch of three readers: an adapter, a row without one (L = 0, B = 0, s = 0, as ``_row_terms`` builds
    it) and an adapter with s = 0: the last two give plain attention over the base values.

    Planted bug that fails it: the scaling is read at batch 0 for every row (``s_ptr + 0 * ss_b``)."""
    q, T, D, r = 4, 23, 64, 8
    query, key, value, L, Bw, _ = _inputs(3, 4, 2, q, T, D, r, torch.float32, seed=7)
    L, Bw = L.clone(), Bw.clone()
    L[1] = 0
    Bw[1] = 0
    s = torch.tensor([1.5, 0.0, 0.0])
    got = _check((query, key, value, L, Bw, s))
    plain = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1),
        attn_mask=torch.ones(q, T, dtype=torch.bool).tril(T - q)).transpose(1, 2)
    torch.testing.assert_close(got[1:], plain[1:], atol=1e-5, rtol=1e-5)
    assert (got[0] - plain[0]).abs().max() > 0.1  # the adapter row does move


def test_strides_broadcast_batch_and_odd_layouts():
    """The layouts the cache produces: key / value ``expand``-ed over two batch rows (stride 0, ReBaseShared's
    alongside schedule), a head-dim stride of 2, ``s`` a strided view; plus a custom scaling.

    Planted bug that fails it: values are addressed with the key strides (``*key.stride()`` twice)."""
    q, T, D, r = 3, 19, 64, 8
    query, _, _, L, Bw, s = _inputs(2, 4, 2, q, T, D, r, torch.float16, seed=8)
    g = torch.Generator().manual_seed(9)
    key = torch.randn(1, 2, T, D, generator=g).half().expand(2, -1, -1, -1)
    value = torch.randn(1, T, 2, 2 * D, generator=g).half().transpose(1, 2)[..., ::2].expand(2, -1, -1, -1)
    s = torch.tensor([0.7, 0.0, 1.3, 0.0]).half()[::2]
    assert key.stride(0) == 0 and value.stride(-1) == 2 and s.stride(0) == 2
    _check((query, key, value, L, Bw, s), scaling=0.2)


def test_dispatch(monkeypatch):
    """``kernels.lowrank_attention`` runs the reference under ``torch`` (bit-identical) and the kernel under
    ``triton``; ``lora.lowrank_attention`` still names the reference.

    Planted bug that fails it: the dispatch ignores the backend (always the torch reference)."""
    args = _inputs(2, 4, 2, 5, 21, 64, 8, torch.float32, seed=10)
    calls = []
    orig = la.lowrank_attention_triton
    monkeypatch.setattr(la, "lowrank_attention_triton", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    assert lora.lowrank_attention is la.lowrank_attention_torch
    monkeypatch.setenv("HF_KVREUSE_KERNELS", "torch")
    assert torch.equal(kernels.lowrank_attention(*args, None, 0.125), la.lowrank_attention_torch(*args, None, 0.125))
    assert not calls
    monkeypatch.setenv("HF_KVREUSE_KERNELS", "triton")
    kernels.lowrank_attention(*args, None, 0.125)
    assert calls


# -- end to end: BaseLRCache on the Triton backend ---------------------------------------------------------------
def _trace_scores(pm, cache, turns):
    """Like ``test_base_lr.run_trace``, also returning every generated step's logits."""
    seq = torch.empty(1, 0, dtype=torch.long)
    scores = []
    for i, (agent, new, gen) in enumerate(turns):
        seq = torch.cat([seq, rand_ids(new, i)], 1)
        pm.set_adapter(agent)
        out = pm.generate(input_ids=seq, cache=cache, max_new_tokens=gen, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
        seq = out.sequences
        scores += list(out.scores)
    return seq, scores


@pytest.fixture(scope="module")
def pm_kv():
    """llama with LoRA on k_proj and v_proj (the key path changes ``key`` before the kernel) and q/o."""
    return multi_lora("llama", targets=("k_proj", "v_proj", "q_proj", "o_proj"))


TRACE_LONG = [("plan", 20, 4)] + TRACE[1:3]  # a 20-token prefill: above lowrank_max_queries=16


@pytest.mark.parametrize("method,schedule", [("nonshared", "after_turn"), ("prelrshared", "after_turn"),
                                             ("rebaseshared", "after_turn"), ("rebaseshared", "alongside")])
def test_base_lr_cache_same_tokens_and_logits_on_triton(monkeypatch, pm_kv, method, schedule):
    """Every BaseLRCache method and schedule gives the torch backend's tokens and (closely) its logits with
    ``HF_KVREUSE_KERNELS=triton``; on the Triton backend every value attention goes through the kernel, the
    20-query prefill too (no transient ``V_base + s·L·B``), and the stats say ``triton``.

    Planted bug that fails it: ``lora_attention`` passes ``-s`` to the kernel (the adapter's value term
    subtracted); the spy also fails if the triton branch falls back to the transient sum."""
    launches = []
    orig = la.lowrank_attention_triton
    monkeypatch.setattr(la, "lowrank_attention_triton",
                        lambda *a, **k: (launches.append(a[0].shape[2]), orig(*a, **k))[1])
    runs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        cache = BaseLRCache(pm_kv, method=method, schedule=schedule)
        runs[name] = _trace_scores(pm_kv, cache, TRACE_LONG), cache.stats.kernels
    assert runs["torch"][1] == "torch" and runs["triton"][1] == "triton"
    (seq_t, sc_t), (seq_r, sc_r) = runs["triton"][0], runs["torch"][0]
    assert torch.equal(seq_t, seq_r)
    for a, b in zip(sc_t, sc_r):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    if method == "nonshared":
        assert not launches  # nothing low-rank to attend to
    else:
        assert 20 in launches and 1 in launches  # the long prefill and the decode steps


def test_eager_attention_on_triton(monkeypatch):
    """Eager attention (its additive float mask reaches the kernel) on the Triton backend: the torch backend's
    tokens and logits.

    Planted bug that fails it: the launcher reads a float mask as no mask (``_mask_view`` returns kind 0 for
    it: the additive mask is dropped, and with it causality)."""
    pm = multi_lora("llama", targets=("v_proj",), attn="eager")
    runs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_KVREUSE_KERNELS", name)
        runs[name] = _trace_scores(pm, BaseLRCache(pm, method="prelrshared"), TRACE_LONG)
    assert torch.equal(runs["triton"][0], runs["torch"][0])
    for a, b in zip(runs["triton"][1], runs["torch"][1]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
