"""TranslatedCache (RaReCache), KVMapper and the position scorers on tiny random-init pairs that differ in depth,
width, head count and head size and share a vocabulary. Planted bugs: docs/MUTATIONS.md."""

import copy
import json

import pytest
import torch

from hf_kvreuse import (FirstLayerDeviationScorer, KVMapper, MapperMismatchError, OracleScorer, RandomScorer,
                        RankDisagreementScorer, TranslatedCache, enable)
from hf_kvreuse.kv import kv_of
from hf_kvreuse.model_check import check_model
from hf_kvreuse.models import tiny_model
from hf_kvreuse.rope import RopeShifter
from hf_kvreuse.translation.mapper import MapperConfig, MapperStats, PairGeometry, content_features

# (source overrides, target overrides): deeper, wider, more heads, another head size
PAIRS = {
    "deeper-wider": (dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                          intermediate_size=96),
                     dict(num_hidden_layers=5, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                          intermediate_size=160)),
    "head-dim": (dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
                 dict(num_hidden_layers=6, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=192)),
}


def _calib(n=24, length=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (length,), generator=g) for _ in range(n)]


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request):
    src_kw, tgt_kw = PAIRS[request.param]
    src = tiny_model("qwen2", seed=1, **src_kw)
    tgt = enable(tiny_model("qwen2", seed=2, **tgt_kw))
    mapper = KVMapper.fit(src, tgt, _calib(), stride=1, progress=False)
    return src, tgt, mapper


@pytest.fixture(scope="module")
def copy_pair():
    """Source = an identical copy of the target (another object): the map must be the identity."""
    tgt = enable(tiny_model("llama", seed=3))
    src = copy.deepcopy(tgt)
    mapper = KVMapper.fit(src, tgt, _calib(40, 64), stride=1, ridge_lambda=1e-7, progress=False)
    return src, tgt, mapper


def _prompt(n=40, seed=5):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))  # 0 is the pad id


def _full(model, ids, new=6):
    return model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True)


def _logits(out):
    return torch.stack(out.logits)


