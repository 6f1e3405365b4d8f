"""Trust by construction: the model check, thread state, continuation after generate, Python object behaviour and
the mixin's argument handling. Every exactness test names in its docstring a planted bug that makes it fail."""

import copy
import pickle
import threading

import pytest
import torch
import transformers
from transformers import DynamicCache, GenerationConfig

from hf_kvreuse import (BlendCache, DirectReuseCache, EPICCache, KVReuseCache, OffsetCache, OptimisticCache,
                        TailRecomputeCache, enable, is_enabled)
from hf_kvreuse.compat import cache_kwargs, output_cache
from hf_kvreuse.generation import background
from hf_kvreuse.generation.background import BackgroundPrefill
from hf_kvreuse.generation.partial import _ScatterCache, partial_forward
from hf_kvreuse.kv import dynamic_cache_from_kv, kv_of
from hf_kvreuse.model_check import UnsupportedModelError, check_model
from hf_kvreuse.models import tiny_model
from hf_kvreuse.rope import UnsupportedRopeError

from conftest import agent_prompts, assert_kv_close, exact_prefill
from test_block_reuse import rag_prompt

GEN = dict(max_new_tokens=8, do_sample=False)


def _small(cls, **kw):
    """A tiny random model of another family, with ids inside the vocabulary."""
    cfg = cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=kw.pop("layers", 4),
              num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    m.generation_config.eos_token_id = None
    return enable(m)


def _donor(model, ids, new=6):
    out = model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    return output_cache(out), out.sequences


# -- the model check ---------------------------------------------------------------------------------------------
def test_interleaved_rope_cohere_direct_reuse_keys_exact():
    """The issue's repro: Cohere rotates interleaved pairs. Re-positioned block keys at layer 0 equal a prefill's.

    Planted bug that fails it: ``RopeShifter.cos_sin``/``shift`` always use the half-split layout (as before)."""
    m = _small(transformers.CohereConfig, layers=2)
    assert check_model(m).rope_layout == "interleaved"
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = DirectReuseCache(m, ids, [(10, 30)])
    m.generate(ids, cache=cache, max_new_tokens=1, do_sample=False)
    ref, _ = exact_prefill(m, ids[:, :-1])
    torch.testing.assert_close(kv_of(cache)[0][0][..., 10:30, :], kv_of(ref)[0][0][..., 10:30, :],
                               atol=1e-5, rtol=1e-5)


def test_granite_layer_path_refused_full_path_exact():
    """Granite multiplies its embeddings in its forward: layer-wise BlendCache is refused at construction, while the
    caches that recompute through the model's own forward stay exact (self-control).

    Planted bug that fails it: ``_probe_layers`` compares with a tolerance of 1.0 (accepts anything)."""
    m = _small(transformers.GraniteConfig, embedding_multiplier=12.0)
    ids, _, spans = rag_prompt(0)
    with pytest.raises(UnsupportedModelError, match="granite"):
        BlendCache(m, ids, spans, recompute_ratio=1.0)
    cache = EPICCache(m, ids, spans, block_prefix_ids="own")
    out = m.generate(ids, cache=cache, return_dict_in_generate=True, output_logits=True, **GEN)
    ref = m.generate(ids, return_dict_in_generate=True, output_logits=True, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)


def test_model_without_rope_refused():
    m = enable(transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4)).eval())
    ids = torch.randint(3, 128, (1, 20))
    with pytest.raises(UnsupportedRopeError, match="GPT2LMHeadModel"):
        DirectReuseCache(m, ids, [(2, 10)])


def test_engine_probe_refuses_a_forward_that_ignores_the_mask(monkeypatch):
    """A model whose forward drops the 4D mask would let recomputed rows see the future: refused, with its name.
    (On the path that relies on the mask: the selected-row attention takes positions, not the mask, and is
    exact on such a model.)"""
    from hf_kvreuse.generation import partial

    monkeypatch.setattr(partial, "selected_path", lambda *a: "mask")
    m = enable(tiny_model("llama", seed=3))
    inner = m.model.forward

    def no_mask(*args, **kwargs):
        kwargs["attention_mask"] = None
        return inner(*args, **kwargs)

    monkeypatch.setattr(m.model, "forward", no_mask)
    report = check_model(m, refresh=True)
    assert not report.engine_ok and "LlamaForCausalLM" in report.engine_reason
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*position-causal mask"):
        DirectReuseCache(m, *rag_prompt(0)[::2])


