"""Question-aware selection of TranslatedCache (issue 24): the attention probe, QuestionAttentionScorer,
QuestionWordScorer, on a tiny random-init pair. Planted bugs: docs/MUTATIONS.md."""

import pytest
import torch

from hf_kvreuse import KVMapper, RandomScorer, TranslatedCache, enable
from hf_kvreuse.focus import mention_rows, token_texts
from hf_kvreuse.kv import kv_of
from hf_kvreuse.models import tiny_model
from hf_kvreuse.generation.selected import wrapped_attention
from hf_kvreuse.translation.question import QuestionAttentionScorer, QuestionWordScorer, attention_probe
from hf_kvreuse.translation.scorers import Scorer

from conftest import WordTokenizer, exact_prefill


@pytest.fixture(scope="module")
def pair():
    src = tiny_model("qwen2", seed=1, num_hidden_layers=3, hidden_size=48, num_attention_heads=3,
                     num_key_value_heads=1, intermediate_size=96)
    tgt = enable(tiny_model("qwen2", seed=2, num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128))
    g = torch.Generator().manual_seed(0)
    mapper = KVMapper.fit(src, tgt, [torch.randint(10, 128, (48,), generator=g) for _ in range(16)], stride=1,
                          progress=False)
    return src, tgt, mapper


def _prompt(n=60, seed=5):
    return torch.randint(10, 128, (1, n), generator=torch.Generator().manual_seed(seed))


class Fixed(Scorer):
    """Scores that pick exactly ``rows`` first (to rebuild another scorer's selection)."""

    def __init__(self, rows, n):
        self.s = torch.zeros(n)
        self.s[rows] = 1.0

    def scores(self, cache, kv):
        return self.s


def test_attention_probe_sums_the_models_own_attention(pair):
    """The probe's per-layer weights are the eager attention of the observed rows summed over heads, as the
    model's own forward with output_attentions gives it; the attention implementation is restored. Planted bug:
    the probe sums over the query rows instead of the heads (`dim=(0, 2)`) -> shapes / values differ."""
    from hf_kvreuse.generation.partial import partial_forward

    _, tgt, _ = pair
    ids = _prompt(30)
    cache, _ = exact_prefill(tgt, ids)
    kv = [(k.clone(), v.clone()) for k, v in kv_of(cache)]
    saved = tgt.config._attn_implementation
    tgt.config._attn_implementation = "eager"
    try:
        ref = tgt(ids, output_attentions=True).attentions
    finally:
        tgt.config._attn_implementation = saved
    rows = torch.arange(24, 30)
    with attention_probe(tgt) as sink:
        partial_forward(tgt, ids, rows, kv, layers=range(len(kv)))
    assert tgt.config._attn_implementation == saved
    assert len(sink) == len(kv)
    for got, a in zip(sink, ref):
        torch.testing.assert_close(got, a[0, :, 24:30, :].sum(dim=0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: QuestionAttentionScorer(share=0.5, window=12),
                                  lambda: QuestionWordScorer(WordTokenizer(), share=0.5, min_chars=1, min_words=1)],
                         ids=["attention", "words"])
def test_question_scorer_leaves_no_trace_but_its_selection(pair, make):
    """A question scorer only chooses rows: the cache it assembles equals one that recomputes the same rows with a
    fixed scorer (same exact layers), at most half of the free budget is chosen by the question, never a forced
    row, and the model's attention implementation is restored. Planted bug: the probe observes rows before the
    question (`window` not clipped to `suffix_tokens`) -> those rows keep the probe's K/V and the caches differ."""
    src, tgt, mapper = pair
    ids = _prompt()
    n = ids.shape[1] - 1
    saved = tgt.config._attn_implementation
    sc = make()
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.4, selector=sc, suffix_tokens=8, sink_tokens=2)
    out = tgt.generate(ids, cache=c, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                       output_logits=True)
    assert tgt.config._attn_implementation == saved
    free = round(0.4 * n) - 10
    assert 0 < sc.chosen.numel() <= round(0.5 * free)
    assert set(sc.chosen.tolist()) <= set(c.selected_rows.tolist())
    assert all(2 <= r < n - 8 for r in sc.chosen.tolist())
    assert c.stats.exact_layers == 2 and c.stats.recomputed_tokens == round(0.4 * n)
    ref = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.4, selector=Fixed(c.selected_rows, n),
                          suffix_tokens=8, sink_tokens=2, prefix_layers=2)
    out_ref = tgt.generate(ids, cache=ref, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                           output_logits=True)
    assert torch.equal(ref.selected_rows, c.selected_rows)
    for (k, v), (rk, rv) in zip(kv_of(c), kv_of(ref)):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(out_ref.logits), atol=1e-5, rtol=1e-5)