@pytest.mark.parametrize("selector", ["rank", "random", "first-layer"])
def test_ratio_one_is_full_prefill(pair, selector):
    """Gate: recompute_ratio=1 is the target's full prefill (logits and tokens). Planted bug: `partial_forward`
    skipped in `prepare` (the mapped K/V kept) -> logits differ."""
    src, tgt, mapper = pair
    ids = _prompt()
    ref = _full(tgt, ids)
    cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=1.0, selector=selector)
    out = tgt.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                       output_logits=True)
    torch.testing.assert_close(_logits(out), _logits(ref), atol=1e-4, rtol=1e-4)
    assert torch.equal(out.sequences, ref.sequences)
    assert cache.stats.recomputed_tokens == ids.shape[1] - 1
    for (k, v), (rk, rv) in zip(kv_of(cache), kv_of(ref.past_key_values)):
        torch.testing.assert_close(k, rk[..., : k.shape[-2], :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, rv[..., : v.shape[-2], :], atol=1e-4, rtol=1e-4)


def test_identity_pair_translates_exactly(copy_pair):
    """A model translated to an identical copy of itself: ratio 0 (pure translation, nothing recomputed) gives the
    target's own K/V and logits. Exercises strip -> map -> re-apply end to end. Planted bug: the target RoPE
    re-applied at positions shifted by one (`positions + 1`) -> K mismatch and logits differ."""
    src, tgt, mapper = copy_pair
    assert float(mapper.fit_r2.min()) > 0.999
    ids = _prompt(50, 7)
    ref = _full(tgt, ids)
    cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.0)
    out = tgt.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                       output_logits=True)
    assert cache.stats.recomputed_tokens == 0
    for (k, v), (rk, rv) in zip(kv_of(cache), kv_of(ref.past_key_values)):
        torch.testing.assert_close(k[..., :49, :], rk[..., :49, :], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(v[..., :49, :], rv[..., :49, :], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(_logits(out), _logits(ref), atol=2e-2, rtol=2e-3)
    assert torch.equal(out.sequences, ref.sequences)


def test_rope_strip_and_reapply_match_the_models_own_rotary():
    """Layer-0 keys depend only on the token and its position, so the model's own forward gives the oracle:
    stripping keys computed at 0..T-1 must equal the keys the model computes with every position at 0, and
    re-applying at p+d must equal the model's keys at p+d. Planted bug: strip by `+positions` -> mismatch."""
    model = tiny_model("qwen2", seed=4)
    mc = check_model(model)
    sh = RopeShifter(model, layout=mc.rope_layout)
    ids = _prompt(20, 9)
    n = ids.shape[1]

    def layer0_keys(pos):
        from transformers import DynamicCache
        c = DynamicCache(config=model.config)
        model(input_ids=ids, position_ids=pos[None], use_cache=True, past_key_values=c)
        return kv_of(c)[0][0]

    k_at = layer0_keys(torch.arange(n))
    k_zero = layer0_keys(torch.zeros(n, dtype=torch.long))
    feats = content_features([(k_at, k_at)], sh, torch.arange(n))
    stripped = feats[0][0].reshape(n, mc.kv_heads, mc.head_dim).transpose(0, 1)[None]
    torch.testing.assert_close(stripped, k_zero, atol=1e-5, rtol=1e-5)
    k_moved = layer0_keys(torch.arange(n) + 11)
    torch.testing.assert_close(sh.shift(stripped, torch.arange(n) + 11), k_moved, atol=1e-5, rtol=1e-5)


def test_mapper_recovers_planted_linear_relation():
    """Synthetic moments: target layer t is an exact affine function of two chosen source layers. The fit must
    choose those layers (single-source R²) and recover W and b. Planted bug: the bias computed without the
    source mean (`b = my`) -> b mismatch."""
    g = PairGeometry(source_layers=4, source_heads=1, source_dim=4, target_layers=2, target_heads=2, target_dim=3)
    gen = torch.Generator().manual_seed(0)
    n = 4000
    x = torch.randn(n, 4 * 2 * 4, generator=gen) * 2 + 0.5
    truth = {0: [1, 3], 1: [0, 2]}
    ys, params = [], {}
    for t, srcs in truth.items():
        for kind in (0, 1):
            cols = torch.cat([torch.arange((2 * s + kind) * 4, (2 * s + kind + 1) * 4) for s in srcs])
            w = torch.randn(len(cols), 6, generator=gen)
            b = torch.randn(6, generator=gen)
            ys.append(x[:, cols] @ w + b)
            params[(t, kind)] = (w, b)
    y = torch.cat(ys, dim=1)
    stats = MapperStats(g)
    for chunk in range(0, n, 1000):  # streaming: moments add up
        stats.add(x[chunk:chunk + 1000], y[chunk:chunk + 1000])
    m = KVMapper.from_stats(stats, MapperConfig(top_k=2, ridge_lambda=1e-9))
    for t, srcs in truth.items():
        assert m.layers[t].sources == srcs
        for kind, name in ((0, "k"), (1, "v")):
            w, b = params[(t, kind)]
            torch.testing.assert_close(getattr(m.layers[t], f"w_{name}"), w, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(getattr(m.layers[t], f"b_{name}"), b, atol=1e-3, rtol=1e-3)
    assert float(m.fit_r2.min()) > 0.9999


def _weak_support_mapper():
    """One layer pair, one head of 6 dims; calibration inputs vary strongly in 2 directions and weakly in 4."""
    g = PairGeometry(1, 1, 6, 1, 1, 6)
    gen = torch.Generator().manual_seed(1)
    n = 3000
    scale = torch.tensor([3.0, 3.0, 0.03, 0.03, 0.03, 0.03])
    xk, xv = torch.randn(n, 6, generator=gen) * scale, torch.randn(n, 6, generator=gen) * scale
    a = torch.linalg.qr(torch.randn(6, 6, generator=gen))[0]
    stats = MapperStats(g)
    stats.add(torch.cat([xk, xv], 1), torch.cat([xk @ a, xv @ a], 1))
    return KVMapper.from_stats(stats, MapperConfig(top_k=1, ridge_lambda=1e-9)), a, scale


@pytest.mark.parametrize("variant", ["energy", "whitened"])
def test_rank_scorer_ranks_planted_poorly_supported_tokens_first(variant):
    """Tokens whose features leave the calibration subspace are exactly the ones a linear map extrapolates on;
    they must rank first. Planted bug: the weak basis taken from the *leading* directions (`vecs[..., :r]`) ->
    the planted tokens rank last."""
    mapper, a, scale = _weak_support_mapper()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(60, 6, generator=gen) * scale
    planted = torch.tensor([5, 17, 33, 48])
    x[planted, 2:] = torch.randn(len(planted), 4, generator=gen) * 3.0
    yk = x @ a
    scorer = RankDisagreementScorer(mapper, variant=variant)
    scorer.reset(60, torch.device("cpu"))
    scorer.observe(0, yk, yk)
    top = torch.topk(scorer.scores(None, None), len(planted)).indices.sort().values
    assert torch.equal(top, planted)
    # the svd reading: W = A is orthogonal here, so its spectrum carries no support information; it still runs
    svd = RankDisagreementScorer(mapper, basis="svd", energy=0.5)
    svd.reset(60, torch.device("cpu"))
    svd.observe(0, yk, yk)
    assert svd.scores(None, None).shape == (60,)


def test_oracle_and_first_layer_scorers(pair):
    """The oracle ranks positions whose translated K/V were corrupted first; the first-layer scorer leaves layers
    0..c exact for every row. Planted bug: OracleScorer compares against the mapped K/V itself -> all zero."""
    src, tgt, mapper = pair
    ids = _prompt()
    ref = _full(tgt, ids, 1)
    cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.0)
    tgt.generate(ids, cache=cache, max_new_tokens=1)
    kv = [(k[..., :39, :].clone(), v[..., :39, :].clone()) for k, v in kv_of(cache)]
    exact = [(rk[..., :39, :].clone(), rv[..., :39, :].clone()) for rk, rv in kv_of(ref.past_key_values)]
    bad = torch.tensor([3, 20, 31])
    for (k, v), (ek, ev) in zip(kv, exact):
        k.copy_(ek)
        v.copy_(ev)
        k[..., bad, :] += 5.0
    o = OracleScorer(exact)
    o.reset(39, torch.device("cpu"))
    assert torch.equal(torch.topk(o.scores(cache, kv), 3).indices.sort().values, bad)
    c2 = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector=FirstLayerDeviationScorer(check_layer=1))
    tgt.generate(ids, cache=c2, max_new_tokens=1)
    assert c2.stats.exact_layers == 2
    for (k, v), (rk, rv) in list(zip(kv_of(c2), kv_of(ref.past_key_values)))[:2]:
        torch.testing.assert_close(k[..., :39, :], rk[..., :39, :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v[..., :39, :], rv[..., :39, :], atol=1e-4, rtol=1e-4)


def test_selection_budget_sinks_and_suffix(pair):
    """The budget is round(ratio * T) rows, always including the sinks and the suffix; ratio 0 recomputes
    nothing. Recomputed rows hold the target's own K/V at layer 0 (their inputs there are exact)."""
    src, tgt, mapper = pair
    ids = _prompt(61, 3)
    for ratio in (0.0, 0.25, 0.5):
        cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=ratio, sink_tokens=3, suffix_tokens=5,
                                selector=RandomScorer(1))
        tgt.generate(ids, cache=cache, max_new_tokens=2)
        rows = cache.selected_rows.tolist()
        assert cache.stats.recomputed_tokens == len(rows) == round(ratio * 60)
        if ratio:
            assert {0, 1, 2, 55, 56, 57, 58, 59} <= set(rows) and cache.stats.forced_tokens == 8


def test_returned_cache_continues_the_conversation(pair):
    """After generate the cache is a plain target cache over its (translated) K/V: a second turn on it equals
    transformers' own continuation from a DynamicCache holding the same K/V, and at ratio 1 plain generate over
    the whole history. Planted bug: `end_generate` records the tokens shifted by one -> the continuation
    recomputes the history instead of reading the translated K/V -> logits differ."""
    from transformers import DynamicCache

    from hf_kvreuse.kv import load_kv

    src, tgt, mapper = pair
    ids = _prompt(30, 11)
    for ratio in (0.3, 1.0):
        cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=ratio)
        out = tgt.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        snap = load_kv(DynamicCache(config=tgt.config), [(k.clone(), v.clone()) for k, v in kv_of(cache)])
        turn2 = torch.cat([out, _prompt(6, 12)], 1)
        got = tgt.generate(turn2, cache=cache, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                           output_logits=True)
        ref = tgt.generate(turn2, past_key_values=snap, max_new_tokens=4, do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
        torch.testing.assert_close(_logits(got), _logits(ref), atol=1e-4, rtol=1e-4)
        if ratio == 1.0:
            assert torch.equal(got.sequences, tgt.generate(turn2, max_new_tokens=4, do_sample=False))


def test_mapper_refused_for_another_pair(pair):
    """A map fitted for one pair is refused for another: other weights of the same architecture, or another
    architecture; naming what differs."""
    src, tgt, mapper = pair
    other = tiny_model("qwen2", seed=99, **{k: getattr(tgt.config, k) for k in (
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")})
    with pytest.raises(MapperMismatchError, match="weights"):
        TranslatedCache(other, src, mapper, _prompt())
    with pytest.raises(MapperMismatchError, match="architecture"):
        mapper.check_pair(tiny_model("llama", seed=1), tgt)


def _same_translation(src, tgt, mapper, loaded):
    """``loaded`` gives the same K/V as ``mapper`` in a TranslatedCache at ratio 0.3 (bit for bit)."""
    ids = _prompt()
    a = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3)
    b = TranslatedCache(tgt, src, loaded, ids, recompute_ratio=0.3)
    tgt.generate(ids, cache=a, max_new_tokens=1)
    tgt.generate(ids, cache=b, max_new_tokens=1)
    for (ka, va), (kb, vb) in zip(kv_of(a), kv_of(b)):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_save_load_round_trip(pair, tmp_path):
    """safetensors + JSON: the loaded map translates to the same K/V; loading checks the pair; no pickle."""
    src, tgt, mapper = pair
    mapper.save(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["mapper.json", "mapper.safetensors"]
    loaded = KVMapper.load(tmp_path / "m", src, tgt)
    assert [lm.sources for lm in loaded.layers] == [lm.sources for lm in mapper.layers]
    _same_translation(src, tgt, mapper, loaded)
    with pytest.raises(MapperMismatchError):
        KVMapper.load(tmp_path / "m", tiny_model("qwen2", seed=5), tgt)
    with pytest.raises(FileNotFoundError):
        KVMapper.load(tmp_path / "missing")


def test_errors(pair):
    src, tgt, mapper = pair
    ids = _prompt()
    with pytest.raises(ValueError, match="recompute_ratio"):
        TranslatedCache(tgt, src, mapper, ids, recompute_ratio=1.5)
    with pytest.raises(TypeError, match="KVMapper"):
        TranslatedCache(tgt, src, "map", ids)
    with pytest.raises(ValueError, match="unknown selector"):
        TranslatedCache(tgt, src, mapper, ids, selector="best")
    with pytest.raises(ValueError, match="oracle"):
        TranslatedCache(tgt, src, mapper, ids, selector="oracle")
    with pytest.raises(ValueError, match="target model itself"):
        TranslatedCache(tgt, tgt, mapper, ids)
    with pytest.raises(ValueError, match="vocabulary"):
        TranslatedCache(tgt, src, mapper, torch.tensor([[1, 2, 500]]))
    cache = TranslatedCache(tgt, src, mapper, ids)
    assert cache.scorer.name == "source-attention"  # the measured default (research notes)
    with pytest.raises(ValueError, match="different input_ids"):
        tgt.generate(_prompt(40, 99), cache=cache, max_new_tokens=1)


def test_given_source_cache_skips_the_source_prefill(pair):
    """A source cache of the prompt (e.g. from the turn the source served) gives the same translated K/V as the
    source prefill, and the source model runs over no more than the donor check's probe tokens (counted by a hook:
    the former ``source_prefill_s`` comparison was a wall-clock race). Planted bug: the given cache sliced from
    position 1 (`k[..., 1:n + 1, :]`) -> K/V differ."""
    from transformers import DynamicCache

    src, tgt, mapper = pair
    ids = _prompt(45, 21)
    sc = DynamicCache(config=src.config)
    src(input_ids=torch.cat([ids, _prompt(5, 22)], 1), use_cache=True, past_key_values=sc)  # longer than needed
    fed = []  # tokens the source model runs over (counted, not timed: a wall-clock comparison fails under load)
    hook = src.register_forward_pre_hook(
        lambda mod, args, kw: fed.append((kw.get("input_ids") if kw.get("input_ids") is not None else args[0]).shape[1]),
        with_kwargs=True)
    try:
        a = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3)
        tgt.generate(ids, cache=a, max_new_tokens=2)
        fed_a, fed[:] = sum(fed), []
        b = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, source_cache=sc)
        tgt.generate(ids, cache=b, max_new_tokens=2)
        fed_b = sum(fed)
    finally:
        hook.remove()
    # a: the source prefill (every prompt token but the last); b: at most check_donor's probe (8 sampled tokens)
    assert fed_a == ids.shape[1] - 1 and fed_b <= 8, (fed_a, fed_b)
    for (ka, va), (kb, vb) in zip(kv_of(a), kv_of(b)):
        torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="source_cache"):
        TranslatedCache(tgt, src, mapper, _prompt(80, 1), source_cache=sc)


def test_pad_token_in_prompt_without_mask_is_refused(pair):
    """generate silently treats a pad id inside the prompt as padding when no mask is given (and pad is not an
    eos id): every cache refuses that call instead of decoding at shifted positions; an explicit all-ones mask
    works. Planted bug: the check removed -> `pytest.raises` fails (DID NOT RAISE)."""
    src, tgt, mapper = pair
    ids = _prompt(30, 8)
    ids[0, 10] = 0  # the tiny models' pad id
    with pytest.raises(ValueError, match="pad token id 0"):
        tgt.generate(ids, cache=TranslatedCache(tgt, src, mapper, ids, recompute_ratio=1.0), max_new_tokens=2)
    mask = torch.ones_like(ids)
    out = tgt.generate(ids, attention_mask=mask, cache=TranslatedCache(tgt, src, mapper, ids, recompute_ratio=1.0),
                       max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = tgt.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                       output_logits=True)
    torch.testing.assert_close(_logits(out), _logits(ref), atol=1e-4, rtol=1e-4)


# -- richer map kinds, exact leading layers, combined scorer (issue 24) --------------------------------------------
from hf_kvreuse.translation import BlockLayout, BlockMoments, CombinedScorer, run_source  # noqa: E402
from hf_kvreuse.translation.moments import depth_band  # noqa: E402

NEW_KINDS = ["kv-both", "hidden", "kv+hidden"]


def _assert_ratio_one_is_full_prefill(src, tgt, mapper, ids):
    """recompute_ratio=1 reproduces the target's full prefill: logits of 6 greedy steps and the prompt's K/V."""
    ref = _full(tgt, ids)
    cache = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=1.0)
    out = tgt.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                       output_logits=True)
    torch.testing.assert_close(_logits(out), _logits(ref), atol=1e-4, rtol=1e-4)
    for (k, v), (rk, rv) in zip(kv_of(cache), kv_of(ref.past_key_values)):
        torch.testing.assert_close(k, rk[..., : k.shape[-2], :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, rv[..., : v.shape[-2], :], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=NEW_KINDS)
def kind_pair(request):
    src_kw, tgt_kw = PAIRS["deeper-wider"]
    src = tiny_model("qwen2", seed=1, **src_kw)
    tgt = enable(tiny_model("qwen2", seed=2, **tgt_kw))
    mapper = KVMapper.fit(src, tgt, _calib(), stride=1, progress=False, inputs=request.param, top_k=2)
    return src, tgt, mapper


def test_new_kinds_read_what_they_say_and_ratio_one_is_full_prefill(kind_pair):
    """Every map kind: its layers read the blocks of its kind, recompute_ratio=1 is the target's full prefill
    (logits and K/V), and ratio 0 holds exactly the map applied by hand to the source's features. Planted bug:
    `gather` reads the keys for ("v", s) blocks -> the ratio-0 K/V differ (kv-both, kv+hidden)."""
    src, tgt, mapper = kind_pair
    kind = mapper.kind
    for t, lm in enumerate(mapper.layers):
        kinds = {b for b, _ in lm.blocks("k")} | {b for b, _ in lm.blocks("v")}
        assert kinds == {"kv-both": {"k", "v"}, "hidden": {"h"}, "kv+hidden": {"k", "v", "h"}}[kind]
        if "hidden" in kind:
            assert {s for b, s in lm.blocks("k") if b == "h"} == set(depth_band(t, 3, 5, 1))
    ids = _prompt()
    _assert_ratio_one_is_full_prefill(src, tgt, mapper, ids)
    # ratio 0: the cache holds exactly the map applied by hand to the source's features
    from transformers import DynamicCache
    n = ids.shape[1] - 1
    sc = DynamicCache(config=src.config)
    hidden = run_source(src, ids[:, :n], sc, range(src.config.num_hidden_layers + 1))
    sh = RopeShifter(src)
    feats = content_features(kv_of(sc), sh, torch.arange(n))
    c0 = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.0)
    tgt.generate(ids, cache=c0, max_new_tokens=1)
    tsh = RopeShifter(tgt)
    for t, lm in enumerate(mapper.layers):
        xk = torch.cat([feats[s][0] if b == "k" else feats[s][1] if b == "v" else hidden[s] for b, s in lm.blocks("k")], -1)
        xv = torch.cat([feats[s][0] if b == "k" else feats[s][1] if b == "v" else hidden[s] for b, s in lm.blocks("v")], -1)
        want_k = tsh.shift(mapper.to_cache_layout(xk @ lm.w_k + lm.b_k), torch.arange(n))
        want_v = mapper.to_cache_layout(xv @ lm.w_v + lm.b_v)
        torch.testing.assert_close(kv_of(c0)[t][0][..., :n, :], want_k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv_of(c0)[t][1][..., :n, :], want_v, atol=1e-4, rtol=1e-4)


