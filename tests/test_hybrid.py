"""Linear-attention hybrids (Qwen3-Next / Qwen3.5 style): ReuseSession's default never raises and gives plain
``generate``'s answers, reusing exact prefixes through held whole states (the state at each prompt's end and at
each call's end, reused only for exactly the tokens it was taken at); every K/V-splicing reuse refuses at
construction, naming the model and its recurrent-state layers.

Exactness: over several calls sharing prefixes, every answer of ``ReuseSession(model)`` equals plain ``generate``'s
(tokens and every step's scores). Planted bug that makes it fail: in ``ReuseSession.generate`` drop the
``self._state_reason`` branch (the session then takes its K/V path and raises on the linear-attention layer).
"""

import contextlib
import functools
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_kvreuse import OptimisticCache, ReuseSession
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.hybrid import draft_refusal, state_cache, state_continues, state_layers
from hf_kvreuse.models.arch_zoo import hybrid_model

@functools.lru_cache(maxsize=None)
def _model(kind: str):
    try:
        return hybrid_model(kind)
    except ImportError as e:  # the builder's error where this transformers release lacks the architecture
        return f"{type(e).__name__}: {e}"


def model(kind):
    m = _model(kind)
    if isinstance(m, str):
        pytest.skip(f"{kind}: {m}")
    return m


KINDS = ["qwen3_next", "qwen3_5_text"]  # arch_zoo.HYBRIDS
GEN = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("kind", KINDS)
def test_state_layers_found(kind):
    m = model(kind)
    assert [x.split(":")[0] for x in state_layers(m.config)] == ["0", "1", "2"]


@pytest.mark.parametrize("kind", KINDS)
def test_session_default_is_plain_generate(kind):
    """Planted bug (module docstring): without the recurrent-state branch the first call raises."""
    m = model(kind)
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(3, 128, (1, 24), generator=g)
    session = ReuseSession(m)
    for turn in range(4):
        role = torch.randint(3, 128, (1, 3 + turn), generator=g)
        ids = torch.cat([doc, role], 1) if turn % 2 else torch.cat([role, doc], 1)
        out = session.generate(ids, **GEN)
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        st = session.last_stats
        assert st.exact_output and ("recurrent-state" in st.reason or "linear-attention" in st.reason), st
    session = ReuseSession(m, policy="full")
    session.generate(doc, **GEN)
    st = session.last_stats
    assert st.method == "full" and "linear-attention" in st.reason and "0: " in st.reason
    assert len(session) == 0 and session.nbytes == 0  # policy "full": nothing held


