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
* multimodal wrappers (gemma3, gemma3n, gemma4*, llama4, mllama, emu3, fuyu, got_ocr2, git, phi4_multimodal,
  qwen3_5, moshi, musicgen*, moss_transcribe_diarize, blt): need vision / audio towers, too slow or extra deps;
* architectures whose attention is sliding-window or chunked by design (cohere2*, gemma4_text, granite_swa,
  hy_v4, inkling*, flint, laguna, lara_mini, mimo_v2_flash, exaone_moe, dory, cwm, afmoe, kolibri1,
  modernbert-decoder): the library refuses sliding layers (``KVReuseCache``); the covered siblings (cohere,
  gemma2/3, mistral, olmo3, ministral) run with every layer on full attention;
* aliases of an already covered class (exaone, internlm3, iquestcoder -> LlamaForCausalLM; sarvam_moe ->
  Glm4MoeForCausalLM; gpt-sw3 -> GPT2LMHeadModel);
* models without an sdpa or eager path usable here or that fail to build from small sizes (big_bird, cpmant,
  reformer, rembert, roformer, megatron-bert, openai-gpt, gpt_neox_japanese, mpt, ctrl: huge embedding,
  hrm_text, qwen4_exp*, dots3_note*, dbrx, beam, zaya, cohere_compass_text).

Architectures whose attention is only available as ``eager`` in this transformers (gemma2, bloom, ...) are built
with ``attn_implementation="eager"``.
"""

from __future__ import annotations

import inspect

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
    "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}, "olmoe": {}, "phimoe": {}, "granitemoe": {},
    "granitemoeshared": {}, "jetmoe": {"num_key_value_heads": None, "kv_channels": HEAD_DIM, "num_local_experts": 2},
    "ernie4_5_moe": {}, "hunyuan_v1_moe": {}, "dots1": {}, "glm4_moe": {}, "flex_olmo": {},
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
    """The tiny config of one zoo architecture (``overrides`` applied last)."""
    if model_type not in SPECS:
        raise ValueError(f"{model_type!r} is not in the zoo; choose from {sorted(SPECS)}")
    cls = _config_class(model_type)
    params = set(inspect.signature(cls.__init__).parameters)
    known = params | set(getattr(cls, "attribute_map", {}) or {})
    spec = dict(SPECS[model_type])
    attn = spec.pop("attn", "sdpa")
    wanted = {**COMMON, **spec, **overrides}
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
    from transformers import AutoModelForCausalLM

    cfg = zoo_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model
