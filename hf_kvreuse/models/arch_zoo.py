"""Tiny random-init configs of many decoder-only architectures of the installed transformers ("the zoo").

Used by ``tests/test_architectures.py`` and ``scripts/arch_table.py`` to show, architecture by architecture,
that every cache of the library either reproduces the model exactly (self-control, re-positioning) or refuses
at construction with an error naming the model type. Never a wrong output.

Every config is small enough to build and run a forward in well under a second on one CPU core: vocab 256,
hidden 64, 4 layers, 4 heads (2 KV heads where the architecture has GQA), head_dim 16, no sliding window
(``layer_types`` all full attention where the config has it), pad/bos/eos = 0/1/2, untied LM head.

The candidates were every key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` of transformers 5.24, tried one by one with
these sizes (build + a forward + a 4-token greedy generate). Kept: the decoder-only language models that build
and run. Left out, and why:

* encoders or encoder-decoder decoders used as causal LMs (bert, roberta, camembert, electra, ernie, xlm-roberta,
  data2vec-text, roc_bert, bert-generation, bart, mbart, marian, pegasus, blenderbot, plbart, prophetnet, trocr,
  whisper, xlnet, xlm, xmod, mvp, ...): not decoder-only LMs; they have learned absolute positions anyway;
* state-space / recurrent / linear-attention models or hybrids with such layers (mamba, mamba2, falcon_mamba,
  falcon_h1, bamba, jamba, zamba, zamba2, rwkv, xlstm, recurrent_gemma, olmo_hybrid, kimi_linear, qwen3_next,
  qwen3_5*, lfm2*, granitemoehybrid, nemotron_h, minimax, bailing_hybrid): their state is not a per-token K/V;
* multi-head latent attention / sparse indexers (deepseek_v2/v3/v32/v4, minicpm3, glm4_moe_lite, longcat_flash,
  sarvam_mla, youtu, axk1/2, glm_moe_dsa): K/V heads of another shape than the query heads or an indexer cache;
  they do not build from these generic sizes (``q_lora_rank`` / ``kv_lora_rank`` layouts);
* multimodal wrappers (gemma3, gemma3n, gemma4, gemma4_unified*, gemma4_assistant, llama4, mllama, emu3, fuyu,
  got_ocr2, git, phi4_multimodal, qwen3_5, moshi, musicgen*, moss_transcribe_diarize, blt): need vision / audio
  towers, too slow or extra deps;
* architectures whose attention is sliding-window or chunked by design and that do not build with every layer on
  full attention here (granitemoe_swa: no sdpa/eager path usable; flint, mimo_v2_flash: no sdpa, inkling*: linear
  layers, hy_v4: indexer cache, modernbert-decoder). The others are in the zoo with ``layer_types`` all
  ``full_attention`` (the library refuses sliding layers in ``KVReuseCache``): mistral, ministral, gemma2/3,
  cohere2, olmo3, gpt_oss, vaultgemma, granite_swa, cwm, exaone_moe, laguna, afmoe, dory, lara_mini, kolibri1,
  gemma4_text, lfm3;
* aliases of an already covered class (exaone, internlm3, iquestcoder -> LlamaForCausalLM; sarvam_moe ->
  Glm4MoeForCausalLM; gpt-sw3 -> GPT2LMHeadModel);
* models without an sdpa path that were not retried with eager (big_bird, cpmant, reformer, rembert, roformer,
  megatron-bert, openai-gpt, gpt_neox_japanese, mpt) or that fail to build from these sizes (hrm_text, qwen4_exp*,
  dots3_note*, dbrx, beam, zaya, cohere_compass_text, gemma3n_text); ctrl (a 4M-parameter positional table).
  The no-RoPE families are represented by gpt2, opt, bloom, gpt_bigcode, biogpt and xglm.

Architectures whose attention is only available as ``eager`` in this transformers (gemma2, bloom, ...) are built
with ``attn_implementation="eager"``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 4, 4, 2, 16, 256

#: sizes every config gets (only the keys its ``__init__`` or ``attribute_map`` knows are passed)
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
              max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, sliding_window=None, layer_types=["full_attention"] * LAYERS,
              # MoE: 2 small experts, one active per token (plus one shared expert where there is one)
              num_experts=2, num_local_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
              n_routed_experts=2, n_shared_experts=1, shared_expert_intermediate_size=32)

#: per-architecture changes to COMMON (None removes a key); "attn": attention implementation (default sdpa)
SPECS: dict[str, dict] = {
    # -- the Llama family and close relatives (half-split RoPE over the whole head)
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "arcee": {}, "helium": {}, "seed_oss": {},
    "hunyuan_v1_dense": {}, "hyperclovax": {}, "ernie4_5": {}, "exaone4": {}, "apertus": {}, "jais2": {},
    "nanochat": {}, "solar_open": {}, "mellum": {}, "bitnet": {}, "doge": {}, "diffllama": {},
    "ministral": {"sliding_window": 4096},      # every layer full attention (layer_types)
    "olmo": {}, "olmo2": {},
    "olmo3": {"sliding_window": 4096},
    "smollm3": {},                              # NoPE layers: every 4th layer has no RoPE
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
                "logits_scaling": 8.0},
    "gemma": {},
    "gemma2": {"sliding_window": 4096, "attn": "eager"},   # sdpa not available for gemma2 in 5.24
    "gemma3_text": {"sliding_window": 4096},
    "phi3": {},
    "nemotron": {},                             # partial rotary (0.5)
    "glm4": {},
    # -- partial rotary and/or interleaved layouts
    "stablelm": {},                             # partial_rotary_factor 0.25
    "persimmon": {},                            # partial rotary 0.5, qk layernorm
    "phi": {},                                  # partial rotary 0.5
    "gpt_neox": {},                             # rotary_pct 0.25
    "cohere": {},                               # interleaved
    "glm": {},                                  # interleaved + partial (0.5)
    "gptj": {"rotary_dim": 8},                  # interleaved + partial (rotary_dim)
    "codegen": {"rotary_dim": 8},               # interleaved + partial, mp_num=4 fused qkv
    "starcoder2": {},
    "falcon": {"head_dim": None, "num_key_value_heads": None, "new_decoder_architecture": True,
               "num_kv_heads": KV_HEADS, "attn": "eager"},
    # -- mixture of experts (2 experts)
    "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}, "olmoe": {}, "phimoe": {}, "granitemoe": {},  # multipliers 1
    "granitemoeshared": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                         "attention_multiplier": 0.0625, "logits_scaling": 8.0},
    "jetmoe": {"num_key_value_heads": None, "kv_channels": HEAD_DIM, "num_local_experts": 2},
    "ernie4_5_moe": {}, "hunyuan_v1_moe": {}, "dots1": {}, "glm4_moe": {}, "flex_olmo": {},
    # -- sliding-window families, every layer on full attention
    # (cohere2, exaone_moe, afmoe, lara_mini, kolibri1 put no RoPE on their full-attention layers)
    "cohere2": {"sliding_window": 4096}, "gpt_oss": {"sliding_window": 4096, "attn": "eager"},  # attention sinks
    "vaultgemma": {"sliding_window": 4096, "attn": "eager"}, "granite_swa": {"sliding_window": 4096, "attn": "eager"},
    "cwm": {"sliding_window": 4096}, "exaone_moe": {"sliding_window": 4096}, "laguna": {"sliding_window": 4096},
    "afmoe": {"sliding_window": 4096}, "dory": {"sliding_window": 4096}, "lara_mini": {"sliding_window": 4096},
    "kolibri1": {"sliding_window": 4096},
    "gemma4_text": {"sliding_window": 4096, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16}, "lfm3": {"sliding_window": 4096},
    "minimax_m2": {},
    # -- RoPE scaling variants (model_type@variant): length-independent types work, dynamic / longrope must refuse
    "llama@linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    "llama@llama3": {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                                         "rope_theta": 10000.0}},
    "qwen2@yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                       "rope_theta": 10000.0}},
    "llama@dynamic": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    "phi3@longrope": {"max_position_embeddings": 1024, "original_max_position_embeddings": 256,
                      "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 256,
                                          "short_factor": [1.0] * (HEAD_DIM // 2),
                                          "long_factor": [2.0] * (HEAD_DIM // 2)}},
    # -- no RoPE: learned absolute positions or ALiBi (must be refused)
    "gpt2": {}, "opt": {"word_embed_proj_dim": HIDDEN, "ffn_dim": 128}, "bloom": {"attn": "eager"},
    "gpt_bigcode": {}, "biogpt": {}, "xglm": {"attn": "eager"},
}

# aliases used by the sizes of old-style configs (GPT-2, OPT, BLOOM, XGLM, ...)
_ALIASES = {"hidden_size": ("n_embd", "d_model"), "num_hidden_layers": ("n_layer", "num_layers"),
            "num_attention_heads": ("n_head", "attention_heads"), "intermediate_size": ("n_inner", "ffn_dim"),
            "max_position_embeddings": ("n_positions",)}


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def zoo_config(model_type: str, **overrides):
    """The tiny config of one zoo architecture (``overrides`` applied last).

    ``model_type`` is a transformers model type, or ``model_type@variant`` for a RoPE-scaling variant of it.
    """
    if model_type not in SPECS:
        raise ValueError(f"{model_type!r} is not in the zoo; choose from {sorted(SPECS)}")
    cls = _config_class(model_type.split("@")[0])
    params = set(inspect.signature(cls.__init__).parameters)
    known = params | set(getattr(cls, "attribute_map", {}) or {})
    spec = dict(SPECS[model_type])
    attn = spec.pop("attn", "sdpa")
    from ..compat import config_kwargs

    # rope_parameters (5.x) become rope_scaling + rope_theta on 4.x: a variant is the same model on every release
    wanted = config_kwargs({**COMMON, **spec, **overrides})
    kwargs = {}
    for key, value in wanted.items():
        if value is None and key in spec:
            continue  # removed by the spec
        if key in params:
            kwargs[key] = value
        elif key in known:  # attribute_map: set through the architecture's own name where it has one
            kwargs[key] = value
        else:
            for alias in _ALIASES.get(key, ()):
                if alias in params:
                    kwargs[alias] = value
                    break
    if "layer_types" in kwargs and "layer_types" not in params:
        kwargs.pop("layer_types")
    cfg = cls(**kwargs)
    cfg._attn_implementation = attn
    return cfg


def zoo_configs(names=None) -> dict:
    """``{model_type: config}`` for every zoo architecture (or ``names``) that builds in this transformers."""
    out = {}
    for name in names or SPECS:
        try:
            out[name] = zoo_config(name)
        except Exception:  # noqa: BLE001 - an architecture missing from this transformers version is skipped
            continue
    return out


def zoo_model(model_type: str, seed: int = 0, logit_scale: float = 20.0, **overrides):
    """A random-init eval-mode float32 model of one zoo architecture.

    ``logit_scale`` multiplies the output embedding so greedy argmax is not a near-tie on random weights.
    """
    return _random_model(zoo_config(model_type, **overrides), seed, logit_scale)


def _random_model(cfg, seed: int, logit_scale: float):
    """A random-init eval-mode float32 model of ``cfg``, its output embedding scaled, pad 0 and no eos."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