def test_new_kinds_save_load_round_trip_and_refuse_another_pair(kind_pair, tmp_path):
    """safetensors + JSON round trip keeps each layer's input blocks and translates to the same K/V; the pair is
    identity-checked. Planted bug: `load` drops the saved `inputs_*` (falls back to K->K / V->V) -> its width check
    raises ValueError."""
    src, tgt, mapper = kind_pair
    mapper.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "mapper.json").read_text())
    assert meta["version"] == 2 and meta["info"]["config"]["inputs"] == mapper.kind
    loaded = KVMapper.load(tmp_path / "m", src, tgt)
    assert [lm.blocks("k") for lm in loaded.layers] == [lm.blocks("k") for lm in mapper.layers]
    assert [lm.blocks("v") for lm in loaded.layers] == [lm.blocks("v") for lm in mapper.layers]
    _same_translation(src, tgt, mapper, loaded)
    with pytest.raises(MapperMismatchError, match="weights"):
        KVMapper.load(tmp_path / "m", tiny_model("qwen2", seed=5, **PAIRS["deeper-wider"][0]), tgt)
    with pytest.raises(MapperMismatchError):
        TranslatedCache(tgt, tiny_model("qwen2", seed=6, **PAIRS["deeper-wider"][0]), mapper, _prompt())


