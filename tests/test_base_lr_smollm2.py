"""BaseLRCache on SmolLM2-135M-Instruct with the shipped plan / act / reflect role adapters (slow)."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvreuse import BaseLRCache
from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.kv import kv_of
from hf_kvreuse.models import load_smollm2
from hf_kvreuse.workflows.datasets import squad

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def roles():
    from hf_kvreuse.workflows import react

    model, tok = load_smollm2()  # a fresh copy: peft wraps the model's modules in place
    pm = react.load_role_adapters(model)
    _, held = react.split_items(squad())
    return pm, tok, react, held[0]


def ids_of(tok, text):
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def episode(pm, tok, react, item, cache):
    """plan → act → reflect over one short episode; returns the act and reflect outputs."""
    passages = [item.passage]
    act = react.act_example(item, passages)
    outs = []
    for agent, prompt, n in (("plan", react.plan_example(item).prompt, 12), ("act", act.prompt, 8)):
        pm.set_adapter(agent)
        outs.append(pm.generate(input_ids=ids_of(tok, prompt), cache=cache, max_new_tokens=n, do_sample=False))
    answer = react.parse_finish(tok.decode(outs[-1][0, ids_of(tok, act.prompt).shape[1]:]))
    pm.set_adapter("reflect")
    prompt = react.reflect_example(item, passages, answer).prompt
    outs.append(pm.generate(input_ids=ids_of(tok, prompt), cache=cache, max_new_tokens=4, do_sample=False))
    return outs


def test_single_agent_prelrshared_equals_generate(roles):
    pm, tok, react, item = roles
    ids = ids_of(tok, react.act_example(item, [item.passage]).prompt)
    pm.set_adapter("act")
    ref = pm.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(pm.generate(input_ids=ids, cache=BaseLRCache(pm), max_new_tokens=10, do_sample=False), ref)


def test_rebaseshared_invariants_and_schedules(roles):
    pm, tok, react, item = roles
    lp = BaseLRCache(pm, method="rebaseshared")
    db = BaseLRCache(pm, method="rebaseshared", schedule="alongside")
    out_lp, out_db = episode(pm, tok, react, item, lp), episode(pm, tok, react, item, db)
    for a, b in zip(out_lp, out_db):
        assert torch.equal(a, b)
    ref = DynamicCache(config=pm.config)
    with torch.no_grad(), pm.disable_adapter():
        pm(input_ids=lp.token_ids, use_cache=True, **cache_kwargs(ref))
    for (k, v), (dk, dv), (rk, rv) in zip(kv_of(lp), kv_of(db), kv_of(ref)):
        torch.testing.assert_close(k, rk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, rv, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dk, rk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dv, rv, atol=1e-4, rtol=1e-4)
    # memory: one adapter's LR cache is r / (2·H_kv·D) = 8 / 384 of the base cache
    base = lp.kv_bytes() - lp.lr_bytes()
    assert lp.lr_bytes("act") / base == pytest.approx(8 / 384)
