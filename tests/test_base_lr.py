"""BaseLRCache (PReCache): the paper's invariants on tiny multi-LoRA models with random non-zero adapters."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import DynamicCache

from hf_kvreuse import BaseLRCache, UnsupportedAdapterError
from hf_kvreuse.compat import cache_kwargs
from hf_kvreuse.kv import kv_of, load_kv
from hf_kvreuse.models import tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
AGENTS = ("plan", "act", "reflect")
METHODS = ("nonshared", "prelrshared", "rebaseshared")
GEN = dict(do_sample=False)


def multi_lora(arch="llama", targets=("v_proj",), r=4, attn="sdpa", seed=1, **lora_kw):
    """A peft model with three random, clearly non-zero LoRA adapters (peft's default init has B = 0)."""
    pm = get_peft_model(tiny_model(arch, attn_implementation=attn),
                        LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False,
                                   **lora_kw), adapter_name=AGENTS[0])
    for name in AGENTS[1:]:
        pm.add_adapter(name, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets),
                                        init_lora_weights=False, **lora_kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return pm.eval()


def split_targets(arch):
    return ("k_proj", "v_proj") if arch != "qwen3" else ("v_proj",)


@pytest.fixture(scope="module", params=ARCHS)
def pm(request):
    return multi_lora(request.param, targets=split_targets(request.param) + ("q_proj", "o_proj"))


@pytest.fixture(scope="module")
def pm_llama():
    return multi_lora("llama")


