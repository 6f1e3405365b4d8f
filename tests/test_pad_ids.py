"""A raw prompt holding the pad id, across architectures: exactly plain ``generate``'s answer, or refused.

Without an ``attention_mask``, transformers' ``generate`` masks the pad tokens of a prompt as padding (when the pad
id is not an eos id) and shifts the positions after them. :class:`hf_kvreuse.ReuseSession` under ``policy="auto"``
or ``"full"`` then runs plain ``generate`` as it is (nothing reused, nothing held); every other policy, and every
reuse cache (first call and continuation), refuses with an error that names the pad id and says to pass an
``attention_mask``. Never another answer. Property test with hypothesis over zoo architectures (tiny random
configs, pad id 0, no eos), random prompts with pad ids anywhere (left padding included), greedy and sampling.
"""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_kvreuse import OptimisticCache, ReuseSession, enable, output_cache
from hf_kvreuse.compat import TRANSFORMERS_VERSION
from hf_kvreuse.inputs import inferred_padding
from hf_kvreuse.models.arch_zoo import zoo_model

#: one family of each position scheme and layout: RoPE half-split / interleaved / partial, GQA, absolute
#: positions (gpt2, opt), ALiBi (bloom), Gemma's scaled embeddings, Cohere's parallel block
ARCHS = ["llama", "qwen2", "gemma", "mistral", "phi3", "stablelm", "cohere", "olmo2", "gpt2", "opt", "bloom", "glm"]
PAD = 0
#: cases per run (the CI profile); ``HF_KVREUSE_PAD_CASES=500`` for a long run
CASES = int(__import__("os").environ.get("HF_KVREUSE_PAD_CASES", "40"))


#: the release the full suite runs on; an older one may lack a family's config fields (StableLM's
#: ``pad_token_id`` on transformers 5.0)
NEWEST = TRANSFORMERS_VERSION >= (5, 24)


@functools.lru_cache(maxsize=None)
def _get(arch):
    """The enabled tiny model. On the newest tested release every family in ARCHS must build, and any error here
    (the builder's or ``enable``'s) is a failure; on an older release a builder error of transformers' own config
    (AttributeError) returns None and the property draws another family (never a skip, which would skip the whole
    property). ``enable`` always runs outside the ``try``."""
    try:
        model = zoo_model(arch)
    except AttributeError:
        if NEWEST:
            raise
        return None
    return enable(model)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompt(data, pads: int, length: int):
    body = data.draw(st.lists(st.integers(3, 127), min_size=length, max_size=length))
    where = data.draw(st.lists(st.integers(0, length), min_size=pads, max_size=pads))
    for w in sorted(where, reverse=True):
        body.insert(w, PAD)
    return torch.tensor([body])


def _run(fn, sample: bool, seed: int, **kw):
    torch.manual_seed(seed)
    return fn(output_logits=True, return_dict_in_generate=True, do_sample=sample, **kw)


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@settings(max_examples=CASES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_session_with_pad_ids_is_plain_generate(data):
    """ReuseSession (auto, and full) on a prompt holding the pad id = plain ``generate`` (tokens and logits), even
    when it holds a cache sharing the prompt's text before the first pad (which it would otherwise reuse); the
    call holds nothing; the reuse policies refuse with the pad id and leave the session as it was.

    Planted bug that fails it: ``ReuseSession.generate`` ignores ``_inferred_padding`` (runs its normal path, with
    the all-ones attention mask it sets): the pad tokens are read as text and the logits differ."""
    arch = data.draw(st.sampled_from([a for a in ARCHS if _get(a) is not None]))
    model = _get(arch)
    length = data.draw(st.integers(4, 20))
    ids = _prompt(data, data.draw(st.integers(1, 3)), length)
    sample = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2 ** 16))
    new = data.draw(st.integers(1, 5))
    policy = data.draw(st.sampled_from(["auto", "full"]))
    assert inferred_padding(model, ids, {}) is not None
    session = ReuseSession(model)
    warm = ids.clone()
    warm[warm == PAD] = 5
    session.generate(warm, max_new_tokens=2, do_sample=False)  # a held cache sharing the text around the pads
    held, calls = session.nbytes, session.calls
    ref = _run(model.generate, sample, seed, input_ids=ids, max_new_tokens=new)
    out = _run(functools.partial(session.generate, ids, policy=policy), sample, seed, max_new_tokens=new)
    _same(out, ref)
    stats = session.last_stats
    assert stats.method == "full" and not stats.stored and stats.new_tokens == ids.shape[1]
    assert session.nbytes == held
    refused = data.draw(st.sampled_from(["prefix", "optimistic", "direct"]))
    with pytest.raises(ValueError, match=f"pad token id {PAD}.*attention_mask"):
        session.generate(ids, policy=refused, max_new_tokens=new)
    assert session.calls == calls + 1 and session.nbytes == held
    # text, as the caller says with an all-ones mask: the session serves it (and reuse stays exact)
    mask = torch.ones_like(ids)
    ref = _run(model.generate, sample, seed, input_ids=ids, attention_mask=mask, max_new_tokens=new)
    out = _run(functools.partial(session.generate, ids, policy=policy), sample, seed, attention_mask=mask,
               max_new_tokens=new)
    _same(out, ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_caches_refuse_pad_ids_first_call_and_continuation(arch):
    """A reuse cache refuses a prompt holding the pad id (no attention_mask) before any work, on its first
    ``generate`` and on a continuation whose new prompt holds it; with an all-ones mask it serves the prompt, and
    a pad id that is also the eos id (generate infers nothing then) is served too.

    Planted bug that fails it: ``begin_continuation`` skips ``_check_pad_tokens`` (the continuation then runs
    with the pad tokens masked over rows that read them as text)."""
    model = _get(arch)
    donor = torch.arange(3, 23)[None]
    out = model.generate(donor, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    ids = torch.cat([torch.tensor([[9, PAD]]), donor[:, 2:]], 1)
    if arch == "gpt2":
        return  # absolute positions: OptimisticCache refuses the model itself
    cache = OptimisticCache(model, input_ids=ids, donor_cache=output_cache(out), donor_ids=out.sequences)
    with pytest.raises(ValueError, match=f"pad token id {PAD}.*position 1.*attention_mask"):
        model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.phase == "new"
    cache = OptimisticCache(model, input_ids=ids, donor_cache=output_cache(out), donor_ids=out.sequences)
    first = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=3,
                           do_sample=False)
    nxt = torch.cat([first, torch.tensor([[PAD, 7, 8]])], 1)
    with pytest.raises(ValueError, match=f"pad token id {PAD}"):
        model.generate(nxt, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.phase == "done" and cache.get_seq_length() == first.shape[1] - 1
    cont = model.generate(nxt, attention_mask=torch.ones_like(nxt), past_key_values=cache, max_new_tokens=2,
                          do_sample=False)
    assert torch.equal(cont, model.generate(nxt, attention_mask=torch.ones_like(nxt), max_new_tokens=2,
                                            do_sample=False))
    # pad == eos: generate infers no mask, the pad id is text for both
    assert inferred_padding(model, ids, {"eos_token_id": PAD}) is None
    assert inferred_padding(model, ids, {"pad_token_id": None}) is None  # no pad, no eos: nothing to infer