TURNS = ("answer", "prompt", "fresh", "same", "shared")


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_held_states_give_exact_prefixes(kind, data):
    """Random conversations: each call's prompt extends the last call's answer, or its prompt only, or is fresh,
    or repeats it (not reused: the held state at its end leaves no token to feed), or shares only the last prompt's
    first tokens (another agent over the same document: reused up to the last block end, ``state_block`` 0, 4
    or 8); greedy or seeded sampling; 1-4 new tokens. Every answer (tokens and scores) = plain
    ``generate``'s with the same seed, and a call whose prompt extends a held state reuses it (``method`` prefix,
    ``exact_prefix_tokens`` = that state's tokens). Planted bugs that fail it: the held state is fed instead of a
    copy (``cache = held.cache``: the next reuse of it starts from a later state: scores differ); the prompt-end
    copy is taken at the second generated token (``self.calls == 3``: no prompt-end state, an extended prompt is
    not reused); the match accepts a held state as long as the prompt (``<= n``: generate is handed a cache with no
    token left to feed and fails); ``state_continues`` always True (on a release whose model restarts the state
    on a multi-token prefill, transformers 4.57's Qwen3-Next, the answers differ); a block copy is taken one token late (``blocks[b + 1]``: the restored layers are
    a token ahead of the K/V layers: scores differ); the restored K/V layers keep every row (no cut at the block
    end: the cache is longer than the state)."""
    m = model(kind)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000), label="seed"))
    block = data.draw(st.sampled_from([0, 4, 8]), label="state_block")
    continues = state_continues(m)[0]
    session = ReuseSession(m, state_block=block, state_copies=None)  # a copy at every block end
    ids, last_out, expect = None, None, 0
    for turn in range(data.draw(st.integers(2, 4), label="calls")):
        how = "fresh" if ids is None else data.draw(st.sampled_from(TURNS), label="turn")
        extra = torch.randint(3, 128, (1, data.draw(st.integers(2, 6), label="extra")), generator=g)
        if how == "fresh":
            ids, expect = torch.cat([torch.randint(3, 128, (1, 12), generator=g), extra], 1), 0
        elif how == "answer":
            ids, expect = torch.cat([last_out, extra], 1), last_out.shape[1] - 1
        elif how == "prompt":
            ids, expect = torch.cat([ids, extra], 1), ids.shape[1]
        elif how == "shared":  # another agent: the first k tokens of the last prompt, then its own
            k = data.draw(st.integers(1, ids.shape[1]), label="shared")
            n_last = ids.shape[1]
            ids = torch.cat([ids[:, :k], extra], 1)
            reach = min(k, n_last - 1, ids.shape[1] - 1)
            expect = reach // block * block if block else 0  # the last block end inside the shared tokens
        else:  # the same prompt again: its prompt-end state holds every token (one must be fed): no reuse
            expect = 0
        sample = data.draw(st.booleans(), label="sample")
        kw = dict(GEN, max_new_tokens=data.draw(st.integers(1, 4), label="new"), do_sample=sample)
        if sample:
            kw.update(top_k=0, temperature=1.0)
        torch.manual_seed(turn)
        out = session.generate(ids, attention_mask=torch.ones_like(ids), **kw)  # a pasted answer may hold the pad id
        torch.manual_seed(turn)
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        stats = session.last_stats
        if not continues:  # this release cannot continue a held state exactly (probed): plain generate, said why
            assert stats.method == "full" and "nothing held" in stats.reason, stats
        elif expect:
            assert stats.method == "prefix" and stats.exact_prefix_tokens >= expect, (how, stats)
        assert stats.exact_output
        last_out = out.sequences


@pytest.mark.parametrize("kind", KINDS)
def test_default_copies_the_last_two_block_ends(kind):
    """By default a prompt's states are copied at its last two block ends only (each copy costs one more forward):
    a later prompt sharing the first 60 of a 70-token prompt's tokens reuses 48 (``state_block=16``: copies at 48
    and 64), one sharing 66 reuses 64, one sharing 40 nothing; the first call runs 3 forwards before its first
    token (to 48, to 64, generate's), not 5. Planted bug that fails it: ``copy_points`` ignores ``last``."""
    m = model(kind)
    if not state_continues(m)[0]:
        pytest.skip("this release does not continue a held state")
    g = torch.Generator().manual_seed(5)
    first = torch.randint(3, 128, (1, 70), generator=g)
    session = ReuseSession(m, state_block=16)
    calls = []
    hook = m.register_forward_pre_hook(lambda mod, args, kw: calls.append(1), with_kwargs=True)
    try:
        session.generate(first, max_new_tokens=1, do_sample=False)
    finally:
        hook.remove()
    assert len(calls) == 3
    for shared, expect in ((60, 48), (66, 64), (40, 0)):
        ids = torch.cat([first[:, :shared], torch.randint(3, 128, (1, 5), generator=g)], 1)
        session.generate(ids, max_new_tokens=1, do_sample=False)
        assert session.last_stats.exact_prefix_tokens == expect, (shared, session.last_stats)


