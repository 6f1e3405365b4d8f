"""What the library installs in a model is seen only by the call that installed it.

Each test runs another thread's forward (or a second library call) *inside* a library call, at a point where
everything that call installs is in place (a pre-hook on the first decoder layer of the calling thread's own
forward), and compares what both compute with what they compute alone.
"""

import threading

import pytest
import torch
from transformers import DynamicCache

from hf_kvreuse import BaseLRCache
from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.local_hooks import base_attn, local_hooks, patched_forward, wrapped_attention
from hf_kvreuse.lora import LoraSplit
from hf_kvreuse.model_check import check_donor
from hf_kvreuse.models import tiny_model

from test_base_lr import GEN, multi_lora, rand_ids


def inside(model, call, other):
    """Run ``call()``; when its forward reaches the first decoder layer (first time only), run ``other()`` in a
    second thread to completion. Returns ``(call's result, other's result)``."""
    owner, got, fired = threading.get_ident(), {}, []
    layers = (model.get_base_model() if hasattr(model, "get_base_model") else model).model.layers

    def pre(module, args):
        if threading.get_ident() == owner and not fired:
            fired.append(1)
            t = threading.Thread(target=lambda: got.update(out=_capture(other)))
            t.start()
            t.join()

    handle = layers[0].register_forward_pre_hook(pre)
    try:
        mine = call()
    finally:
        handle.remove()
    assert fired, "the call never ran the model"
    out = got["out"]
    if isinstance(out, BaseException):
        raise AssertionError(f"the other thread's call failed inside the library call: {out!r}") from out
    return mine, out


