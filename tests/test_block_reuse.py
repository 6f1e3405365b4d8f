"""One matrix over every block-reuse cache: the correctness gates of METHODS.md §1.4 and §7.3."""

import pytest
import torch

from hf_kvreuse import (BlendCache, ChunkStore, DirectReuseCache, EPICCache, FocusRecomputeCache, KVChunk, OffsetCache,
                        TailRecomputeCache)
from hf_kvreuse.kv import kv_of
from hf_kvreuse.models import tiny_model

from conftest import WordTokenizer, exact_prefill, assert_same_generation

# (class, kwargs for "repair nothing", kwargs for "repair everything")
METHODS = {
    "direct": (DirectReuseCache, {}, None),
    "tail": (TailRecomputeCache, {"recompute_tokens": 0}, {"recompute_tokens": 10_000}),
    "epic": (EPICCache, {"recompute_tokens": 0}, {"recompute_tokens": 10_000}),
    "focus": (FocusRecomputeCache, {"tokenizer": WordTokenizer(), "recompute_tokens": 0},
              {"tokenizer": WordTokenizer(), "recompute_tokens": 10_000}),
    "blend": (BlendCache, {"recompute_ratio": 0.0}, {"recompute_ratio": 1.0}),
    "blend-keys": (BlendCache, {"recompute_ratio": 0.0, "deviation": "keys"},
                   {"recompute_ratio": 1.0, "deviation": "keys"}),
}
GEN = dict(max_new_tokens=12, do_sample=False)


