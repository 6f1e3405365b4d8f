import threading
import warnings

import pytest
import torch

from hf_kvreuse import OptimisticCache, enable, is_enabled
from hf_kvreuse.compat import output_cache
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.models import tiny_model

from conftest import agent_prompts, assert_kv_close, exact_prefill

GEN = dict(max_new_tokens=16, do_sample=False)


def _donor(model, ids, new=8):
    out = model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    return output_cache(out), out.sequences


def _cache(model, ids_b, donor, **kw):
    kw.setdefault("rebase", "commit")  # the RebaseKV mechanism as published (verify has tests/test_verify.py)
    return OptimisticCache(model, input_ids=ids_b, donor_cache=donor[0], donor_ids=donor[1], **kw)


def _no_worker_alive():
    return not any(t.name == "hf_kvreuse-prefill" and t.is_alive() for t in threading.enumerate())


@pytest.fixture
def slow_background(monkeypatch):
    """Hold the background prefill until the foreground waits for it (or cancels it): the swap then happens
    exactly at max_optimistic_tokens (or at the end of generation), however loaded the machine is."""
    orig_prefill, orig_boost, orig_cancel = BackgroundPrefill._prefill, BackgroundPrefill.boost, BackgroundPrefill.cancel

    def release(self):
        if not hasattr(self, "_release"):
            self._release = threading.Event()
        return self._release

    def held(self):
        if not self.synchronous:  # max_optimistic_tokens=0 prefills in the caller's thread: nothing to hold
            assert release(self).wait(timeout=60), "the foreground never waited for the background prefill"
        return orig_prefill(self)

    def boost(self):
        release(self).set()
        orig_boost(self)

    def cancel(self):
        release(self).set()
        orig_cancel(self)

    monkeypatch.setattr(BackgroundPrefill, "_prefill", held)
    monkeypatch.setattr(BackgroundPrefill, "boost", boost)
    monkeypatch.setattr(BackgroundPrefill, "cancel", cancel)


def test_donor_equal_to_target_is_plain_generate(arch_model):
    """A donor whose prompt is the target's: the whole prompt is an exact prefix, so tokens equal plain generate.

    Planted bug that fails it: ``OptimisticCache._assemble`` copies each layer's donor K/V into the previous
    layer (``zip(kv, donor_kv[1:] + donor_kv[:1])``, a wrong layer index)."""
    ids_a, _ = agent_prompts(0)
    donor = _donor(arch_model, ids_a)
    ref = arch_model.generate(ids_a, **GEN)
    cache = _cache(arch_model, ids_a, donor, max_optimistic_tokens=None)
    out = arch_model.generate(ids_a, cache=cache, **GEN)
    assert torch.equal(out, ref)
    assert cache.stats.new_tokens == 1 and cache.stats.prefix_tokens == ids_a.shape[1] - 1  # the last prompt token


@pytest.mark.parametrize("do_sample", [False, True])
def test_zero_optimistic_tokens_is_plain_generate(arch_model, do_sample):
    """``max_optimistic_tokens=0``: the exact cache is built before the first token; greedy and sampled output
    equal plain generate.

    Planted bug that fails it: ``_swap_in`` does not ``load_kv`` the exact K/V (the cache stays empty)."""
    ids_a, ids_b = agent_prompts(1)
    donor = _donor(arch_model, ids_a)
    kw = dict(max_new_tokens=16, do_sample=do_sample, top_k=0)
    torch.manual_seed(5)
    ref = arch_model.generate(ids_b, **kw)
    cache = _cache(arch_model, ids_b, donor, max_optimistic_tokens=0)
    torch.manual_seed(5)
    out = arch_model.generate(ids_b, cache=cache, **kw)
    assert torch.equal(out, ref)
    assert cache.stats.swap_step == 0 and cache.stats.exact


