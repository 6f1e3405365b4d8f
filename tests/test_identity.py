"""Identity = everything that determines a forward (issue 63, findings 1, 3, 4, 5): weights written in place
through ``p.data`` or merged by peft, weights held in buffers and quantized packed params, LoRA scaling, and a
donor made under another adapter are never served as this model's exact K/V. Each exactness test compares with
plain ``generate`` and names, in its docstring, a planted bug that makes it fail (docs/mutations_pending/identity.md).
"""

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_kvreuse import OptimisticCache, ReuseSession, enable, fingerprint
from hf_kvreuse.models import tiny_model

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


def _out(m, ids, **kw):
    return m.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY, **kw)


def _assert_equal_to_plain(model, got, ids, plain_model=None):
    ref = _out(plain_model or model, ids)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _lora(targets=("q_proj", "v_proj"), names=("a", "b"), seed=1):
    """A peft model on tiny llama with random, clearly non-zero LoRA adapters (peft's default init has B = 0)."""
    from peft import LoraConfig, get_peft_model

    cfg = dict(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    pm = get_peft_model(tiny_model("llama"), LoraConfig(**cfg), adapter_name=names[0])
    for name in names[1:]:
        pm.add_adapter(name, LoraConfig(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return pm.eval()


# -- finding 1: writes that bypass the version counter -----------------------------------------------------------
@pytest.mark.parametrize("forget", [False, True])
def test_data_write_is_seen_by_the_session(forget):
    """A write through ``p.data`` (torch keeps the version counter) between two session calls: the second call
    does not reuse the first call's prefix as exact and equals plain ``generate`` with the new weights, with or
    without ``fingerprint.forget``. Planted bug: ``weights_state`` leaves out the sampled elements
    (``seen = b""``): the old prefix is served as exact and the scores differ."""
    model = enable(tiny_model("llama"))
    s = ReuseSession(model, policy="prefix", min_donor_tokens=8)
    a = _ids(30, 1)
    s.generate(a, max_new_tokens=4, **GREEDY)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.data.mul_(-1.5)  # no version bump
    if forget:
        fingerprint.forget(model)
    ids = torch.cat([a, _ids(6, 2)], 1)
    got = s.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY)
    assert s.last_stats.exact_prefix_tokens == 0
    _assert_equal_to_plain(model, got, ids)


def test_data_write_then_save_does_not_relabel_old_entries(tmp_path):
    """``save()`` after a ``p.data`` write does not label the entries of the old weights with the new weights'
    fingerprint: they are left out (with the warning), and a session loaded from the file serves nothing of
    them. Planted bugs: ``weights_state`` leaves out the sampled elements (the old entries are saved under the
    new weights' fingerprint and the loaded session serves them as exact); ``_param_digest`` leaves the sample
    out of its cache key (the fingerprint does not change without ``forget``)."""
    model = enable(tiny_model("llama"))
    s = ReuseSession(model, policy="prefix", min_donor_tokens=8)
    a = _ids(30, 3)
    s.generate(a, max_new_tokens=4, **GREEDY)
    fp_old = fingerprint.model_fingerprint(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.data.add_(0.5)
    assert fingerprint.model_fingerprint(model) != fp_old  # seen without forget()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.save(tmp_path / "s")
    loaded = ReuseSession.load(tmp_path / "s", model, policy="prefix", min_donor_tokens=8)
    ids = torch.cat([a, _ids(6, 4)], 1)
    got = loaded.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY)
    assert loaded.last_stats.exact_prefix_tokens == 0
    _assert_equal_to_plain(model, got, ids)


def test_merge_and_unload_is_seen_by_the_session():
    """peft's ``merge_and_unload`` (``weight.data += delta``) after a call on the base model: the next call on the
    merged model equals plain ``generate`` and reuses no exact prefix of the unmerged weights. Planted bug:
    ``weights_state`` leaves out the sampled elements: the pre-adapter prefix is served as exact."""
    from peft import LoraConfig, get_peft_model

    base = enable(tiny_model("llama"))
    s = ReuseSession(base, policy="prefix", min_donor_tokens=8)
    a = _ids(30, 5)
    s.generate(a, max_new_tokens=4, **GREEDY)
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                                         init_lora_weights=False))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    merged = pm.merge_and_unload()
    assert merged is base
    ids = torch.cat([a, _ids(6, 6)], 1)
    got = s.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY)
    assert s.last_stats.exact_prefix_tokens == 0
    _assert_equal_to_plain(base, got, ids)