def _capture(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 (reported by the caller)
        return e


@torch.no_grad()
def logits(model, ids):
    return model(input_ids=ids).logits


def test_local_hooks_act_in_their_context_only():
    """A hook registered through ``local_hooks`` changes this context's forward and not another thread's; it is
    gone after the block. Planted bug that fails it: ``LocalHooks.forward`` registers ``hook`` itself (the other
    thread's logits are zeroed too)."""
    m = tiny_model("llama").eval()
    ids = rand_ids(9)
    ref = logits(m, ids)

    def zero(mod, args, out):
        return torch.zeros_like(out)

    def call():
        with local_hooks() as hooks:
            hooks.forward(m.lm_head, zero)
            return logits(m, ids)

    mine, theirs = inside(m, call, lambda: logits(m, ids))
    assert torch.count_nonzero(mine) == 0
    torch.testing.assert_close(theirs, ref, rtol=0, atol=0)
    torch.testing.assert_close(logits(m, ids), ref, rtol=0, atol=0)


def test_donor_probe_leaves_another_threads_forward_whole():
    """The donor probe stops its own forward after layer 0 with a hook; another thread's forward of the same
    model meanwhile runs every layer and returns the same logits. Planted bug that fails it: the stop hook is a
    plain ``register_forward_hook`` (the other thread's forward raises ``_StopAfterLayer0``)."""
    m = tiny_model("llama").eval()
    donor_ids, ids = rand_ids(12, seed=3), rand_ids(9)
    kv = DynamicCache(config=m.config)
    with torch.no_grad():
        m(input_ids=donor_ids, use_cache=True, **cache_kwargs(kv))
    ref = logits(m, ids)
    _, theirs = inside(m, lambda: check_donor(m, kv, donor_ids, 12, who="test"), lambda: logits(m, ids))
    torch.testing.assert_close(theirs, ref, rtol=0, atol=0)


def test_mixed_adapter_rows_leave_another_threads_adapters_alone():
    """A shared BaseLRCache whose forward runs two rows (an adapted row and an adapter-free one, passed to peft
    as per-row adapter names) does not hand those names to another thread's forward of the same peft model: that
    forward computes with its active adapter, as alone; and the cache's own answer is plain generate's.
    Planted bug that fails it: ``mixed_adapters`` registers its pre-hooks with ``register_forward_pre_hook``
    (the other thread's forward runs the cache's agent's adapter, not its own)."""
    pm = multi_lora("llama", targets=("v_proj", "q_proj", "o_proj"))  # q/o: peft's own mixed-batch path
    ids = rand_ids(10)
    pm.set_adapter("act")
    want = pm.generate(input_ids=ids, max_new_tokens=4, **GEN)
    pm.set_adapter("plan")  # the other thread's adapter; the cache runs agent "act"
    ref = logits(pm, ids)
    cache = BaseLRCache(pm, method="rebaseshared", schedule="alongside", agent="act")
    mine, theirs = inside(pm, lambda: pm.generate(input_ids=ids, cache=cache, max_new_tokens=4, **GEN),
                          lambda: logits(pm, ids))
    torch.testing.assert_close(theirs, ref, rtol=0, atol=0)
    assert torch.equal(mine, want)


def test_a_second_base_lr_call_inside_the_first_leaves_it_exact():
    """Two BaseLRCaches on one peft model, the second's whole ``generate`` running in another thread inside the
    first's forward: both answers are plain generate's, and afterwards the model has neither the patched
    projections nor the library's attention. Planted bugs that fail it: ``LoraSplit.install`` patches without
    reference counting (the second call's exit removes the first's split projections: its low-rank caches miss
    rows and the call fails); ``wrapped_attention`` restores the saved implementation on any exit."""
    pm = multi_lora("llama", targets=("k_proj", "v_proj"))
    pm.set_adapter("act")
    a, b = rand_ids(11, seed=5), rand_ids(8, seed=6)
    want_a = pm.generate(input_ids=a, max_new_tokens=3, **GEN)
    want_b = pm.generate(input_ids=b, max_new_tokens=3, **GEN)
    attn = pm.config._attn_implementation
    ca, cb = BaseLRCache(pm, method="prelrshared"), BaseLRCache(pm, method="prelrshared")
    got_a, got_b = inside(pm, lambda: pm.generate(input_ids=a, cache=ca, max_new_tokens=3, **GEN),
                          lambda: pm.generate(input_ids=b, cache=cb, max_new_tokens=3, **GEN))
    assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b)
    assert pm.config._attn_implementation == attn
    assert not any("forward" in mod.__dict__ for mod in pm.modules())


def test_swaps_and_patches_survive_out_of_order_exits():
    """The attention swap and the split projections stay while any call holds them, whatever the order of exits,
    and are undone by the last one out. Planted bugs that fail it: no reference count in ``wrapped_attention``
    (the first exit restores the base while the second call runs) or in ``patched_forward``."""
    pm = multi_lora("llama", targets=("k_proj", "v_proj"))
    cfg = pm.config
    base = cfg._attn_implementation
    s1, s2 = LoraSplit(pm), LoraSplit(pm)
    v = pm.get_base_model().model.layers[0].self_attn.v_proj
    first, second = wrapped_attention(pm), wrapped_attention(pm)
    name = first.__enter__()
    s1.install()
    assert second.__enter__() == name
    s2.install()
    first.__exit__(None, None, None)
    s1.uninstall()
    assert cfg._attn_implementation == name and base_attn(cfg) == base
    assert "forward" in v.__dict__
    second.__exit__(None, None, None)
    s2.uninstall()
    assert cfg._attn_implementation == base and "forward" not in v.__dict__


def test_patched_forward_refuses_a_foreign_instance_forward():
    """A module whose ``forward`` another library already replaced on the instance is refused, not overwritten
    and later deleted. Planted bug that fails it: the check is removed (the foreign forward is lost)."""
    lin = torch.nn.Linear(2, 2)
    lin.forward = lambda x: x
    with pytest.raises(RuntimeError, match="already has an instance forward"):
        with patched_forward([(lin, lambda m: (lambda x: x))]):
            pass
    assert "forward" in lin.__dict__