def rand_ids(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def run_trace(pm, cache, turns, seed=0):
    """Run a trajectory: each turn appends new tokens, then the turn's agent generates. Returns sequences."""
    seq = torch.empty(1, 0, dtype=torch.long)
    outs = []
    for i, (agent, new, gen) in enumerate(turns):
        seq = torch.cat([seq, rand_ids(new, seed + i)], 1)
        pm.set_adapter(agent)
        seq = pm.generate(input_ids=seq, cache=cache, max_new_tokens=gen, **GEN)
        outs.append(seq)
    return outs


TRACE = [("plan", 14, 5), ("act", 3, 4), ("plan", 9, 3), ("reflect", 4, 4)]


def plain(pm, agent, ids, gen):
    pm.set_adapter(agent)
    return pm.generate(input_ids=ids, max_new_tokens=gen, **GEN)


def neutral_states(pm, ids):
    """Adapter-free forward over ``ids``: its K/V and the input X of every v_proj / k_proj."""
    xs, handles = {}, []
    for layer in pm.get_base_model().model.layers:
        for proj in ("k_proj", "v_proj"):
            mod = getattr(layer.self_attn, proj)
            handles.append(mod.register_forward_hook(
                lambda m, a, o, key=(layer.self_attn.layer_idx, proj): xs.__setitem__(key, a[0].detach())))
    cache = DynamicCache(config=pm.config)
    with torch.no_grad(), pm.disable_adapter():
        pm(input_ids=ids, use_cache=True, **cache_kwargs(cache))
    for h in handles:
        h.remove()
    return cache, xs


def factor(pm, layer, proj, agent):
    mod = getattr(pm.get_base_model().model.layers[layer].self_attn, proj)
    return mod.lora_A[agent].weight if agent in getattr(mod, "lora_A", {}) else None


# -- correctness gates -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_single_agent_equals_plain_generate(pm, method):
    """One agent alone: every method is plain generate with that adapter (tokens and logits).

    Planted bug that fails it ([llama-prelrshared]): ``lowrank_attention`` drops the scaling ``s`` of the
    ``(P·L)·B`` term (decode steps)."""
    ids = rand_ids(20)
    pm.set_adapter("act")
    ref = pm.generate(input_ids=ids, max_new_tokens=8, output_scores=True, return_dict_in_generate=True, **GEN)
    cache = BaseLRCache(pm, method=method)
    out = pm.generate(input_ids=ids, cache=cache, max_new_tokens=8, output_scores=True,
                      return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert cache.stats.last.agent == "act" and cache.stats.last.prefill_tokens == 20
    # the model is left as it was: plain generate afterwards is unchanged
    assert torch.equal(pm.generate(input_ids=ids, max_new_tokens=8, **GEN), ref.sequences)
    assert pm.config._attn_implementation == "sdpa"


def test_adapters_change_the_output(pm_llama):
    """Sanity for every test here: the random adapters lead to different tokens than each other / the base."""
    ids = rand_ids(20)
    outs = {a: plain(pm_llama, a, ids, 8) for a in AGENTS}
    with pm_llama.disable_adapter():
        outs["base"] = pm_llama.generate(input_ids=ids, max_new_tokens=8, **GEN)
    assert len({tuple(o[0].tolist()) for o in outs.values()}) == 4


def test_nonshared_equals_plain_generate_every_turn(pm):
    """The baseline keeps one exact cache per agent: every turn equals plain generate of the full prompt.

    Planted bug that fails it: ``prepare`` keys the nonshared caches by ``self.agent`` (None unless fixed) instead
    of the turn's agent, so every agent reuses one cache."""
    cache = BaseLRCache(pm, method="nonshared")
    outs = run_trace(pm, cache, TRACE)
    prev = torch.empty(1, 0, dtype=torch.long)
    for i, ((agent, new, gen), out) in enumerate(zip(TRACE, outs)):
        prompt = torch.cat([prev, rand_ids(new, i)], 1)
        assert torch.equal(out, plain(pm, agent, prompt, gen))
        prev = out
    # the act turn re-prefilled everything the plan agent added; the second plan turn only the others' tokens
    assert cache.stats.turns[1].cached_tokens == 0
    assert cache.stats.turns[2].prefill_tokens == outs[2].shape[1] - 3 - (outs[0].shape[1] - 1)


@pytest.mark.parametrize("method", ["prelrshared", "rebaseshared"])
def test_shared_prefills_only_new_tokens(pm_llama, method):
    cache = BaseLRCache(pm_llama, method=method)
    outs = run_trace(pm_llama, cache, TRACE)
    for i, turn in enumerate(cache.stats.turns):
        prev_len = outs[i - 1].shape[1] if i else 0
        assert turn.cached_tokens == max(prev_len - 1, 0)
        assert turn.prefill_tokens == TRACE[i][1] + (1 if i else 0)  # new tokens + the last generated token
    assert cache.physical_length() == outs[-1].shape[1] - 1


# -- PReCache invariants ----------------------------------------------------------------------------------------
def test_prelrshared_lr_caches_equal_writer_states_times_A(pm):
    """PreLRShared: after the plan turn, every adapter's LR cache is X_plan·A_j and the base is plan's K/V.

    Planted bug that fails it: the split ``v_proj``/``k_proj`` forward returns peft's adapted projection
    (``original(module, x)``) instead of ``module.base_layer(x)``."""
    cache = BaseLRCache(pm, method="prelrshared")
    pm.set_adapter("plan")
    out = pm.generate(input_ids=rand_ids(16), cache=cache, max_new_tokens=4, **GEN)
    T = out.shape[1] - 1
    xs, handles = {}, []
    base = pm.get_base_model()
    for layer in base.model.layers:
        handles.append(layer.self_attn.v_proj.register_forward_hook(
            lambda m, a, o, key=layer.self_attn.layer_idx: xs.__setitem__(key, a[0].detach())))
    ref_cache = DynamicCache(config=pm.config)
    with torch.no_grad():
        pm(input_ids=out[:, :T], use_cache=True, **cache_kwargs(ref_cache))
    for h in handles:
        h.remove()
    for layer, x in xs.items():
        for agent in AGENTS:
            A = factor(pm, layer, "v_proj", agent)
            # decode steps vs one prefill: fp32 noise grows with depth (4 layers)
            torch.testing.assert_close(cache.store.get("v", agent, layer), x @ A.T, atol=1e-4, rtol=1e-4)
        vproj = base.model.layers[layer].self_attn.v_proj.base_layer
        hkv = pm.config.num_key_value_heads
        v_base = vproj(x).view(1, T, hkv, -1).transpose(1, 2)
        torch.testing.assert_close(kv_of(cache)[layer][1], v_base, atol=1e-5, rtol=1e-5)
        if "k" in cache.split.modules[layer]:
            continue
        torch.testing.assert_close(kv_of(cache)[layer][0], kv_of(ref_cache)[layer][0], atol=1e-5, rtol=1e-5)


def test_rebaseshared_base_equals_adapter_free_forward(pm):
    """ReBaseShared: base K/V equal an adapter-free forward; other agents' LR = X_neutral·A over each turn.

    Planted bug that fails it: ``_rebase`` runs without ``self.model.disable_adapter()``."""
    cache = BaseLRCache(pm, method="rebaseshared")
    outs = run_trace(pm, cache, TRACE)
    T = outs[-1].shape[1] - 1
    ref, xs = neutral_states(pm, outs[-1][:, :T])
    for (k, v), (rk, rv) in zip(kv_of(cache), kv_of(ref)):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    starts = [t.cached_tokens for t in cache.stats.turns] + [T]
    for i, turn in enumerate(cache.stats.turns):
        lo, hi = starts[i], starts[i + 1]
        for layer in range(pm.config.num_hidden_layers):
            for proj, kind in (("v_proj", "v"), ("k_proj", "k")):
                for agent in AGENTS:
                    A = factor(pm, layer, proj, agent)
                    if A is None or agent == turn.agent:
                        continue
                    L = cache.store.get(kind, agent, layer)[:, lo:hi]
                    torch.testing.assert_close(L, xs[(layer, proj)][:, lo:hi] @ A.T, atol=1e-5, rtol=1e-5)


def test_rebaseshared_own_turn_lr_is_adapted_pass_over_neutral_prefix(pm_llama):
    """The active agent's LR over its own turn comes from its adapted pass over the neutral prefix.

    Planted bug that fails it: ``_rebase`` rewrites every adapter's LR, the turn's own included
    (``others = self.adapters``). (Skipping the rebase fails it too, by the write-schedule RuntimeError.)"""
    pm = pm_llama
    cache = BaseLRCache(pm, method="rebaseshared")
    outs = run_trace(pm, cache, TRACE[:2])
    lo, hi = cache.stats.turns[1].cached_tokens, outs[1].shape[1] - 1
    # reference: a fresh single-agent act cache (exact act states) is NOT the target; the neutral prefix is
    ref, _ = neutral_states(pm, outs[1][:, :lo])
    xs, handles = {}, []
    for layer in pm.get_base_model().model.layers:
        handles.append(layer.self_attn.v_proj.register_forward_hook(
            lambda m, a, o, key=layer.self_attn.layer_idx: xs.setdefault(key, []).append(a[0].detach())))
    # run act over its turn on a copy of the neutral prefix, with act's LR term on the prefix values
    replay = BaseLRCache(pm, method="rebaseshared", agent="act")
    replay.layers = [type(layer)() for layer in replay.layers]
    load_kv(replay, [(k.clone(), v.clone()) for k, v in kv_of(ref)])
    replay.token_ids = outs[1][:, :lo]
    for layer in range(pm.config.num_hidden_layers):
        replay.store.append("v", "act", layer, cache.store.get("v", "act", layer)[:, :lo])
    replay.store.lr["v"]["plan"] = {layer: cache.store.get("v", "plan", layer)[:, :lo].clone()
                                    for layer in range(pm.config.num_hidden_layers)}
    replay.store.lr["v"]["reflect"] = {layer: cache.store.get("v", "reflect", layer)[:, :lo].clone()
                                       for layer in range(pm.config.num_hidden_layers)}
    pm.set_adapter("act")
    pm.generate(input_ids=outs[1][:, : hi + 1], cache=replay, max_new_tokens=1, **GEN)
    for h in handles:
        h.remove()
    for layer in range(pm.config.num_hidden_layers):
        A = factor(pm, layer, "v_proj", "act")
        x_turn = xs[layer][0][:, : hi - lo]  # the replay prefill covers lo..hi; the turn cached lo..hi-1
        torch.testing.assert_close(cache.store.get("v", "act", layer)[:, lo:hi], x_turn @ A.T, atol=1e-5, rtol=1e-5)


def _schedule_tensors(cache):
    """Every tensor a schedule leaves: the base K/V per layer and each adapter's LR factor per kind and layer,
    keyed by name with the layer index last."""
    out = {}
    for layer, (k, v) in enumerate(kv_of(cache)):
        out[("K", layer)], out[("V", layer)] = k, v
    for kind in ("k", "v"):
        for agent, per_layer in cache.store.lr[kind].items():
            for layer in per_layer:
                out[(kind, agent, layer)] = cache.store.get(kind, agent, layer)
    return out


def test_alongside_equals_after_turn(pm):
    """DB (a second adapter-free batch row) and LP (re-prefill after the turn) give the same caches.

    In exact arithmetic the two schedules are one computation; in float32 they differ by rounding only, because
    the alongside schedule runs the adapted row as one of two batch rows, so the BLAS sums in another order (which
    order depends on the CPU: AVX-512 and AVX2 kernels differ). The random LoRA factors (0.3·randn on q/k/v/o)
    amplify a rounding difference several times per layer, so a fixed ``atol`` is a statement about one machine
    (1e-5 held on AVX2 and failed at 1.4e-4 on an AVX-512 CPU). The tolerance is therefore measured, not guessed:
    the same trace runs in float64 with the after_turn schedule (the reference, exact to ~1e-13 here), and at each
    layer the float32 after_turn run's largest error against it, in float32 eps of each tensor's scale
    (``max|ref|``), is the rounding this computation has at that depth on this machine (measured: 2 eps at layer 0,
    up to 65 eps at layer 3). The alongside run must be within ``4·(that + 1)`` eps of the float64 reference on
    every tensor (measured worst: 1.1·(that + 1), with AVX-512 and with ``ATEN_CPU_CAPABILITY=avx2``
    ``MKL_CBWR=AVX2``). A schedule bug is an O(1) error, 10^5 eps and more.

    Planted bug that fails it: ``finish`` (alongside) keeps the adapted row as the new base (``keys[:1]``)."""
    eps = torch.finfo(torch.float32).eps
    caches, outs = {}, {}
    for schedule in ("after_turn", "alongside"):
        caches[schedule] = BaseLRCache(pm, method="rebaseshared", schedule=schedule)
        outs[schedule] = run_trace(pm, caches[schedule], TRACE)
    for a, b in zip(outs["after_turn"], outs["alongside"]):
        assert torch.equal(a, b)
    pm64 = copy.deepcopy(pm).double()
    ref_cache = BaseLRCache(pm64, method="rebaseshared", schedule="after_turn")
    for a, b in zip(run_trace(pm64, ref_cache, TRACE), outs["after_turn"]):
        assert torch.equal(a, b)  # the reference follows the same tokens, so its caches are comparable
    lp, db, ref = (_schedule_tensors(c) for c in (caches["after_turn"], caches["alongside"], ref_cache))
    assert lp.keys() == db.keys() == ref.keys()
    assert all(t.shape[0] == 1 for key, t in db.items() if key[0] in ("K", "V"))

    def rel_err(t, key):  # max |t - ref| in float32 eps of the reference tensor's scale
        return ((t.double() - ref[key]).abs().max() / ref[key].abs().max()).item() / eps

    rounding = {}
    for key, t in lp.items():
        rounding[key[-1]] = max(rounding.get(key[-1], 0.0), rel_err(t, key))
    for key, t in db.items():
        err, bound = rel_err(t, key), 4 * (rounding[key[-1]] + 1)
        assert err <= bound, f"{key}: alongside is {err:.1f} eps from the float64 reference, bound {bound:.1f}"
    assert caches["alongside"].stats.turns[-1].rebase_tokens == 0
    assert caches["after_turn"].stats.turns[-1].rebase_tokens > 0


@pytest.mark.parametrize("limit", [None, 0])
def test_lowrank_and_transient_value_paths_agree(pm, limit):
    """Always low-rank (P·V + s·(P·L)·B) or always the transient V + s·L·B: the same tokens as the default, which
    takes the transient path for the first prefill (20 > 16 queries) and the low-rank one for every decode step.
    (With ``TRACE``, whose prefills are all <= 16 tokens, the default is always low-rank, so ``limit=None``
    compared a path with itself and could not fail.)

    Planted bug that fails it (both limits): ``lowrank_attention`` drops the scaling ``s`` of the ``(P·L)·B``
    term."""
    trace = [("plan", 20, 5)] + TRACE[1:]
    outs = []
    for lim in (16, limit):
        cache = BaseLRCache(pm, method="prelrshared", lowrank_max_queries=lim)
        outs.append(run_trace(pm, cache, trace)[-1])
    assert torch.equal(outs[0], outs[1])


def test_lowrank_attention_equals_materialised_values():
    """Planted bug that fails it: ``lowrank_attention``'s default causal mask uses ``<`` instead of ``<=``."""
    from hf_kvreuse.lora import lowrank_attention

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, q, T, D, r = 2, 6, 2, 5, 11, 8, 3
    Q, K, V = (torch.randn(B, n, t, D, generator=g) for n, t in ((H, q), (Hkv, T), (Hkv, T)))
    L, Bw, s = torch.randn(B, T, r, generator=g), torch.randn(B, Hkv * D, r, generator=g), torch.tensor([0.5, 2.0])
    V_agent = V + ((L @ Bw.transpose(1, 2)) * s[:, None, None]).view(B, T, Hkv, D).transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        Q, K.repeat_interleave(H // Hkv, 1), V_agent.repeat_interleave(H // Hkv, 1),
        attn_mask=torch.ones(q, T, dtype=torch.bool).tril(T - q)).transpose(1, 2)
    torch.testing.assert_close(lowrank_attention(Q, K, V, L, Bw, s, None, D ** -0.5), ref, atol=1e-5, rtol=1e-5)


def test_eager_attention_matches_sdpa():
    """Eager and sdpa attention through the LR attention give the same tokens over the trajectory.

    Planted bug that fails it: ``lowrank_attention`` reads eager's additive float mask as a boolean one
    (``w.masked_fill(~m.bool(), -inf)``)."""
    outs = []
    for attn in ("sdpa", "eager"):
        pm = multi_lora("llama", targets=("k_proj", "v_proj"), attn=attn)
        cache = BaseLRCache(pm, method="prelrshared")
        outs.append(run_trace(pm, cache, TRACE)[-1])
        assert pm.config._attn_implementation == attn
    assert torch.equal(outs[0], outs[1])


def test_edited_trajectory_is_cropped_to_common_prefix(pm_llama):
    """ids that do not extend the cached tokens: the cache keeps the common prefix, and stays exact.

    Planted bug that fails it: ``prepare`` crops the base K/V but not the LR store (fails loudly: the LR cache's
    length check raises)."""
    pm = pm_llama
    cache = BaseLRCache(pm, method="prelrshared")
    pm.set_adapter("plan")
    out = pm.generate(input_ids=rand_ids(20), cache=cache, max_new_tokens=4, **GEN)
    edited = torch.cat([out[:, :10], rand_ids(6, 9)], 1)
    again = pm.generate(input_ids=edited, cache=cache, max_new_tokens=5, **GEN)
    assert cache.stats.last.cached_tokens == 10
    assert torch.equal(again, plain(pm, "plan", edited, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_memory_per_extra_agent(dtype):
    """LR cache of one adapter = r / (2·H_kv·D) of the full (base) cache: 4 / 64 here, 8 / 384 on SmolLM2, also
    for a bf16 model whose LoRA factors peft keeps in float32.

    Planted bug that fails it [bfloat16]: the LR rows are stored in the LoRA factor's dtype (float32), as before
    (the ratio doubles)."""
    pm = multi_lora("llama", r=4).to(dtype)
    for name, p in pm.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # what peft does for a bf16 base model (autocast_adapter_dtype)
    cache = BaseLRCache(pm, method="prelrshared")
    run_trace(pm, cache, TRACE[:2])
    base = cache.kv_bytes() - cache.lr_bytes()
    cfg = pm.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert cache.lr_bytes("act") / base == pytest.approx(4 / (2 * cfg.num_key_value_heads * head_dim))


# -- clear errors ----------------------------------------------------------------------------------------------
def test_errors(pm_llama):
    with pytest.raises(ValueError, match="unknown adapter 'critic'"):
        BaseLRCache(pm_llama, agent="critic")
    with pytest.raises(ValueError, match="method must be one of"):
        BaseLRCache(pm_llama, method="shared")
    with pytest.raises(TypeError, match="PeftModel"):
        BaseLRCache(tiny_model("llama"))
    with pytest.raises(UnsupportedAdapterError, match="k_proj.*k_norm"):
        BaseLRCache(multi_lora("qwen3", targets=("k_proj", "v_proj")))
    with pytest.raises(UnsupportedAdapterError, match="v_proj.*DoRA"):
        BaseLRCache(multi_lora("llama", use_dora=True))
    with pytest.raises(UnsupportedAdapterError, match="no LoRA on k_proj or v_proj"):
        BaseLRCache(multi_lora("llama", targets=("q_proj",)))
    merged = multi_lora("llama")
    merged.merge_adapter()
    with pytest.raises(UnsupportedAdapterError, match="merged"):
        BaseLRCache(merged)
    # nonshared has no split, so any adapter works there
    BaseLRCache(multi_lora("llama", use_dora=True), method="nonshared")
    cache = BaseLRCache(pm_llama)
    pm_llama.set_adapter("plan")
    with pytest.raises(ValueError, match="batch size 1"):
        pm_llama.generate(input_ids=rand_ids(8).repeat(2, 1), cache=cache, max_new_tokens=2)
    assert pm_llama.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="filled through model.generate"):
        pm_llama(input_ids=rand_ids(8), use_cache=True, **cache_kwargs(BaseLRCache(pm_llama)))