def rag_prompt(seed=0, n_docs=3, doc_len=20):
    """system ⊕ doc_1 ⊕ sep ⊕ doc_2 ⊕ sep ⊕ ... ⊕ question; returns ids, doc id tensors, doc spans."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(3, 128, (n,), generator=g)  # noqa: E731
    parts, docs, spans, pos = [r(6)], [], [], 6
    for _ in range(n_docs):
        d = r(doc_len)
        docs.append(d)
        spans.append((pos, pos + doc_len))
        parts += [d, r(2)]
        pos += doc_len + 2
    parts.append(r(7))
    return torch.cat(parts)[None], docs, spans


@pytest.mark.parametrize("method", list(METHODS) + ["offset"])
def test_self_control_equals_full_prefill(arch_model, method):
    """Blocks computed under their own prefix: any method reproduces full prefill.

    Planted bug that fails it: ``BlockReuseCache.prefix_for`` returns ``input_ids[0, :s - 1]`` for "own" (the
    block's prefix one token short): [llama-direct] fails on the tokens, [llama-offset] on the anchor check."""
    cls, none_kw, _ = METHODS.get(method, (OffsetCache, {}, None))
    ids, _, spans = rag_prompt()
    cache = cls(arch_model, ids, spans, block_prefix_ids="own", **none_kw)
    out = arch_model.generate(ids, cache=cache, return_dict_in_generate=True, output_logits=True, **GEN)
    ref = arch_model.generate(ids, return_dict_in_generate=True, output_logits=True, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logits[0], ref.logits[0], atol=1e-3, rtol=1e-3)
    in_blocks = sum(e - s for s, e in spans)
    assert cache.stats.recomputed_tokens == ids.shape[1] - 1 - in_blocks  # only the rows outside blocks


@pytest.mark.parametrize("method", [m for m in METHODS if METHODS[m][2] is not None])
def test_full_recompute_equals_full_prefill(arch_model, method):
    """Repairing everything is full prefill (tokens and first logits).

    Planted bug that fails it ([llama-tail]): ``EdgeRecomputeCache.extra_rows`` caps each block's rows at
    ``e - s - 1`` (one reused row per block is never recomputed)."""
    cls, _, all_kw = METHODS[method]
    ids, _, spans = rag_prompt(1)
    cache = cls(arch_model, ids, spans, **all_kw)
    out = arch_model.generate(ids, cache=cache, return_dict_in_generate=True, output_logits=True, **GEN)
    ref = arch_model.generate(ids, return_dict_in_generate=True, output_logits=True, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logits[0], ref.logits[0], atol=1e-3, rtol=1e-3)
    assert cache.stats.reused_tokens == 0


@pytest.mark.parametrize("method", [m for m in METHODS if m != "direct"])
def test_zero_recompute_equals_direct_reuse(arch_model, method):
    """Repairing nothing is direct reuse (tokens and every K/V).

    Planted bug that fails it: ``EdgeRecomputeCache.extra_rows`` recomputes one row even for ``recompute_tokens=0``
    (``n = max(1, ...)``)."""
    cls, none_kw, _ = METHODS[method]
    ids, _, spans = rag_prompt(2)
    store = ChunkStore()
    direct = DirectReuseCache(arch_model, ids, spans, store=store)
    cache = cls(arch_model, ids, spans, store=store, **none_kw)
    out_d = arch_model.generate(ids, cache=direct, **GEN)
    out = arch_model.generate(ids, cache=cache, **GEN)
    assert torch.equal(out, out_d)
    # every reused row keeps direct reuse's K/V (CacheBlend's rows outside blocks saw fresh K/V in its first
    # layers, so only the block rows are compared for it)
    rows = torch.cat([torch.arange(s, e) for s, e in spans])
    for (k, v), (dk, dv) in zip(kv_of(cache), kv_of(direct)):
        torch.testing.assert_close(k[..., rows, :], dk[..., rows, :], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[..., rows, :], dv[..., rows, :], atol=1e-5, rtol=1e-5)
    assert cache.stats.reused_tokens == direct.stats.reused_tokens == sum(e - s for s, e in spans)


@pytest.mark.parametrize("method", ["direct", "tail", "epic", "blend", "offset"])
def test_fused_first_step_equals_two_forwards(arch_model, method):
    """``fuse_first_step`` (the default) for the methods whose recompute is one forward over their rows (direct,
    Tail-k, EPIC): the first logits, tokens and K/V equal the two-forward path's (``fuse_first_step=False``), which
    is not full prefill here (blocks computed standalone, so a wrong row or position shows). Blend and offset
    compute their rows their own way and never fuse.

    Planted bugs that fail it: ``PendingRows`` appends the row ``n - 2`` instead of the last prompt token's
    ``n - 1``; ``BlockReuseCache.prepare`` fuses ``rows_to_compute`` without ``extra_rows`` (``fresh`` only), so EPIC
    and Tail-k lose their repaired rows."""
    ids, _, spans = rag_prompt(7)
    cls, kw = (OffsetCache, {"block_prefix_ids": "own"}) if method == "offset" else (METHODS[method][0], {})
    if method in ("tail", "epic"):
        kw = {"recompute_tokens": 3}
    if method == "blend":
        kw = {"recompute_ratio": 0.3}
    runs = {}
    for fuse in (True, False):
        extra = {} if method in ("blend", "offset") else {"fuse_first_step": fuse}
        cache = cls(arch_model, ids, spans, store=ChunkStore(), **kw, **extra)
        out = arch_model.generate(ids, cache=cache, return_dict_in_generate=True, output_logits=True, **GEN)
        runs[fuse] = cache, out
    (fc, fo), (uc, uo) = runs[True], runs[False]
    fusing = method in ("direct", "tail", "epic")
    assert fc.stats.fused_first_step == fusing and not uc.stats.fused_first_step
    assert_same_generation(runs[True], runs[False])
    if fusing:
        _, full_logits = exact_prefill(arch_model, ids)
        assert not torch.allclose(fo.logits[0][0], full_logits[0, -1], atol=1e-3)



@pytest.mark.parametrize("method", ["direct", "epic"])
def test_fused_first_step_frees_its_pending_rows_without_the_garbage_collector(llama, method, pending_runs):
    """After the fused first forward, nothing holds the pending rows (and with them the prompt-length K/V storage
    that the next decode step replaces): they are freed by reference counting, not left for the cyclic garbage
    collector (one prompt-length K/V copy more at peak, measured as ~40 MiB at 1k tokens on SmolLM2 before the fix).

    Planted bug that fails it: ``PendingRows`` stores its bound ``compute`` method as an attribute (the reference
    cycle that ``PendingForward``'s stored ``_compute`` held before 2026-12-04)."""
    ids, _, spans = rag_prompt(3)
    kw = {"recompute_tokens": 3} if method == "epic" else {}
    cache = METHODS[method][0](llama, ids, spans, store=ChunkStore(), **kw)
    llama.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert cache.stats.fused_first_step and len(pending_runs) == 1
    assert pending_runs[0]() is None, "the pending rows outlived the fused forward (a reference cycle)"


def test_direct_reuse_is_not_exact_but_blend_repairs(llama):
    """Standalone blocks change the output; the reused rows' K/V above layer 0 differ from full prefill.

    Planted bug that fails it: ``BlockReuseCache.assemble_blocks`` places block keys without the RoPE shift
    (layer-0 keys then differ from full prefill)."""
    ids, _, spans = rag_prompt(3)
    ref_cache, _ = exact_prefill(llama, ids[:, :-1])
    direct = DirectReuseCache(llama, ids, spans)
    llama.generate(ids, cache=direct, max_new_tokens=1, do_sample=False)
    k_direct = kv_of(direct)[1][0][..., : ids.shape[1] - 1, :]
    k_ref = kv_of(ref_cache)[1][0]
    assert (k_direct - k_ref).abs().max() > 1e-2
    # layer 0 K/V are context-free: re-positioned standalone blocks equal full prefill there
    torch.testing.assert_close(kv_of(direct)[0][0][..., : ids.shape[1] - 1, :], kv_of(ref_cache)[0][0],
                               atol=1e-5, rtol=1e-5)
    blend = BlendCache(llama, ids, spans, recompute_ratio=0.5)
    llama.generate(ids, cache=blend, max_new_tokens=1, do_sample=False)
    n_reused = sum(e - s for s, e in spans)
    assert blend.selected_rows.numel() == int(n_reused * 0.5)
    err_blend = (kv_of(blend)[1][0][..., : ids.shape[1] - 1, :] - k_ref).norm()
    assert err_blend < (k_direct - k_ref).norm()


def test_shuffled_block_order_and_store_reuse(llama):
    """Blocks given as ids in any order are located, stored once and reused from the store under another prompt;
    blocks given by span reuse them with the same tokens.

    Planted bug that fails it: ``find_blocks`` records each span one token short (``(s, s + n - 1)``)."""
    ids, docs, spans = rag_prompt(4)
    store = ChunkStore()
    by_ids = DirectReuseCache(llama, ids, [docs[2], docs[0], docs[1]], store=store)  # any order, located by ids
    assert by_ids.blocks == spans
    out1 = llama.generate(ids, cache=by_ids, **GEN)
    assert store.misses == 3 and len(store) == 3
    # the same documents in another order under another system prompt: every block comes from the store
    sep = torch.tensor([5, 6])
    ids2 = torch.cat([torch.tensor([9, 9, 9]), docs[1], sep, docs[2], sep, docs[0], torch.tensor([7, 7, 7, 7])])[None]
    cache2 = EPICCache(llama, ids2, docs, store=store, recompute_tokens=4)
    llama.generate(ids2, cache=cache2, **GEN)
    assert cache2.stats.store_hits == 3 and cache2.stats.store_misses == 0
    assert cache2.stats.recomputed_tokens == (ids2.shape[1] - 1) - 3 * (20 - 4)
    by_span = DirectReuseCache(llama, ids, spans, store=store)
    assert torch.equal(llama.generate(ids, cache=by_span, **GEN), out1)


def test_block_errors(llama):
    ids, docs, spans = rag_prompt(5)
    with pytest.raises(ValueError, match="not found"):
        DirectReuseCache(llama, ids, [torch.tensor([1, 2, 3, 4, 5, 6, 7])])
    with pytest.raises(ValueError, match="overlap"):
        DirectReuseCache(llama, ids, [(6, 20), (10, 30)])
    with pytest.raises(ValueError, match="recompute_ratio"):
        BlendCache(llama, ids, spans, recompute_ratio=1.5)
    cache = DirectReuseCache(llama, ids, spans)
    with pytest.raises(ValueError, match="different input_ids"):
        llama.generate(ids[:, 1:], cache=cache, **GEN)


def test_chunk_store_lru_budget_and_keys(llama):
    """LRU eviction under the byte budget; prefix and model are part of the key; a chunk computed under a prefix
    has the K/V of a plain prefill there.

    Planted bug that fails it: ``ChunkStore.key`` ignores ``prefix_ids`` (a prefixed lookup returns the standalone
    chunk)."""
    ids = torch.randint(3, 128, (1, 30))
    store = ChunkStore()
    c = store.get_or_compute(llama, ids[0, :10])
    store.max_bytes = int(c.nbytes * 2.5)
    store.get_or_compute(llama, ids[0, 10:20])
    store.get(llama, ids[0, :10])                    # touch: most recently used
    store.get_or_compute(llama, ids[0, 20:30])       # evicts the least recently used (10:20)
    assert store.evictions == 1 and len(store) == 2
    assert store.get(llama, ids[0, 10:20]) is None and store.get(llama, ids[0, :10]) is not None
    # the prefix and the producing model are part of the key
    assert store.get(llama, ids[0, :10], prefix_ids=ids[0, :3]) is None
    other = tiny_model("llama", seed=1)
    assert store.get(other, ids[0, :10]) is None
    with_prefix = store.get_or_compute(llama, ids[0, 3:10], prefix_ids=ids[0, :3])
    assert with_prefix.start == 3
    full, _ = exact_prefill(llama, ids[:, :10])
    torch.testing.assert_close(with_prefix.kv[1][0], kv_of(full)[1][0][..., 3:10, :], atol=1e-5, rtol=1e-5)
    assert isinstance(with_prefix, KVChunk)


def test_offset_cache(llama):
    """Layer 0 untouched; above it each block row moves by one per-block offset (values, RoPE-free keys).

    Planted bug that fails it: ``OffsetCache._apply_offset`` un-rotates block keys by ``+pos`` instead of
    ``-pos`` (``cs_blk = sh.cos_sin(pos, dev)``). (Also applying the offset at layer 0 does not fail it: the
    anchor's layer-0 K/V are context-free, so that offset is zero.)"""
    ids, docs, spans = rag_prompt(6)
    with pytest.raises(ValueError, match="prefix"):
        OffsetCache(llama, ids, spans)
    with pytest.raises(ValueError, match="anchor token"):  # the prefix must end with the token before each block
        llama.generate(ids, cache=OffsetCache(llama, ids, spans, block_prefix_ids=torch.tensor([11, 12])), **GEN)
    prefixes = [torch.cat([torch.tensor([11, 12, 13, 14]), ids[0, s - 1: s]]) for s, _ in spans]
    store = ChunkStore()
    direct = DirectReuseCache(llama, ids, spans, store=store, block_prefix_ids=prefixes)
    offset = OffsetCache(llama, ids, spans, store=store, block_prefix_ids=prefixes)
    llama.generate(ids, cache=direct, max_new_tokens=1, do_sample=False)
    llama.generate(ids, cache=offset, max_new_tokens=1, do_sample=False)
    assert offset.stats.store_hits == 3 and offset.stats.reused_tokens == direct.stats.reused_tokens
    n = ids.shape[1] - 1
    kd, ko = kv_of(direct), kv_of(offset)
    # layer 0 untouched; above it, every block row moved by the same (per-block) value offset
    torch.testing.assert_close(ko[0][0][..., :n, :], kd[0][0][..., :n, :], atol=1e-5, rtol=1e-5)
    from hf_kvreuse.rope import RopeShifter

    sh = RopeShifter(llama)
    for s, e in spans:
        dv = ko[1][1][..., s:e, :] - kd[1][1][..., s:e, :]
        assert dv.abs().max() > 1e-3
        torch.testing.assert_close(dv, dv[..., :1, :].expand_as(dv), atol=1e-5, rtol=1e-5)
        # keys: constant offset in RoPE-free space (un-rotate each row by its own position)
        unrot = -torch.arange(s, e)
        dk = sh.shift(ko[1][0][..., s:e, :], unrot) - sh.shift(kd[1][0][..., s:e, :], unrot)
        assert dk.abs().max() > 1e-3
        torch.testing.assert_close(dk, dk[..., :1, :].expand_as(dk), atol=1e-4, rtol=1e-4)


def test_spans_as_lists_and_bad_blocks(llama):
    ids, docs, spans = rag_prompt(7)
    assert DirectReuseCache(llama, ids, [list(sp) for sp in spans]).blocks == spans
    with pytest.raises(TypeError, match="spans"):
        DirectReuseCache(llama, ids, [spans[0], docs[1]])


def test_offset_formula_with_a_nonzero_offset(llama):
    """Blocks computed under another prefix (same anchor token): above layer 0 the first block's K/V are exactly
    ``source block + (target anchor - source anchor)`` in RoPE-free space, with every term taken here from plain
    prefills (the self-control has a zero offset by construction, so it cannot test this).

    Planted bug that fails it: ``OffsetCache._apply_offset`` reads the target anchor at row ``s`` instead of
    ``s - 1``."""
    from hf_kvreuse.rope import RopeShifter

    ids, _, spans = rag_prompt(8)
    (s, e) = spans[0]
    prefixes = [torch.cat([torch.tensor([11, 12, 13, 14, 15]), ids[0, b - 1: b]]) for b, _ in spans]
    prefix = prefixes[0]
    cache = OffsetCache(llama, ids, spans, block_prefix_ids=prefixes)
    llama.generate(ids, cache=cache, max_new_tokens=1, do_sample=False)
    p = prefix.shape[0]
    src, _ = exact_prefill(llama, torch.cat([prefix, ids[0, s:e]])[None])   # the block after the other prefix
    tgt, _ = exact_prefill(llama, ids[:, :s])                                 # the target anchor in this prompt
    sh = RopeShifter(llama)
    got = kv_of(cache)
    for layer in (1, len(got) - 1):
        (sk, sv), (tk, tv) = kv_of(src)[layer], kv_of(tgt)[layer]
        want_v = tv[..., s - 1: s, :] + sv[..., p:, :] - sv[..., p - 1: p, :]
        torch.testing.assert_close(got[layer][1][..., s:e, :], want_v, atol=1e-5, rtol=1e-5)
        free = lambda k, start: sh.shift(k, -torch.arange(start, start + k.shape[-2]))  # noqa: E731
        want_k = free(tk[..., s - 1: s, :], s - 1) + free(sk[..., p:, :], p) - free(sk[..., p - 1: p, :], p - 1)
        want_k = sh.shift(want_k, torch.arange(s, e))
        torch.testing.assert_close(got[layer][0][..., s:e, :], want_k, atol=1e-4, rtol=1e-4)
        assert (want_v - sv[..., p:, :]).abs().max() > 1e-3  # the offset is not zero