#: tiny sliding-window configs (window 8), per zoo architecture: every family whose cache keeps sliding layers
SLIDING = {
    "mistral": dict(sliding_window=8, layer_types=["sliding_attention"] * 4),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                  layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2),
    "gemma2": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
    "cohere2": dict(sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "olmo3": dict(sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "gpt_oss": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
}
#: the linear-attention hybrids built by :func:`hybrid_model` (three gated-delta-rule layers, one attention layer)
HYBRIDS = ("qwen3_next", "qwen3_5_text")
HYBRID_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def hybrid_model(kind: str, seed: int = 0, logit_scale: float = 20.0):
    """A tiny random-init linear-attention hybrid (``kind`` in :data:`HYBRIDS`), as :func:`zoo_model` builds the
    others; raises where this transformers release lacks the architecture."""
    if kind == "qwen3_next":
        from transformers.models.qwen3_next import Qwen3NextConfig as Cfg
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=32)
    elif kind == "qwen3_5_text":
        from transformers.models.qwen3_5 import Qwen3_5TextConfig as Cfg
        extra = {}
    else:
        raise ValueError(f"unknown hybrid {kind!r}: choose one of {HYBRIDS}")
    cfg = Cfg(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
              linear_key_head_dim=16, linear_value_head_dim=16, layer_types=HYBRID_LAYERS, pad_token_id=0,
              eos_token_id=2, bos_token_id=1, **extra)
    return _random_model(cfg, seed, logit_scale)