@pytest.mark.parametrize("kind", KINDS)
def test_explicit_reuse_refuses(kind):
    """K/V-splicing policies refuse a hybrid, naming it; ``"optimistic"`` (verified drafts from held states) does
    not; OptimisticCache refuses a donor that is not a cache of the model's layer kinds."""
    m = model(kind)
    name = type(m).__name__
    for policy in ("blend", "direct", "epic"):
        with pytest.raises(ValueError, match=name):
            ReuseSession(m, policy=policy)
    why = draft_refusal(m)
    if why:  # this release cannot draft on it (no generic state cache, or a held state does not continue)
        with pytest.raises(ValueError, match="linear-attention"):
            ReuseSession(m, policy="optimistic")
    else:
        ReuseSession(m, policy="optimistic")
    session = ReuseSession(m)
    with pytest.raises(ValueError, match="linear-attention"):
        session.generate(torch.randint(3, 128, (1, 8)), policy="epic", max_new_tokens=2)
    assert session.calls == 0
    ids = torch.randint(3, 128, (1, 8))
    if why:
        with pytest.raises(ValueError, match=f"{name}.*linear-attention"):
            OptimisticCache(m, ids, DynamicCache(), ids)
        return
    with pytest.raises(ValueError, match=f"not a cache of {name}"):
        OptimisticCache(m, ids, DynamicCache(), ids)
    with pytest.raises(ValueError, match="repair"):
        OptimisticCache(m, ids, _donor(m, ids)[0], ids, repair="epic")


def drafting(m):
    """``m``, or a skip where this transformers release cannot draft on it (the refusal test covers that case)."""
    why = draft_refusal(m)
    if why:
        pytest.skip(f"no drafts on this release: {why}")
    return m


# -- verified optimistic drafts on hybrids --------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _decayed(kind: str, decay: float):
    """The tiny hybrid with every gated-delta head's decay set to ``decay`` (the random init forgets within a few
    tokens; 0.02 keeps ~40, so a draft's borrowed state matters)."""
    model(kind)  # a skip where this release lacks the architecture
    m = hybrid_model(kind)
    with torch.no_grad():
        for mod in m.modules():
            if hasattr(mod, "A_log"):
                mod.A_log.fill_(float(torch.tensor(decay).log()))
    return m


def _donor(m, ids, points=()):
    """The model's own cache of ``ids`` (all but the last token, as generate leaves it) and copies of its
    recurrent-state layers after each of ``points`` tokens."""
    import copy

    from hf_kvreuse.hybrid import state_indices

    cache, snaps, pos = DynamicCache(config=m.config), {}, 0
    with torch.no_grad():
        for b in sorted(set(points) | {ids.shape[1] - 1}):
            if b > pos:
                m(input_ids=ids[:, pos:b], use_cache=True, logits_to_keep=1, past_key_values=cache)
                pos = b
            if b < ids.shape[1] - 1:
                snaps[b] = {i: copy.deepcopy(cache.layers[i]) for i in state_indices(cache)}
    return cache, snaps


