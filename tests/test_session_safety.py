"""A session's held caches survive every call option: ``release_donor`` in the cache options, beam search, several
returned sequences (planted bugs in each docstring, rows in docs/MUTATIONS.md)."""

import pytest
import torch

from hf_kvreuse import ReuseSession, enable
from hf_kvreuse.models import tiny_model

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return enable(tiny_model("llama"))


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, n), generator=g)


def _plain(model, ids, **kw):
    return model.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY, **kw)


def _assert_plain(model, s, ids):
    out = s.generate(ids, max_new_tokens=4, output_scores=True, return_dict_in_generate=True, **GREEDY)
    ref = _plain(model, ids)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_release_donor_keeps_held_caches(model):
    """``method_kwargs=dict(release_donor=True)``: the session's held entries keep their K/V, the next call that
    meets them equals plain ``generate``. Planted bug: the session hands its held entries' own K/V lists to the
    cache (``caches = [entries[d][1].kv ...]`` without the copy): the held K become empty, the next call fails."""
    s = ReuseSession(model, policy="optimistic", method_kwargs=dict(release_donor=True), min_donor_tokens=8)
    a, b = _ids(40, 1), _ids(12, 2)
    s.generate(a, max_new_tokens=4, **GREEDY)
    held = [e.kv[0][0].shape[-2] for e in s._entries.values()]
    s.generate(torch.cat([b, a[:, :30]], 1), max_new_tokens=4, **GREEDY)  # reuses a's rows as donor
    assert s.last_stats.method == "optimistic"
    assert held[0] > 0 and all(e.kv[0][0].shape[-2] == e.ids.numel() for e in s._entries.values())
    _assert_plain(model, s, torch.cat([a[:, :35], b], 1))  # meets a's entry again (exact prefix)
    assert s.last_stats.exact_prefix_tokens >= 35


@pytest.mark.parametrize("kw", [dict(num_beams=2), dict(num_beams=3, num_return_sequences=2),
                                dict(do_sample=True, num_return_sequences=2, top_k=5)])
def test_several_sequences_do_not_poison(model, kw):
    """A beam-search / several-sequence call holds nothing of batch > 1 and the next ordinary call equals plain
    ``generate``. Planted bug: ``_store`` holds the beam cache (drop the batch-1 check): the next call fails in
    ``DynamicCache.update`` (batch 2 against batch 1)."""
    s = ReuseSession(model)
    ids = _ids(38, 3)
    g = dict(GREEDY, **kw)
    torch.manual_seed(0)
    s.generate(ids, max_new_tokens=4, **g)
    assert all(e.kv[0][0].shape[0] == 1 for e in s._entries.values())
    _assert_plain(model, s, torch.cat([ids, ids[:, :5]], 1))


def test_batch_prompt_refused_session_unchanged(model):
    """A batch of two prompts is refused with a ValueError and leaves the session as it was."""
    s = ReuseSession(model)
    ids = _ids(20, 4)
    s.generate(ids, max_new_tokens=2, **GREEDY)
    before = s.held()
    with pytest.raises(ValueError):
        s.generate(torch.cat([ids, ids]), max_new_tokens=2, **GREEDY)
    assert s.held() == before