# ---------------------------------------------------------------------------------------------------------------
# The exactness checks every cache must pass on every zoo architecture, or refuse at construction.

#: check name -> what it verifies
CHECKS = {
    "optimistic": "OptimisticCache: swap before the first token equals plain generate (tokens and logits); "
                  "never swapping, the donor rows re-positioned into layer 0 equal a full prefill's",
    "direct": "DirectReuseCache, blocks under their own prefix: equals plain generate",
    "epic": "EPICCache(recompute_tokens=4), blocks under their own prefix: equals plain generate",
    "tail": "TailRecomputeCache(recompute_tokens=4), blocks under their own prefix: equals plain generate",
    "blend": "BlendCache(recompute_ratio=0.15), blocks under their own prefix: equals plain generate",
    "offset": "OffsetCache, blocks under their own prefix: equals plain generate",
    "blend_full": "BlendCache(recompute_ratio=1.0), standalone blocks: equals plain generate",
    "reposition": "DirectReuseCache, standalone blocks: the block rows of layer 0 equal a full prefill's",
}
REFUSAL_ERRORS = (ValueError,)  # UnsupportedRopeError and UnsupportedModelError are ValueErrors
GEN = dict(max_new_tokens=6, do_sample=False)
LOGITS_TOL = dict(atol=1e-3, rtol=1e-3)
KV_TOL = dict(atol=1e-4, rtol=1e-4)