def test_question_attention_picks_the_rows_the_question_attends_to(pair, monkeypatch):
    """The attention scorer's chosen rows are the context rows the question rows attend to more than the rows just
    before them (pool=1: no neighbours), never a forced row, none without a positive contrast. Planted bugs: rows
    of no mass kept (the `top.values > 0` filter dropped) -> the budget is filled with arbitrary rows; the
    reference rows not subtracted -> row 11, which every row reads, is chosen."""
    from hf_kvreuse.translation import question

    src, tgt, mapper = pair
    ids = _prompt()
    n = ids.shape[1] - 1
    planted = torch.zeros(16, n)  # 8 reference rows, then the 8 question rows
    planted[:, [0, 1]] = 50.0  # sinks: forced, never chosen
    planted[:, 11] = 6.0       # read by every row: cancels
    planted[8:, [7, 19, 33]] = torch.tensor([3.0, 5.0, 4.0])
    monkeypatch.setattr(question, "attention_probe", _fake_probe(planted, len(tgt.model.layers)))
    sc = QuestionAttentionScorer(base=RandomScorer(0), share=1.0, pool=1)
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector=sc, suffix_tokens=8, sink_tokens=2)
    tgt.generate(ids, cache=c, max_new_tokens=1)
    assert sc.chosen.tolist() == [19, 33, 7]
    assert {19, 33, 7} <= set(c.selected_rows.tolist())


def _fake_probe(weights, layers):
    import contextlib

    @contextlib.contextmanager
    def probe(model):
        sink = []
        yield sink
        sink.extend(weights.clone() for _ in range(layers))

    return probe


def test_question_words_choose_the_mentions_rarer_words_first():
    """Mentions of a question word, with `before` / `after` tokens around each, rarer words first; special tokens
    and short words never count. Planted bug: `before` ignored (`max(0, first - before)` -> `first`) -> the rows
    before a mention are missing."""
    tok = WordTokenizer()
    #        0   1   2   3   4   5   6   7   8   9
    ids = [11, 12, 13, 14, 15, 16, 13, 17, 18, 19]
    texts = token_texts(tok, ids)
    assert mention_rows(texts, {"w13", "w18"}, budget=10, window=0, before=1, ordered=True).tolist() == [7, 8, 1, 2,
                                                                                                          5, 6]
    assert mention_rows(texts, {"w13"}, budget=3, window=1, before=0).tolist() == [2, 3, 6]
    assert mention_rows(texts, set(), budget=3).numel() == 0