def test_model_check_cached_once_per_model(llama):
    first = check_model(llama)
    assert check_model(llama) is first and first.rope_ok and first.engine_ok and first.layers_ok
    assert first.probe_s >= 0  # its cost is a benchmark figure (README), not asserted: a wall-clock limit fails under load


def test_partial_engine_fails_loudly_when_a_layer_is_not_written(llama, monkeypatch):
    """The scatter cache counts writes: a layer that stores nothing (here: a skipped update) raises."""
    orig = _ScatterCache.update

    def skip_layer_2(self, k, v, layer_idx, *a, **kw):
        if layer_idx == 2:  # attends over the cache but stores nothing (as a layer bypassing the cache would)
            return self._kv[layer_idx]
        return orig(self, k, v, layer_idx, *a, **kw)

    monkeypatch.setattr(_ScatterCache, "update", skip_layer_2)
    ids = torch.randint(3, 128, (1, 12))
    kv, _ = exact_prefill(llama, ids)
    kv = [(k.clone(), v.clone()) for k, v in kv_of(kv)]
    with pytest.raises(RuntimeError, match=r"cache writes per layer \{2: 0\}"):
        partial_forward(llama, ids, torch.arange(6, 12), kv)


# -- the assembled optimistic cache ------------------------------------------------------------------------------
@pytest.fixture
def held_background(monkeypatch):
    """Hold the background prefill until the foreground waits (boost) or cancels."""
    orig_prefill, orig_boost, orig_cancel = BackgroundPrefill._prefill, BackgroundPrefill.boost, BackgroundPrefill.cancel
    gates = {}

    def gate(job):
        return gates.setdefault(id(job), threading.Event())

    def held(self):
        if not self.synchronous:
            assert gate(self).wait(timeout=60)
        return orig_prefill(self)

    monkeypatch.setattr(BackgroundPrefill, "_prefill", held)
    monkeypatch.setattr(BackgroundPrefill, "boost", lambda self: (gate(self).set(), orig_boost(self)))
    monkeypatch.setattr(BackgroundPrefill, "cancel", lambda self: (gate(self).set(), orig_cancel(self)))


def test_assembled_optimistic_cache_layer0_equals_full_prefill(arch_model, held_background, monkeypatch):
    """Layer 0 K/V depend only on token and position, so every row of the assembled optimistic cache (donor rows
    re-positioned, unmatched rows computed) equals full prefill there; above layer 0 donor rows are stale.

    The snapshot is taken after the first forward (with ``fuse_first_step`` the unmatched rows are computed there)
    and before the swap; rows of the whole prompt are compared, the last token's included.

    Planted bug that fails it: ``OptimisticCache._assemble`` copies donor keys without the RoPE shift."""
    ids_a, ids_b = agent_prompts(21, shared=40, role_a=5, role_b=11)
    donor = _donor(arch_model, ids_a)
    snap = {}
    orig = OptimisticCache.after_forward

    def snapshot_first_step(self, outputs):
        if "kv" not in snap:
            snap["kv"] = [(k.clone(), v.clone()) for k, v in kv_of(self)]
        orig(self, outputs)

    monkeypatch.setattr(OptimisticCache, "after_forward", snapshot_first_step)
    cache = OptimisticCache(arch_model, ids_b, *donor, max_optimistic_tokens=None, rebase="commit")
    arch_model.generate(ids_b, cache=cache, max_new_tokens=2, do_sample=False)
    assert cache.stats.reused_tokens >= 30 and cache.stats.new_tokens > 0 and cache.stats.fused_first_step
    ref, _ = exact_prefill(arch_model, ids_b)
    (k0, v0), (rk0, rv0) = snap["kv"][0], kv_of(ref)[0]
    torch.testing.assert_close(k0, rk0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v0, rv0, atol=1e-5, rtol=1e-5)
    assert (snap["kv"][1][0] - kv_of(ref)[1][0]).abs().max() > 1e-3  # stale above layer 0: not a no-op


