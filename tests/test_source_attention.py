"""Source-attention selection of TranslatedCache (the source model's own attention from the prompt's last rows)
on a tiny random-init pair. Planted bugs: docs/MUTATIONS.md."""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_kvreuse import KVMapper, TranslatedCache, enable
from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.kv import kv_of
from hf_kvreuse.models import tiny_model
from hf_kvreuse.rope import RopeShifter
from hf_kvreuse.translation import source_attention as sa
from hf_kvreuse.translation.mapper import run_source
from hf_kvreuse.translation.selection import make_scorer
from hf_kvreuse.translation.source_attention import (DEPTH, SourceAttentionScorer, depth_layers, row_attention,
                                                     source_queries)

SRC_KW = dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
              intermediate_size=96)


@pytest.fixture(scope="module")
def pair():
    src = tiny_model("qwen2", seed=1, **SRC_KW)
    tgt = enable(tiny_model("qwen2", seed=2, num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128))
    g = torch.Generator().manual_seed(0)
    mapper = KVMapper.fit(src, tgt, [torch.randint(10, 128, (48,), generator=g) for _ in range(16)], stride=1,
                          progress=False)
    return src, tgt, mapper


def _prompt(n=50, seed=5):
    return torch.randint(10, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _eager_weights(ids, w):
    """The source model's own attention weights of the last ``w`` rows, per layer ``[H, w, T]`` (eager run)."""
    eager = tiny_model("qwen2", seed=1, attn_implementation="eager", **SRC_KW)
    out = eager(input_ids=ids, output_attentions=True)
    return [a[0, :, -w:] for a in out.attentions]


@torch.no_grad()
def test_rebuilt_queries_reproduce_the_models_own_attention(pair):
    """The last rows' attention rebuilt from the captured hidden states and the cached keys equals the eager
    attention weights of the model's own forward, on every layer. Planted bugs that fail it: no RoPE on the
    rebuilt queries; RoPE at positions 0..w-1 instead of the rows' own; the causal mask off by one."""
    src, _, _ = pair
    ids = _prompt()
    n, w = ids.shape[1], 7
    cache = DynamicCache(config=src.config)
    hidden = run_source(src, ids, cache, range(src.config.num_hidden_layers))
    kv = kv_of(cache)
    shifter = RopeShifter(src)
    want = _eager_weights(ids, w)
    pos = torch.arange(n - w, n)
    for s in range(src.config.num_hidden_layers):
        q = source_queries(src, s, hidden[s][n - w:], pos, shifter)
        got = row_attention(q, kv[s][0][0], pos)
        torch.testing.assert_close(got, want[s].float(), atol=1e-5, rtol=1e-4)
    # rows inside the prompt (not only the last): the causal mask matters there
    pos = torch.arange(n - 2 * w, n - w)
    q = source_queries(src, 1, hidden[1][n - 2 * w: n - w], pos, shifter)
    eager = tiny_model("qwen2", seed=1, attn_implementation="eager", **SRC_KW)
    ref = eager(input_ids=ids, output_attentions=True).attentions[1][0, :, n - 2 * w: n - w]
    torch.testing.assert_close(row_attention(q, kv[1][0][0], pos), ref.float(), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_cache_scores_are_the_source_attention_and_ratio_one_is_full_prefill(pair):
    """In the cache, the scorer's priority is the source prefill's own attention from the suffix rows (averaged
    over rows and heads, summed over the chosen layers, max-pooled), the selection spends the free budget on its
    top rows, and ratio 1 still reproduces the target's full prefill. Planted bugs that fail it: the cache never
    calls observe_source (refused at scoring); hidden states of the wrong layer passed; the pooling dropped."""
    src, tgt, mapper = pair
    ids = _prompt(60)
    n = ids.shape[1] - 1
    sc = SourceAttentionScorer(layers=[0, 2], pool=3, window=None)  # window None: the marked suffix's rows
    cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector=sc, suffix_tokens=8)
    out = tgt.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 2
    ref_cache = DynamicCache(config=src.config)
    hidden = run_source(src, ids[:, :n], ref_cache, [0, 2])
    kv = kv_of(ref_cache)
    shifter = RopeShifter(src)
    pos = torch.arange(n - 8, n)
    acc = sum(row_attention(source_queries(src, s, hidden[s][n - 8:], pos, shifter), kv[s][0][0], pos)
              .mean(dim=(0, 1)) for s in (0, 2))
    acc = torch.nn.functional.max_pool1d(acc[None, None], 3, stride=1, padding=1)[0, 0]
    torch.testing.assert_close(sc._attn, acc, atol=1e-5, rtol=1e-4)
    forced, free = cache.forced_rows(n)
    pri = acc.clone()
    pri[forced] = 0
    top = set(torch.topk(pri, free).indices.tolist())
    assert top <= set(cache.selected_rows.tolist())
    # ratio 1: the target's full prefill, logits compared
    full = tgt.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    c1 = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=1.0, selector="source-attention")
    got = tgt.generate(ids, past_key_values=c1, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                       output_logits=True)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(full.logits), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_given_source_cache_needs_the_hidden_states_and_gives_the_same_selection(pair):
    """With the source's own cache, the hidden states of the scorer's layers are required (refused without, naming
    them), and given them the selection equals that of the cache's own source prefill. Planted bug that fails it:
    the given hidden states ignored (the scorer reads none: refused at scoring)."""
    src, tgt, mapper = pair
    ids = _prompt(44, seed=9)
    n = ids.shape[1] - 1
    sc_cache = DynamicCache(config=src.config)
    hidden = run_source(src, ids[:, :n], sc_cache, range(src.config.num_hidden_layers))
    with pytest.raises(ValueError, match="source-attention"):
        TranslatedCache(tgt, src, mapper, ids, selector="source-attention", source_cache=sc_cache)
    a = TranslatedCache(tgt, src, mapper, ids, selector="source-attention", source_cache=sc_cache,
                        source_hidden=hidden)
    tgt.generate(ids, past_key_values=a, max_new_tokens=1, do_sample=False)
    b = TranslatedCache(tgt, src, mapper, ids, selector="source-attention")
    tgt.generate(ids, past_key_values=b, max_new_tokens=1, do_sample=False)
    assert torch.equal(a.selected_rows, b.selected_rows)


