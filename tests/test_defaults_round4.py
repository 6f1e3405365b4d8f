"""The default never raises where plain ``generate`` runs, and never labels exact what is not (issue 63, findings 2,
9 and 10, and the rule "every generate option and model config a method cannot honour makes "auto" step down").

Every test compares tokens and scores (and hidden states / attentions where asked for) with plain
``model.generate`` on tiny random-init models, and names in its docstring a planted bug that makes it fail
(docs/MUTATIONS.md)."""

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hf_kvreuse import OptimisticCache, ReuseSession
from hf_kvreuse.auto import AutoChooser
from hf_kvreuse.models import tiny_model
from hf_kvreuse.rope import UnsupportedRopeError

SETTINGS = dict(deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
OUT = dict(output_scores=True, return_dict_in_generate=True)


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


def _plain(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)


def _assert_same(out, ref, what=("scores",)):
    """Tokens equal; scores (and the other per-step outputs named) close."""
    assert torch.equal(out.sequences, ref.sequences)
    for name in what:
        a, b = getattr(out, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert len(a) == len(b), name
        for x, y in zip(a, b):
            xs = x if isinstance(x, tuple) else (x,)
            ys = y if isinstance(y, tuple) else (y,)
            assert len(xs) == len(ys), name
            for u, v in zip(xs, ys):
                torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-4, msg=name)
    if getattr(ref, "sequences_scores", None) is not None:
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)


# -- finding 2: RoPE whose frequencies depend on the length ---------------------------------------------------------
MAX_POS = 32
ROPES = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": MAX_POS,
                 "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
}


def _rope_model(kind):
    if kind == "longrope":
        return tiny_model("llama", max_position_embeddings=4 * MAX_POS, rope_parameters=ROPES[kind])
    return tiny_model("llama", max_position_embeddings=MAX_POS, rope_parameters=ROPES[kind])


@pytest.mark.parametrize("kind", sorted(ROPES))
@settings(max_examples=4, **SETTINGS)
@given(policy=st.sampled_from(["auto", "prefix"]),
       short=st.integers(8, MAX_POS - 6), extra=st.integers(1, 20), seed=st.integers(0, 50))
def test_length_dependent_rope_never_reuses_rows_of_another_length(kind, policy, short, extra, seed):
    """``rope_type="dynamic"`` (NTK) or ``"longrope"``: a prefix held from a short prompt (within the original
    length) is not reused for a prompt that reaches past it (its rows were computed with other frequencies): the
    session runs plain ``generate`` with the reason (rope_type) in ``last_stats``, and its tokens and scores are
    plain ``generate``'s on a fresh model of the same weights (the module's frequencies depend on its history);
    an approximate policy asked for by name refuses.

    Planted bug that fails it: ``length_dependent_rope`` returns None (the prefix path never asks): under
    ``dynamic`` the held prefix is reused as exact and the scores differ; under ``longrope`` the reason does not
    name it."""
    model, ref_model = _rope_model(kind), _rope_model(kind)
    a = _ids(short, seed)
    b = torch.cat([a, _ids(MAX_POS + extra - short, seed + 1)], 1)
    assert b.shape[1] > MAX_POS
    s = ReuseSession(model, policy=policy)
    s.generate(a, max_new_tokens=4, **GREEDY)
    out = s.generate(b, max_new_tokens=4, **GREEDY, **OUT)
    _assert_same(out, _plain(ref_model, b, max_new_tokens=4, **GREEDY, **OUT))
    st_ = s.last_stats
    assert st_.method == "full" and st_.exact_prefix_tokens == 0 and st_.exact_output, st_
    assert f"rope_type={kind!r}" in st_.reason, st_
    with pytest.raises(UnsupportedRopeError, match=kind):
        s.generate(b, policy="optimistic", max_new_tokens=4, **GREEDY)


# -- finding 9: cache_implementation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["generation_config", "call"])
def test_cache_implementation_runs_plain_generate(where):
    """A model whose ``generation_config`` sets ``cache_implementation="static"`` (or a call passing it): the
    default policy runs plain ``generate`` (tokens and scores equal), says why, and holds nothing; a reuse policy
    asked for by name refuses with an error naming ``cache_implementation`` (not transformers' error about a
    cache the caller never passed).

    Planted bug that fails it: ``plain_only_call`` ignores ``cache_implementation``: the session hands generate
    its cache and transformers raises "Passing both `cache_implementation` ... and `cache`"."""
    model = tiny_model("llama")
    kw = {}
    if where == "generation_config":
        model.generation_config.cache_implementation = "static"
    else:
        kw = dict(cache_implementation="static")
    a = _ids(30, 0)
    b = torch.cat([a, _ids(8, 1)], 1)
    s = ReuseSession(model)
    s.generate(a, max_new_tokens=4, **GREEDY, **kw)
    out = s.generate(b, max_new_tokens=4, **GREEDY, **OUT, **kw)
    st_ = s.last_stats
    assert st_.method == "full" and "cache_implementation='static'" in st_.reason and not st_.stored, st_
    assert st_.exact_output
    _assert_same(out, _plain(model, b, max_new_tokens=4, **GREEDY, **OUT, **kw))
    for policy in ("prefix", "optimistic"):
        with pytest.raises(ValueError, match="cache_implementation") as e:
            s.generate(b, policy=policy, max_new_tokens=4, **GREEDY, **kw)
        assert "Passing both" not in str(e.value)