def _plain_kw(data, vocab_hit):
    sample = data.draw(st.booleans(), label="sample")
    kw = dict(max_new_tokens=data.draw(st.integers(1, 10), label="new"), do_sample=sample,
              return_dict_in_generate=True, output_scores=True, output_logits=True)
    if sample:
        kw.update(top_k=data.draw(st.sampled_from([0, 5]), label="top_k"), temperature=1.0)
    if data.draw(st.booleans(), label="penalty"):
        kw["repetition_penalty"] = 1.3
    if data.draw(st.booleans(), label="eos"):  # a token the answer may well produce ends it early
        kw["eos_token_id"] = vocab_hit
    return kw


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hybrid_drafts_are_plain_generate(kind, data):
    """OptimisticCache on a linear-attention hybrid, drafting from another prompt's cache over a shared block (the
    block at another position: its attention rows re-positioned, the state layers the donor's copy at a point
    inside the block), random prompts, donor state points and generate settings (greedy or seeded sampling,
    top-k, repetition penalty, an early eos, 1-10 new tokens, ``max_optimistic_tokens``): the tokens, scores and
    logits equal plain ``generate``'s, and the returned cache continues as plain ``generate``'s.

    Planted bugs that fail it (docs/MUTATIONS.md): no rewind after a withdrawn draft (``_rewind_states`` returns at
    once: the state layers carry the withdrawn drafts: later logits differ); the exact cache's state layers not
    taken (``_take_exact`` keeps the draft's: every verified logit comes from the borrowed state)."""
    decay = data.draw(st.sampled_from([None, 0.02, 0.005]), label="decay")
    m = drafting(model(kind) if decay is None else _decayed(kind, decay))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000), label="seed"))
    R = lambda k: torch.randint(3, 128, (1, k), generator=g)  # noqa: E731
    block = R(data.draw(st.integers(8, 60), label="block"))
    role_a, role_b = R(data.draw(st.integers(1, 12), label="role_a")), R(data.draw(st.integers(1, 12), label="role_b"))
    same = data.draw(st.booleans(), label="same_role")  # the donor is this agent's own exact cache of a prefix
    if same:
        role_b = role_a
    donor_ids = torch.cat([role_a, block, R(data.draw(st.integers(1, 8), label="q_a"))], 1)
    target = torch.cat([role_b, block, R(data.draw(st.integers(1, 8), label="q_b"))], 1)
    points = data.draw(st.lists(st.integers(1, donor_ids.shape[1] - 2), max_size=4), label="points")
    dcache, snaps = _donor(m, donor_ids, points)
    kw = _plain_kw(data, int(target[0, -1]))
    limit = data.draw(st.sampled_from([None, 1, 4, 16]), label="max_optimistic_tokens")
    cache = OptimisticCache(m, target, dcache, donor_ids, donor_states=snaps, max_optimistic_tokens=limit,
                            min_span=data.draw(st.sampled_from([1, 4]), label="min_span"), donor_exact=same)
    # held: the exact cache is never ready on its own (the swap comes at max_optimistic_tokens, or the drafts run to
    # the end): every draft is verified, whatever the machine's speed
    held = data.draw(st.booleans(), label="held")
    torch.manual_seed(7)
    with mock.patch.object(BackgroundPrefill, "ready", lambda self: False) if held else contextlib.nullcontext():
        out = m.generate(target, attention_mask=torch.ones_like(target), past_key_values=cache, **kw)
    torch.manual_seed(7)
    ref = m.generate(target, attention_mask=torch.ones_like(target), **kw)
    assert torch.equal(out.sequences, ref.sequences), cache.plan
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert cache.stats.exact and cache.stats.exact_output
    assert out.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length()  # what generate leaves
    # the returned cache continues: 3 more tokens after the answer, greedily
    more = torch.cat([out.sequences, R(3)], 1)
    greedy = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    a = m.generate(more, attention_mask=torch.ones_like(more), past_key_values=out.past_key_values, **greedy)
    b = m.generate(more, attention_mask=torch.ones_like(more), **greedy)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_session_drafts(kind):
    """``ReuseSession(policy="optimistic")`` on a hybrid: three agents, each prompt its role text, then one shared
    document, the transcript and a cue, two rounds. Every answer (tokens and logits) = plain ``generate``'s;
    later calls draft from held calls' states (``donor_tokens`` > 0) and keep drafts; the caller continues each
    returned cache. Planted bug that fails it: the session holds the returned cache's layers, not copies of them
    (``final.layers = list(cache.layers)``: the caller's continuation moves the held states on: later answers
    differ)."""
    m = drafting(_decayed(kind, 0.02))
    g = torch.Generator().manual_seed(3)
    R = lambda k: torch.randint(3, 128, (1, k), generator=g)  # noqa: E731
    doc, roles = R(90), [R(9), R(13), R(7)]
    session = ReuseSession(m, policy="optimistic", state_block=16)
    transcript = torch.empty(1, 0, dtype=torch.long)
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    drafted = accepted = reused = 0
    for _ in range(2):
        for role in roles:
            ids = torch.cat([role, doc, transcript, R(4)], 1)
            out = session.generate(ids, **kw)
            ref = m.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            assert torch.equal(out.sequences, ref.sequences)
            for a, b in zip(out.logits, ref.logits):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            st_ = session.last_stats
            assert st_.exact_output
            reused += st_.donor_tokens
            drafted += st_.drafted_tokens or 0
            accepted += st_.accepted_tokens or 0
            transcript = torch.cat([transcript, out.sequences[:, ids.shape[1]:]], 1)
            # the caller goes on with the returned cache (it is theirs: feeding it must not change what is held)
            more = torch.cat([out.sequences, R(2)], 1)
            m.generate(more, attention_mask=torch.ones_like(more), past_key_values=out.past_key_values,
                       max_new_tokens=2, do_sample=False)
    assert reused > 0 and drafted > 0 and accepted > 0