@pytest.mark.parametrize("do_sample", [False, True])
def test_swap_before_first_token_after_assembly_is_plain_generate(arch_model, monkeypatch, do_sample):
    """The optimistic cache is assembled (and thrown away) and the exact cache is ready before the first forward:
    the output equals plain generate, sampled with the same seed included.

    Planted bug that fails it: ``_swap_in`` returns one token too few to feed (``input_ids.shape[1] - n``)."""
    monkeypatch.setattr(BackgroundPrefill, "ready", lambda self: (self.join(), True)[1])
    ids_a, ids_b = agent_prompts(22)
    donor = _donor(arch_model, ids_a)
    kw = dict(max_new_tokens=10, do_sample=do_sample, top_k=0)
    torch.manual_seed(3)
    ref = arch_model.generate(ids_b, return_dict_in_generate=True, output_logits=True, **kw)
    cache = OptimisticCache(arch_model, ids_b, *donor, max_optimistic_tokens=None, background_start="immediate",
                            rebase="commit")
    torch.manual_seed(3)
    out = arch_model.generate(ids_b, cache=cache, return_dict_in_generate=True, output_logits=True, **kw)
    assert cache.stats.swap_step == 0 and cache.stats.new_tokens > 0  # assembly ran, then the swap
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)


def test_sampling_swap_continues_exactly(llama, held_background):
    """Sampling with a swap at 3 tokens: every token after the swap is sampled from the exact model, so the run
    equals plain sampled generation continued from the same first 3 tokens with the same random state.

    Planted bug that fails it: the replay after the swap feeds only the last token (``return 1`` in ``_swap_in``,
    with ``self._replay = None``; keeping the replay record, ``_count_divergence`` raises instead)."""
    ids_a, ids_b = agent_prompts(4)
    donor = _donor(llama, ids_a)
    cache = OptimisticCache(llama, ids_b, *donor, max_optimistic_tokens=3, rebase="commit")
    kw = dict(do_sample=True, temperature=0.8, top_k=0, return_dict_in_generate=True, output_logits=True)
    out = llama.generate(ids_b, cache=cache, max_new_tokens=12, **kw)
    assert cache.stats.swap_step == 3
    n = ids_b.shape[1]
    # exact logits of every post-swap step, given the same earlier tokens
    with torch.no_grad():
        exact = llama(out.sequences[:, :-1]).logits[0, n + 2:]
    torch.testing.assert_close(torch.stack(out.logits[3:])[:, 0], exact, atol=1e-4, rtol=1e-4)


