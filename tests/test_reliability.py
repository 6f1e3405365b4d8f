"""Never silently wrong, round two (issue 21): the one-expression form on a model never enabled, sliding-window
models in ReuseSession, generate options (use_cache, beams, several sequences), the latent policy after a shared
prefix, corrupted artifacts, foreign donors, logits processors in the divergence count, offloaded models, a
source cache in the session's method_kwargs, reading a session from another thread, and the weights fingerprint.

Every test names in its docstring a planted bug that makes it fail (docs/MUTATIONS.md)."""

import threading

import pytest
import torch
import transformers

from hf_kvreuse import (DirectReuseCache, KVMapper, LatentBridge, OptimisticCache, ReuseSession, TranslatedCache,
                        enable, output_cache)
from hf_kvreuse.compat import HAS_QUERY_OFFSET
from hf_kvreuse.artifacts import CorruptArtifactError, record_files
from hf_kvreuse.fingerprint import model_fingerprint
from hf_kvreuse.generation import mixin
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.kv import dynamic_cache_from_kv, kv_of
from hf_kvreuse.models import tiny_model
from hf_kvreuse.models.arch_zoo import zoo_model

GEN = dict(max_new_tokens=5, do_sample=False)


def toks(n, seed, vocab=128):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def scores_of(out):
    return torch.stack(out.scores)


# -- 1. the one-expression form -----------------------------------------------------------------------------------
@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_one_expression_form_on_a_fresh_model(keyword):
    """``model.generate(ids, cache=DirectReuseCache(model, ...))`` in one expression, on a model never enabled,
    uses the cache: the same tokens and logits as the two-line form, and the cache's stats are filled.

    Planted bug that fails it: ``hf_kvreuse/__init__.py`` does not call ``install_routing()`` (the stock generate
    then runs and the never-prepared cache refuses its first update)."""
    ids = toks(40, 0)
    fresh = tiny_model("llama", seed=11)
    assert not mixin.is_enabled(fresh)
    out = fresh.generate(ids, **{keyword: (c := DirectReuseCache(fresh, ids, [(10, 30)]))}, output_scores=True,
                         return_dict_in_generate=True, **GEN)
    assert c.phase == "done" and c.stats.reused_tokens == 20
    two_lines = DirectReuseCache(fresh, ids, [(10, 30)])
    ref = fresh.generate(ids, cache=two_lines, output_scores=True, return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(scores_of(out), scores_of(ref), atol=1e-5, rtol=1e-5)


def test_a_cache_whose_hooks_never_ran_refuses_its_first_update():
    """Second line of defence: if transformers' own generate runs (here: the routing removed, as a model class
    that overrides ``generate`` would do), the cache refuses instead of silently acting as an empty cache.

    Planted bug that fails it: ``KVReuseCache.update`` without the ``phase == "new"`` check (plain prefill, no
    error)."""
    ids = toks(40, 0)
    fresh = tiny_model("llama", seed=12)
    mixin.uninstall_routing()
    try:
        with pytest.raises(RuntimeError, match="before any hf_kvreuse generate prepared it"):
            fresh.generate(ids, past_key_values=_built_then_disabled(fresh, ids), **GEN)
    finally:
        mixin.install_routing()


def _built_then_disabled(model, ids):
    """A cache built on ``model`` and the model put back to its plain class (so the stock generate runs)."""
    cache = DirectReuseCache(model, ids, [(10, 30)])
    mixin.disable(model)
    return cache


# -- 2. sliding-window models in the session -------------------------------------------------------------------------
SLIDING = {
    "mistral": dict(sliding_window=8, layer_types=["sliding_attention"] * 4),
    "mistral-eager": dict(sliding_window=8, layer_types=["sliding_attention"] * 4),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                  layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2),
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
    "cohere2": dict(sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                                   "full_attention"]),
}


