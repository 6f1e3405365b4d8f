"""ReuseSession(policy="fast"): gated committed drafts under the online divergence guard (hf_kvreuse.guard)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvreuse import ReuseSession
from hf_kvreuse.guard import DivergenceGuard, GuardConfig
from hf_kvreuse.models import tiny_model

_MODELS: dict = {}


def _model(arch="llama"):
    if arch not in _MODELS:
        _MODELS[arch] = tiny_model(arch, seed=0)
    return _MODELS[arch]


def _prompts(seed: int, agents: int = 3, doc_len: int = 80):
    """Role-first prompts: each agent's own role tokens, then one shared document and cue."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(5, 120, (1, doc_len), generator=g)
    roles = [torch.randint(5, 120, (1, 4), generator=g) for _ in range(agents)]
    return [torch.cat([torch.tensor([[1]]), r, doc, torch.tensor([[3, 4]])], 1) for r in roles]


def _plain(model, ids, **gen):
    return model.generate(ids, return_dict_in_generate=True, output_scores=True, **gen)


def _assert_plain(model, session, ids, **gen):
    out = session.generate(ids, return_dict_in_generate=True, output_scores=True, **gen)
    ref = _plain(model, ids, **gen)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-4)


@settings(max_examples=6, derandomize=True, deadline=None)
@given(seed=st.integers(0, 10_000), arch=st.sampled_from(["llama", "qwen2"]))
def test_fast_under_a_tripped_guard_is_plain_generate(seed, arch):
    """Once the guard allows only verified drafts, every call equals plain ``generate`` (tokens and scores) and is
    labelled exact. Planted bug: ``_cache_kwargs_for_call`` always sets ``rebase="commit"`` -> the scores (and
    usually the tokens) differ, and ``exact_output`` is False."""
    model = _model(arch)
    guard = DivergenceGuard(GuardConfig(window=4, max_unclean=0, cooldown=100))
    session = ReuseSession(model, policy="fast", guard=guard)
    prompts = _prompts(seed)
    _assert_plain(model, session, prompts[0], max_new_tokens=6, do_sample=False)
    for i, ids in enumerate(prompts[1:], 1):
        guard.record(f"a{i}", dict(rebase="commit", divergent_tokens=1))   # tripped before its first call
        session_ids = ids
        out = session.generate(session_ids, agent=f"a{i}", return_dict_in_generate=True, output_scores=True,
                               max_new_tokens=6, do_sample=False)
        ref = _plain(model, session_ids, max_new_tokens=6, do_sample=False)
        s = session.last_stats
        assert s.policy == "fast" and s.method == "optimistic" and s.guard_mode == "verify"
        assert s.exact_output
        assert torch.equal(out.sequences, ref.sequences)
        torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-4)


@settings(max_examples=6, derandomize=True, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_fast_with_gate_one_is_plain_generate(seed):
    """``gate=1.0`` gates every optimistic step (no margin reaches 1 on these models), so every token comes from the
    exact cache: the output is plain ``generate``'s. Planted bug: ``_cache_kwargs_for_call`` leaves the gate out
    -> committed drafts diverge (tokens or scores differ)."""
    model = _model()
    session = ReuseSession(model, policy="fast", guard=GuardConfig(gate=1.0))
    for i, ids in enumerate(_prompts(seed)):
        out = session.generate(ids, agent=f"a{i}", return_dict_in_generate=True, output_scores=True,
                               max_new_tokens=6, do_sample=False)
        ref = _plain(model, ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(out.sequences, ref.sequences)
        torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-4)
        if i:
            assert session.last_stats.method == "optimistic" and session.last_stats.guard_mode == "commit"


def test_fast_labels_committed_divergence_and_trips_the_guard():
    """With no gate, committed drafts on a random model leave plain ``generate``'s tokens: those calls say
    ``exact_output=False`` and count their divergence, and the guard moves the agent to verified drafts. Planted
    bug: ``_set_last`` does not record the outcome in the guard -> the agent never leaves ``"commit"``."""
    model = _model()
    session = ReuseSession(model, policy="fast", guard=GuardConfig(gate=0.0, window=4, max_unclean=1))
    prompts = _prompts(3, agents=5)
    session.generate(prompts[0], agent="writer", max_new_tokens=8, do_sample=False)
    modes, diverged = [], 0
    for ids in prompts[1:]:
        out = session.generate(ids, agent="writer", max_new_tokens=8, do_sample=False)
        s = session.last_stats
        modes.append(s.guard_mode)
        same = torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False))
        if s.guard_mode == "commit":
            assert s.exact_output is False or same     # never labelled exact when it is not
            diverged += bool(s.divergent_tokens)
        else:
            assert s.exact_output and same
    assert diverged >= 2, "the planted workload must diverge under commit (else this test proves nothing)"
    assert modes[0] == "commit" and "verify" in modes
    assert session.guard.summary()["writer"]["unclean"] >= 2


def test_fast_guard_shared_between_sessions():
    """A DivergenceGuard passed to several sessions is one record (a workflow run over many documents)."""
    guard = DivergenceGuard(GuardConfig(gate=0.0, window=2, max_unclean=0))
    model = _model()
    for seed in (3, 4):
        s = ReuseSession(model, policy="fast", guard=guard)
        for i, ids in enumerate(_prompts(seed)):
            s.generate(ids, agent="critic" if i else "researcher", max_new_tokens=6, do_sample=False)
        assert s.guard is guard
    assert guard.summary()["critic"]["calls"] >= 2


def test_fast_bad_input_refused_and_session_unchanged():
    model = _model()
    with pytest.raises(TypeError, match="guard must be"):
        ReuseSession(model, policy="fast", guard="strict")
    with pytest.raises(ValueError, match="GuardConfig.gate"):
        ReuseSession(model, policy="fast", guard=GuardConfig(gate=2.0))
    s = ReuseSession(model, policy="fast", method_kwargs={"gate": 0.3})
    ids = _prompts(0)[0]
    with pytest.raises(ValueError, match="policy='fast' sets rebase and the gate"):
        s.generate(ids, max_new_tokens=2)
    assert len(s) == 0 and s.last_stats is None and s.calls == 0


def test_fast_exact_paths_stay_exact():
    """Calls "auto" serves exactly (nothing held, an exact prefix) are exact under "fast" too, and labelled so."""
    model = _model()
    s = ReuseSession(model, policy="fast")
    ids = _prompts(1)[0]
    _assert_plain(model, s, ids, max_new_tokens=4, do_sample=False)
    assert s.last_stats.policy == "fast" and s.last_stats.method == "full" and s.last_stats.exact_output
    longer = torch.cat([ids, torch.randint(5, 120, (1, 40))], 1)
    _assert_plain(model, s, longer, max_new_tokens=4, do_sample=False)
    assert s.last_stats.method in ("prefix", "full") and s.last_stats.exact_output
    assert s.last_stats.reason.startswith("fast: ")