def test_plan_draft():
    """The plan computes the fewest tokens: an exact start, then one span cut at a state point; a span that saves
    fewer than ``min_reuse`` tokens is not used; an exact start inside a span trims it."""
    from hf_kvreuse.alignment import Span
    from hf_kvreuse.hybrid import plan_draft

    target = torch.arange(100)
    donor = torch.cat([torch.arange(1000, 1010), torch.arange(5, 95)])  # target[5:95] at donor 10..100
    spans = [Span(donor_start=10, target_start=5, length=90, donor=0)]
    plan = plan_draft(spans, target, [donor], [[40, 80]], [False], covered=99, min_reuse=4)
    assert (plan.exact_len, plan.span_donor_start, plan.span_target, plan.state_at) == (0, 10, 5, 80)
    assert plan.reused == 70 and plan.resume == 75 and plan.computed(99) == 5 + 24
    none = plan_draft(spans, target, [donor], [[12]], [False], covered=99, min_reuse=4)
    assert none.span_donor == -1 and none.computed(99) == 99  # 2 tokens saved < min_reuse
    # a second, exact donor: the target's first 30 tokens, a state after 20: the span starts there
    own = torch.arange(30)
    spans2 = spans + [Span(donor_start=0, target_start=0, length=30, donor=1)]
    plan = plan_draft(spans2, target, [donor, own], [[40, 80], [20, 30]], [False, True], covered=99, min_reuse=4)
    assert (plan.exact_donor, plan.exact_len, plan.span_target, plan.span_donor_start, plan.state_at) == (1, 30, 30, 35, 80)


def test_background_snapshots_are_the_states_of_a_shorter_prefill():
    """BackgroundPrefill(start_cache=..., snapshot_every=k): each copy equals the state layers after a prefill of
    exactly that many tokens (planted bug: a copy taken one chunk late differs)."""
    from hf_kvreuse.generation.background import BackgroundPrefill
    from hf_kvreuse.hybrid import state_cache

    m = drafting(_decayed("qwen3_5_text", 0.02))
    ids = torch.randint(3, 128, (1, 37), generator=torch.Generator().manual_seed(0))
    job = BackgroundPrefill(m, ids, synchronous=True, start_cache=state_cache(m), snapshot_every=16).start()
    cache = job.result()
    assert sorted(job.snapshots) == [16, 32] and cache.get_seq_length() == 37
    for b, snap in job.snapshots.items():
        ref, _ = _donor(m, ids[:, : b + 1])
        for i, layer in snap.items():
            torch.testing.assert_close(layer.recurrent_states[0], ref.layers[i].recurrent_states[0])
            torch.testing.assert_close(layer.conv_states[0], ref.layers[i].conv_states[0])


def test_hybrid_donor_of_another_model_is_refused():
    """A hybrid donor cache computed by another model of the same shape is refused (its first attention layer's
    keys over the first tokens differ), unless ``verify_donor=False``."""
    m, other = drafting(model("qwen3_5_text")), hybrid_model("qwen3_5_text", seed=5)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    cache, _ = _donor(other, ids)
    with pytest.raises(ValueError, match="not computed by this model"):
        OptimisticCache(m, ids, cache, ids)
    OptimisticCache(m, ids, cache, ids, verify_donor=False)
    with pytest.raises(ValueError, match="donor_states"):
        OptimisticCache(m, ids, _donor(m, ids)[0], ids, donor_states=[{5: {}}])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("wrong_at", [0, 3, None])