def _sliding_model(name):
    arch = name.split("-")[0]
    try:
        m = zoo_model(arch, **SLIDING[name])
    except Exception as e:  # noqa: BLE001 - an architecture missing from this transformers release
        pytest.skip(f"{arch} does not build here: {e}")
    if name.endswith("-eager"):
        m.config._attn_implementation = "eager"
    if not any(getattr(layer, "is_sliding", False)
               for layer in transformers.DynamicCache(config=m.config).layers):
        pytest.skip(f"{arch} builds no sliding-window cache layer on transformers {transformers.__version__}")
    return m


@pytest.mark.parametrize("policy", ["prefix", "auto"])
@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_window_session_matches_plain_generate(name, policy):
    """A conversation in a session on a sliding-window model (window 8, prompts far past it), with a branch off
    an earlier turn: every call gives plain generate's tokens and logits, and held entries carry the right ids.

    Planted bugs that fail it: ``kv.load_kv`` does not set ``cumulative_length`` (second call: other tokens, or a
    crash under eager); ``ReuseSession._store`` takes layer 0's row count as the token count (ids mislabelled)."""
    m = _sliding_model(name)
    s = ReuseSession(m, policy=policy)
    ids = toks(12, 0, vocab=200)
    history = []
    for turn in range(4):
        if turn == 3:  # branch: keep the first turn's prompt + answer only, then new text
            ids = torch.cat([history[0][:, :14], toks(3, 99, vocab=200)], 1)
        out = s.generate(ids, output_scores=True, return_dict_in_generate=True, **GEN)
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), output_scores=True, return_dict_in_generate=True,
                         **GEN)
        assert torch.equal(out.sequences, ref.sequences), (turn, s.last_stats)
        torch.testing.assert_close(scores_of(out), scores_of(ref), atol=1e-4, rtol=1e-4)
        if turn in (1, 2) and policy == "prefix":  # "auto" may measure plain prefill sooner on a tiny model
            assert s.last_stats.exact_prefix_tokens == history[-1].shape[1] - 1, s.last_stats
        history.append(out.sequences)
        ids = torch.cat([out.sequences, toks(4, turn + 10, vocab=200)], 1)
    _held_entries_are_exact(m, s)


def _held_entries_are_exact(model, session):
    from hf_kvreuse.compat import cache_kwargs

    for e in session._entries.values():
        ref = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(e.ids[None], use_cache=True, **cache_kwargs(ref))
        # the rows a cache of all its tokens keeps (a sliding layer's window, also where the entry holds every row)
        for (k, v), (rk, rv) in zip(e.prefix_kv(e.ids.numel(), session._windows), kv_of(ref)):
            torch.testing.assert_close(k, rk, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, rv, atol=1e-4, rtol=1e-4)


def test_sliding_window_model_refuses_approximate_policies():
    """Block policies are refused on a sliding-window model; "optimistic" needs held caches with every row."""
    m = _sliding_model("mistral")
    with pytest.raises(ValueError, match="sliding-window.*sliding_history=True"):
        ReuseSession(m, policy="optimistic", sliding_history=False)
    ReuseSession(m, policy="optimistic")
    s = ReuseSession(m)
    with pytest.raises(ValueError, match="sliding-window"):
        s.generate(toks(12, 0), policy="blend", **GEN)


# -- 3, 4. generate options -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return enable(tiny_model("llama"))


