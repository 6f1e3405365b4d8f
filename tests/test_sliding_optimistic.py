"""OptimisticCache on models with sliding-window layers: every output is plain ``generate``'s.

The optimistic cache is assembled over every row, its unmatched rows computed with each layer type's own mask
(:func:`hf_kvreuse.generation.partial.partial_forward` adds the window), and its sliding layers then keep what
transformers' own layers keep after a prefill. Verified drafts are replayed on the exact cache; a sliding layer
whose window moved during the replay is cut back from the rows :func:`hf_kvreuse.sliding.keep_rows` kept.
Property test (hypothesis) over tiny random configs of the installed sliding-window architectures (window 8):
prompts shorter and longer than the window, drafts that cross it, forced swap steps.
"""

import os

import pytest
import torch
import transformers
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hf_kvreuse import OptimisticCache, enable
from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.kv import kv_of
from hf_kvreuse.model_check import UnsupportedModelError
from hf_kvreuse.models.arch_zoo import SLIDING, held_background
from hf_kvreuse.rotary import UnsupportedRopeError
from hf_kvreuse.sliding import crop_rows, keep_history, keep_rows, layer_windows, take_history

from test_sliding import _model as _sliding_model
from test_sliding import one_thread  # noqa: F401 - the module's fixture: one torch thread

CASES = int(os.environ.get("HF_KVREUSE_SLIDING_CASES", "12"))
WINDOW = 8


def _model(name):
    """The tiny model of a sliding architecture (window 8), enabled; skipped where this release lacks it."""
    return enable(_sliding_model(name))


def _full_rows(model, ids):
    """Every row of every layer of a prefill of ``ids`` (the sliding layers' from their history) and the native
    cache transformers leaves."""
    cache = transformers.DynamicCache(config=model.config)
    windows = layer_windows(model.config)
    keep_history(cache, windows)
    with torch.no_grad():
        model(ids, use_cache=True, **cache_kwargs(cache))
    return take_history(cache, windows, ids.shape[1]), cache


def _supported(name):
    """The model, or None where OptimisticCache refuses it by name (RoPE it cannot re-position, ...)."""
    model = _model(name)
    ids = torch.randint(3, 200, (1, 12))
    try:
        OptimisticCache(model, ids, _full_rows(model, ids[:, :6])[0], ids[:, :6])
    except (UnsupportedRopeError, UnsupportedModelError) as e:
        assert type(model).__name__ in str(e)
        return None
    return model


ARCHS = sorted(SLIDING)


def _toks(data, n):
    return torch.tensor([data.draw(st.lists(st.integers(3, 199), min_size=n, max_size=n))])


