"""ReuseSession: exact prefix reuse, multi-donor optimistic decoding, block policies, budget, errors (tiny models)."""

import gc

import pytest
import torch

from hf_kvreuse.compat import output_cache
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.generation.mixin import enable
from hf_kvreuse.kv import kv_of
from hf_kvreuse.models import tiny_model
from hf_kvreuse.session import POLICIES, ReuseSession

from conftest import assert_kv_close, exact_prefill

GEN = dict(max_new_tokens=5, do_sample=False)


@pytest.fixture(scope="module")
def model():
    return enable(tiny_model("llama"))


def toks(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


def plain(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{**GEN, **kw})


def held_kv_is_exact(model, session, atol=1e-4):
    """Every held cache flagged exact holds the exact K/V of its tokens."""
    for e in session._entries.values():
        if e.exact:
            ref, _ = exact_prefill(model, e.ids[None])
            assert_kv_close(e.kv, ref, atol=atol, rtol=atol)


def test_full_policy_is_plain_generate(model):
    """``policy="full"`` gives plain generate's tokens and keeps the exact cache of prompt + answer.

    Planted bug that fails it: ``_store`` records ``sequences[0, 1:length+1]`` as the held tokens (K/V no longer
    match their ids)."""
    s = ReuseSession(model, policy="full")
    ids = toks(40, 0)
    out = s.generate(ids, **GEN)
    assert torch.equal(out, plain(model, ids))
    assert s.last_stats.method == "full" and s.last_stats.stored and len(s) == 1
    held_kv_is_exact(model, s)


@pytest.mark.parametrize("policy", ["prefix", "auto"])
@pytest.mark.parametrize("branch", [False, True])
def test_conversation_reuses_exact_prefix(model, policy, branch):
    """A prompt extending an earlier call (or branching off inside it) reuses its K/V as an exact prefix: tokens
    and logits equal plain generate's.

    Planted bug that fails it: the prefix policy loads one row too many (``k[..., :prefix + 1, :]``): when the
    prompt branches off inside the held tokens the cache holds a row of the old branch and every later
    position is off by one."""
    s = ReuseSession(model, policy=policy)
    ids = toks(50, 1)
    out = s.generate(ids, **GEN)
    ids2 = torch.cat([out[:, :45] if branch else out, toks(7, 2)], 1)
    got = s.generate(ids2, return_dict_in_generate=True, output_logits=True, **GEN)
    ref = plain(model, ids2, return_dict_in_generate=True, output_logits=True)
    st = s.last_stats
    assert st.method == "prefix" and st.exact_prefix_tokens == (45 if branch else out.shape[1] - 1)
    assert st.new_tokens == ids2.shape[1] - st.exact_prefix_tokens
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    held_kv_is_exact(model, s)
    # the first call's cache is a prefix of the second's (not kept twice) unless the second branched off
    assert len(s) == (2 if branch else 1)


def _agents_round(n_doc=120, seed=3):
    """Three agents: own role text, then a shared document."""
    doc = toks(n_doc, seed)
    roles = [toks(12, seed + 10 + i) for i in range(3)]
    return doc, roles


def test_auto_swap_before_first_token_is_plain_generate(model):
    """``auto`` with the exact cache swapped in before the first token (``max_optimistic_tokens=0``) gives plain
    generate's tokens and logits, while the background prefill computed only the rows past the exact prefix.

    Planted bug that fails it: ``BackgroundPrefill._prefill`` loads the prefix but still starts its loop at 0
    (``range(0, ...)``): the prefix rows are then in the exact cache twice."""
    s = ReuseSession(model, policy="auto", method_kwargs=dict(max_optimistic_tokens=0))
    doc, roles = _agents_round()
    out_a = s.generate(torch.cat([roles[0], doc], 1), agent="a", **GEN)
    # same agent, next round: its own prompt is an exact prefix, the other agent's answer comes after it
    out_b = s.generate(torch.cat([roles[1], doc], 1), agent="b", **GEN)
    ids = torch.cat([out_a, toks(6, 40), out_b[:, -5:], doc[:, :60]], 1)
    got = s.generate(ids, agent="a", return_dict_in_generate=True, output_logits=True, **GEN)
    ref = plain(model, ids, return_dict_in_generate=True, output_logits=True)
    st = s.last_stats
    assert st.method == "optimistic" and st.exact_prefix_tokens == out_a.shape[1] - 1
    assert st.background_tokens == ids.shape[1] - 1 - st.exact_prefix_tokens
    assert st.donor_tokens >= 60 and st.exact
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    held_kv_is_exact(model, s)


def test_spans_from_several_calls(model, monkeypatch):
    """Spans come from two earlier calls (own role text from one, document from the other); the optimistic
    cache's layer-0 K/V equal exact prefill's on every reused row, and after a swap at step 3 the tokens continue
    exactly.

    Planted bug that fails it: ``OptimisticCache._assemble`` copies every span from the first donor
    (``donors[0][i]`` instead of ``donors[sp.donor][i]``): the role rows then hold another call's K/V."""
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
    s = ReuseSession(model, policy="optimistic", method_kwargs=dict(max_optimistic_tokens=3))
    doc, roles = _agents_round(seed=5)
    other = toks(100, 77)
    s.generate(torch.cat([roles[0], other], 1), agent="a", **GEN)   # has a's role, not the document
    s.generate(torch.cat([roles[1], doc], 1), agent="b", **GEN)     # has the document
    ids = torch.cat([toks(3, 9), roles[0], doc], 1)                  # no exact prefix with either
    seen = {}
    from hf_kvreuse.cache_classes.optimistic import OptimisticCache

    orig = OptimisticCache._assemble

    def spy(self):
        orig(self)
        seen["kv"] = [(k.clone(), v.clone()) for k, v in kv_of(self)]
        seen["al"] = self.alignment

    monkeypatch.setattr(OptimisticCache, "_assemble", spy)
    out = s.generate(ids, agent="a", **GEN)
    st = s.last_stats
    assert st.donor_calls == 2 and {sp.donor for sp in seen["al"].spans} == {0, 1}
    assert st.donor_tokens == 12 + doc.shape[1] - 1 and st.exact_prefix_tokens == 0
    ref, _ = exact_prefill(model, ids[:, :-1])
    rows = torch.nonzero(seen["al"].target_to_donor() >= 0).flatten()
    (k0, v0), (rk, rv) = seen["kv"][0], kv_of(ref)[0]
    torch.testing.assert_close(k0[..., rows, :], rk[..., rows, :], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v0[..., rows, :], rv[..., rows, :], atol=1e-5, rtol=1e-5)
    n = ids.shape[1]
    assert torch.equal(out, plain(model, out[:, : n + 3], max_new_tokens=2))
    held_kv_is_exact(model, s)


def test_approximate_caches_are_never_an_exact_prefix(model):
    """A cache assembled by an approximate method (direct reuse) serves as a donor but never as an exact prefix.

    Planted bug that fails it: ``trusted`` keeps every held cache (``e.exact`` dropped from the filter): the next
    prompt then reuses direct reuse's stale rows as if exact."""
    s = ReuseSession(model, policy="direct")
    doc, roles = _agents_round(seed=8)
    s.generate(torch.cat([roles[0], doc], 1), **GEN)
    out = s.generate(torch.cat([roles[1], doc], 1), **GEN)
    assert s.last_stats.method == "direct" and not s.last_stats.exact
    s.generate(torch.cat([out, toks(5, 1)], 1), policy="prefix", **GEN)
    # the only exact held cache is the first call's, which shares no prefix with this prompt
    assert s.last_stats.exact_prefix_tokens == 0


def test_another_adapter_is_never_an_exact_prefix():
    """K/V made under another LoRA adapter are not an exact prefix for this one.

    Planted bug that fails it: entries are trusted whatever their ``producer`` (the fingerprint comparison
    dropped): the second adapter's prompt then reuses the first adapter's values."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False),
                        adapter_name="first")
    pm.add_adapter("second", LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    enable(pm)
    s = ReuseSession(pm, policy="auto", method_kwargs=dict(max_optimistic_tokens=0))
    ids = toks(60, 4)
    pm.set_adapter("first")
    out = s.generate(ids, **GEN)
    pm.set_adapter("second")
    ids2 = torch.cat([out, toks(4, 5)], 1)
    got = s.generate(ids2, **GEN)
    assert s.last_stats.exact_prefix_tokens == 0
    assert torch.equal(got, pm.generate(input_ids=ids2, attention_mask=torch.ones_like(ids2), **GEN))


@pytest.mark.parametrize("policy", ["blend", "epic", "tail", "direct"])
def test_block_policies(model, policy):
    """The block baselines run over the session's caches; blend at recompute ratio 1 is full prefill.

    Planted bug that fails it: ``_block_cache`` hands each block the held rows one late (``d + 1 : d + m + 1``):
    direct reuse keeps block rows as they are, and its layer-0 keys (exact after re-positioning) then differ."""
    doc, roles = _agents_round(seed=11)
    kw = dict(recompute_ratio=1.0) if policy == "blend" else {}
    s = ReuseSession(model, policy=policy, method_kwargs=kw)
    s.generate(torch.cat([roles[0], doc], 1), **GEN)
    ids = torch.cat([roles[1], doc], 1)
    got = s.generate(ids, return_dict_in_generate=True, output_logits=True, **GEN)
    st = s.last_stats
    assert st.method == policy and not st.exact and st.donor_tokens == doc.shape[1] - 1
    if policy == "blend":
        ref = plain(model, ids, return_dict_in_generate=True, output_logits=True)
        assert torch.equal(got.sequences, ref.sequences)
        torch.testing.assert_close(got.logits[0], ref.logits[0], atol=1e-4, rtol=1e-4)
    if policy == "direct":
        # layer 0 of a re-positioned block is exact (it depends on the token and its position only)
        ref, _ = exact_prefill(model, ids[:, :-1])
        k = kv_of(output_cache(got))[0][0]
        rows = slice(roles[1].shape[1], ids.shape[1] - 1)
        torch.testing.assert_close(k[..., rows, :], kv_of(ref)[0][0][..., rows, :], atol=1e-5, rtol=1e-5)


def test_focus_policy_recomputes_the_rows_the_prefixes_disagree_on(model):
    """Policy "focus" runs FocusRecomputeCache over the session's caches with the donor call's prefix as each block's
    donor prefix: a word of the new role text that the donor's lacks, planted in the document, is recomputed; with
    every row recomputed it is plain generate. Without a tokenizer the session refuses at once.
    Planted bug that fails it: ``_block_cache`` gives the focus cache no block prefixes (the blocks then look
    standalone: tail rows only)."""
    from conftest import WordTokenizer

    tok = WordTokenizer()
    doc, roles = _agents_round(seed=12)
    roles[1][0, -1] = 7
    roles[0][roles[0] == 7] = 8
    doc[0, 40] = 7                                       # the new role's word, in the shared document
    for k, exact in ((8, False), (10_000, True)):
        s = ReuseSession(model, policy="focus", method_kwargs=dict(tokenizer=tok, recompute_tokens=k))
        s.generate(torch.cat([roles[0], doc], 1), **GEN)
        ids = torch.cat([roles[1], doc], 1)
        got = s.generate(ids, return_dict_in_generate=True, output_logits=True, **GEN)
        st = s.last_stats
        assert st.method == "focus" and st.cache_stats["focus_rows"] >= 1
        if exact:
            ref = plain(model, ids, return_dict_in_generate=True, output_logits=True)
            assert torch.equal(got.sequences, ref.sequences)
            torch.testing.assert_close(got.logits[0], ref.logits[0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        ReuseSession(model, policy="focus")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        ReuseSession(model).generate(toks(10, 0), policy="focus", **GEN)


def test_budget_and_lru(model):
    """Held bytes never exceed ``max_bytes`` after a call; the least recently *used* cache goes first."""
    one = ReuseSession(model, policy="full")
    one.generate(toks(60, 0), **GEN)
    size = one.nbytes
    s = ReuseSession(model, policy="prefix", max_bytes=int(3.5 * size))
    a, b, c = toks(60, 1), toks(60, 2), toks(60, 3)
    out_a = s.generate(a, **GEN)
    s.generate(b, **GEN)
    s.generate(torch.cat([out_a[:, :30], toks(30, 9)], 1), **GEN)  # uses a's cache as its exact prefix
    assert s.last_stats.exact_prefix_tokens == 30
    s.generate(c, **GEN)  # over budget: b is the least recently used
    assert s.nbytes <= s.max_bytes and s.last_stats.evicted >= 1
    kept = [e.ids[:60] for e in s._entries.values()]
    assert not any(torch.equal(k, b[0]) for k in kept) and any(torch.equal(k, a[0]) for k in kept)


def test_memory_flat_over_1000_calls(model):
    """1,000 calls of a 3-agent loop under a budget: held bytes stay under it and live tensor memory is flat."""
    doc, roles = _agents_round(n_doc=40, seed=21)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and 1,000 calls stay within seconds
    try:
        _thousand_calls(model, doc, roles)
    finally:
        torch.set_num_threads(threads)


def _thousand_calls(model, doc, roles):
    from test_memory import live_tensor_bytes

    s = ReuseSession(model, max_bytes=200_000, method_kwargs=dict(max_optimistic_tokens=1))
    answers = torch.zeros(1, 0, dtype=torch.long)
    marks = {}
    for i in range(1000):
        ids = torch.cat([roles[i % 3], doc, answers[:, -12:]], 1)
        out = s.generate(ids, agent=str(i % 3), max_new_tokens=2, do_sample=False)
        answers = torch.cat([answers, out[:, ids.shape[1]:]], 1)[:, -24:]
        assert s.nbytes <= s.max_bytes
        if i in (99, 999):
            del out
            marks[i] = live_tensor_bytes()
    assert marks[999] <= marks[99] + 100_000
    assert s.calls == 1000 and s.last_stats.method in POLICIES


def test_failed_call_leaves_session_as_it_was(model):
    """An error inside generate leaves the held caches and their order untouched."""
    s = ReuseSession(model)
    doc, roles = _agents_round(seed=30)
    s.generate(torch.cat([roles[0], doc], 1), **GEN)
    s.generate(torch.cat([roles[1], doc], 1), **GEN)
    before = [(k, e.ids.clone(), [t.data_ptr() for kv in e.kv for t in kv]) for k, e in s._entries.items()]

    class Boom:
        def put(self, value):
            if value.dim() == 2 and value.shape[-1] == 1 or value.dim() == 1:
                raise RuntimeError("boom")

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="boom"):
        s.generate(torch.cat([roles[2], doc], 1), streamer=Boom(), **GEN)
    after = [(k, e.ids, [t.data_ptr() for kv in e.kv for t in kv]) for k, e in s._entries.items()]
    assert [a[0] for a in before] == [a[0] for a in after]
    assert all(torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(before, after))
    gc.collect()
    # and the session still works
    s.generate(torch.cat([roles[2], doc], 1), **GEN)


def test_errors(model):
    s = ReuseSession(model)
    with pytest.raises(ValueError, match="policy"):
        ReuseSession(model, policy="nope")
    with pytest.raises(ValueError, match="one prompt"):
        s.generate(toks(10, 0).repeat(2, 1), **GEN)
    with pytest.raises(ValueError, match="builds the cache"):
        s.generate(toks(10, 0), past_key_values=object(), **GEN)
    with pytest.raises(ValueError, match="padding"):
        ids = toks(10, 0)
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        s.generate(ids, attention_mask=mask, **GEN)
    with pytest.raises(ValueError, match="at least 2"):
        s.generate(toks(1, 0), **GEN)
    with pytest.raises(ValueError, match="translated"):
        s.generate(toks(10, 0), policy="translated", **GEN)
    assert len(s) == 0


def _two_adapter_model():
    from peft import LoraConfig, get_peft_model

    cfg = dict(r=4, target_modules=["v_proj"], init_lora_weights=False)
    pm = get_peft_model(tiny_model("llama"), LoraConfig(**cfg), adapter_name="plan")
    pm.add_adapter("act", LoraConfig(**cfg))
    return enable(pm)


@pytest.mark.parametrize("method", ["nonshared", "prelrshared"])
def test_base_lr_policy_is_base_lr_cache(method):
    """``policy="base_lr"``: the session's trajectory cache gives what one BaseLRCache driven by hand gives, and
    its nonshared method is plain generate under each adapter.

    Planted bug that fails it: ``_generate_base_lr`` builds a new BaseLRCache every call (``self._trajectory =
    None`` first): nothing is cached any more (``exact_prefix_tokens`` stays 0)."""
    from hf_kvreuse import BaseLRCache

    pm = _two_adapter_model()
    s = ReuseSession(pm, policy="base_lr", method_kwargs=dict(method=method))
    by_hand = BaseLRCache(pm, method=method)
    ids = toks(40, 1)
    outs, hand = [], []
    for turn, adapter in enumerate(["plan", "act", "plan"]):
        pm.set_adapter(adapter)
        got = s.generate(ids, agent=adapter, **GEN)
        ref = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=by_hand, **GEN)
        assert torch.equal(got, ref)
        if method == "nonshared":
            assert torch.equal(got, pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **GEN))
        if turn == 2 or (turn and method != "nonshared"):  # nonshared: each agent reuses only its own turns
            assert s.last_stats.exact_prefix_tokens > 0
        assert s.last_stats.exact == (method == "nonshared") and s.nbytes > 0
        ids = torch.cat([got, toks(6, 10 + turn)], 1)


def test_mode_options_reach_the_cache_class(model):
    """``"MODE:key=value"`` (``hf-kvreuse bench --methods``'s ablation syntax) updates the named mode's
    ``method_kwargs``; bad specs are refused naming the spec.

    Planted bug that fails it: ``resolve_mode`` drops the options (every spec runs its plain mode)."""
    from hf_kvreuse.session import resolve_mode

    assert resolve_mode("prefix") == dict(policy="prefix", method_kwargs={})
    assert resolve_mode("auto-verify:max_optimistic_tokens=4") == dict(
        policy="auto", rebase="verify", method_kwargs=dict(max_optimistic_tokens=4))
    assert resolve_mode("auto-commit-gate:gate=0.3:max_optimistic_tokens=None")["method_kwargs"] == dict(
        gate=0.3, max_optimistic_tokens=None)
    assert resolve_mode("auto-commit-repair:repair=epic")["method_kwargs"] == dict(repair="epic", repair_ratio=0.15)
    s = ReuseSession.for_method(model, "auto-verify:max_optimistic_tokens=2", method_kwargs=dict(min_span=3))
    assert (s.policy, s.rebase) == ("auto", "verify")
    assert s.method_kwargs == dict(max_optimistic_tokens=2, min_span=3)
    for bad in ("nope", "auto:4", "auto:=3", "auto:max optimistic=1", "auto-verify:max_optimstic_tokens=4"):
        with pytest.raises(ValueError, match="method="):
            resolve_mode(bad)
    with pytest.raises(ValueError, match="not an option of any"):
        ReuseSession.for_method(model, "auto-commit:gat=0.5")


def test_hold_checks_dtype_and_places_layers(model, monkeypatch):
    """``hold()`` refuses K/V of another dtype than the model's (naming both and the model), and puts each layer's
    K/V on that layer's device (``meta`` stands in for a second device); a held exact prefix then serves generate.

    Planted bug that fails it: ``hold()`` stores the K/V where the caller left them (the code before)."""
    from hf_kvreuse import session as session_mod

    ids = torch.randint(3, 120, (1, 12), generator=torch.Generator().manual_seed(0))
    cache, _ = exact_prefill(model, ids)
    kv = kv_of(cache)
    s = ReuseSession(model, policy="prefix")
    with pytest.raises(ValueError, match="dtype.*LlamaForCausalLM"):
        s.hold(ids, [(k.half(), v.half()) for k, v in kv], exact=True)
    s.hold(ids, kv, exact=True)
    longer = torch.cat([ids, torch.tensor([[5, 6, 7]])], 1)
    ref = model.generate(longer, max_new_tokens=3, do_sample=False)
    assert torch.equal(s.generate(longer, max_new_tokens=3, do_sample=False), ref)
    assert s.last_stats.exact_prefix_tokens == 12
    n = model.config.num_hidden_layers
    devices = [torch.device("cpu")] * (n - 1) + [torch.device("meta")]
    monkeypatch.setattr(session_mod, "layer_devices", lambda m: devices)
    s2 = ReuseSession(model, policy="prefix")
    s2.hold(ids, kv, exact=True)
    assert [k.device for k, _ in s2._entries[0].kv] == devices