@pytest.mark.parametrize("swap_at", [1, 3, 7])
def test_continuation_after_swap_is_exact(arch_model, slow_background, swap_at):
    """After a swap at ``swap_at`` the tokens are plain generate continued from the same tokens, and the returned
    cache is exact.

    Planted bug that fails it: ``_swap_in`` feeds one token too few (``input_ids.shape[1] - n``); with the replay
    record kept ``_count_divergence`` raises, with it dropped the token comparison fails."""
    ids_a, ids_b = agent_prompts(2)
    donor = _donor(arch_model, ids_a)
    cache = _cache(arch_model, ids_b, donor, max_optimistic_tokens=swap_at)
    out = arch_model.generate(ids_b, cache=cache, **GEN)
    assert cache.stats.swap_step == swap_at
    n = ids_b.shape[1]
    cut = out[:, : n + swap_at]
    ref = arch_model.generate(cut, max_new_tokens=GEN["max_new_tokens"] - swap_at, do_sample=False)
    assert torch.equal(out, ref)
    # the returned cache is the exact cache of every fed token
    exact, _ = exact_prefill(arch_model, out[:, :-1])
    assert_kv_close(cache, exact, atol=1e-4, rtol=1e-4)


def test_optimistic_tokens_differ_and_divergence_is_counted(llama, slow_background):
    """The replay's count of optimistic tokens the exact model would not have chosen equals a count by hand.
    The prompts are chosen so that some, not all, of the 8 diverge, the first not at 0 (all 8 diverging, as with
    seed 3, made an off-by-one in the count invisible).

    Planted bug that fails it: ``_swap_in`` records the replay tokens shifted by one
    (``self._replay = input_ids[0, n - 1:-1]``)."""
    ids_a, ids_b = agent_prompts(8, shared=30, role_a=4, role_b=12)
    donor = _donor(llama, ids_a)
    cache = _cache(llama, ids_b, donor, max_optimistic_tokens=8)
    out = llama.generate(ids_b, cache=cache, **GEN)
    n = ids_b.shape[1]
    exact_greedy = llama.generate(ids_b, **GEN)
    # count by hand: positions where the exact model's greedy choice (given the same earlier tokens) differs
    with torch.no_grad():
        logits = llama(out[:, : n + 8]).logits[0, n - 1: n + 7]
    manual = int((logits.argmax(-1) != out[0, n: n + 8]).sum())
    assert cache.stats.divergent_tokens == manual
    assert 0 < manual < 8 and not torch.equal(out, exact_greedy)  # the stale cache did change some tokens
    assert cache.stats.optimistic_tokens == 8 and cache.stats.reused_tokens > 0
    assert cache.stats.first_divergence == int((logits.argmax(-1) != out[0, n: n + 8]).nonzero()[0, 0])