def test_background_overlaps_decode_without_holding(llama):
    """No held worker: the exact prefill really runs beside the decode loop (started immediately); whenever it
    swaps in, every later token is the exact model's and the returned cache is exact.

    Planted bug that fails it: ``_swap_in`` loads the exact K/V but skips the replay (``return 1`` and
    ``self._replay = None``): the returned cache lacks the replayed rows."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 128, (1, 600), generator=g)
    ids_a = torch.cat([torch.randint(3, 128, (1, 7), generator=g), shared], 1)
    ids_b = torch.cat([torch.randint(3, 128, (1, 13), generator=g), shared], 1)
    big = enable(tiny_model("llama", seed=4, hidden_size=128, intermediate_size=512))
    donor = _donor(big, ids_a)
    cache = OptimisticCache(big, ids_b, *donor, max_optimistic_tokens=None, background_start="immediate",
                            background_threads=1, rebase="commit")
    out = big.generate(ids_b, cache=cache, max_new_tokens=24, do_sample=False)
    s = cache.stats.swap_step
    assert cache.stats.exact and s is not None
    n = ids_b.shape[1]
    if s < 24:  # the swap came during decoding (else only the returned cache is checked)
        ref = big.generate(out[:, : n + s], max_new_tokens=24 - s, do_sample=False)
        assert torch.equal(out, ref)
    exact, _ = exact_prefill(big, out[:, :-1])
    assert_kv_close(cache, exact, atol=1e-4, rtol=1e-4)


# -- thread state ------------------------------------------------------------------------------------------------
def test_background_prefill_runs_under_callers_autocast(llama, held_background):
    """Under ``torch.autocast("cpu", bfloat16)`` the exact cache swapped in is the one a full prefill under the
    same autocast makes (not the fp32 one).

    Planted bug that fails it: ``BackgroundPrefill._run`` does not enter ``self.state``."""
    ids_a, ids_b = agent_prompts(23)
    donor = _donor(llama, ids_a)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = OptimisticCache(llama, ids_b, *donor, max_optimistic_tokens=2, rebase="commit")
        out = llama.generate(ids_b, cache=cache, max_new_tokens=2, do_sample=False)
        ref_bf16, _ = exact_prefill(llama, ids_b[:, :-1])
    ref_fp32, _ = exact_prefill(llama, ids_b[:, :-1])
    n = ids_b.shape[1] - 1
    k, rk16, rk32 = kv_of(cache)[3][0][..., :n, :], kv_of(ref_bf16)[3][0], kv_of(ref_fp32)[3][0]
    assert (rk16.float() - rk32.float()).abs().max() > 1e-3  # autocast does change these K
    torch.testing.assert_close(k.float(), rk16.float(), atol=1e-6, rtol=1e-6)
    assert out.shape[1] == ids_b.shape[1] + 2


def test_background_prefill_keeps_inference_mode(llama, held_background):
    ids_a, ids_b = agent_prompts(24)
    donor = _donor(llama, ids_a)
    with torch.inference_mode():
        cache = OptimisticCache(llama, ids_b, *donor, max_optimistic_tokens=2, rebase="commit")
        llama.generate(ids_b, cache=cache, max_new_tokens=3, do_sample=False)
    assert all(k.is_inference() for k, _ in kv_of(cache))


def _count_in_new_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_thread_counts_restored(llama):
    """After generate the caller's count and the default of threads created later are what they were.

    Planted bug that fails it: ``ThreadBudget.release`` and ``OptimisticCache._restore_threads`` do not call
    ``torch.set_num_threads`` (the worker's and the lowered foreground's counts then leak)."""
    before = torch.get_num_threads()
    ids_a, ids_b = agent_prompts(25)
    donor = _donor(llama, ids_a)
    results = {}

    def run():
        cache = OptimisticCache(llama, ids_b, *donor, max_optimistic_tokens=None, background_threads=1,
                                on_early_finish="cancel", rebase="commit")
        llama.generate(ids_b, cache=cache, max_new_tokens=4, do_sample=False)
        results["own"] = torch.get_num_threads()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert torch.get_num_threads() == before
    assert _count_in_new_thread() == before
    assert background.ThreadBudget.running() == 0


def test_concurrent_generate_calls_match_sequential(arch_model, held_background):
    """Two generate calls with caches in two Python threads at once give the tokens (and exact caches) they give
    one after the other, and the thread budget is back to where it was.

    Planted bug that fails it: the mixin keeps the running cache on the model (``self.__dict__["_kvr_running"]``
    in ``generate``) and ``prepare_inputs_for_generation`` takes it from there, so each call may step the other's
    cache. (A module-level ``_ScatterCache`` shared by ``partial_forward`` does not fail it: the two calls' short
    partial forwards did not overlap.)"""
    before = torch.get_num_threads()
    pairs = [agent_prompts(30 + i) for i in range(2)]
    donors = [_donor(arch_model, a) for a, _ in pairs]

    def run(i, out):
        ids_b = pairs[i][1]
        if i == 0:
            cache = OptimisticCache(arch_model, ids_b, *donors[i], max_optimistic_tokens=4, rebase="commit")
        else:
            ids, _, spans = rag_prompt(i)
            ids_b = ids
            cache = EPICCache(arch_model, ids, spans, recompute_tokens=3)
        out[i] = (arch_model.generate(ids_b, cache=cache, max_new_tokens=10, do_sample=False),
                  [(k.clone(), v.clone()) for k, v in kv_of(cache)])

    sequential, concurrent = {}, {}
    for i in range(2):
        run(i, sequential)
    threads = [threading.Thread(target=run, args=(i, concurrent)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert torch.equal(sequential[i][0], concurrent[i][0])
        assert_kv_close(sequential[i][1], concurrent[i][1], atol=1e-5, rtol=1e-5)
    assert torch.get_num_threads() == before and background.ThreadBudget.running() == 0


# -- continuation: the returned cache continues the conversation ------------------------------------------------
def _make(kind, model, seed=0):
    ids, _, spans = rag_prompt(seed)
    if kind == "optimistic":
        ids_a, ids = agent_prompts(seed + 40)
        return OptimisticCache(model, ids, *_donor(model, ids_a), max_optimistic_tokens=2, rebase="commit"), ids
    cls, kw = {"direct": (DirectReuseCache, {}), "tail": (TailRecomputeCache, {"recompute_tokens": 4}),
               "epic": (EPICCache, {"recompute_tokens": 4}), "blend": (BlendCache, {"recompute_ratio": 0.3}),
               "offset": (OffsetCache, {"block_prefix_ids": "own"})}[kind]
    return cls(model, ids, spans, **kw), ids


CONTINUE = ["optimistic", "direct", "tail", "epic", "blend", "offset"]


@pytest.mark.parametrize("kind", CONTINUE)
def test_returned_cache_continues_like_a_dynamic_cache(arch_model, kind):
    """After generate, the returned cache takes the next turn (extended ids) exactly as a ``DynamicCache`` holding
    the same K/V would: same tokens and logits. For OptimisticCache (exact after its swap) that is plain generate.

    Planted bug that fails it (reuse kinds, e.g. [llama-direct]): ``end_generate`` records ``token_ids`` shifted by
    one (``sequences[:, 1 : physical_length() + 1]``): the continuation finds no common prefix and recomputes the
    history exactly, unlike the DynamicCache holding the reused K/V; for [*-optimistic], whose cache is exact so
    that recomputing changes no token, the continuation's first forward must also feed only the new tokens (it
    formerly passed under this bug). (``token_ids`` one token short does not fail it: that token is recomputed
    over the same cache and agrees to 1e-5.)"""
    cache, ids = _make(kind, arch_model)
    out = arch_model.generate(ids, cache=cache, return_dict_in_generate=True, **GEN)
    assert output_cache(out) is cache and cache.phase == "done"
    snapshot = dynamic_cache_from_kv([(k.clone(), v.clone()) for k, v in kv_of(cache)], arch_model.config)
    turn2 = torch.cat([out.sequences, torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))], 1)
    # the first turn may have generated the pad id: mark every token as text, as a chat loop passing masks does
    kw = dict(return_dict_in_generate=True, output_logits=True, attention_mask=torch.ones_like(turn2), **GEN)
    fed, held = [], snapshot.get_seq_length()  # the continuation must feed only the new tokens, as the snapshot does
    hook = arch_model.register_forward_pre_hook(lambda mod, args, kwargs: fed.append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[1]), with_kwargs=True)
    try:
        got = arch_model.generate(turn2, past_key_values=output_cache(out), **kw)
        fed_got, fed[:] = list(fed), []
        ref = arch_model.generate(turn2, past_key_values=snapshot, **kw)
        fed_ref = list(fed)
    finally:
        hook.remove()
    assert fed_got[0] == fed_ref[0] == turn2.shape[1] - held, (fed_got, fed_ref)
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == got.sequences.shape[1] - 1
    if kind == "optimistic":
        plain = arch_model.generate(turn2, **kw)
        assert torch.equal(got.sequences, plain.sequences)
    # a third turn keeps going
    turn3 = torch.cat([got.sequences, torch.tensor([[5, 6, 7]])], 1)
    assert arch_model.generate(turn3, cache=cache, attention_mask=torch.ones_like(turn3), **GEN).shape[1] == turn3.shape[1] + GEN["max_new_tokens"]


def test_edited_history_is_cropped_to_common_prefix(llama):
    """A next turn that rewrites earlier tokens reuses only the common prefix: the result equals plain generate.

    Planted bug that fails it: ``begin_continuation`` skips the crop (stale K/V of the old tokens stay)."""
    cache, ids = _make("optimistic", llama)
    out = llama.generate(ids, cache=cache, **GEN)
    edited = out.clone()
    edited[0, 20] = (edited[0, 20] + 1) % 128
    edited = torch.cat([edited, torch.tensor([[9, 10, 11]])], 1)
    got = llama.generate(edited, cache=cache, **GEN)
    assert torch.equal(got, llama.generate(edited, **GEN))


def test_failed_continuation_leaves_cache_as_it_was(llama):
    """A continuation that raises leaves length, tokens and K/V as they were.

    Planted bug that fails it: ``end_continuation`` does not crop the failed call's K/V on error."""
    cache, ids = _make("direct", llama)
    out = llama.generate(ids, cache=cache, **GEN)
    length, tokens = cache.get_seq_length(), cache.token_ids.clone()
    k0 = kv_of(cache)[0][0].clone()

    class Boom(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            raise RuntimeError("stop here")

    nxt = torch.cat([out, torch.tensor([[3, 4, 5]])], 1)
    with pytest.raises(RuntimeError, match="stop here"):
        llama.generate(nxt, cache=cache, stopping_criteria=transformers.StoppingCriteriaList([Boom()]), **GEN)
    assert cache.get_seq_length() == length and torch.equal(cache.token_ids, tokens)
    assert torch.equal(kv_of(cache)[0][0], k0) and cache.phase == "done"


def test_optimistic_cache_without_input_ids(llama):
    """``input_ids=None``: the prompt is taken from generate; same result (and same swap) as passing it.

    Planted bug that fails it: ``begin_generate`` takes the prompt as ``input_ids[:, :-1]`` when none was given
    (tokens stay exact through the replay; the swap moves to step 1)."""
    ids_a, ids_b = agent_prompts(26)
    donor = _donor(llama, ids_a)
    ca, cb = (OptimisticCache(llama, ids, *donor, max_optimistic_tokens=0, rebase="commit") for ids in (None, ids_b))
    a = llama.generate(ids_b, cache=ca, **GEN)
    b = llama.generate(ids_b, cache=cb, **GEN)
    assert torch.equal(a, b) and torch.equal(a, llama.generate(ids_b, **GEN))
    assert torch.equal(ca.input_ids, ids_b) and ca.stats.swap_step == cb.stats.swap_step == 0


def test_dynamic_cache_contract(llama):
    cache, ids = _make("epic", llama)
    out = llama.generate(ids, cache=cache, **GEN)
    n = cache.get_seq_length()
    cache.crop(-3)
    assert cache.get_seq_length() == n - 3 and cache.token_ids.shape[1] == n - 3
    cache.reorder_cache(torch.tensor([0]))
    cache.batch_repeat_interleave(1)
    with pytest.raises(NotImplementedError, match="batch size"):
        cache.reorder_cache(torch.tensor([0, 0]))
    with pytest.raises(NotImplementedError, match="batch size"):
        cache.batch_repeat_interleave(2)
    got = llama.generate(out, cache=cache, **GEN)  # continues after the crop (recomputes the 3 tokens)
    assert got.shape[1] == out.shape[1] + GEN["max_new_tokens"]


def test_base_lr_crop_keeps_low_rank_store_consistent():
    """``BaseLRCache.crop`` (transformers may crop after a stop check) crops the low-rank store with the K/V, and
    the next turn still equals plain generate with the adapter.

    Planted bug that fails it: ``BaseLRCache.crop`` does not crop ``self.store``."""
    from test_base_lr import multi_lora, rand_ids

    from hf_kvreuse import BaseLRCache

    pm = multi_lora("llama")
    cache = BaseLRCache(pm, method="prelrshared")
    pm.set_adapter("plan")
    seq = pm.generate(input_ids=rand_ids(20), cache=cache, max_new_tokens=5, do_sample=False)
    cache.crop(-4)
    n = cache.get_seq_length()
    lens = {t.shape[1] for kind in cache.store.lr.values() for per in kind.values() for t in per.values()}
    assert lens == {n} and cache.token_ids.shape[1] == n
    nxt = torch.cat([seq, rand_ids(6, 1)], 1)  # the same agent: a single agent's trajectory is exact
    got = pm.generate(input_ids=nxt, cache=cache, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, pm.generate(input_ids=nxt, max_new_tokens=5, do_sample=False))


# -- Python objects ----------------------------------------------------------------------------------------------
def test_enabled_model_pickles_and_deepcopies_enabled(llama):
    """Pickled and deep-copied models come back enabled and generate the same tokens, with and without a cache.

    Planted bug that fails it: ``_new_enabled`` does not set the enabled class (the copy is a plain model)."""
    ids = torch.randint(3, 128, (1, 12))
    ref = llama.generate(ids, **GEN)
    for clone in (pickle.loads(pickle.dumps(llama)), copy.deepcopy(llama)):
        assert is_enabled(clone) and type(clone).__name__ == "LlamaForCausalLM"
        assert torch.equal(clone.generate(ids, **GEN), ref)
        ids_a, ids_b = agent_prompts(27)
        c = OptimisticCache(clone, ids_b, *_donor(clone, ids_a), max_optimistic_tokens=0, rebase="commit")
        assert torch.equal(clone.generate(ids_b, cache=c, **GEN), llama.generate(ids_b, **GEN))


def test_deepcopy_cache_copies_tensors_not_the_model(llama):
    """A deep copy has its own K/V tensors, equal to the original's, and shares the model and the store.

    Planted bug that fails it: ``KVReuseCache._shared_attrs`` includes ``"layers"`` (the copy shares K/V)."""
    cache, ids = _make("direct", llama)
    llama.generate(ids, cache=cache, **GEN)
    dup = copy.deepcopy(cache)
    assert dup.model is llama and dup.store is cache.store
    assert kv_of(dup)[0][0] is not kv_of(cache)[0][0]
    assert_kv_close(dup, cache, atol=0, rtol=0)
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(cache)


# -- the mixin's argument handling ------------------------------------------------------------------------------
def test_positional_generation_config_is_validated(llama):
    ids_a, ids_b = agent_prompts(28)
    cache = OptimisticCache(llama, ids_b, *_donor(llama, ids_a), rebase="commit")
    with pytest.raises(ValueError, match="num_beams"):
        llama.generate(ids_b, GenerationConfig(num_beams=4, max_new_tokens=3), cache=cache)


def test_cache_kept_when_the_other_keyword_is_none(llama):
    """``generate(cache=c, past_key_values=None)`` uses ``c`` (it was dropped after assembly before).

    Planted bug that fails it: ``_one_cache_keyword`` collects every cache keyword present, ``None`` included
    (``if n in kwargs``): the call is refused as two different caches."""
    ids_a, ids_b = agent_prompts(29)
    cache = OptimisticCache(llama, ids_b, *_donor(llama, ids_a), max_optimistic_tokens=0, rebase="commit")
    out = llama.generate(ids_b, cache=cache, past_key_values=None, return_dict_in_generate=True, **GEN)
    assert output_cache(out) is cache and cache.stats.exact
    other = DynamicCache(config=llama.config)
    with pytest.raises(ValueError, match="two different caches"):
        llama.generate(ids_b, cache=OptimisticCache(llama, ids_b, *_donor(llama, agent_prompts(29)[0]),
                                                    rebase="commit"),
                       past_key_values=other, **GEN)


def test_positional_forward_goes_through_the_cache(llama):
    calls = []

    class Counting(KVReuseCache):
        requires = {}
        multi_turn = True

        def forward(self, forward_fn, **kwargs):
            calls.append(sorted(kwargs))
            return forward_fn(**kwargs)

    cache = Counting(llama)
    ids = torch.randint(3, 128, (1, 6))
    llama(ids, None, None, **cache_kwargs(cache))
    assert calls and "input_ids" in calls[0]