def test_no_marked_question_still_gets_a_selection(pair):
    """suffix_tokens=0 (no question marked): the last 16 rows' attention still ranks the context (not the base
    scorer alone). Planted bug that fails it: window taken from suffix_tokens without the fallback."""
    src, tgt, mapper = pair
    ids = _prompt(60, seed=3)
    sc = SourceAttentionScorer(window=None)
    cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector=sc, suffix_tokens=0)
    tgt.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
    assert sc.chosen.numel() > 0 and float(sc._attn.sum()) > 0


def test_bad_arguments_are_refused(pair):
    src, tgt, mapper = pair
    with pytest.raises(ValueError, match="window"):
        SourceAttentionScorer(window=0)
    with pytest.raises(ValueError, match="pool"):
        SourceAttentionScorer(pool=4)
    with pytest.raises(ValueError, match="outside"):
        TranslatedCache(tgt, src, mapper, _prompt(), selector=SourceAttentionScorer(layers=[7]))
    assert make_scorer("source-attention", mapper).name == "source-attention"


@torch.no_grad()
def test_run_source_capture_is_local_to_its_context(pair):
    """run_source's hooks write only into the calling context's sink: a forward of the same model in another
    thread while they exist neither adds to nor replaces what this call captures. Planted bug that fails it: the
    hook writes unconditionally (the other thread's hidden states, of another prompt, land in this call's dict)."""
    src, _, _ = pair
    ids, other = _prompt(30, seed=1), _prompt(30, seed=2)
    ref = run_source(src, ids, DynamicCache(config=src.config), [1])[1]
    later = src.model.layers[2].input_layernorm  # runs after this call captured layer 1
    fired = threading.Event()

    def intruder(m, a):  # inside run_source's forward, another thread runs the model on another prompt
        if not fired.is_set():
            fired.set()
            t = threading.Thread(target=lambda: src(input_ids=other))
            t.start()
            t.join()

    h = later.register_forward_pre_hook(intruder)
    try:
        got = run_source(src, ids, DynamicCache(config=src.config), [1])[1]
    finally:
        h.remove()
    assert fired.is_set()
    torch.testing.assert_close(got, ref)