# -- finding 10: output_hidden_states / output_attentions ----------------------------------------------------------
@pytest.fixture(scope="module")
def eager():
    return tiny_model("llama", attn_implementation="eager")


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_whole_prompt_outputs_step_down_and_never_advise_commit(eager, flag, monkeypatch):
    """``output_hidden_states`` / ``output_attentions`` with ``return_dict_in_generate`` under the default
    policy, where the chooser picks verified drafts: the call runs plain ``generate`` (tokens, scores and the asked
    outputs equal plain ``generate``'s; the reason names the option), never raises; ``"prefix"`` and
    ``"optimistic"`` asked for by name refuse naming the option, and no message suggests the approximate
    ``rebase='commit'`` to a caller who asked for nothing approximate (nor does ``OptimisticCache``'s own).

    Planted bug that fails it: ``plain_only_call`` skips ``WHOLE_PROMPT_OUTPUTS``: "auto" picks verified drafts
    and raises ("... not supported with rebase='verify'")."""
    monkeypatch.setattr(AutoChooser, "choose", lambda self, device, n, new: (True, "forced by the test"))
    shared = _ids(40, 3)
    a = torch.cat([_ids(6, 4), shared], 1)
    b = torch.cat([_ids(9, 5), shared], 1)
    s = ReuseSession(eager, min_donor_tokens=4)
    s.generate(a, max_new_tokens=4, **GREEDY)
    kw = {flag: True, "max_new_tokens": 4, **GREEDY, **OUT}
    out = s.generate(b, **kw)
    st_ = s.last_stats
    assert st_.method == "full" and flag in st_.reason and st_.exact_output, st_
    what = ("scores", "hidden_states" if flag == "output_hidden_states" else "attentions")
    _assert_same(out, _plain(eager, b, **kw), what)
    for policy in ("prefix", "optimistic"):
        with pytest.raises(ValueError, match=flag) as e:
            s.generate(b, policy=policy, **kw)
        assert "commit" not in str(e.value)
    held = next(iter(s._entries.values()))
    cache = OptimisticCache(eager, b, [held.kv], [held.ids[None]], rebase="verify", verify_donor=False)
    with pytest.raises(ValueError, match=flag) as e:
        eager.generate(b, attention_mask=torch.ones_like(b), past_key_values=cache, **kw)
    assert "commit" not in str(e.value)


# -- the general rule: every generate option "auto" cannot honour steps down -----------------------------------------
@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def assistant():
    return tiny_model("llama", seed=1)


OPTIONS = {
    "watermarking": dict(watermarking_config={"bias": 2.0, "greenlist_ratio": 0.25}),
    "assistant_model": dict(assistant_model="assistant"),
    "prompt_lookup": dict(prompt_lookup_num_tokens=3),
    "beams": dict(num_beams=2),
    "beams_returned": dict(num_beams=3, num_return_sequences=2),
    "beam_sample": dict(num_beams=2, do_sample=True, top_k=8),
    "sampled_returned": dict(do_sample=True, num_return_sequences=2, top_k=8),
    "repetition_penalty": dict(repetition_penalty=1.3),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@settings(max_examples=3, **SETTINGS)
@given(layout=st.sampled_from(["extends", "shares_span"]), seed=st.integers(0, 100))
def test_auto_equals_plain_generate_under_every_option(llama, assistant, option, layout, seed):
    """For each option (watermarking, an assistant model, prompt lookup, beams, several returned sequences, beam
    sampling), ``"auto"`` over a held cache that the prompt extends or shares a span with answers as plain
    ``generate`` does (tokens and scores, sampling under the same seed) or steps down to it, never raises, and
    gives a reason when it does not run its own pick.

    Planted bug that fails it: ``PREFIX_MODES`` includes ``"assisted_generation"``: an assistant model or prompt
    lookup runs over the held exact prefix and the tokens differ."""
    kw = dict(OPTIONS[option])
    if kw.get("assistant_model") == "assistant":
        kw["assistant_model"] = assistant
    a = _ids(36, seed)
    b = (torch.cat([a, _ids(7, seed + 1)], 1) if layout == "extends"
         else torch.cat([_ids(5, seed + 2), a[:, 4:]], 1))
    s = ReuseSession(llama, min_donor_tokens=4)
    s.generate(a, max_new_tokens=4, **GREEDY)
    gen = dict(GREEDY, max_new_tokens=5, **OUT, **kw)
    torch.manual_seed(seed)
    try:
        ref = _plain(llama, b, **gen)
    except (TypeError, AttributeError, ValueError) as e:  # this transformers release's own generate refuses it:
        torch.manual_seed(seed)                             # the session fails the same way, and stays usable
        with pytest.raises(type(e)):
            s.generate(b, **gen)
        torch.manual_seed(seed)
        plain = dict(GREEDY, max_new_tokens=3, **OUT)
        _assert_same(s.generate(b, **plain), _plain(llama, b, **plain))
        return
    torch.manual_seed(seed)
    out = s.generate(b, **gen)
    _assert_same(out, ref)
    st_ = s.last_stats
    assert st_.exact_output and st_.reason, st_