def test_sampling_with_swap_returns_exact_cache(llama, slow_background):
    """Sampling with a swap at 3: the returned cache is the exact cache of every fed token (the logits after the
    swap are checked in test_trust.test_sampling_swap_continues_exactly).

    Planted bug that fails it: ``_swap_in`` feeds one token too few (``input_ids.shape[1] - n``): with the replay
    record kept ``_count_divergence`` raises; with it dropped, ``physical_length`` is one short."""
    ids_a, ids_b = agent_prompts(4)
    donor = _donor(llama, ids_a)
    cache = _cache(llama, ids_b, donor, max_optimistic_tokens=3)
    out = llama.generate(ids_b, cache=cache, max_new_tokens=12, do_sample=True, temperature=0.8)
    assert out.shape[1] == ids_b.shape[1] + 12 and cache.stats.swap_step == 3
    assert cache.physical_length() == out.shape[1] - 1
    exact, _ = exact_prefill(llama, out[:, :-1])
    assert_kv_close(cache, exact, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("repair", [None, "epic"])
def test_fused_first_step_equals_two_forwards(arch_model, slow_background, repair):
    """``fuse_first_step`` (the default): the unmatched rows and the last prompt token in one partial forward give
    the same first logits, tokens and optimistic K/V (the cache is left optimistic: ``on_early_finish="cancel"``)
    as RebaseKV's two forwards (``fuse_first_step=False``), and those logits are not full prefill's (the rows read
    the stale cache, so a wrong row or position shows).

    Planted bugs that fail it: the fused forward's extra row is ``covered - 1`` instead of the last prompt token's
    ``covered``; ``OptimisticCache.forward`` does not ``load_kv`` the full-length K/V after it."""
    ids_a, ids_b = agent_prompts(12)
    donor = _donor(arch_model, ids_a)
    runs = {}
    for fuse in (True, False):
        cache = _cache(arch_model, ids_b, donor, max_optimistic_tokens=None, on_early_finish="cancel",
                       fuse_first_step=fuse, repair=repair, repair_tokens=3)
        out = arch_model.generate(ids_b, cache=cache, max_new_tokens=4, do_sample=False,
                                  return_dict_in_generate=True, output_logits=True)
        runs[fuse] = cache, out
    (fc, fo), (uc, uo) = runs[True], runs[False]
    assert fc.stats.fused_first_step and not uc.stats.fused_first_step
    assert fc.stats.new_tokens == uc.stats.new_tokens > 1 and fc.stats.repaired_tokens == uc.stats.repaired_tokens
    assert (fc.stats.repaired_tokens > 0) == (repair == "epic")
    torch.testing.assert_close(torch.stack(fo.logits), torch.stack(uo.logits), atol=1e-4, rtol=1e-4)
    assert torch.equal(fo.sequences, uo.sequences)
    assert fc.physical_length() == uc.physical_length() == fo.sequences.shape[1] - 1
    assert_kv_close(fc, uc, atol=1e-5, rtol=1e-5)
    _, full_logits = exact_prefill(arch_model, ids_b)
    assert not torch.allclose(fo.logits[0][0], full_logits[0, -1], atol=1e-3)


def test_fused_first_step_off_when_hidden_states_are_returned(slow_background):
    """generate asked for hidden states: the first forward is the model's own (its hidden states are the last
    token's, as without a cache); a non-bool ``fuse_first_step`` is refused. (Its own model: transformers leaves
    output-capturing hooks on a model that returned hidden states, and such a model no longer pickles.)"""
    llama = enable(tiny_model("llama"))
    ids_a, ids_b = agent_prompts(13)
    donor = _donor(llama, ids_a)
    cache = _cache(llama, ids_b, donor, max_optimistic_tokens=None, on_early_finish="cancel")
    out = llama.generate(ids_b, cache=cache, max_new_tokens=2, do_sample=False, return_dict_in_generate=True,
                         output_hidden_states=True)
    assert not cache.stats.fused_first_step and out.hidden_states[0][-1].shape[1] == 1
    with pytest.raises(TypeError, match="fuse_first_step"):
        _cache(llama, ids_b, donor, fuse_first_step="yes")


def test_both_keywords(llama):
    """``cache=`` and ``past_key_values=`` both work (plain generate's tokens) and neither warns.

    Planted bug that fails it: ``compat.CACHE_NAMES`` lacks ``"past_key_values"`` (the cache passes through to
    transformers untouched: same tokens from an empty cache, but transformers warns)."""
    ids_a, ids_b = agent_prompts(5)
    donor = _donor(llama, ids_a)
    ref = llama.generate(ids_b, **GEN)
    out1 = llama.generate(ids_b, cache=_cache(llama, ids_b, donor, max_optimistic_tokens=0), **GEN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out2 = llama.generate(ids_b, past_key_values=_cache(llama, ids_b, donor, max_optimistic_tokens=0), **GEN)
    assert torch.equal(out1, ref) and torch.equal(out2, ref)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_return_dict_and_chain_of_three(llama):
    g = torch.Generator().manual_seed(9)
    q = torch.randint(3, 128, (1, 30), generator=g)
    roles = [torch.randint(3, 128, (1, 5 + i), generator=g) for i in range(3)]
    ids = torch.cat([roles[0], q], 1)
    out = llama.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    answers = [out.sequences[:, ids.shape[1]:]]
    for i in (1, 2):
        ids = torch.cat([roles[i], q] + answers, 1)
        cache = OptimisticCache(llama, input_ids=ids, donor_cache=output_cache(out), donor_ids=out.sequences,
                                max_optimistic_tokens=2, rebase="commit")
        out = llama.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        assert output_cache(out) is cache and cache.stats.exact
        assert cache.stats.reused_tokens >= q.shape[1]  # the question and earlier answers came from the donor
        answers.append(out.sequences[:, ids.shape[1]:])


def test_background_error_reaches_caller(llama, monkeypatch):
    def boom(self):
        raise ValueError("injected failure")

    monkeypatch.setattr(BackgroundPrefill, "_prefill", boom)
    ids_a, ids_b = agent_prompts(6)
    donor = _donor(llama, ids_a)
    for mot in (None, 4, 0):
        cache = _cache(llama, ids_b, donor, max_optimistic_tokens=mot)
        with pytest.raises(RuntimeError, match="background exact prefill failed") as info:
            llama.generate(ids_b, cache=cache, **GEN)
        assert isinstance(info.value.__cause__, ValueError)
        assert _no_worker_alive()


def test_no_worker_outlives_generate(llama, slow_background):
    ids_a, ids_b = agent_prompts(7)
    donor = _donor(llama, ids_a)
    for finish in ("swap", "cancel"):
        cache = _cache(llama, ids_b, donor, max_optimistic_tokens=None, on_early_finish=finish)
        llama.generate(ids_b, cache=cache, max_new_tokens=2, do_sample=False)
        assert _no_worker_alive()
        assert cache.stats.exact == (finish == "swap")
        assert cache.stats.optimistic_tokens == 2


def test_early_finish_swap_returns_exact_cache(llama, slow_background):
    """Generation ends before the swap: ``finish`` swaps and replays, so the returned cache is exact.

    Planted bug that fails it: ``finish`` replays at positions one too far (``arange(n, fed.shape[1] + 1)``)."""
    ids_a, ids_b = agent_prompts(8)
    donor = _donor(llama, ids_a)
    cache = _cache(llama, ids_b, donor, max_optimistic_tokens=None)
    out = llama.generate(ids_b, cache=cache, max_new_tokens=3, do_sample=False)
    exact, _ = exact_prefill(llama, out[:, :-1])
    assert_kv_close(cache, exact, atol=1e-4, rtol=1e-4)


def test_eager_attention(llama_eager, slow_background):
    """Eager attention: the tokens after a swap at 4 and the returned cache are exact.

    Planted bug that fails it: ``_swap_in`` feeds one token too few (``input_ids.shape[1] - n``; with the replay
    record dropped, so that ``_count_divergence`` does not raise first): the tokens still agreed here, the K/V
    check (added for this) fails."""
    ids_a, ids_b = agent_prompts(10)
    donor = _donor(llama_eager, ids_a)
    cache = _cache(llama_eager, ids_b, donor, max_optimistic_tokens=4)
    out = llama_eager.generate(ids_b, cache=cache, **GEN)
    n = ids_b.shape[1]
    ref = llama_eager.generate(out[:, : n + 4], max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)
    exact, _ = exact_prefill(llama_eager, out[:, :-1])
    assert_kv_close(cache, exact, atol=1e-4, rtol=1e-4)


def test_clear_errors(llama):
    ids_a, ids_b = agent_prompts(11)
    donor = _donor(llama, ids_a)
    with pytest.raises(ValueError, match="batched or padded"):
        _cache(llama, torch.cat([ids_b, ids_b]), donor)
    with pytest.raises(ValueError, match="different input_ids"):
        llama.generate(ids_b[:, 5:], cache=_cache(llama, ids_b, donor), **GEN)
    with pytest.raises(ValueError, match="num_beams"):
        llama.generate(ids_b, cache=_cache(llama, ids_b, donor), max_new_tokens=4, num_beams=2)
    with pytest.raises(ValueError, match="padded"):
        mask = torch.ones_like(ids_b)
        mask[0, 0] = 0
        llama.generate(ids_b, attention_mask=mask, cache=_cache(llama, ids_b, donor), **GEN)
    with pytest.raises(ValueError, match="batch size 1"):  # continuations are checked like first calls
        cache = _cache(llama, ids_b, donor, max_optimistic_tokens=0)
        out = llama.generate(ids_b, cache=cache, **GEN)
        llama.generate(out.repeat(2, 1), cache=cache, **GEN)
    other = enable(tiny_model("qwen3"))
    with pytest.raises(ValueError, match="another model"):
        other.generate(ids_b, cache=_cache(llama, ids_b, donor), **GEN)
    with pytest.raises(ValueError, match="layers"):
        big = enable(tiny_model("llama", num_hidden_layers=3))
        big.generate(ids_b, cache=_cache(big, ids_b, donor), **GEN)
    assert _no_worker_alive()


def test_enable_is_idempotent_and_keeps_class_name(tmp_path):
    model = tiny_model("llama")
    name = type(model).__name__
    assert enable(enable(model)) is model and is_enabled(model)
    assert type(model).__name__ == name
    model.save_pretrained(tmp_path)
    assert name in (tmp_path / "config.json").read_text()
    from hf_kvreuse import disable

    assert not is_enabled(disable(model)) and type(model).__name__ == name


def test_plain_generate_unaffected(llama):
    """An enabled model without an hf_kvreuse cache generates what the plain model does.

    Planted bug that fails it: the mixin's ``generate`` fast path drops the positional prompt
    (``super().generate(**kwargs)``)."""
    ids = torch.randint(3, 128, (1, 12))
    plain = tiny_model("llama")  # same seed, not enabled
    assert torch.equal(llama.generate(ids, **GEN), plain.generate(ids, **GEN))


@pytest.mark.parametrize("fuse", [False, True])
def test_failure_during_assembly_leaves_no_worker(llama, monkeypatch, slow_background, fuse):
    """The unmatched rows' forward fails (in the assembly; with ``fuse_first_step`` in the first forward of
    generate) while the background prefill runs: the error reaches the caller and no worker outlives generate."""
    import hf_kvreuse.cache_classes.optimistic as opt
    import hf_kvreuse.generation.fused as fused

    def broken(*args, **kwargs):
        raise RuntimeError("assembly failed")

    monkeypatch.setattr(opt, "partial_forward", broken)
    monkeypatch.setattr(fused, "partial_forward", broken)
    ids_a, ids_b = agent_prompts(12)
    donor = _donor(llama, ids_a)
    cache = _cache(llama, ids_b, donor, background_start="immediate", fuse_first_step=fuse)
    with pytest.raises(RuntimeError, match="assembly failed"):
        llama.generate(ids_b, cache=cache, **GEN)
    assert _no_worker_alive()


def test_sliding_window_model_served_here_refused_by_block_caches():
    """OptimisticCache serves sliding-window models (tests/test_sliding_optimistic.py); the block caches refuse them
    when built, naming the model."""
    from hf_kvreuse import BlockReuseCache

    model = tiny_model("mistral", sliding_window=8)
    ids = torch.randint(3, 128, (1, 5))
    donor = _donor(enable(model), ids, new=2)  # shorter than the window: every row is there
    _cache(model, ids, donor)
    with pytest.raises(ValueError, match="MistralForCausalLM.*sliding-window"):
        BlockReuseCache(model, ids, [(2, 8)])


def test_peft_model(slow_background):
    """A peft LoRA model (what the multi-agent adapter caches build on) works through enable(): tokens and the
    returned cache are exact.

    Planted bug that fails it: ``_swap_in`` feeds one token too few (``input_ids.shape[1] - n``, replay record
    dropped): the tokens still agreed here, the K/V check (added for this) fails."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False),
                        adapter_name="agent")
    enable(pm)
    ids_a, ids_b = agent_prompts(13)
    out_a = pm.generate(input_ids=ids_a, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    donor = (output_cache(out_a), out_a.sequences)
    ref = pm.generate(input_ids=ids_b, **GEN)
    assert torch.equal(pm.generate(input_ids=ids_b, cache=_cache(pm, ids_b, donor, max_optimistic_tokens=0), **GEN),
                       ref)
    cache = _cache(pm, ids_b, donor, max_optimistic_tokens=3)
    out = pm.generate(input_ids=ids_b, cache=cache, **GEN)
    n = ids_b.shape[1]
    assert cache.stats.swap_step == 3
    assert torch.equal(out, pm.generate(input_ids=out[:, : n + 3], max_new_tokens=GEN["max_new_tokens"] - 3,
                                        do_sample=False))
    exact, _ = exact_prefill(pm, out[:, :-1])
    assert_kv_close(cache, exact, atol=1e-4, rtol=1e-4)