def test_hybrid_rejection_rewinds_the_state(kind, wrong_at):
    """A planted wrong draft (the ``wrong_at``-th): the drafts before it are kept, it is replaced by the exact
    choice, and since a recurrent state cannot be cut back, the states are restored from their copy and the kept
    tokens fed again (``rerun_tokens`` = kept + 1); the output (tokens, logits) and the returned cache's
    continuation are plain ``generate``'s. No planted draft (``None``): every draft is kept and ends the generation;
    nothing is fed again (the replay leaves out the last token, which generate never feeds).

    Planted bugs that fail it: no rewind (``_rewind_states`` returns at once: the state layers also carry the
    withdrawn drafts, so every later logit differs); the replay always feeds the last draft (``fed`` not cut:
    ``rerun_tokens`` 4 where nothing needs feeding again)."""
    m = drafting(model(kind))  # the random init's fast decay: the unplanted drafts are all right here
    g = torch.Generator().manual_seed(11)
    R = lambda k: torch.randint(3, 128, (1, k), generator=g)  # noqa: E731
    block = R(40)
    donor_ids, target = torch.cat([R(5), block, R(4)], 1), torch.cat([R(7), block, R(4)], 1)
    dcache, snaps = _donor(m, donor_ids, [30])
    new = 10 if wrong_at is not None else 4  # unplanted, the first 4 drafts are right on both models
    kw = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = m.generate(target, attention_mask=torch.ones_like(target), **kw)
    wrong = int((ref.sequences[0, target.shape[1] + (wrong_at or 0)] + 1) % 128)
    after = OptimisticCache.after_forward

    def plant(self, outputs):
        if not self._swapped and self._forwards == wrong_at:  # the forward that scores that draft
            outputs.logits[0, -1, wrong] = 1e4
        return after(self, outputs)

    cache = OptimisticCache(m, target, dcache, donor_ids, donor_states=snaps,
                            max_optimistic_tokens=8 if wrong_at is not None else None)
    with mock.patch.object(BackgroundPrefill, "ready", lambda self: False), \
            mock.patch.object(OptimisticCache, "after_forward", plant):
        out = m.generate(target, attention_mask=torch.ones_like(target), past_key_values=cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if wrong_at is None:
        assert (cache.stats.accepted_tokens, cache.stats.rerun_tokens) == (4, 0)
    else:
        assert (cache.stats.accepted_tokens, cache.stats.rerun_tokens) == (wrong_at, wrong_at + 1)
    more = torch.cat([out.sequences, R(3)], 1)
    greedy = dict(max_new_tokens=3, do_sample=False)
    assert torch.equal(m.generate(more, attention_mask=torch.ones_like(more), past_key_values=out.past_key_values,
                                  **greedy), m.generate(more, attention_mask=torch.ones_like(more), **greedy))


#: tiny configs of the other recurrent-state families of transformers 5.x (the layouts that run plain generate)
FAMILIES = {"mamba": {}, "falcon_mamba": {}, "falcon_h1": {}, "lfm2": {}, "nemotron_h": {}, "olmo_hybrid": {},
            "recurrent_gemma": {}, "minimax": {}, "rwkv": {},
            "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100),
            "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"])}


#: the families whose next turn reuses a held state on transformers 5.24 (the others run plain generate, said why)
REUSES = {"falcon_h1", "lfm2", "nemotron_h", "olmo_hybrid", "jamba", "granitemoehybrid"}