def test_sample_sees_a_write_anywhere_in_a_strided_column():
    """The sampled positions of a 2-D weight spread over its columns, not one column: a ``.data`` write to a
    single column that holds a sample is seen. (Writes that change no sampled element are the documented gap.)"""
    model = tiny_model("llama")
    w = model.model.layers[0].mlp.down_proj.weight
    before = fingerprint.weights_state(model)
    positions = fingerprint.sample_positions(w.numel(), w.shape[-1])
    assert len({i % w.shape[1] for i in positions}) == len(positions)  # one sample per column hit
    with torch.no_grad():
        w.data.view(-1)[positions[3]] += 1.0  # one element, a sampled one, no version bump
    assert fingerprint.weights_state(model) != before


# -- finding 3: weights held as buffers and packed params -----------------------------------------------------
def test_buffer_write_is_seen_by_the_session():
    """A write to a buffer the forward reads (the rotary ``inv_freq``) between two calls: the next call equals
    plain ``generate`` with the new buffer. Planted bug: ``_tensors`` yields parameters only (no buffers): the
    old prefix is served as exact."""
    model = enable(tiny_model("llama"))
    s = ReuseSession(model, policy="prefix", min_donor_tokens=8)
    a = _ids(30, 7)
    s.generate(a, max_new_tokens=4, **GREEDY)
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.5)
    ids = torch.cat([a, _ids(6, 8)], 1)
    got = s.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY)
    assert s.last_stats.exact_prefix_tokens == 0
    _assert_equal_to_plain(model, got, ids)


def _quantized(model):
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def test_quantized_models_of_other_weights_are_told_apart(tmp_path):
    """Two dynamic-int8 models whose Linear weights differ (their parameters, embeddings and norms, are equal)
    get different fingerprints, and a session saved from one is refused on load into the other. Planted bug: ``_tensors`` leaves out packed weights (``_PACKED_ATTRS = ()``): the
    fingerprints are equal and the session loads."""
    m1 = tiny_model("llama")
    m2 = copy.deepcopy(m1)
    with torch.no_grad():
        for layer in m2.model.layers:
            layer.self_attn.k_proj.weight.mul_(-1.0)
    q1, q2 = enable(_quantized(m1)), enable(_quantized(m2))
    assert fingerprint.model_fingerprint(q1) != fingerprint.model_fingerprint(q2)
    s = ReuseSession(q1, policy="prefix", min_donor_tokens=8)
    a = _ids(30, 9)
    s.generate(a, max_new_tokens=4, **GREEDY)
    s.save(tmp_path / "q")
    with pytest.raises(ValueError):
        ReuseSession.load(tmp_path / "q", q2, policy="prefix", min_donor_tokens=8)


def test_packed_params_replaced_are_seen():
    """``set_weight_bias`` on a dynamic-int8 Linear (a new packed object) changes the fingerprint and the weights
    state."""
    q = _quantized(tiny_model("llama"))
    fp, st = fingerprint.model_fingerprint(q), fingerprint.weights_state(q)
    lin = q.model.layers[0].self_attn.k_proj
    w, b = lin._weight_bias()
    w2 = torch.quantize_per_tensor(-w.dequantize(), w.q_scale(), w.q_zero_point(), w.dtype)
    lin.set_weight_bias(w2, b)
    assert fingerprint.weights_state(q) != st
    assert fingerprint.model_fingerprint(q) != fp


# -- finding 4: LoRA scaling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["set_scale", "rescale"])
def test_lora_scaling_is_part_of_the_identity(how):
    """K/V held at full adapter strength are not reused at another strength (peft's ``set_scale`` /
    ``rescale_adapter_scale`` touch no parameter): the call equals plain ``generate`` at that strength. Planted
    bug: ``_adapter_state`` leaves out ``scaling``: the full-strength prefix is served as exact."""
    from peft.helpers import rescale_adapter_scale
    from peft.tuners.lora import LoraLayer

    pm = enable(_lora(targets=("k_proj", "v_proj"), names=("a",)))
    s = ReuseSession(pm, policy="prefix", min_donor_tokens=8)
    a = _ids(30, 10)
    s.generate(a, max_new_tokens=4, **GREEDY)
    ids = torch.cat([a, _ids(6, 11)], 1)
    if how == "set_scale":
        for m in pm.modules():
            if isinstance(m, LoraLayer):
                m.set_scale("a", 0.25)
        got = s.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY)
        stats = s.last_stats
        _assert_equal_to_plain(pm, got, ids)
    else:
        with rescale_adapter_scale(pm, 0.25):
            got = s.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY)
            stats = s.last_stats
            _assert_equal_to_plain(pm, got, ids)
    assert stats.exact_prefix_tokens == 0