def test_session_use_cache_false_is_plain_generate(llama):
    """``session.generate(..., use_cache=False)`` gives plain generate's tokens (with ``use_cache=False``) and holds
    nothing; a cache passed with ``use_cache=False`` is refused.

    Planted bug that fails it: ``ReuseSession.generate`` does not route ``use_cache=False`` to
    ``_generate_uncached`` (the call decodes from a cache that generate fills with duplicate rows: other tokens)."""
    for policy in ("full", "auto"):
        s = ReuseSession(llama, policy=policy)
        first = s.generate(toks(30, 1), **GEN)
        ids2 = torch.cat([first, toks(4, 2)], 1)  # extends the held call: "auto" would reuse its prefix
        out = s.generate(ids2, use_cache=False, max_new_tokens=6, do_sample=False)
        assert torch.equal(out, llama.generate(ids2, use_cache=False, max_new_tokens=6, do_sample=False))
        assert not s.last_stats.stored and len(s) == 1
    ids = toks(30, 3)
    with pytest.raises(ValueError, match="use_cache=False"):
        llama.generate(ids, cache=DirectReuseCache(llama, ids, [(5, 20)]), use_cache=False, **GEN)


@pytest.mark.parametrize("opts", [dict(num_beams=3, num_return_sequences=2, max_new_tokens=5),
                                  dict(do_sample=True, num_return_sequences=2, max_new_tokens=5, top_k=20)])
def test_session_beams_and_several_sequences(llama, opts):
    """Beam search and ``num_return_sequences > 1`` in a session: plain generate's sequences (exact prefix
    reused), nothing held from them, and the session keeps working for batch-1 calls afterwards.

    Planted bugs that fail it: ``_generate`` stores the call's batch-2 cache (later calls fail); it passes the
    timing streamer to beam search ("streamer cannot be used with beam search"); it does not expand the exact
    prefix to the call's sequences (generate expands the prompt only: a size mismatch)."""
    s = ReuseSession(llama)
    ids = toks(30, 3)
    first = s.generate(ids, **GEN)
    ids2 = torch.cat([first, toks(4, 4)], 1)
    torch.manual_seed(0)
    got = s.generate(ids2, **opts)
    torch.manual_seed(0)
    ref = llama.generate(ids2, attention_mask=torch.ones_like(ids2), **opts)
    assert torch.equal(got, ref)
    assert s.last_stats.exact_prefix_tokens == first.shape[1] - 1 and not s.last_stats.stored and len(s) == 1
    ids3 = torch.cat([first, toks(6, 5)], 1)
    assert torch.equal(s.generate(ids3, **GEN), llama.generate(ids3, **GEN))
    with pytest.raises(ValueError, match="decodes one sequence"):
        s.generate(ids3, policy="optimistic", num_beams=2, max_new_tokens=3)


# -- 5. the latent policy after a shared prefix ---------------------------------------------------------------------
def test_latent_policy_with_a_shared_prefix(llama):
    """``policy="latent"`` on a prompt that shares a prefix with a held cache (the common case) runs: the span at
    token 0 is the agent's own prefix, computed, not a remedied block.

    Planted bug that fails it: ``_generate`` keeps the aligned span at token 0 as a block (LatentRemedyCache:
    "the first block must start after ...")."""
    # latent rows need Cache.get_query_offset (transformers>=5.17); below it the span logic is checked with n = 0
    bridge = LatentBridge(llama, n_latent=2 if HAS_QUERY_OFFSET else 0, hidden=16)
    s = ReuseSession(llama, method_kwargs=dict(bridge=bridge))
    doc = toks(30, 6)
    role_a, role_b = toks(6, 7), toks(6, 8)
    s.generate(torch.cat([role_a, doc], 1), **GEN)
    ids = torch.cat([role_a, doc[:, :2], role_b, doc], 1)  # shares role_a + 2 tokens with the held call
    out = s.generate(ids, policy="latent", **GEN)
    assert s.last_stats.method == "latent" and out.shape[1] == ids.shape[1] + 5
    assert s.last_stats.donor_tokens >= 29 and s.last_stats.exact_prefix_tokens == 0


