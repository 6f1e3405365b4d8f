"""Sliding-window models in ReuseSession: exact prefixes survive a generation that moves the window past them.

Agents with their own role text over one shared document (shorter or longer than the window), several rounds;
each next prompt of an agent repeats its previous prompt and then differs from its answer (the transcript of the
others). Every answer must equal plain ``generate`` (tokens and logits), and each agent's next turn must reuse its
whole previous prompt as an exact prefix: the sliding layers' rows come from the copy taken at the prompt's end
(:mod:`hf_kvreuse.sliding`), which must equal what plain prefill of that prompt leaves. Property test
(hypothesis) over tiny random configs of the installed sliding-window architectures.
"""

import functools
import os

import pytest
import torch
import transformers
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hf_kvreuse import ReuseSession
from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.kv import kv_of
from hf_kvreuse.models.arch_zoo import SLIDING, zoo_model

CASES = int(os.environ.get("HF_KVREUSE_SLIDING_CASES", "12"))
WINDOW = 8


@functools.lru_cache(maxsize=None)
def _build(name):
    try:
        m = zoo_model(name, **SLIDING[name])
    except Exception as e:  # noqa: BLE001 - an architecture missing from this transformers release
        return f"{type(e).__name__}: {str(e)[:160]}"
    if not any(getattr(layer, "is_sliding", False) for layer in transformers.DynamicCache(config=m.config).layers):
        return f"no sliding-window cache layer on transformers {transformers.__version__}"
    return m


def _model(name):
    m = _build(name)
    if isinstance(m, str):
        pytest.skip(f"{name}: {m}")
    return m


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _toks(data, n):
    return torch.tensor([data.draw(st.lists(st.integers(3, 199), min_size=n, max_size=n))])


def _prefill_rows(model, ids):
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **cache_kwargs(ref))
    return list(kv_of(ref))