def test_adapter_state_covers_every_tuner_layer():
    """One layer's scaling changed (the others left) changes the adapter state: every tuner layer counts, not the
    first one. Planted bug: ``_adapter_state`` keeps the first tuner layer only (``break`` after it)."""
    from peft.tuners.lora import LoraLayer

    pm = _lora(names=("a",))
    before = fingerprint.weights_state(pm)
    last = [m for m in pm.modules() if isinstance(m, LoraLayer)][-1]
    last.scaling["a"] *= 0.5
    assert fingerprint.weights_state(pm) != before


# -- finding 5: donor_exact under another adapter -----------------------------------------------------------------
def test_donor_exact_refuses_a_cache_of_another_adapter():
    """A cache this model returned under adapter "a" (q/v LoRA: layer-0 keys unchanged), passed with
    ``donor_exact=True`` while adapter "b" is active: refused with the reason (its producer tag shows other
    weights), never served as an exact prefix. Planted bug: ``stale_producer`` returns None (the tag is
    ignored) and the exact-donor probe is skipped: the layer-0 key probe passes and the output differs from
    plain ``generate``."""
    pm = enable(_lora())
    a = _ids(30, 12)
    pm.set_adapter("a")
    out = pm.generate(a, max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    donor, donor_ids = out.past_key_values, out.sequences[:, :-1]
    pm.set_adapter("b")
    ids = torch.cat([a, _ids(6, 13)], 1)
    try:
        cache = OptimisticCache(pm, ids, donor, donor_ids, donor_exact=True, max_optimistic_tokens=0)
    except ValueError as e:
        assert "adapter" in str(e) and "donor_exact" in str(e)
        return
    got = pm.generate(ids, cache=cache, max_new_tokens=4, output_scores=True, return_dict_in_generate=True,
                      **GREEDY)
    _assert_equal_to_plain(pm, got, ids)


def test_donor_exact_probe_sees_another_adapter_without_a_tag():
    """The same donor handed over without its tag (its K/V copied into a new DynamicCache): the exact-donor probe
    compares every layer's keys and values over the donor's first tokens and refuses it. Planted bugs: the
    exact-donor probe is skipped (``check_exact_donor`` returns after the tag check); the probe compares layer
    0's keys only (the old probe): the output differs from plain ``generate``."""
    pm = enable(_lora())
    a = _ids(30, 14)
    pm.set_adapter("a")
    out = pm.generate(a, max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    donor = DynamicCache(config=pm.config)
    for i, layer in enumerate(out.past_key_values.layers):
        donor.update(layer.keys.clone(), layer.values.clone(), i)
    donor_ids = out.sequences[:, :-1]
    pm.set_adapter("b")
    ids = torch.cat([a, _ids(6, 15)], 1)
    try:
        cache = OptimisticCache(pm, ids, donor, donor_ids, donor_exact=True, max_optimistic_tokens=0)
    except ValueError as e:
        assert "donor_exact" in str(e)
        return
    got = pm.generate(ids, cache=cache, max_new_tokens=4, output_scores=True, return_dict_in_generate=True,
                      **GREEDY)
    _assert_equal_to_plain(pm, got, ids)


def test_donor_exact_of_this_adapter_still_reuses():
    """The same adapter's own cache with ``donor_exact=True`` is still an exact prefix (tagged and untagged),
    equal to plain ``generate``."""
    pm = enable(_lora())
    a = _ids(30, 16)
    pm.set_adapter("b")
    out = pm.generate(a, max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    untagged = DynamicCache(config=pm.config)
    for i, layer in enumerate(out.past_key_values.layers):
        untagged.update(layer.keys.clone(), layer.values.clone(), i)
    ids = torch.cat([a, _ids(6, 17)], 1)
    for donor in (out.past_key_values, untagged):
        cache = OptimisticCache(pm, ids, donor, out.sequences[:, :-1], donor_exact=True, max_optimistic_tokens=0)
        got = pm.generate(ids, cache=cache, max_new_tokens=4, output_scores=True, return_dict_in_generate=True,
                          **GREEDY)
        assert cache.stats.prefix_tokens >= 30
        _assert_equal_to_plain(pm, got, ids)