def test_format_1_maps_still_load(pair, tmp_path):
    """A map saved before the map kinds (format 1: no inputs_* tensors) loads as the K->K / V->V kind; an unknown
    version is refused. Planted bug: format 1 dropped from the readable versions -> ValueError on load."""
    from safetensors.torch import load_file, save_file

    src, tgt, mapper = pair
    mapper.save(tmp_path / "m")
    ts = {k: v for k, v in load_file(str(tmp_path / "m" / "mapper.safetensors")).items() if ".inputs_" not in k}
    save_file(ts, str(tmp_path / "m" / "mapper.safetensors"))
    meta = json.loads((tmp_path / "m" / "mapper.json").read_text())
    meta["version"] = 1
    meta.pop("sha256")  # format-1 maps predate the recorded sha256: loaded with a warning, values still checked
    meta.pop("meta_sha256", None)  # and the manifest's own digest
    (tmp_path / "m" / "mapper.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="no recorded sha256"):
        old = KVMapper.load(tmp_path / "m", src, tgt)
    assert all(lm.blocks("k") == [("k", s) for s in lm.sources] for lm in old.layers)
    meta["version"] = 3
    (tmp_path / "m" / "mapper.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format version"):
        KVMapper.load(tmp_path / "m")


def test_hidden_kind_with_a_source_cache_needs_the_source_hidden_states():
    """A source cache holds no hidden states: a hidden-reading map refuses it alone, and with the hidden states of
    the same prefill (run_source) gives the K/V of the cache's own source prefill. Planted bug: the given
    hidden states sliced from row 1 (`h[1:n + 1]`) -> K/V differ."""
    from transformers import DynamicCache

    src_kw, tgt_kw = PAIRS["head-dim"]
    src = tiny_model("qwen2", seed=1, **src_kw)
    tgt = enable(tiny_model("qwen2", seed=2, **tgt_kw))
    mapper = KVMapper.fit(src, tgt, _calib(16), stride=1, progress=False, inputs="hidden")
    ids = _prompt(45, 21)
    sc = DynamicCache(config=src.config)
    hidden = run_source(src, torch.cat([ids, _prompt(5, 22)], 1), sc, mapper.hidden_layers)
    with pytest.raises(ValueError, match="hidden states"):
        TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, source_cache=sc)
    a = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3)
    b = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, source_cache=sc, source_hidden=hidden)
    tgt.generate(ids, cache=a, max_new_tokens=2)
    tgt.generate(ids, cache=b, max_new_tokens=2)
    for (ka, va), (kb, vb) in zip(kv_of(a), kv_of(b)):
        torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="hidden"):
        mapper.translate(kv_of(sc), torch.arange(10), RopeShifter(src), RopeShifter(tgt), torch.float32)


def _planted_moments(seed=0, n=3000, chunks=3):
    """Synthetic rows (2 source layers of K/V width 3, hidden 4) and a target (3 layers, width 2) that is an exact
    affine function of chosen blocks per layer."""
    lay = BlockLayout(source_layers=2, kv_width=3, hidden=4)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, lay.n_features, generator=gen) * torch.linspace(0.5, 3, lay.n_features) + 2.0
    truth = {0: [("h", 0), ("k", 1)], 1: [("h", 1), ("v", 0)], 2: [("h", 2), ("h", 1)]}
    ys, params = [], {}
    for t, blocks in truth.items():
        xs = torch.cat([x[:, lay.cols(b)] for b in blocks], 1)
        w = torch.randn(xs.shape[1], 4, generator=gen)
        b = torch.randn(4, generator=gen)
        ys.append(xs @ w + b)
        params[t] = (blocks, w, b)
    y = torch.cat(ys, 1)
    parts = []
    for c in range(chunks):
        m = BlockMoments(lay, 3, 2, band=1, cross=True)
        lo, hi = c * n // chunks, (c + 1) * n // chunks
        m.add(x[lo:lo + 100], y[lo:lo + 100])  # two batches: the shift (the first batch's mean) is not the part's
        m.add(x[lo + 100:hi], y[lo + 100:hi])
        parts.append(m)
    return lay, parts, params, x, y


