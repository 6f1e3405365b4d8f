"""Prompt ids in every form a user holds them (hf_kvreuse.inputs): tensors, lists, and what a tokenizer or
``apply_chat_template`` returns (a BatchEncoding on transformers 5), for every cache constructor, ``generate`` and
``ReuseSession.generate``; padded or batched input refused with an error that says what to pass."""

import pytest
import torch
from transformers import BatchEncoding

from hf_kvreuse import BlendCache, OptimisticCache, ReuseSession, output_cache
from hf_kvreuse.inputs import prompt_ids

from conftest import agent_prompts

GEN = dict(max_new_tokens=6, do_sample=False)


def enc(ids, mask=None):
    return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids) if mask is None else mask})


def test_prompt_ids_forms_and_refusals():
    ids = torch.tensor([[5, 6, 7]])
    for x in (ids, ids[0], [5, 6, 7], [[5, 6, 7]], enc(ids), {"input_ids": [5, 6, 7]}):
        assert torch.equal(prompt_ids(x), ids)
    with pytest.raises(ValueError, match="padding"):
        prompt_ids(enc(ids, torch.tensor([[0, 1, 1]])))
    with pytest.raises(ValueError, match="one prompt per call"):
        prompt_ids(enc(torch.ones(2, 3, dtype=torch.long)))
    with pytest.raises(TypeError, match="got text"):
        prompt_ids("hello")
    with pytest.raises(TypeError, match="no 'input_ids'"):
        prompt_ids({"ids": ids})
    with pytest.raises(TypeError, match="integers"):
        prompt_ids(torch.ones(1, 3))
    with pytest.raises(ValueError, match="does not match"):
        prompt_ids(ids, mask=torch.ones(1, 4))


def test_batch_encoding_everywhere_gives_the_tensors_answer(llama):
    """A BatchEncoding (what ``apply_chat_template(..., return_tensors="pt")`` returns on transformers 5) works as
    ``input_ids=`` / ``donor_ids=`` of the caches, as ``generate(**enc, past_key_values=...)`` and
    ``generate(enc, past_key_values=...)``, and in ``ReuseSession.generate``: the same tokens as the plain tensors,
    and (exact cache before the first token) as plain generate.

    Planted bug that fails it: ``unpack_generate_inputs`` passes the mapping's ``attention_mask`` as
    ``input_ids`` (the cache then refuses other ids than it was built for)."""
    ids_a, ids_b = agent_prompts(2)
    ref = llama.generate(ids_b, **GEN)
    out_a = llama.generate(ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    runs = []
    for form in ("kw", "positional"):
        cache = OptimisticCache(llama, input_ids=enc(ids_b), donor_cache=output_cache(out_a),
                                donor_ids=enc(out_a.sequences), max_optimistic_tokens=0, rebase="commit")
        out = llama.generate(**enc(ids_b), past_key_values=cache, **GEN) if form == "kw" else \
            llama.generate(enc(ids_b), past_key_values=cache, **GEN)
        runs.append(out)
        assert cache.stats.exact
    assert all(torch.equal(o, ref) for o in runs)
    blocks = BlendCache(llama, enc(ids_b), [(9, 30)], recompute_ratio=1.0)
    assert torch.equal(llama.generate(**enc(ids_b), past_key_values=blocks, **GEN), ref)
    s = ReuseSession(llama, policy="prefix")
    assert torch.equal(s.generate(enc(ids_b), **GEN), ref)


def test_padded_or_batched_encodings_refused(llama):
    ids_a, ids_b = agent_prompts(2)
    padded = enc(ids_b, torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones(1, ids_b.shape[1] - 2,
                                                                                   dtype=torch.long)], 1))
    out_a = llama.generate(ids_a, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="padding"):
        OptimisticCache(llama, input_ids=padded, donor_cache=output_cache(out_a), donor_ids=out_a.sequences,
                        rebase="commit")
    with pytest.raises(ValueError, match="padding"):
        ReuseSession(llama).generate(padded, **GEN)
    with pytest.raises(ValueError, match="one prompt per call"):
        ReuseSession(llama).generate(enc(torch.cat([ids_b, ids_b])), **GEN)
    with pytest.raises(TypeError, match="got text"):
        ReuseSession(llama).generate("a prompt", **GEN)
    cache = OptimisticCache(llama, input_ids=None, donor_cache=output_cache(out_a), donor_ids=out_a.sequences,
                            rebase="commit")
    with pytest.raises(ValueError, match="prompt twice"):
        llama.generate(enc(ids_b), input_ids=ids_b, past_key_values=cache, **GEN)