@functools.lru_cache(maxsize=None)
def _family(name: str):
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_kvreuse.compat import TRANSFORMERS_VERSION

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:  # only the builder's own errors (a family or config field missing from this release) make a skip
            cfg = AutoConfig.for_model(name, vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2, **FAMILIES[name])
            torch.manual_seed(0)
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        except (ImportError, KeyError, ValueError, TypeError, AttributeError) as e:
            if TRANSFORMERS_VERSION >= (5, 24):  # the surveyed release builds every family: fail loudly
                raise
            return f"{type(e).__name__}: {str(e)[:120]}"
        ids = torch.randint(3, 128, (1, 12))
        try:  # transformers' own generate on the bare model (not enabled: no library code runs here)
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, pad_token_id=0)
        except Exception as e:  # noqa: BLE001 - plain generate itself fails on this family on an older release
            if TRANSFORMERS_VERSION >= (5, 24):
                raise
            return f"plain generate fails: {type(e).__name__}: {str(e)[:120]}"
    return m


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_session_default_on_every_recurrent_family(name):
    """Every other recurrent-state family that runs plain ``generate`` (Mamba, Falcon-H1, LFM2, Nemotron-H, OLMo
    hybrid, RecurrentGemma, MiniMax, RWKV, Jamba, GraniteMoeHybrid): ``ReuseSession()`` never raises; three calls (a
    document, its next turn, another agent over it) equal plain ``generate`` (tokens and scores), with the reason
    where nothing is reused. Planted bugs that fail it: ``state_continues`` lets its probe raise (RecurrentGemma and
    MiniMax raise on the first call); ``state_at`` cuts the rows of a layer that holds none (Nemotron-H's MLP
    blocks: it raises); the session reads K/V from a cache the model left empty (RWKV raises after its first
    answer)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.17"):
        pytest.skip("known gap: before transformers 5.17 Mamba, Falcon-Mamba, Falcon-H1 and RWKV are not recognised "
                    "as recurrent-state models, and the session's default raises on them (their forward takes no "
                    "DynamicCache)")
    m = _family(name)
    if isinstance(m, str):
        pytest.skip(f"{name}: {m}")
    # where a held state continues exactly (probed), the next turn reuses its prompt
    reuses = name in REUSES and state_cache(m) is not None  # this release builds their state layers
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(3, 128, (1, 40), generator=g)
    session = ReuseSession(m)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    last = None
    for ids in (torch.cat([doc, torch.randint(3, 128, (1, 5), generator=g)], 1), None,
                torch.cat([doc, torch.randint(3, 128, (1, 7), generator=g)], 1)):
        ids = torch.cat([last, torch.randint(3, 128, (1, 4), generator=g)], 1) if ids is None else ids
        out = session.generate(ids, **kw)
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        st_ = session.last_stats
        assert st_.exact_output and (st_.method != "full" or st_.reason), st_
        if reuses and last is not None and ids.shape[1] > last.shape[1]:
            assert st_.method == "prefix", st_
        last = out.sequences


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["folder", "store"])
def test_hybrid_session_saves_with_the_warning(kind, where, tmp_path):
    """Saving a linear-attention hybrid's session (to a folder, or to a store backend) warns that its recurrent
    states are not saved and writes what can be saved (no K/V entries: such a session holds none); the loaded
    session answers as plain ``generate`` does (tokens and every step's scores). Planted bug that makes it fail:
    ``persist._model_identity`` reads the K/V layout of every model with ``kv_layout`` (the save raises "cache
    layer 0 ... not a key/value layer" before the warning)."""
    from hf_kvreuse.stores import FolderBackend

    m = model(kind)
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(3, 128, (1, 20), generator=g)
    session = ReuseSession(m)
    session.generate(doc, **GEN)
    continues = state_continues(m)[0]  # a release whose model restarts the state: the session holds nothing
    assert (len(session) > 0) == continues  # where it continues, it holds a recurrent state
    target = tmp_path / "saved" if where == "folder" else FolderBackend(tmp_path / "store")
    names = {} if where == "folder" else dict(name="hybrid")
    with pytest.warns(UserWarning, match="recurrent-state") if continues else contextlib.nullcontext():
        manifest = session.save(target, **names)
    assert manifest["entries"] == []
    back = ReuseSession.load(target, m, **names)
    assert len(back) == 0
    for extra in (3, 5):
        ids = torch.cat([doc, torch.randint(3, 128, (1, extra), generator=g)], 1)
        out = back.generate(ids, **GEN)
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert back.last_stats.exact_output