def test_block_moments_recover_a_planted_linear_function():
    """From streamed, merged BlockMoments the solve recovers an affine map that reads hidden and K/V blocks, and
    the merged moments equal one pass over all rows. Planted bug: `merge` re-centres a cross term with the wrong
    sign (`+ outer(da, sb)`) -> merged covariances differ from one pass."""
    lay, parts, params, x, y = _planted_moments()
    merged = BlockMoments(lay, 3, 2, band=1, cross=True)
    for m in parts:
        merged.merge(m)
    one = BlockMoments(lay, 3, 2, band=1, cross=True)
    one.add(x, y)
    for t, (blocks, w, b) in params.items():
        c1, c2 = merged.cov(blocks, t), one.cov(blocks, t)
        for u, v in zip(c1, c2):
            torch.testing.assert_close(u, v, atol=1e-3, rtol=1e-4)
    g = PairGeometry(2, 1, 3, 3, 1, 2)
    m = KVMapper.from_moments(merged, g, MapperConfig(top_k=1, ridge_lambda=1e-9, scaling="std"),
                              blocks=lambda t, sources: (params[t][0], params[t][0]))
    for t, (blocks, w, b) in params.items():
        lm = m.layers[t]
        torch.testing.assert_close(lm.w_k, w[:, :2], atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(lm.w_v, w[:, 2:], atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(lm.b_k, b[:2], atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(lm.b_v, b[2:], atol=2e-3, rtol=1e-3)
    assert float(m.fit_r2.min()) > 0.9999


def test_prefix_layers_are_exact_and_the_rest_recompute_from_them(pair):
    """prefix_layers=p: every row's K/V of layers < p are the target's own; the selected rows then run layers
    p.. from the prefix's hidden states, which equals recomputing them through every layer (the old path).
    Planted bug: the selected rows resume one layer late (`layers=range(e + 1, L)`) -> layer p K/V differ."""
    from hf_kvreuse.generation.partial import partial_forward

    src, tgt, mapper = pair
    ids = _prompt(50, 13)
    n = ids.shape[1] - 1
    ref = _full(tgt, ids, 1)
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector=RandomScorer(3), prefix_layers=2)
    tgt.generate(ids, cache=c, max_new_tokens=1)
    assert c.stats.exact_layers == 2
    for (k, v), (rk, rv) in list(zip(kv_of(c), kv_of(ref.past_key_values)))[:2]:
        torch.testing.assert_close(k[..., :n, :], rk[..., :n, :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v[..., :n, :], rv[..., :n, :], atol=1e-4, rtol=1e-4)
    # the old path: translate, every row through layers 0-1, the same rows through all layers from embeddings
    probe = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.0)
    kv = mapper.translate(kv_of(_src_cache(src, ids[:, :n])), torch.arange(n), probe._src_shifter, probe._shifter,
                          torch.float32)
    partial_forward(tgt, ids[:, :n], torch.arange(n), kv, layers=range(2))
    partial_forward(tgt, ids[:, :n], c.selected_rows, kv, layers=range(len(kv)))
    for (k, v), (wk, wv) in zip(kv_of(c), kv):
        torch.testing.assert_close(k[..., :n, :], wk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v[..., :n, :], wv, atol=1e-4, rtol=1e-4)


def test_first_layer_deviation_follows_a_longer_exact_prefix(pair):
    """The first-layer scorer (alone, or as a question scorer's base) measures the deviation at the first layer
    after ``prefix_layers`` (layer 1 without a prefix), so every scorer works with a layer-aware budget; an explicit
    check layer inside the prefix is refused at construction, before any generate. Planted bugs: the default layer
    stays 1 (-> refused at generate, the old behaviour), or it is the prefix's last layer (-> the selection differs
    from an explicit check at layer p, and exact_layers is p)."""
    from hf_kvreuse.translation.scorers import FirstLayerDeviationScorer

    src, tgt, mapper = pair
    ids = _prompt(50, 13)
    p = 2
    auto = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector="first-layer", prefix_layers=p)
    tgt.generate(ids, cache=auto, max_new_tokens=1)
    assert auto.stats.exact_layers == p + 1
    explicit = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3,
                               selector=FirstLayerDeviationScorer(check_layer=p), prefix_layers=p)
    tgt.generate(ids, cache=explicit, max_new_tokens=1)
    assert torch.equal(auto.selected_rows, explicit.selected_rows)
    torch.testing.assert_close(auto.last_scores, explicit.last_scores)
    plain = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector="first-layer")
    tgt.generate(ids, cache=plain, max_new_tokens=1)
    assert plain.stats.exact_layers == 2  # no prefix: layer 1, as measured
    with pytest.raises(ValueError, match="inside the 3 exact leading layers"):
        TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector=FirstLayerDeviationScorer(check_layer=1),
                        prefix_layers=3)


def _src_cache(src, ids):
    from transformers import DynamicCache
    sc = DynamicCache(config=src.config)
    src(input_ids=ids, use_cache=True, past_key_values=sc)
    return sc


def test_combined_scorer_averages_ranks():
    """first-layer+rank combines by ranks, not raw scales. Planted bug: raw scores summed -> the large-scale
    scorer alone decides the order."""

    class Fixed(RandomScorer):
        def __init__(self, s):
            self.s = torch.tensor(s, dtype=torch.float)

        def scores(self, cache, kv):
            return self.s

    big = Fixed([1000.0, 3000.0, 2000.0, 4000.0])   # order 0 < 2 < 1 < 3
    small = Fixed([0.4, 0.1, 0.3, 0.2])              # order 1 < 3 < 2 < 0
    c = CombinedScorer([big, small])
    c.reset(4, torch.device("cpu"))
    # ranks: big [0, 2, 1, 3], small [3, 0, 2, 1] -> sums [3, 2, 3, 4] / 3
    torch.testing.assert_close(c.scores(None, None), torch.tensor([3.0, 2.0, 3.0, 4.0]) / 3)