def rag_prompt(seed: int = 0, n_docs: int = 3, doc_len: int = 12, vocab: int = 128):
    """system ⊕ doc_1 ⊕ sep ⊕ doc_2 ⊕ ... ⊕ question: ``(ids [1, N], doc spans)``."""
    g = torch.Generator().manual_seed(seed)
    parts, spans, pos = [torch.randint(3, vocab, (5,), generator=g)], [], 5
    for _ in range(n_docs):
        parts += [torch.randint(3, vocab, (doc_len,), generator=g), torch.randint(3, vocab, (2,), generator=g)]
        spans.append((pos, pos + doc_len))
        pos += doc_len + 2
    parts.append(torch.randint(3, vocab, (6,), generator=g))
    return torch.cat(parts)[None], spans


def agent_prompts(seed: int = 0, shared: int = 24, role_a: int = 5, role_b: int = 8, vocab: int = 128):
    """Two prompts sharing a block of ``shared`` tokens after different role prefixes."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(3, vocab, (1, shared), generator=g)
    ra = torch.randint(3, vocab, (1, role_a), generator=g)
    rb = torch.randint(3, vocab, (1, role_b), generator=g)
    return torch.cat([ra, q], 1), torch.cat([rb, q], 1)


def _prefill_kv(model, ids):
    from transformers import DynamicCache

    from ..compat import cache_kwargs
    from ..kv import kv_of

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, position_ids=torch.arange(ids.shape[1])[None], logits_to_keep=1, **cache_kwargs(cache))
    return kv_of(cache)


def _generate(model, ids, **kw):
    out = model.generate(ids, return_dict_in_generate=True, output_logits=True, **GEN, **kw)
    return out.sequences, torch.stack(out.logits)


def _assert_same_generation(model, ids, cache, what: str) -> None:
    seq, logits = _generate(model, ids, cache=cache)
    ref_seq, ref_logits = _generate(model, ids)
    assert torch.equal(seq, ref_seq), f"{what}: tokens differ from plain generate: {seq.tolist()} vs {ref_seq.tolist()}"
    torch.testing.assert_close(logits, ref_logits, **LOGITS_TOL, msg=lambda m: f"{what}: logits differ: {m}")


def _assert_layer0(kv, ref, rows: torch.Tensor, what: str) -> None:
    (k, v), (rk, rv) = kv[0], ref[0]
    torch.testing.assert_close(k[..., rows, :], rk[..., rows, :], **KV_TOL,
                               msg=lambda m: f"{what}: layer-0 keys: {m}")
    torch.testing.assert_close(v[..., rows, :], rv[..., rows, :], **KV_TOL,
                               msg=lambda m: f"{what}: layer-0 values: {m}")


@contextlib.contextmanager
def held_background():
    """Hold OptimisticCache's background prefill until the foreground waits for it or cancels it, so the swap
    happens exactly at ``max_optimistic_tokens`` (or never), however loaded the machine is."""
    from ..generation.background import BackgroundPrefill

    orig = BackgroundPrefill._prefill, BackgroundPrefill.boost, BackgroundPrefill.cancel

    def release(job):
        if not hasattr(job, "_release"):
            job._release = threading.Event()
        return job._release

    def held(job):
        if not job.synchronous:
            assert release(job).wait(timeout=60), "the foreground never waited for the background prefill"
        return orig[0](job)

    def boost(job):
        release(job).set()
        orig[1](job)

    def cancel(job):
        release(job).set()
        orig[2](job)

    BackgroundPrefill._prefill, BackgroundPrefill.boost, BackgroundPrefill.cancel = held, boost, cancel
    try:
        yield
    finally:
        BackgroundPrefill._prefill, BackgroundPrefill.boost, BackgroundPrefill.cancel = orig


def _check_optimistic(model):
    from ..cache_classes import OptimisticCache
    from ..compat import output_cache
    from ..kv import kv_of

    from transformers import DynamicCache

    from ..compat import cache_kwargs
    from ..sliding import keep_history, layer_windows, take_history

    from ..hybrid import state_reason

    if state_reason(model.config):  # a linear-attention hybrid: drafts verified, checked against plain generate
        yield from _check_optimistic_states(model)
        return
    ids_a, ids_b = agent_prompts()
    windows = layer_windows(model.config)
    own = DynamicCache(config=model.config)
    if any(windows):  # a donor needs every row: the sliding layers keep theirs on the side
        keep_history(own, windows)
    donor = model.generate(ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                           **cache_kwargs(own))
    donor_kv = output_cache(donor)
    if any(windows):
        donor_kv = take_history(donor_kv, windows, donor.sequences.shape[1] - 1)
    make = lambda **kw: OptimisticCache(model, input_ids=ids_b, donor_cache=donor_kv,  # noqa: E731
                                        donor_ids=donor.sequences, **{"rebase": "commit", **kw})
    yield make(max_optimistic_tokens=0)  # construction: a refusal stops here
    _assert_same_generation(model, ids_b, make(max_optimistic_tokens=0), "OptimisticCache(max_optimistic_tokens=0)")
    cache = make(max_optimistic_tokens=None, on_early_finish="cancel")
    with held_background():
        model.generate(ids_b, cache=cache, max_new_tokens=1, do_sample=False)
    assert not cache.stats.exact and cache.stats.reused_tokens > 0
    t2d = cache.alignment.target_to_donor()
    from_donor = torch.nonzero(t2d >= 0).flatten()
    assert from_donor.numel() == cache.stats.reused_tokens and bool((from_donor != t2d[from_donor]).any())
    kv, ref = kv_of(cache), _prefill_kv(model, ids_b)
    held = kv[0][0].shape[-2]  # a sliding layer 0 keeps the last rows only (the same ones as the prefill's)
    if held < ids_b.shape[1]:
        from_donor = from_donor[from_donor >= ids_b.shape[1] - held] - (ids_b.shape[1] - held)
    _assert_layer0(kv, ref, from_donor, "OptimisticCache: donor rows re-positioned into layer 0")


def _check_optimistic_states(model):
    """A hybrid (its drafts borrow the donor's recurrent state, so no row of the draft equals a prefill's): the
    swap before the first token, and verified drafts up to the end (the exact cache held back), equal plain
    generate (tokens and logits)."""
    from ..cache_classes import OptimisticCache
    from ..compat import cache_kwargs, output_cache
    from ..hybrid import state_cache

    from ..hybrid import copy_states, state_indices

    ids_a, ids_b = agent_prompts()
    own = state_cache(model)
    donor = model.generate(ids_a, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                           **(cache_kwargs(own) if own is not None else {}))
    snaps = {}
    if own is not None:  # the donor's states 4 tokens before the shared block's end
        at = state_cache(model)
        with torch.no_grad():
            model(input_ids=ids_a[:, :-4], use_cache=True, logits_to_keep=1, **cache_kwargs(at))
        snaps = {ids_a.shape[1] - 4: copy_states(at, state_indices(at))}
    make = lambda **kw: OptimisticCache(model, input_ids=ids_b, donor_cache=output_cache(donor),  # noqa: E731
                                        donor_ids=donor.sequences, donor_states=[snaps], min_span=1, **kw)
    yield make(max_optimistic_tokens=0)  # construction: a refusal stops here
    _assert_same_generation(model, ids_b, make(max_optimistic_tokens=0), "OptimisticCache(max_optimistic_tokens=0)")
    cache = make(max_optimistic_tokens=None)
    with held_background():
        _assert_same_generation(model, ids_b, cache, "OptimisticCache(rebase='verify'), drafts to the end")
    assert cache.stats.drafted_tokens and cache.plan.span_donor >= 0, cache.stats


def _check_block(model, cls_name: str, **kw):
    from .. import cache_classes

    cls = getattr(cache_classes, cls_name)
    ids, spans = rag_prompt()
    yield cls(model, ids, spans, **kw)
    _assert_same_generation(model, ids, cls(model, ids, spans, **kw), f"{cls_name}({kw})")


def _check_reposition(model):
    from ..cache_classes import DirectReuseCache
    from ..kv import kv_of

    ids, spans = rag_prompt(1)
    yield DirectReuseCache(model, ids, spans)
    cache = DirectReuseCache(model, ids, spans)
    model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False)
    rows = torch.cat([torch.arange(s, e) for s, e in cache.blocks])
    assert cache.stats.reused_tokens == rows.numel() and all(s > 0 for s, _ in cache.blocks)
    _assert_layer0(kv_of(cache), _prefill_kv(model, ids), rows, "DirectReuseCache: standalone blocks in layer 0")


_RUNNERS = {
    "optimistic": _check_optimistic,
    "direct": lambda m: _check_block(m, "DirectReuseCache", block_prefix_ids="own"),
    "epic": lambda m: _check_block(m, "EPICCache", block_prefix_ids="own", recompute_tokens=4),
    "tail": lambda m: _check_block(m, "TailRecomputeCache", block_prefix_ids="own", recompute_tokens=4),
    "blend": lambda m: _check_block(m, "BlendCache", block_prefix_ids="own", recompute_ratio=0.15),
    "offset": lambda m: _check_block(m, "OffsetCache", block_prefix_ids="own"),
    "blend_full": lambda m: _check_block(m, "BlendCache", recompute_ratio=1.0),
    "reposition": _check_reposition,
}


def run_check(model, check: str) -> str | None:
    """Run one of :data:`CHECKS` on an :func:`~hf_kvreuse.enable`-d ``model``.

    Returns None when the cache was built and reproduced the model exactly, or the refusal message when its
    construction raised a ``ValueError`` (:class:`~hf_kvreuse.rope.UnsupportedRopeError`,
    :class:`~hf_kvreuse.model_check.UnsupportedModelError`, ...). A wrong output raises ``AssertionError``;
    an error after a successful construction propagates.
    """
    steps = _RUNNERS[check](model)
    try:
        next(steps)  # the first construction
    except REFUSAL_ERRORS as e:
        return f"{type(e).__name__}: {e}"
    for _ in steps:
        pass
    return None