@settings(max_examples=CASES, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_agents_reuse_their_prompt_after_the_window_moved(data):
    """Every answer = plain generate (tokens, logits); an agent's next turn reuses its whole previous prompt
    (``exact_prefix_tokens`` = its length) although the answer moved the sliding windows past it; the held
    prompt-boundary rows equal plain prefill's.

    Drawn: ``sliding_history`` (every row held, or the window plus prompt-boundary copies) and the policy
    (``"auto"`` may run plain prefill where it measures that faster, so reuse is asserted under ``"prefix"``).

    Planted bug that fails it: ``WindowSnapshot.put`` copies at the third call instead of the second (the cache
    then holds one row more than the prompt: no copy is taken, the next turn reuses nothing). Checked. Another:
    ``take_history`` drops the prefix's rows it was started with (the held sliding rows then start at the
    prefix's end: their check against plain prefill fails, or ``prefix_kv`` finds no rows)."""
    name = data.draw(st.sampled_from(sorted(SLIDING)))
    history = data.draw(st.booleans())
    policy = data.draw(st.sampled_from(["auto", "prefix"]))
    model = _model(name)
    doc = _toks(data, data.draw(st.integers(3, 3 * WINDOW)))
    agents = data.draw(st.integers(1, 3))
    roles = [_toks(data, data.draw(st.integers(1, 4))) for _ in range(agents)]
    new = data.draw(st.integers(2, WINDOW + 2))
    sample = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2 ** 16))
    session = ReuseSession(model, policy=policy, sliding_history=history)
    transcript = torch.empty(1, 0, dtype=torch.long)
    last_prompt, seen, last_ids = {}, {}, {}
    for rnd in range(2):
        for a in range(agents):
            if rnd == 0:
                ids = torch.cat([roles[a], doc, transcript, torch.tensor([[3 + a]])], 1)
            else:  # its previous prompt, then what the others said since, then its cue
                ids = torch.cat([last_ids[a], transcript[:, seen[a]:], torch.tensor([[3 + a]])], 1)
            kw = dict(max_new_tokens=new, do_sample=sample, output_logits=True, return_dict_in_generate=True)
            torch.manual_seed(seed)
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            torch.manual_seed(seed)
            out = session.generate(ids, agent=str(a), **kw)
            assert torch.equal(out.sequences, ref.sequences), (name, rnd, a, session.last_stats)
            for x, y in zip(out.logits, ref.logits):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
            if rnd == 1 and policy == "prefix":  # the whole previous prompt reused exactly, wherever the windows moved
                assert session.last_stats.exact_prefix_tokens >= last_prompt[a], (name, a, session.last_stats)
            last_prompt[a] = ids.shape[1]
            last_ids[a] = ids
            seen[a] = transcript.shape[1]
            answer = out.sequences[:, ids.shape[1]:].clamp(min=3)  # no pad id (0) in the next prompts
            transcript = torch.cat([transcript, torch.tensor([[150 + a]]), answer[:, :2]], 1)
    windows = session._windows
    for e in session._entries.values():
        n = e.ids.numel()
        if history:  # every row held, and every prefix of it is what plain prefill of that prefix keeps
            assert all(k.shape[-2] == n for k, _ in e.kv) and not e.marks
            for m in sorted({1, n // 2, n - 1, n} - {0}):
                for got, ref in zip(e.prefix_kv(m, windows), _prefill_rows(model, e.ids[None, :m])):
                    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(got[1], ref[1], atol=1e-4, rtol=1e-4)
        for m, rows in e.marks.items():
            ref = _prefill_rows(model, e.ids[None, :m])
            for got, (rk, rv) in zip(rows, ref):
                if got is not None:
                    torch.testing.assert_close(got[0], rk, atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(got[1], rv, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("history", [True, False], ids=["history", "windows"])
def test_next_turn_reuses_the_prompt_past_the_window(history):
    """One agent, a document of three windows, an answer longer than the window, then its next turn with other
    text after its prompt: exact prefix = the whole previous prompt, answer = plain generate.

    Planted bug that fails it: ``ReuseSession._generate`` does not consult ``boundary_kv`` (only the final rows
    are tried: nothing reused). Checked."""
    model = _model("gemma3_text") if not isinstance(_build("gemma3_text"), str) else _model("mistral")
    ids = torch.arange(10, 10 + 3 * WINDOW)[None]
    session = ReuseSession(model, policy="prefix", sliding_history=history)
    session.generate(ids, max_new_tokens=WINDOW + 3, do_sample=False)
    nxt = torch.cat([ids, torch.tensor([[150, 151, 152]])], 1)
    out = session.generate(nxt, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(nxt, attention_mask=torch.ones_like(nxt), max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)
    assert session.last_stats.exact_prefix_tokens == ids.shape[1], session.last_stats


@pytest.mark.parametrize("history", [True, False], ids=["history", "windows"])
def test_other_agents_reuse_the_shared_document(history):
    """Three agents, each prompt = one document (three windows long), then the agent's own role: with
    ``sliding_history`` the second and third agents reuse the document exactly (a prefix that is no held prompt's
    end); without it they reuse nothing (the windows moved past the document). Answers = plain generate.

    Planted bug that fails it: ``take_history`` returns the layers' window rows (``kv_of(cache)``) instead of the
    history: [history] reuses nothing."""
    model = _model("gemma3_text") if not isinstance(_build("gemma3_text"), str) else _model("mistral")
    doc = torch.arange(10, 10 + 3 * WINDOW)[None]
    session = ReuseSession(model, policy="prefix", sliding_history=history)
    for a in range(3):
        ids = torch.cat([doc, torch.tensor([[100 + a, 101 + a, 102 + a]])], 1)
        out = session.generate(ids, max_new_tokens=WINDOW + 2, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=WINDOW + 2, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref.sequences)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)
        want = 0 if a == 0 else (doc.shape[1] if history else 0)
        assert session.last_stats.exact_prefix_tokens == want, (a, session.last_stats)


def test_history_is_dropped_when_rows_are_rewritten():
    """A cache whose sliding layers keep a history gives every row (``take_history``) after plain updates, and
    nothing after an operation that rewrites the rows (crop): never a history that no longer matches the cache.

    Planted bug that fails it: ``_history_class`` leaves ``crop`` out of the operations that drop the history
    *and* ``take_history`` skips its token-count check (the cropped cache then hands back rows past its length).
    Either alone passes, rightly: the other still refuses the stale history. Checked."""
    from transformers import DynamicCache

    from hf_kvreuse.sliding import keep_history, take_history

    model = _model("mistral")
    windows = [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
               for layer in DynamicCache(config=model.config).layers]
    assert any(windows)
    for crop in (False, True):
        # transformers refuses to crop a sliding layer whose window is full: a prompt inside the window there
        ids = torch.arange(10, 10 + (WINDOW - 2 if crop else 2 * WINDOW))[None]
        cache = DynamicCache(config=model.config)
        assert keep_history(cache, windows)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        n = ids.shape[1]
        if crop:
            cache.crop(-2)  # drop the last two tokens (the form every release accepts)
        kv = take_history(cache, windows, int(cache.get_seq_length()))
        if crop:
            assert kv is None
        else:
            assert kv is not None and all(k.shape[-2] == n for k, _ in kv)
        assert all(not hasattr(type(layer), "_history_base") for layer in cache.layers)  # back to their classes