def test_pair_fit_uses_the_measured_default_of_the_kind(tmp_path, monkeypatch):
    """`python -m hf_kvreuse.translation fit` makes the best measured kind (kv+hidden) with its measured ridge, and
    qwen_pair_mapper passes each kind's ridge on; ``--dtype fp32`` loads both models in float32. Planted bug:
    qwen_pair_mapper drops ``ridge_lambda=lam`` (the hidden kinds are fitted at KVMapper.fit's 0.01, where they
    overfit) -> fails: the recorded ridge."""
    from hf_kvreuse.translation import __main__ as cli
    from hf_kvreuse.translation import pairs

    seen = {}

    class FakeMapper:
        kind = "kv+hidden"
        info = {}
        layers = []

        def save(self, path):
            path.mkdir(parents=True, exist_ok=True)
            (path / "mapper.json").write_text("{}")

    def fake_fit(source, target, calib, **kw):
        seen.update(kw)
        return FakeMapper()

    monkeypatch.setattr(pairs, "calibration_ids", lambda tok, n, max_tokens: [torch.arange(8)])
    monkeypatch.setattr(pairs.KVMapper, "fit", staticmethod(fake_fit))
    dtypes = []
    monkeypatch.setattr("hf_kvreuse.models.load_qwen",
                        lambda *a, **k: (dtypes.append(k.get("dtype")), (object(), object()))[1])
    cli.main(["fit", "--out", str(tmp_path / "m"), "--calibration", "1"])
    assert dtypes == [torch.bfloat16, torch.bfloat16]   # the default: the shipped map's dtype
    cli.main(["fit", "--out", str(tmp_path / "m32"), "--calibration", "1", "--dtype", "fp32"])
    assert dtypes[2:] == [torch.float32, torch.float32]
    assert seen["inputs"] == pairs.FIT_DEFAULT_INPUTS == "kv+hidden"
    assert seen["ridge_lambda"] == pairs.DEFAULT_RIDGE["kv+hidden"] == 0.3
    for kind, lam in pairs.DEFAULT_RIDGE.items():
        pairs.qwen_pair_mapper(object(), object(), object(), path=tmp_path / kind, inputs=kind, progress=False)
        assert (seen["inputs"], seen["ridge_lambda"]) == (kind, lam)
    pairs.qwen_pair_mapper(object(), object(), object(), path=tmp_path / "x", inputs="kv", ridge_lambda=0.5)
    assert seen["ridge_lambda"] == 0.5


