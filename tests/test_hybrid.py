"""Linear-attention hybrids (Qwen3-Next / Qwen3.5 style): ReuseSession's default never raises and gives plain
``generate``'s answers, reusing exact prefixes through held whole states (the state at each prompt's end and at
each call's end, reused only for exactly the tokens it was taken at); every K/V-splicing reuse refuses at
construction, naming the model and its recurrent-state layers.

Exactness: over several calls sharing prefixes, every answer of ``ReuseSession(model)`` equals plain ``generate``'s
(tokens and every step's scores). Planted bug that makes it fail: in ``ReuseSession.generate`` drop the
``self._state_reason`` branch (the session then takes its K/V path and raises on the linear-attention layer).
"""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_kvreuse import OptimisticCache, ReuseSession
from hf_kvreuse.hybrid import state_continues, state_layers
from hf_kvreuse.models.arch_zoo import hybrid_model

@functools.lru_cache(maxsize=None)
def _model(kind: str):
    try:
        return hybrid_model(kind)
    except Exception as e:  # noqa: BLE001 - an architecture missing from this transformers release
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
        assert st.exact_output and "recurrent-state" in st.reason or "linear-attention" in st.reason
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
    session = ReuseSession(m, state_block=block)
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
def test_explicit_reuse_refuses(kind):
    m = model(kind)
    name = type(m).__name__
    for policy in ("optimistic", "blend"):
        with pytest.raises(ValueError, match=name):
            ReuseSession(m, policy=policy)
    session = ReuseSession(m)
    with pytest.raises(ValueError, match="linear-attention"):
        session.generate(torch.randint(3, 128, (1, 8)), policy="optimistic", max_new_tokens=2)
    assert session.calls == 0
    with pytest.raises(ValueError, match=f"{name}.*linear-attention"):
        ids = torch.randint(3, 128, (1, 8))
        OptimisticCache(m, ids, DynamicCache(), ids)