def test_question_words_rank_regions_by_their_rarer_question_words():
    """A row's priority sums 1 / count over the distinct question words within reach: one rare word outranks a
    common word mentioned three times; rows out of reach get nothing; the question itself is not context. Planted
    bug: every mention counted with weight 1 (no distinct-word OR, no 1 / count) -> the repeated word wins."""
    tok = WordTokenizer()
    ids = torch.tensor([[11, 12, 13, 21, 14, 21, 15, 21, 16, 17, 18, 19, 23, 24, 25, 26, 27, 28, 29, 31, 32, 33, 34,
                         22, 35, 36, 37, 38, 39, 41, 42, 43, 44, 45, 46, 47, 48, 49, 51, 52, 53, 54, 55, 56,
                         21, 22, 57, 58]])  # question: the last covered rows 44-46 (w21 w22 w57) and w58

    class Cache:
        input_ids, suffix_tokens = ids, 3

    n = ids.shape[1] - 1
    sc = QuestionWordScorer(tok, before=1, after=1, min_chars=1, min_words=1)
    pri = sc.priority(Cache, None, n, torch.zeros(n, dtype=torch.bool))
    assert pri[22:25].tolist() == [1.0, 1.0, 1.0]          # w22 (once in the context) at 23, reach 1
    assert pri[2:9].tolist() == pytest.approx([1 / 3] * 7)  # w21 three times at 3, 5, 7: once per row
    assert pri[44:].abs().sum() == 0 and pri[10:21].abs().sum() == 0
    # two distinct question words needed: only rows within reach of both w21 and w22 (none here) would score
    sc2 = QuestionWordScorer(tok, before=1, after=1, min_chars=1, min_words=2)
    assert sc2.priority(Cache, None, n, torch.zeros(n, dtype=torch.bool)).abs().sum() == 0
    far = ids.clone()
    far[0, 9] = 22  # w22 now also at 9: rows 8-9 are within reach of w21 (at 7) and w22
    Cache.input_ids = far
    pri2 = sc2.priority(Cache, None, n, torch.zeros(n, dtype=torch.bool))
    assert torch.nonzero(pri2).flatten().tolist() == [8] and float(pri2[8]) == pytest.approx(1 / 3 + 1 / 2)


def test_question_scorer_without_a_find_leaves_the_base_selection(pair):
    """No question word reaches the context: the base scorer alone chooses (the same rows as the base scorer on its
    own). Planted bug: the guard for an empty find dropped -> max() of an empty tensor raises."""
    src, tgt, mapper = pair
    ids = _prompt()
    sc = QuestionWordScorer(WordTokenizer(), base=RandomScorer(4), share=1.0, min_chars=1, min_words=99)
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.4, selector=sc, suffix_tokens=8)
    tgt.generate(ids, cache=c, max_new_tokens=1)
    ref = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.4, selector=RandomScorer(4), suffix_tokens=8)
    tgt.generate(ids, cache=ref, max_new_tokens=1)
    assert sc.chosen.numel() == 0 and torch.equal(c.selected_rows, ref.selected_rows)