class _WordTokenizer:
    """A tokenizer stand-in: one id per character, and a chat template that wraps each message in [role]...[/]."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 1000 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(f"[{m['role']}]{m['content']}[/]" for m in messages) + ("[assistant]" if add_generation_prompt else "")
        return self(text)["input_ids"]


def test_calibration_prompts_file_is_read_and_used(tmp_path, monkeypatch):
    """``fit --prompts FILE.jsonl`` calibrates on the user's prompts ({"text"} raw, {"messages"} through the chat
    template with the generation prompt, cut to --max-tokens, every one by default), never on DROP; bad lines are
    refused with their line number; a map already saved is not silently kept in place of a fit on new prompts.
    Planted bug: the CLI does not pass ``prompts=`` on (DROP is used) -> fails: the DROP stand-in raises."""
    from hf_kvreuse.translation import __main__ as cli
    from hf_kvreuse.translation import pairs

    tok = _WordTokenizer()
    f = tmp_path / "p.jsonl"
    lines = ['{"text": "abcdefghij"}', "", '{"messages": [{"role": "user", "content": "hello"}]}'] + \
        [f'{{"text": "prompt number {i}"}}' for i in range(70)]
    f.write_text("\n".join(lines) + "\n")
    got = pairs.prompts_file_ids(tok, f, max_tokens=12)
    assert len(got) == 72                                 # blank line skipped, no cap at 64
    assert got[0].tolist() == [ord(c) for c in "abcdefghij"]
    assert got[1].tolist() == [ord(c) for c in "[user]hello[/][assistant]"][:12]
    assert len(pairs.prompts_file_ids(tok, f, n=2)) == 2
    for bad, why in (("{oops", "line 1: not JSON"), ('{"prompt": "x"}', 'line 1: expected an object'),
                     ('["a"]', "line 1: expected"), ('{"text": "abc"}', "line 1: 3 tokens")):
        (tmp_path / "bad.jsonl").write_text(bad + "\n")
        with pytest.raises(ValueError, match=why):
            pairs.prompts_file_ids(tok, tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds none"):
        pairs.prompts_file_ids(tok, tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="no file"):
        pairs.prompts_file_ids(tok, tmp_path / "missing.jsonl")

    seen = {}

    class FakeMapper:
        kind, info, layers = "kv+hidden", {}, []

        def save(self, path):
            path.mkdir(parents=True, exist_ok=True)
            (path / "mapper.json").write_text("{}")

    def fake_fit(source, target, calib, **kw):
        seen["calib"], seen["description"] = list(calib), kw["description"]
        return FakeMapper()

    def no_drop(*a, **k):
        raise AssertionError("DROP used in place of the prompts given")

    monkeypatch.setattr(pairs, "calibration_ids", no_drop)
    monkeypatch.setattr(pairs.KVMapper, "fit", staticmethod(fake_fit))
    monkeypatch.setattr("hf_kvreuse.models.load_qwen", lambda *a, **k: (object(), tok))
    cli.main(["fit", "--out", str(tmp_path / "m"), "--prompts", str(f), "--max-tokens", "12"])
    assert [t.tolist() for t in seen["calib"]] == [t.tolist() for t in got]
    assert "72 prompts" in seen["description"] and "p.jsonl" in seen["description"]
    with pytest.raises(ValueError, match="already saved.*refit"):
        cli.main(["fit", "--out", str(tmp_path / "m"), "--prompts", str(f)])
    cli.main(["fit", "--out", str(tmp_path / "m"), "--prompts", str(f), "--refit", "--calibration", "5"])
    assert len(seen["calib"]) == 5
    with pytest.raises(ValueError, match="prompt 1: 3 tokens"):   # token tensors are checked the same way
        pairs.qwen_pair_mapper(object(), object(), tok, path=tmp_path / "t", prompts=[torch.arange(9), torch.arange(3)])
    with pytest.raises(ValueError, match="at least one calibration prompt"):
        cli.main(["fit", "--out", str(tmp_path / "m0"), "--prompts", str(f), "--calibration", "0"])


def test_output_kl_is_zero_for_the_identity_map(copy_pair):
    """The student forward of the output fit (mapped cache + answer tokens at their positions) reproduces the
    teacher's full prefill when the map is exact: KL ~ 0 and every argmax equal.

    Planted bug that fails it: the student's answer tokens at positions ``n + 1..`` (one off): KL 2.3e-5 against
    2e-8 (the teacher's log-probabilities are kept in float32 for this: float16 alone rounds them by 5e-5)."""
    from hf_kvreuse.translation.output_fit import make_examples, output_kl

    src, tgt, mapper = copy_pair
    examples = make_examples(src, tgt, [_prompt(30, seed=s)[0] for s in (1, 2)], mapper, answer_tokens=5,
                             progress=False)
    assert [ex.answer.numel() for ex in examples] == [5, 5]
    res = output_kl(mapper, tgt, examples)
    assert abs(res["kl"]) < 1e-6 and res["top1_agreement"] == 1.0, res


def test_output_fit_lowers_the_kl_and_keeps_the_format(pair, tmp_path):
    """Fine-tuning through the frozen target lowers the KL on its examples, leaves the given mapper untouched,
    returns the validation-best epoch, and saves / loads / checks the pair like any map; ratio 1.0 stays the
    target's full prefill.

    Planted bug that fails it: ``fit_outputs`` trains the given mapper's tensors in place (the original's
    translation changes)."""
    from hf_kvreuse.artifacts import CorruptArtifactError
    from hf_kvreuse.translation.output_fit import (OutputFitConfig, fit_outputs, load_examples, make_examples,
                                                   output_kl, save_examples)

    src, tgt, mapper = pair
    before_w = [lm.w_k.clone() for lm in mapper.layers]
    ex = make_examples(src, tgt, [_prompt(24, seed=s)[0] for s in range(3)], mapper, answer_tokens=4,
                       progress=False)
    kl0 = output_kl(mapper, tgt, ex)["kl"]
    save_examples(ex, tmp_path / "ex")  # the teacher pass kept on disk reads back the same, verified
    assert output_kl(mapper, tgt, load_examples(tmp_path / "ex"))["kl"] == kl0
    with open(tmp_path / "ex" / "examples.safetensors", "r+b") as f:  # a corrupted file is refused
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(CorruptArtifactError):
        load_examples(tmp_path / "ex")
    fitted, hist = fit_outputs(mapper, tgt, ex, OutputFitConfig(epochs=3, lr=3e-3, answer_tokens=4), val_examples=ex,
                               progress=False)
    kl1 = output_kl(fitted, tgt, ex)["kl"]
    assert kl1 < 0.7 * kl0, (kl0, kl1, hist)
    assert all(torch.equal(a, lm.w_k) for a, lm in zip(before_w, mapper.layers))
    assert fitted.info["output_fit"]["best_epoch"] == min(hist, key=lambda h: h["val_kl"])["epoch"]
    assert not any(lm.w_k.requires_grad for lm in fitted.layers)
    fitted.save(tmp_path / "fit")
    loaded = KVMapper.load(tmp_path / "fit", src, tgt)
    _same_translation(src, tgt, fitted, loaded)
    assert loaded.info["output_fit"]["epochs"] == 3
    ids = _prompt()
    ref = _full(tgt, ids)
    out = tgt.generate(ids, cache=TranslatedCache(tgt, src, loaded, ids, recompute_ratio=1.0), max_new_tokens=6,
                       do_sample=False, return_dict_in_generate=True, output_logits=True)
    torch.testing.assert_close(_logits(out), _logits(ref), atol=1e-4, rtol=1e-4)


# -- non-linear residual maps (issue 24, 2c) ------------------------------------------------------------------------
from hf_kvreuse.translation import ResidualConfig, apply_residual, fit_residuals, train_residual  # noqa: E402


def test_residual_recovers_a_planted_nonlinear_function():
    """Rows generated by ``y = x W + gelu(x A0 + c0) U0`` (a planted rank-4 non-linearity on top of a known linear
    map): the trained correction explains most of what the linear map leaves on held-out rows, starts as the
    linear map (U = 0, zero epochs) and stays near zero where there is nothing to correct. Planted bug:
    `apply_residual` skips the standardisation (`x` instead of `(x - mu) / sd`) -> the held-out R² of the
    correction falls far below 0.8 (inputs here have mean 2 and scale 3)."""
    g = torch.Generator().manual_seed(0)
    n, f, ft = 3000, 12, 8
    x = 2.0 + 3.0 * torch.randn(n, f, generator=g)
    w = torch.randn(f, 2 * ft, generator=g)
    a0, c0, u0 = torch.randn(f, 4, generator=g) / 3.0, torch.randn(4, generator=g), torch.randn(4, 2 * ft, generator=g)
    lin = x @ w
    y = lin + torch.nn.functional.gelu(((x - 2.0) / 3.0) @ a0 + c0) @ u0
    tr, te = slice(0, 2500), slice(2500, n)
    res, stats = train_residual(x[tr], lin[tr], y[tr], ResidualConfig(rank=16, epochs=40, lr=3e-3))
    target = y[te] - lin[te]
    got = apply_residual(res, x[te])
    r2 = 1 - float(((got - target) ** 2).sum() / ((target - target.mean(0)) ** 2).sum())
    assert r2 > 0.8, r2
    assert stats["residual_r2"][0] > stats["linear_r2"][0] and stats["residual_r2"][1] > stats["linear_r2"][1]
    res0, _ = train_residual(x[tr], lin[tr], y[tr], ResidualConfig(epochs=0))
    assert torch.equal(apply_residual(res0, x[te]), torch.zeros(n - 2500, 2 * ft))
    resz, _ = train_residual(x[tr], y[tr], y[tr], ResidualConfig(rank=8, epochs=5))   # nothing left to correct
    assert apply_residual(resz, x[te]).abs().max() < 0.05 * y.abs().max()
    with pytest.raises(ValueError, match="shapes"):
        train_residual(x, lin[:10], y)


@pytest.fixture(scope="module")
def residual_pair():
    src_kw, tgt_kw = PAIRS["deeper-wider"]
    src = tiny_model("qwen2", seed=1, **src_kw)
    tgt = enable(tiny_model("qwen2", seed=2, **tgt_kw))
    linear = KVMapper.fit(src, tgt, _calib(), stride=1, progress=False, top_k=2)
    mapper = fit_residuals(copy.deepcopy(linear), src, tgt, _calib(), ResidualConfig(rank=8, epochs=3), progress=False)
    return src, tgt, linear, mapper


def test_residual_map_applies_what_it_trained_and_ratio_one_is_full_prefill(residual_pair):
    """A map with corrections: recompute_ratio=1 is the target's full prefill (logits); ratio 0 holds exactly the
    linear map plus the trained correction applied by hand to the source's features, which differs from the linear
    map alone; training lowered the in-sample error of every layer. Planted bug: `map_layer` ignores
    `LayerMap.residual` -> the ratio-0 K/V equal the linear map's, not the corrected ones."""
    src, tgt, linear, mapper = residual_pair
    info = mapper.info["residual"]
    assert info["config"]["rank"] == 8 and len(info["layers"]) == tgt.config.num_hidden_layers
    for s in info["layers"].values():
        assert s["residual_r2"][0] >= s["linear_r2"][0] - 1e-6 and s["residual_r2"][1] >= s["linear_r2"][1] - 1e-6
    ids = _prompt()
    _assert_ratio_one_is_full_prefill(src, tgt, mapper, ids)
    from transformers import DynamicCache
    n = ids.shape[1] - 1
    sc = DynamicCache(config=src.config)
    run_source(src, ids[:, :n], sc)
    feats = content_features(kv_of(sc), RopeShifter(src), torch.arange(n))
    c0 = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.0)
    tgt.generate(ids, cache=c0, max_new_tokens=1)
    tsh = RopeShifter(tgt)
    ft = mapper.geometry.ft
    for t, lm in enumerate(mapper.layers):
        xk = torch.cat([feats[s][0] for _, s in lm.blocks("k")], -1)
        xv = torch.cat([feats[s][1] for _, s in lm.blocks("v")], -1)
        d = apply_residual(lm.residual, torch.cat([xk, xv], -1))
        want_k = tsh.shift(mapper.to_cache_layout(xk @ lm.w_k + lm.b_k + d[:, :ft]), torch.arange(n))
        want_v = mapper.to_cache_layout(xv @ lm.w_v + lm.b_v + d[:, ft:])
        torch.testing.assert_close(kv_of(c0)[t][0][..., :n, :], want_k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv_of(c0)[t][1][..., :n, :], want_v, atol=1e-4, rtol=1e-4)
    lin0 = TranslatedCache(tgt, src, linear, ids, recompute_ratio=0.0)
    tgt.generate(ids, cache=lin0, max_new_tokens=1)
    assert not torch.allclose(kv_of(lin0)[1][1][..., :n, :], kv_of(c0)[1][1][..., :n, :], atol=1e-4)