@given(st.integers(1, 128), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
@settings(max_examples=200, deadline=None)
def test_depth_band_layers(num_layers, a, b):
    """The default layers: non-empty, inside the model, contiguous, each at a depth within the band whenever any
    layer is; the calibrated band gives layers 15-20 of a 24-layer source (what was measured). Planted bug that
    fails it: the band read as layer indices of a 24-layer model (no scaling with depth)."""
    lo, hi = min(a, b), max(a, b)
    got = depth_layers(num_layers, (lo, hi))
    assert got and all(0 <= s < num_layers for s in got)
    assert list(got) == list(range(got[0], got[-1] + 1))
    if any(lo <= s / num_layers <= hi for s in range(num_layers)):
        assert all(lo <= s / num_layers <= hi for s in got)
    assert depth_layers(24) == tuple(range(15, 21)) and DEPTH == (0.6, 0.85)


@torch.no_grad()
def test_auto_is_the_last_rows_source_attention_over_the_depth_band(pair):
    """``selector="auto"`` scores with the source's last covered row over the depth-band layers (the measured
    winner) and spends the free budget on its top rows. Planted bugs that fail it: auto still question-words /
    first-layer; the default window the suffix rows; every layer summed instead of the band."""
    src, tgt, mapper = pair
    ids = _prompt(60, seed=11)
    n = ids.shape[1] - 1
    cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, suffix_tokens=8)
    assert isinstance(cache.scorer, SourceAttentionScorer) and cache.stats.selector == "source-attention"
    assert cache.stats.selector_note == ""
    tgt.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
    layers = depth_layers(src.config.num_hidden_layers)
    ref = DynamicCache(config=src.config)
    hidden = run_source(src, ids[:, :n], ref, layers)
    kv, shifter, pos = kv_of(ref), RopeShifter(src), torch.arange(n - 1, n)
    acc = sum(row_attention(source_queries(src, s, hidden[s][n - 1:], pos, shifter), kv[s][0][0], pos)
              .mean(dim=(0, 1)) for s in layers)
    acc = torch.nn.functional.max_pool1d(acc[None, None], 7, stride=1, padding=3)[0, 0]
    torch.testing.assert_close(cache.scorer._attn, acc, atol=1e-5, rtol=1e-4)
    forced, free = cache.forced_rows(n)
    pri = acc.clone()
    pri[forced] = 0
    assert set(torch.topk(pri, free).indices.tolist()) <= set(cache.selected_rows.tolist())


@torch.no_grad()
def test_auto_falls_back_and_says_why(pair, monkeypatch):
    """Given a source cache without the band's hidden states, auto falls back to first-layer deviation (no
    tokenizer) and names the missing layers in ``stats.selector_note``; with them it uses source attention; a
    source model whose queries it cannot rebuild is refused by name when the selector is named and makes auto
    fall back. Planted bugs that fail it: auto raises instead of falling back; the note left empty."""
    src, tgt, mapper = pair
    ids = _prompt(40, seed=2)
    n = ids.shape[1] - 1
    sc_cache = DynamicCache(config=src.config)
    hidden = run_source(src, ids[:, :n], sc_cache, range(src.config.num_hidden_layers))
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, source_cache=sc_cache)
    assert c.stats.selector == "first-layer" and "source_hidden" in c.stats.selector_note
    assert str(depth_layers(src.config.num_hidden_layers)[0]) in c.stats.selector_note
    tgt.generate(ids, past_key_values=c, max_new_tokens=1, do_sample=False)
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, source_cache=sc_cache, source_hidden=hidden)
    assert c.stats.selector == "source-attention" and c.stats.selector_note == ""
    fused = tiny_model("qwen2", seed=1, **SRC_KW)
    del fused.model.layers[depth_layers(3)[0]].self_attn.q_proj
    assert "q_proj" in sa.unsupported(fused, depth_layers(3)) and sa.unsupported(src, range(3)) == ""
    monkeypatch.setattr(sa, "unsupported", lambda model, layers: "layer 2 has no self_attn.q_proj")
    with pytest.raises(ValueError, match="Qwen2ForCausalLM.*q_proj"):
        TranslatedCache(tgt, src, mapper, ids, selector="source-attention")
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3)
    assert c.stats.selector == "first-layer" and "q_proj" in c.stats.selector_note