# -- 6. corrupted artifacts -----------------------------------------------------------------------------------------
def _flip_byte(path, offset=-17):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def tiny_pair():
    src = tiny_model("qwen2", seed=1, num_hidden_layers=2)
    tgt = enable(tiny_model("qwen2", seed=2, num_hidden_layers=3))
    calib = [torch.randint(3, 128, (32,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    return src, tgt, KVMapper.fit(src, tgt, calib, stride=1, progress=False)


def test_corrupted_mapper_refused(tiny_pair, tmp_path):
    """A mapper file with one flipped byte (same size) is refused on load; one whose tensors hold NaN (with a
    matching hash, as a diverged fit would save) is refused too; an intact one loads.

    Planted bugs that fail it: ``artifacts.verify_file`` returns without comparing the sha256 (flipped byte loads);
    ``artifacts.check_finite`` skipped on load (the NaN map loads, TranslatedCache emits token 0)."""
    from safetensors.torch import load_file, save_file

    from hf_kvreuse.models.offline import sha256_of

    src, tgt, mapper = tiny_pair
    mapper.save(tmp_path / "ok")
    KVMapper.load(tmp_path / "ok", src, tgt)
    mapper.save(tmp_path / "flip")
    _flip_byte(tmp_path / "flip" / "mapper.safetensors")
    with pytest.raises(CorruptArtifactError, match="sha256"):
        KVMapper.load(tmp_path / "flip", src, tgt)
    mapper.save(tmp_path / "nan")
    f = tmp_path / "nan" / "mapper.safetensors"
    ts = load_file(str(f))
    ts["1.w_v"][0, 0] = float("nan")
    save_file(ts, str(f))
    import json
    meta = json.loads((tmp_path / "nan" / "mapper.json").read_text())
    meta["sha256"] = {f.name: sha256_of(f)}
    from hf_kvreuse.safe_files import sign

    (tmp_path / "nan" / "mapper.json").write_text(json.dumps(sign(meta)))  # re-signed: only the values are wrong
    with pytest.raises(CorruptArtifactError, match="non-finite"):
        KVMapper.load(tmp_path / "nan", src, tgt)


def test_corrupted_bridge_and_adapter_refused(llama, tmp_path):
    """A LatentBridge checkpoint and a role adapter folder with one flipped byte are refused on load.

    Planted bug that fails it: ``LatentBridge.load`` / ``react.load_role_adapters`` read the tensors without
    ``read_artifact`` / ``verify_files``."""
    import shutil

    from hf_kvreuse.workflows import react

    bridge = LatentBridge(llama, n_latent=2, hidden=16)
    bridge.save(tmp_path / "bridge")
    LatentBridge.load(tmp_path / "bridge", llama)
    _flip_byte(tmp_path / "bridge" / "bridge.safetensors")
    with pytest.raises(CorruptArtifactError, match="sha256"):
        LatentBridge.load(tmp_path / "bridge", llama)
    shipped = react.role_adapters_dir("smollm2")
    shutil.copytree(shipped, tmp_path / "adapters")
    _flip_byte(tmp_path / "adapters" / "act" / "adapter_model.safetensors")
    with pytest.raises(CorruptArtifactError, match="'act'"):
        react.load_role_adapters(llama, tmp_path / "adapters")
    record_files(tmp_path / "adapters" / "act")  # re-recorded: the check passes (and the shape check refuses)
    with pytest.raises(ValueError, match="another model"):
        react.load_role_adapters(llama, tmp_path / "adapters")


# -- 7. foreign donors --------------------------------------------------------------------------------------------------
def _agents():
    g = torch.Generator().manual_seed(0)
    ids_a = torch.randint(3, 128, (1, 40), generator=g)
    ids_b = torch.cat([torch.randint(3, 128, (1, 5), generator=g), ids_a[:, 4:]], 1)
    return ids_a, ids_b


def test_foreign_donor_refused(llama):
    """A donor made by another model of the same shape is refused; this model's own donor is accepted, tagged
    (returned by its generate) or not (a bare copy of its K/V: probed); ``verify_donor=False`` trusts any.

    Planted bug that fails it: ``model_check.check_donor`` returns at once (another model's cache is accepted and
    6 of 9 optimistic tokens diverge)."""
    other = tiny_model("llama", seed=1)
    ids_a, ids_b = _agents()
    out_o = other.generate(ids_a, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    out_m = llama.generate(ids_a, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="not computed by this model"):
        OptimisticCache(llama, ids_b, output_cache(out_o), out_o.sequences, rebase="commit")
    OptimisticCache(llama, ids_b, output_cache(out_m), out_m.sequences, rebase="commit")
    bare = dynamic_cache_from_kv([(k.clone(), v.clone()) for k, v in kv_of(output_cache(out_m))], llama.config)
    OptimisticCache(llama, ids_b, bare, out_m.sequences, rebase="commit")
    OptimisticCache(llama, ids_b, output_cache(out_o), out_o.sequences, verify_donor=False, rebase="commit")


def test_foreign_source_cache_refused(tiny_pair):
    """TranslatedCache refuses a ``source_cache`` that its source model did not compute.

    Planted bug that fails it: ``TranslatedCache.__init__`` does not call ``check_donor`` on ``source_cache``."""
    from hf_kvreuse.compat import cache_kwargs

    src, tgt, mapper = tiny_pair
    ids = toks(30, 9)
    impostor = tiny_model("qwen2", seed=7, num_hidden_layers=2)
    cache = transformers.DynamicCache(config=impostor.config)
    with torch.no_grad():
        impostor(ids[:, :-1], use_cache=True, **cache_kwargs(cache))
    with pytest.raises(ValueError, match="not computed by this model"):
        TranslatedCache(tgt, src, mapper, input_ids=ids, source_cache=cache)


# -- 8. divergence under the call's logits processors ---------------------------------------------------------------
def test_divergence_counts_under_logits_processors(llama, monkeypatch):
    """With ``repetition_penalty`` the divergence count compares generate's own (processed) choices: an optimistic
    cache that is exact (the donor is this prompt's own cache) gives plain generate's tokens and 0 divergent.

    Planted bug that fails it: ``KVReuseCache.process_logits`` returns the raw logits (3 tokens counted
    divergent although all equal plain generate's)."""
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: False)
    ids = toks(40, 0)
    out_a = llama.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    for kw in (dict(), dict(repetition_penalty=1.3), dict(repetition_penalty=1.3, no_repeat_ngram_size=2)):
        c = OptimisticCache(llama, ids, output_cache(out_a), out_a.sequences, max_optimistic_tokens=8, rebase="commit")
        out = llama.generate(ids, cache=c, max_new_tokens=10, do_sample=False, **kw)
        assert torch.equal(out, llama.generate(ids, max_new_tokens=10, do_sample=False, **kw))
        assert c.stats.optimistic_tokens == 8 and c.stats.divergent_tokens == 0, (kw, c.stats)


# -- 9. offloaded models ------------------------------------------------------------------------------------------------
def test_offloaded_model():
    """A model offloaded with accelerate (parameters on ``meta``, moved in for each forward; here to the CPU):
    the fingerprint equals the non-offloaded copy's; OptimisticCache refuses background prefill with a clear error
    and with ``max_optimistic_tokens=0`` gives plain generate's tokens; the session's "full" and "auto" run.

    Planted bug that fails it: the model check opens ``torch.autocast`` on the first parameter's device ("meta":
    ``RuntimeError: unsupported scalarType``)."""
    from accelerate import cpu_offload

    m, ref = tiny_model("llama"), tiny_model("llama")
    cpu_offload(m, execution_device=torch.device("cpu"))
    assert next(m.parameters()).device.type == "meta"
    assert model_fingerprint(m) == model_fingerprint(ref)
    ids_a, ids_b = _agents()
    out_a = m.generate(ids_a, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="offloaded"):
        OptimisticCache(m, ids_b, output_cache(out_a), out_a.sequences, rebase="commit")
    c = OptimisticCache(m, ids_b, output_cache(out_a), out_a.sequences, max_optimistic_tokens=0, rebase="commit")
    assert torch.equal(m.generate(ids_b, cache=c, **GEN), ref.generate(ids_b, **GEN))
    s = ReuseSession(m)
    for ids in (ids_a, torch.cat([ids_a, toks(4, 1)], 1), ids_b):
        assert torch.equal(s.generate(ids, **GEN), ref.generate(ids, **GEN))
    assert s.last_stats.method in ("prefix", "full")


# -- 10. a per-prompt source cache in method_kwargs ------------------------------------------------------------------------
def test_source_cache_in_method_kwargs_refused(llama):
    """Planted bug that fails it: ``ReuseSession.__init__`` accepts ``method_kwargs["source_cache"]`` (the one
    prompt's source cache then serves every later prompt)."""
    with pytest.raises(ValueError, match="source_cache"):
        ReuseSession(llama, policy="translated", method_kwargs=dict(source_model=llama, mapper=None,
                                                                      source_cache=object()))


# -- 11. the session read from another thread ---------------------------------------------------------------------------
def _pause(monkeypatch, name):
    """Make ``ReuseSession.<name>`` wait (after signalling ``inside``) until ``go`` is set."""
    inside, go = threading.Event(), threading.Event()
    real = getattr(ReuseSession, name)

    def paused(self, *a, **k):
        inside.set()
        go.wait(30)
        return real(self, *a, **k)

    monkeypatch.setattr(ReuseSession, name, paused)
    return inside, go


class _RecordingLock:
    """A session lock (``_lock`` / ``_state``) that records which named threads tried to take it: ``tried(name)``
    is set when that thread asks for it, before it waits. A test then knows, without sleeping, that a thread
    reached the lock and is blocked on it (its ``done`` event is still clear)."""

    def __init__(self, lock, *names):
        self._inner = lock
        self._tried = {name: threading.Event() for name in names}

    def tried(self, name) -> threading.Event:
        return self._tried[name]

    def _note(self):
        ev = self._tried.get(threading.current_thread().name)
        if ev is not None:
            ev.set()

    def acquire(self, *a, **k):
        self._note()
        return self._inner.acquire(*a, **k)

    def release(self):
        return self._inner.release()

    def __enter__(self):
        self._note()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _run_named(name, fn):
    """Start ``fn`` in a thread called ``name``; returns the thread and an event set when ``fn`` has returned."""
    done = threading.Event()

    def body():
        try:
            fn()
        finally:
            done.set()

    t = threading.Thread(target=body, name=name)
    t.start()
    return t, done


def _blocked_on(lock: _RecordingLock, name: str, done: threading.Event) -> bool:
    """Wait (no timing involved) until thread ``name`` either asked for ``lock`` or finished; True when it asked
    and has not finished (it waits on the lock). The 30 s bound only stops a hung test."""
    for _ in range(3000):
        if lock.tried(name).is_set() or done.is_set():
            break
        lock.tried(name).wait(0.01)
    return lock.tried(name).is_set() and not done.is_set()


def test_session_read_while_a_call_stores(llama, monkeypatch):
    """While a call updates the held caches, ``held()`` from another thread waits for the update to finish
    instead of iterating a dict that changes size under it: the reader asks for the session's ``_state`` lock
    while the call holds it (inside ``_store``) and returns only after the store.

    Planted bug that fails it: ``held`` without ``self._state`` (it returns before the store finishes)."""
    s = ReuseSession(llama)
    s._state = state = _RecordingLock(s._state, "reader")
    inside, go = _pause(monkeypatch, "_store")
    call, call_done = _run_named("call", lambda: s.generate(toks(20, 1), **GEN))
    assert inside.wait(30)
    seen = []
    reader, read = _run_named("reader", lambda: seen.append(s.held()))
    assert _blocked_on(state, "reader", read), f"held() did not wait for the store (returned {seen})"
    assert seen == []
    go.set()
    for t in (call, reader):
        t.join(30)
    assert seen == [[dict(tokens=24, exact=True, agent=None, nbytes=seen[0][0]["nbytes"])]]


def test_clear_during_a_call_is_not_undone(llama, monkeypatch):
    """``clear()`` during a call waits for it, then drops everything: the call's own cache is not stored after
    the clear (which would silently undo it). The clearer asks for the session's ``_lock`` while the call holds
    it and finishes only after the call.

    Planted bug that fails it: ``clear`` without ``self._lock`` (it clears at once; the call then stores)."""
    s = ReuseSession(llama)
    s.generate(toks(20, 2), **GEN)
    s._lock = lock = _RecordingLock(s._lock, "clearer")
    inside, go = _pause(monkeypatch, "_timed_generate")
    call, _ = _run_named("call", lambda: s.generate(toks(20, 1), **GEN))
    assert inside.wait(30)
    assert len(s) == 1 and s.nbytes > 0  # readable during the call
    clearer, cleared = _run_named("clearer", s.clear)
    assert _blocked_on(lock, "clearer", cleared), "clear() did not wait for the running call"
    assert len(s) == 1  # nothing cleared yet
    go.set()
    for t in (call, clearer):
        t.join(30)
    assert s.last_stats.stored and len(s) == 0 and s.nbytes == 0


# -- 12. the fingerprint ------------------------------------------------------------------------------------------------------
def test_fingerprint_sees_every_element_and_reads_each_version_once(monkeypatch):
    """An in-place change of one element anywhere changes the fingerprint (a fine-tune of a few rows makes held
    caches stale); unchanged parameters are not read again (no device work per call).

    Planted bugs that fail it: ``tensor_digest`` over a strided sample of 8 values (the changed element is not
    sampled); ``_param_digest`` ignores the version (every call re-reads every parameter)."""
    from hf_kvreuse import fingerprint

    m = tiny_model("llama", seed=4)
    before = model_fingerprint(m)
    calls = []
    real = fingerprint.tensor_digest
    monkeypatch.setattr(fingerprint, "tensor_digest", lambda t: calls.append(t.shape) or real(t))
    assert model_fingerprint(m) == before and not calls
    w = m.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        w[7, 13] += 1e-3
    after = model_fingerprint(m)
    assert after != before and calls == [w.shape]
    with torch.no_grad():
        w[7, 13] -= 1e-3
    assert model_fingerprint(m) in (before, after)  # float rounding may not restore the exact bits
    swapped = tiny_model("llama", seed=4)
    with torch.no_grad():  # two elements exchanged: a plain sum would not see it
        e = swapped.model.embed_tokens.weight
        e[3, 0], e[5, 1] = e[5, 1].clone(), e[3, 0].clone()
    assert model_fingerprint(swapped) != before


def test_generate_moves_the_prompt_to_the_models_input_device(monkeypatch):
    """A prompt on another device than the model's inputs (CPU ids, CUDA model: transformers accepts it and keeps
    the sequence there) moves to the model's input device, mask too, before a cache reads it: the caches' own
    forwards, positions and logits processors then see one device. Here ``meta`` stands in for the model's device
    (no second device on CPU); a real generate on CPU is unchanged.

    Planted bug that fails it: ``_to_input_device`` skips ``attention_mask`` (a CPU mask beside CUDA ids)."""
    ids, mask = torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)
    monkeypatch.setattr(mixin, "input_device", lambda model: torch.device("meta"))
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 2}
    mixin._to_input_device(None, kwargs)
    assert kwargs["input_ids"].device.type == "meta" and kwargs["attention_mask"].device.type == "meta"
    assert kwargs["max_new_tokens"] == 2 and ids.device.type == "cpu"  # the caller's tensors are not touched
    kwargs = {"inputs": ids}
    mixin._to_input_device(None, kwargs)
    assert kwargs["inputs"].device.type == "meta"