def test_residual_map_round_trip_and_another_pair_refused(residual_pair, tmp_path):
    """safetensors + JSON keep the corrections (same K/V bit for bit after loading); a corrected map is checked
    against its pair on load and when refitted. Planted bug: `load` drops the `residual.*` tensors -> the loaded
    map translates to the linear map's K/V, not the same ones."""
    src, tgt, linear, mapper = residual_pair
    mapper.save(tmp_path / "r")
    loaded = KVMapper.load(tmp_path / "r", src, tgt)
    assert all(lm.residual is not None for lm in loaded.layers)
    assert loaded.nbytes > linear.nbytes
    _same_translation(src, tgt, mapper, loaded)
    other = tiny_model("qwen2", seed=5, **PAIRS["deeper-wider"][0])
    with pytest.raises(MapperMismatchError, match="weights"):
        KVMapper.load(tmp_path / "r", other, tgt)
    with pytest.raises(MapperMismatchError, match="weights"):
        fit_residuals(copy.deepcopy(linear), other, tgt, _calib(2), progress=False)
    # a failed refit leaves the corrections as they were (planted: `map_layer` called with the layer's
    # correction cleared and not put back -> layer 0 has none after the error)
    m = copy.deepcopy(mapper)
    with pytest.raises(ValueError, match="invalid residual config"):
        fit_residuals(m, src, tgt, _calib(2), ResidualConfig(rank=0), progress=False)
    assert all(torch.equal(a.residual["u"], b.residual["u"]) for a, b in zip(m.layers, mapper.layers))


@pytest.mark.parametrize("cfg", [dict(recompute_ratio=0.3, selector="first-layer"),
                                 dict(recompute_ratio=0.3, selector="random", prefix_layers=3),
                                 dict(recompute_ratio=0.0), dict(recompute_ratio=1.0),
                                 dict(recompute_ratio=0.5, selector="random", prefix_layers=-1)])
def test_fused_first_step_equals_the_recompute_then_one_token_step(pair, cfg):
    """fuse_first_step=True (the default) recomputes the selected rows in the first token's forward with the last
    prompt token: the same tokens, logits and K/V as the recompute in the assembly followed by generate's own
    one-token step, for exact leading layers 0, 2, 3 and all of them, at ratios 0, 0.3, 0.5 and 1; the cache then
    continues. Planted bugs: the last token skips the exact leading layers (its hidden state from the embedding),
    the selected rows are left out of the fused forward (only the last token runs), the last token's logits read
    the first selected row instead (`h[:, :1]`) -> logits / K/V differ. (The selected rows restarting from their
    embeddings at layer 0 is not a bug: the leading layers are exact for every row, so it only costs time.)"""
    src, tgt, mapper = pair
    ids = _prompt(48, 21)
    cfg = dict(cfg)
    if cfg.get("prefix_layers") == -1:
        cfg["prefix_layers"] = tgt.config.num_hidden_layers
    outs, caches = {}, {}
    for fuse in (True, False):
        c = TranslatedCache(tgt, src, mapper, ids, fuse_first_step=fuse, **cfg)
        outs[fuse] = tgt.generate(ids, cache=c, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                  output_logits=True)
        caches[fuse] = c
    assert caches[True].stats.fused_first_step and not caches[False].stats.fused_first_step
    assert torch.equal(caches[True].selected_rows, caches[False].selected_rows)
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    torch.testing.assert_close(_logits(outs[True]), _logits(outs[False]), atol=1e-4, rtol=1e-4)
    for (k, v), (k2, v2) in zip(kv_of(caches[True]), kv_of(caches[False])):
        torch.testing.assert_close(k, k2, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, v2, atol=1e-4, rtol=1e-4)
    if cfg["recompute_ratio"] == 1.0:  # the full prefill, in one forward now
        ref = _full(tgt, ids, 5)
        assert torch.equal(outs[True].sequences, ref.sequences)
        torch.testing.assert_close(_logits(outs[True]), _logits(ref), atol=1e-4, rtol=1e-4)
    nxt = torch.cat([outs[True].sequences, _prompt(3, 22)], 1)  # the returned cache continues
    nxt2 = torch.cat([outs[False].sequences, _prompt(3, 22)], 1)
    more = tgt.generate(nxt, attention_mask=torch.ones_like(nxt), cache=caches[True], max_new_tokens=2,
                        do_sample=False)
    more2 = tgt.generate(nxt2, attention_mask=torch.ones_like(nxt2), cache=caches[False], max_new_tokens=2,
                         do_sample=False)
    assert torch.equal(more, more2)


def test_fused_first_step_steps_aside_for_hidden_states(pair):
    """A generate that returns hidden states or attentions keeps the model's own first forward (the fused one would
    report the recomputed rows, not the last token). Planted bug: `returns_internals` ignored -> fused is True."""
    src, tgt, mapper = pair
    ids = _prompt(30, 23)
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector="random")
    out = tgt.generate(ids, cache=c, max_new_tokens=2, do_sample=False, output_hidden_states=True,
                       return_dict_in_generate=True)
    assert not c.stats.fused_first_step
    assert out.hidden_states[0][-1].shape[1] == 1  # the last prompt token's forward, as generate runs it
    with pytest.raises(TypeError, match="fuse_first_step"):
        TranslatedCache(tgt, src, mapper, ids, fuse_first_step=1)


def test_fused_first_step_reads_logits_only_from_a_probed_plain_head(pair, monkeypatch):
    """With exact leading layers the fused step computes the last token's logits from the output head itself: only
    where a probe shows that the model's own forward does the same (Granite divides its logits by
    ``logits_scaling``: not plain; Gemma 2's soft-capping is reproduced); elsewhere the cache keeps generate's
    one-token step, with the same answer. Planted bug: `plain_head` always True -> the Granite probe passes."""
    from hf_kvreuse.generation.partial import plain_head
    from hf_kvreuse.models.arch_zoo import zoo_model

    assert plain_head(pair[1])
    assert not plain_head(zoo_model("granite", logits_scaling=4.0))
    assert plain_head(zoo_model("gemma2", final_logit_softcapping=5.0))
    src, tgt, mapper = pair
    ids = _prompt(40, 24)
    ref = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector="first-layer", fuse_first_step=False)
    want = tgt.generate(ids, cache=ref, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                        output_logits=True)
    monkeypatch.setattr("hf_kvreuse.cache_classes.translated.plain_head", lambda m: False)
    c = TranslatedCache(tgt, src, mapper, ids, recompute_ratio=0.3, selector="first-layer")
    got = tgt.generate(ids, cache=c, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                       output_logits=True)
    assert not c.stats.fused_first_step and c.stats.exact_layers == 2
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(_logits(got), _logits(want), atol=1e-5, rtol=1e-5)