@settings(max_examples=CASES, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_verified_drafts_are_plain_generate(data):
    """A target prompt that shares spans with a full-row donor at other positions (the document after another
    role text), shorter or longer than the window; drafts forced to stop at a drawn step (0 to 6, crossing the
    window); ``rebase="verify"``: tokens and logits equal plain ``generate``'s, greedy and seeded sampling; the
    returned cache continues exactly (a second ``generate`` on it equals plain ``generate`` of the longer prompt).

    Planted bug that fails it (checked): ``_verify`` cuts the layers back one token late
    (``crop_rows(self, self._windows, n + j + 1 - ...)``: the rejected draft's row stays). The drafts' own quality
    (the masks, the re-positioning) cannot fail it, by design: the tests below check them."""
    name = data.draw(st.sampled_from(ARCHS), label="arch")
    model = _supported(name)
    if model is None:
        return
    doc = _toks(data, data.draw(st.integers(4, 20), label="doc"))
    role_a, role_b = _toks(data, data.draw(st.integers(1, 5))), _toks(data, data.draw(st.integers(1, 5)))
    q = _toks(data, data.draw(st.integers(1, 4)))
    ids_a = torch.cat([role_a, doc, q], 1)
    ids_b = torch.cat([role_b, doc, q], 1)
    steps = data.draw(st.integers(0, 6), label="max_optimistic_tokens")
    sample = data.draw(st.booleans(), label="do_sample")
    new = data.draw(st.integers(1, 10), label="max_new_tokens")
    gen = dict(max_new_tokens=new, do_sample=sample, return_dict_in_generate=True, output_logits=True,
               pad_token_id=0)
    if sample:
        gen.update(top_k=20)
    donor, _ = _full_rows(model, ids_a)
    torch.manual_seed(7)
    ref = model.generate(ids_b, **gen)
    cache = OptimisticCache(model, ids_b, donor, ids_a, max_optimistic_tokens=steps, rebase="verify")
    torch.manual_seed(7)
    with held_background():
        out = model.generate(ids_b, past_key_values=cache, **gen)
    assert torch.equal(out.sequences, ref.sequences), (name, cache.stats)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert cache.stats.exact_output
    # the returned cache continues: its sliding layers hold what plain prefill of the sequence leaves
    seq = out.sequences
    more = torch.cat([seq, q], 1)
    ref2 = model.generate(more, max_new_tokens=3, do_sample=False, pad_token_id=0)
    out2 = model.generate(more, past_key_values=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out2, ref2), name


@pytest.mark.parametrize("name", ARCHS)
def test_own_prefix_and_swap_before_the_first_step(name):
    """Under its own prompt as donor the assembled cache is full prefill's K/V (every layer, sliding layers as
    transformers keeps them); with ``max_optimistic_tokens=0`` (exact before the first token) and under
    ``"commit"`` the output is plain ``generate``'s. A prompt of 3 windows.

    Planted bug that fails it (checked): ``load_kv`` keeps the first ``window - 1`` rows of a sliding layer
    given every row (``k[..., :window - 1, :]``)."""
    model = _supported(name)
    if model is None:
        pytest.skip(f"{name}: refused by name")
    ids = torch.randint(3, 200, (1, 3 * WINDOW + 2), generator=torch.Generator().manual_seed(3))
    donor, native = _full_rows(model, ids)
    cache = OptimisticCache(model, ids, donor, ids, max_optimistic_tokens=None, rebase="commit",
                            record_divergence=False)
    cache.prepare(model, ids, {})
    n = ids.shape[1] - 1
    ref_cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :n], use_cache=True, **cache_kwargs(ref_cache))
    for (k, v), (rk, rv) in zip(kv_of(cache), kv_of(ref_cache)):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-4)
    cache.finish(None, RuntimeError("probe only"))
    other = torch.cat([ids[:, 5:], ids[:, :5]], 1)
    ref = model.generate(other, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for kw in (dict(max_optimistic_tokens=0), dict(max_optimistic_tokens=None, rebase="verify")):
        c = OptimisticCache(model, other, donor, ids, **kw)
        assert torch.equal(model.generate(other, past_key_values=c, max_new_tokens=6, do_sample=False,
                                          pad_token_id=0), ref), kw


def test_native_donor_past_its_window_is_refused_by_name():
    """A donor whose sliding layers kept only their window (a cache of more tokens than the window) cannot give
    the rows the alignment needs: refused, naming the model and the way out."""
    model = _supported("mistral") or _supported("gemma2")
    if model is None:
        pytest.skip("no supported sliding architecture")
    ids = torch.randint(3, 200, (1, 2 * WINDOW))
    _, native = _full_rows(model, ids)
    with pytest.raises(ValueError, match=f"{type(model).__name__}.*every row"):
        OptimisticCache(model, ids, native, ids)


@given(st.integers(1, 30), st.integers(1, 12), st.data())
@settings(max_examples=40, deadline=None)
def test_crop_rows_is_what_a_prefill_leaves(n, extra, data):
    """keep_rows, then one multi-token update past the window, then crop_rows to any length in between: every
    layer holds what a prefill of that many tokens leaves (rows and token count).

    Planted bug that fails it (checked): ``crop_rows`` sets ``cumulative_length`` to the rows kept."""
    model = _model("gemma2")
    windows = layer_windows(model.config)
    ids = torch.randint(3, 200, (1, n + extra), generator=torch.Generator().manual_seed(n * 100 + extra))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :n], use_cache=True, **cache_kwargs(cache))
        keep_rows(cache, windows)
        model(ids[:, n:], position_ids=torch.arange(n, n + extra)[None], use_cache=True, **cache_kwargs(cache))
    length = data.draw(st.integers(n, n + extra))
    crop_rows(cache, windows, length)
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :length], use_cache=True, **cache_kwargs(ref))
    for layer, rl in zip(cache.layers, ref.layers):
        assert type(layer) is type(rl) and layer.get_seq_length() == rl.get_seq_length()
        torch.testing.assert_close(layer.keys, rl.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(layer.values, rl.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ARCHS)
def test_every_sliding_architecture_is_served_or_refused_by_name(name):
    """The sliding architectures whose RoPE the library re-positions are served (Gemma 3 and OLMo 3 included:
    their layer types have their own frequencies); the others are refused naming the model (Cohere 2: its full
    layers have no RoPE at all).

    Planted bug that fails it (checked): the sliding mask without the window (the engine probe refuses them)."""
    model = _model(name)
    served = _supported(name) is not None
    assert served == (name != "cohere2"), name


@pytest.mark.parametrize("name", ARCHS)
def test_partial_forward_past_the_window(name):
    """Rows recomputed after exact rows, more than a window past the start: every layer's K/V and the logits equal
    a plain forward's (the sliding layers attend to their window only).

    Planted bug that fails it (checked): the sliding layers' mask without the window (``window=None`` in
    ``_sliding_masks``): the model check's engine probe then refuses every sliding model, which fails the test
    above; with the probe bypassed, this one."""
    from hf_kvreuse.generation.partial import partial_forward

    model = _supported(name)
    if model is None:
        pytest.skip(f"{name}: refused by name")
    ids = torch.randint(3, 200, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(5))
    full, _ = _full_rows(model, ids)
    with torch.no_grad():
        logits = model(ids).logits
    r = 2 * WINDOW
    kv = [(k.clone(), v.clone()) for k, v in full]
    for k, v in kv:
        k[..., r:, :] = 0
        v[..., r:, :] = 0
    with torch.no_grad():
        out = partial_forward(model, ids, torch.arange(r, ids.shape[1]), kv, logits_to_keep=0)
    for (k, v), (rk, rv) in zip(kv, full):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.logits, logits[:, r:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma3_text", "olmo3"])
def test_per_layer_type_rope_shift(name):
    """Gemma 3 / OLMo 3 keep local and global RoPE frequencies: ``RopeShifter.for_layer(i)`` moves every layer's
    keys exactly where the model computes them (layer-0 inputs: one token per sequence, so every layer's key
    depends on the token and its position only); ``shift`` without a layer refuses to guess.

    Planted bug that fails it (checked): ``for_layer`` returns the first layer's shifter for every layer."""
    from hf_kvreuse.rope import RopeShifter

    model = _supported(name)
    if model is None:
        pytest.skip(f"{name}: refused")
    shifter = RopeShifter(model)
    tok = torch.randint(3, 200, (5, 1), generator=torch.Generator().manual_seed(2))
    kvs = []
    for start in (3, 3 + 41):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=tok, position_ids=torch.full((5, 1), start), use_cache=True, **cache_kwargs(cache))
        kvs.append(kv_of(cache))
    for i, ((k0, _), (k1, _)) in enumerate(zip(*kvs)):
        torch.testing.assert_close(shifter.for_layer(i).shift(k0, 41), k1, atol=1e-5, rtol=1e-4)
    if shifter._layers is not None:  # (a release whose layer types share one rotary module has one shifter)
        with pytest.raises(ValueError, match="for_layer"):
            shifter.shift(kvs[0][0][0], 1)


@pytest.mark.parametrize("policy", ["optimistic", "auto"])
@pytest.mark.parametrize("name", ARCHS)
def test_session_verified_drafts_on_sliding_models(name, policy):
    """ReuseSession on a sliding-window model: three agents with their own role texts over one document of about
    four windows, two rounds, each prompt carrying the transcript. Every answer (tokens, scores) equals plain
    ``generate``'s; under ``"optimistic"`` every call after the first reuses the others' caches through verified
    drafts, and every held entry keeps every row of every layer (so it can donate again) and equals plain prefill.
    ``"auto"`` chooses per call and gives a reason; Cohere 2 steps down to exact prefixes.

    Planted bugs that fail it (checked): the session does not take the optimistic call's rows
    (``history = True`` removed: the entry keeps the window only, later calls run without it); ``_take_exact``
    does not keep the sliding layers' history (the held entry loses every row)."""
    from test_reliability import _held_entries_are_exact

    from hf_kvreuse import ReuseSession

    model = _model(name)
    served = _supported(name) is not None
    if policy == "optimistic" and not served:
        pytest.skip(f"{name}: refused by name (tested above)")
    s = ReuseSession(model, policy=policy, min_donor_tokens=4)
    doc = torch.randint(3, 200, (1, 4 * WINDOW), generator=torch.Generator().manual_seed(11))
    methods = []
    for _ in range(2):
        for role in ([[5, 6]], [[7, 8, 9]], [[11]]):
            ids = torch.cat([torch.tensor(role), doc, torch.tensor([[3, 4]])], 1)
            gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True,
                       return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
            out = s.generate(ids, **gen)
            ref = model.generate(ids, **gen)
            assert torch.equal(out.sequences, ref.sequences), (name, s.last_stats)
            for a, b in zip(out.scores, ref.scores):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert s.last_stats.exact_output, (name, s.last_stats)  # (formerly `a and b or c`: checked nothing
            if policy == "auto":                                     # for other policies)
                assert s.last_stats.reason is not None, (name, s.last_stats)
            methods.append(s.last_stats.method)
            doc = torch.cat([doc, out.sequences[:, ids.shape[1]:]], 1)
    if policy == "optimistic":
        assert methods[0] == "full" and all(m == "optimistic" for m in methods[1:]), methods
        assert all(e.every_row() for e in s._entries.values())
    elif not served:
        assert "optimistic" not in methods and "re-positioned" in s.last_stats.reason
    _held_entries_are_exact(model, s)