def test_question_words_ignore_the_chat_templates_own_words():
    """Words of the tokenizer's chat template (role names, a default system prompt) are not question words: the
    question's trailing template ("<|im_start|>assistant") would otherwise point at the prompt's head ("You are a
    helpful assistant"). Planted bug: the template's words not removed -> row 5 (w41) scores."""

    class ChatTokenizer(WordTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
            return [41, 42]

    ids = torch.tensor([[11, 12, 13, 14, 15, 41, 16, 17, 18, 19, 21, 23, 24, 25, 26, 27, 28, 29, 31, 32, 33, 34, 35,
                         22, 36, 37, 38, 39, 43, 44, 22, 41, 45]])

    class Cache:
        input_ids, suffix_tokens = ids, 3

    n = ids.shape[1] - 1
    sc = QuestionWordScorer(ChatTokenizer(), before=1, after=1, min_chars=1, min_words=1)
    pri = sc.priority(Cache, None, n, torch.zeros(n, dtype=torch.bool))
    assert torch.nonzero(pri).flatten().tolist() == [22, 23, 24]


def test_question_words_by_name_needs_the_tokenizer(pair):
    """selector="question-words" is refused at construction without tokenizer=, and with it builds the scorer; a
    tokenizer too small for the prompt's ids is refused. Planted bug: the size check removed -> no error."""
    src, tgt, mapper = pair
    ids = _prompt()
    with pytest.raises(ValueError, match="tokenizer"):
        TranslatedCache(tgt, src, mapper, ids, selector="question-words")
    c = TranslatedCache(tgt, src, mapper, ids, selector="question-words", tokenizer=WordTokenizer())
    assert isinstance(c.scorer, QuestionWordScorer) and c.stats.selector == "question-words"
    assert isinstance(TranslatedCache(tgt, src, mapper, ids, selector="question-attention").scorer,
                      QuestionAttentionScorer)

    class Small(WordTokenizer):
        def __len__(self):
            return 50

    with pytest.raises(ValueError, match="outside the tokenizer"):  # another tokenizer than the pair's
        TranslatedCache(tgt, src, mapper, ids, tokenizer=Small())


def test_auto_falls_back_to_question_words_with_a_tokenizer(pair):
    """selector="auto" (the default) is source attention, with or without a tokenizer; given a source cache without
    the hidden states source attention reads, it falls back to question-words with tokenizer=, first-layer without.
    Planted bug: the fallback always first-layer -> fails."""
    from transformers import DynamicCache

    from hf_kvreuse import FirstLayerDeviationScorer
    from hf_kvreuse.translation.source_attention import SourceAttentionScorer

    src, tgt, mapper = pair
    ids = _prompt()
    assert isinstance(TranslatedCache(tgt, src, mapper, ids).scorer, SourceAttentionScorer)
    assert isinstance(TranslatedCache(tgt, src, mapper, ids, tokenizer=WordTokenizer()).scorer, SourceAttentionScorer)
    sc = DynamicCache(config=src.config)
    src(input_ids=ids[:, :-1], past_key_values=sc, use_cache=True)
    c = TranslatedCache(tgt, src, mapper, ids, source_cache=sc, tokenizer=WordTokenizer())
    assert isinstance(c.scorer, QuestionWordScorer) and c.scorer.share == 1.0
    assert "question-words" in c.stats.selector_note
    c = TranslatedCache(tgt, src, mapper, ids, source_cache=sc)
    assert isinstance(c.scorer, FirstLayerDeviationScorer)


def test_attention_probe_is_invisible_to_another_threads_generate(pair):
    """While a probe is open in one thread, another thread's plain ``generate`` on the same model returns the same
    tokens and logits as alone. Planted bug: the probe switches ``config._attn_implementation`` to the eager
    probe function (the model-wide switch): the other thread's sdpa mask (None) is read by eager as "no mask", it
    attends to future tokens and its logits differ."""
    import threading

    _, tgt, _ = pair
    ids = _prompt(24, seed=9)
    kw = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
              eos_token_id=None, pad_token_id=0)
    alone = tgt.generate(ids, **kw)
    got, started, go = {}, threading.Event(), threading.Event()

    def pause(module, args):  # the other thread's prefill has built its mask; the probe opens now
        if not started.is_set():
            started.set()
            go.wait(30)

    hook = tgt.model.layers[0].register_forward_pre_hook(pause)
    try:
        t = threading.Thread(target=lambda: got.update(out=tgt.generate(ids, **kw)))
        t.start()
        assert started.wait(30)
        with attention_probe(tgt):
            go.set()
            t.join()
    finally:
        go.set()
        hook.remove()
    assert torch.equal(got["out"].sequences, alone.sequences)
    for a, b in zip(got["out"].scores, alone.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_probes_exiting_out_of_order_leave_the_model_unchanged(pair):
    """Two probes (two threads' scorers) that exit in the other order than they entered leave the model's attention
    implementation and config as they were, and no observer that keeps collecting. Planted bugs: each probe saves and
    restores the implementation it found (no reference count): the model stays on the probe's implementation for
    good; the observer is not closed at exit: the first probe's observer, which the context variable's reset order
    leaves in place, appends every later forward's attention weights (memory grows with every call)."""
    _, tgt, _ = pair
    saved = tgt.config._attn_implementation
    first, second = attention_probe(tgt), attention_probe(tgt)
    sink_a = first.__enter__()
    sink_b = second.__enter__()
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert tgt.config._attn_implementation == saved
    n_a, n_b = len(sink_a), len(sink_b)
    with wrapped_attention(tgt):  # even through the library's wrapper, nothing is observed any more
        tgt(torch.randint(3, 100, (1, 6)))
    assert (len(sink_a), len(sink_b)) == (n_a, n_b)
